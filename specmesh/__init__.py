"""specmesh: speculative decoding served as gRPC microservices.

Kept import-light: ``specmesh.Client`` / ``specmesh.AsyncClient`` / ``specmesh.Result``
load the SDK (and grpc) only when first accessed.
"""

import os as _os

# OpenMP threads that spin after each parallel region starve every other process
# on a small machine (measured: 2 spinning threads made a decode step 17x slower
# while another process ran). Sleep instead, unless the user chose otherwise.
# Takes effect only if torch was not imported before specmesh.
_OMP_CHOSEN_BY_USER = any(k in _os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A process whose model work runs on one thread (``specmesh.threads``) lets libgomp's
# threads spin this many rounds before they sleep: ``specmesh bench``, ``demo``,
# training, the studies, and each service of ``serve``. Waking a sleeping thread at
# every parallel op is most of a small model's step on a few cores: bf16 decode step
# 27-35 -> 20-23 ms, plain decoding +27-47% tokens/s (2 AMD EPYC cores with AVX-512).
# The spin is bounded (it ends a fraction of a millisecond after the last op), so
# services that alternate (router, drafter, verifier) still get the cores in turn; two
# processes that both compute at once on the same cores do starve each other (7x
# slower verify forwards), which is what ``serve --cpus`` placement is for.
SPINCOUNT = "10000"


def spin_threads() -> bool:
    """Let OpenMP threads spin briefly between parallel regions (``GOMP_SPINCOUNT``).
    Only before torch is imported (libgomp reads its settings once, when torch loads
    it) and only when the user set neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``.
    Returns whether it took effect."""
    import sys

    if _OMP_CHOSEN_BY_USER or "torch" in sys.modules:
        return False
    _os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return True


def user_omp_env() -> dict:
    """The OpenMP wait settings the user chose (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``), to
    pass on to processes this one starts; empty where the ones in ``os.environ`` are
    specmesh's own (a child decides its own policy, ``spin_threads``)."""
    if not _OMP_CHOSEN_BY_USER:
        return {}
    return {k: _os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in _os.environ}


def _source_checkout_fallback() -> None:
    """Run from a source checkout (a bare GPU machine: ``scripts/device-check`` there, the
    repository root on ``sys.path``; or a second checkout, a git worktree, on ``PYTHONPATH``
    beside an editable install of another): map the ``package-dir`` folders of
    pyproject.toml (``specmesh.router`` is ``router/`` ...) of the checkout this ``specmesh``
    was imported from, with a finder placed first on ``sys.meta_path``: the services come
    from the same checkout as the core, whatever an editable install of another checkout
    maps them to. An installed, non-editable package has no pyproject.toml beside it: its
    mapping stands."""
    import sys

    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    folders = ("router", "drafter_service", "verifier_service", "kernels")
    if not _os.path.isfile(_os.path.join(root, "pyproject.toml")) or any(
            type(f).__name__ == "_SourceFolders" for f in sys.meta_path):
        return
    from importlib.util import spec_from_file_location

    class _SourceFolders:
        @staticmethod
        def find_spec(name, path=None, target=None):
            pkg, _, sub = name.partition(".")
            if pkg != "specmesh" or sub not in folders:
                return None
            d = _os.path.join(root, sub)
            init = _os.path.join(d, "__init__.py")
            return spec_from_file_location(name, init, submodule_search_locations=[d]) \
                if _os.path.isfile(init) else None

    sys.meta_path.insert(0, _SourceFolders())


_source_checkout_fallback()

_LAZY = {"Client": "client", "AsyncClient": "client", "Result": "client"}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'specmesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = sorted(_LAZY)
