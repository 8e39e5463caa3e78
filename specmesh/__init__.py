"""specmesh: speculative decoding served as gRPC microservices.

Kept import-light: ``specmesh.Client`` / ``specmesh.AsyncClient`` / ``specmesh.Result``
load the SDK (and grpc) only when first accessed.
"""

_LAZY = {"Client": "client", "AsyncClient": "client", "Result": "client"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'specmesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = sorted(_LAZY)
