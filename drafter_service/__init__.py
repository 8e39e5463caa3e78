"""The Drafter gRPC service (``specmesh.drafter_service``).

  servicer  the thin gRPC servicer over a ``DrafterHost``; ``drafter_service`` wires it
  host      ``DrafterHost``: per-session tokens synced by delta, drafters built by name

Installed as ``specmesh.drafter_service`` (pyproject ``package-dir``). Reached as the
bare name ``drafter_service`` (the repository root on ``sys.path``) this file loads
nothing.
"""

if __name__ == "specmesh.drafter_service":
    from .host import DrafterHost
    from .servicer import DrafterServicer, drafter_service

    __all__ = ["DrafterHost", "DrafterServicer", "drafter_service"]
else:  # the bare name: an empty placeholder, so nothing runs twice under two names
    __path__ = []  # and none of its modules load under the bare name either

    def __getattr__(name):
        raise AttributeError(f"{name!r}: this folder is the package specmesh.drafter_service; import it by that "
                             f"name, not as {__name__!r}")
