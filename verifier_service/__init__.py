"""The Verifier gRPC service (see ``servicer``)."""

from .servicer import VerifierServicer, verifier_service

__all__ = ["VerifierServicer", "verifier_service"]
