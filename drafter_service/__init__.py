"""The Drafter gRPC service (see ``host`` and ``servicer``)."""

from .host import DrafterHost
from .servicer import DrafterServicer, drafter_service

__all__ = ["DrafterHost", "DrafterServicer", "drafter_service"]
