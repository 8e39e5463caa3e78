"""The Router gRPC service: public Generate API over drafter and verifier services."""

from .core import GenerateSpec, Router
from .servicer import RouterServicer, router_service

__all__ = ["GenerateSpec", "Router", "RouterServicer", "router_service"]
