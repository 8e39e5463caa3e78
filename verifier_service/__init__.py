"""The Verifier gRPC service (``specmesh.verifier_service``).

  servicer  the thin gRPC servicer over an ``EngineVerifier``; ``verifier_service`` wires it
  batcher   ``VerifyBatcher``: concurrent sessions' Verify calls -> one ragged forward

Installed as ``specmesh.verifier_service`` (pyproject ``package-dir``). Reached as the
bare name ``verifier_service`` (the repository root on ``sys.path``) this file loads
nothing.
"""

if __name__ == "specmesh.verifier_service":
    from .servicer import VerifierServicer, verifier_service

    __all__ = ["VerifierServicer", "verifier_service"]
else:  # the bare name: an empty placeholder, so nothing runs twice under two names
    __path__ = []  # and none of its modules load under the bare name either

    def __getattr__(name):
        raise AttributeError(f"{name!r}: this folder is the package specmesh.verifier_service; import it by that "
                             f"name, not as {__name__!r}")
