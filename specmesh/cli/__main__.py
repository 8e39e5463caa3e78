"""``python -m specmesh.cli ARGS``: the ``specmesh`` command (``specmesh.cli.main``), as the
Kubernetes manifests, ``specmesh serve``'s supervisor and ``scripts/device-check`` start it."""

import sys

from . import main

sys.exit(main())
