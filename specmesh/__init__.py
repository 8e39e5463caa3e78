"""specmesh: speculative decoding served as gRPC microservices.

Kept import-light: ``specmesh.Client`` / ``specmesh.AsyncClient`` / ``specmesh.Result``
load the SDK (and grpc) only when first accessed.
"""

import os as _os

# OpenMP threads that spin after each parallel region starve every other process
# on a small machine (measured: 2 spinning threads made a decode step 17x slower
# while another process ran). Sleep instead, unless the user chose otherwise.
# Takes effect only if torch was not imported before specmesh.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_LAZY = {"Client": "client", "AsyncClient": "client", "Result": "client"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'specmesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = sorted(_LAZY)
