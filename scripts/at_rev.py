"""A module of this repository as it was at another git revision, for the side-by-side
scripts (``kernel_ab.py``, ``policy_ab.py``): ``module_at("d077749", "specmesh/loop.py")``.

The file is read with ``git show`` and loaded as ``<its package>._<name>_at_rev``
(``specmesh._loop_at_rev``, ``specmesh.engine._int4_matmul_at_rev``), so its relative
imports resolve to this checkout's modules (a file from before a move, such as
``specmesh/int4_matmul.py`` before the engine package, loads under its old package, so
it loads only where its module-level relative imports still resolve here); it is
registered in ``sys.modules`` (dataclasses look their module up). Knows nothing about
what the module holds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path


def module_at(rev: str, relpath: str):
    """The module at ``relpath`` (from the repository root) as it was at ``rev``."""
    text = subprocess.run(["git", "show", f"{rev}:{relpath}"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout
    package = ".".join(Path(relpath).parent.parts)  # specmesh/engine/x.py: specmesh.engine
    name = f"{package}._{Path(relpath).stem}_at_rev"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / Path(relpath).name
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod
