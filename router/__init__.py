"""The Router gRPC service (``specmesh.router``): public Generate API over drafter and
verifier services.

  servicer    the thin gRPC servicer; ``router_service`` / ``dynamic_router`` wire it
  core        validation, plan, streaming, cancel
  strategies  which strategy runs, and its adapters
  adapters    ``RemoteDrafter`` / ``RemoteVerifier`` (the core contracts over gRPC), ``Calls``
  replicas    ``ReplicaSet`` (verifier replicas, session affinity) and ``DrafterPool``
  codec       text <-> token ids

Installed as ``specmesh.router`` (pyproject ``package-dir``). Reached as the bare name
``router`` (the repository root on ``sys.path``) this file loads nothing.
"""

if __name__ == "specmesh.router":
    from .core import GenerateSpec, Router
    from .servicer import RouterServicer, dynamic_router, router_service

    __all__ = ["GenerateSpec", "Router", "RouterServicer", "dynamic_router", "router_service"]
else:  # the bare name: an empty placeholder, so nothing runs twice under two names
    __path__ = []  # and none of its modules load under the bare name either

    def __getattr__(name):
        raise AttributeError(f"{name!r}: this folder is the package specmesh.router; import it by that name, "
                             f"not as {__name__!r}")
