"""Typed exceptions of the client SDK, one per gRPC status code.

``from_rpc_error`` turns a ``grpc.RpcError`` into the matching ``SpecmeshError``
subclass (code name, server message, and for INVALID_ARGUMENT the field the
server named: messages read "<field>: <why>"). Knows nothing about services;
does not import grpc.
"""

from __future__ import annotations

from typing import Optional


class SpecmeshError(Exception):
    """A failed call: ``code`` is the gRPC status name, ``details`` the server's message."""

    code = "UNKNOWN"

    def __init__(self, details: str = "", code: Optional[str] = None):
        super().__init__(f"{code or self.code}: {details}")
        self.details = details
        if code:
            self.code = code


DOWNSTREAM = "downstream: "  # the router's prefix on a refusal passed on from a drafter or verifier


class InvalidArgumentError(SpecmeshError, ValueError):
    code = "INVALID_ARGUMENT"

    @property
    def field(self) -> str:
        """The offending request field named by the server (e.g. ``sampling.top_p``); a
        refusal the router passed on from a service behind it (``downstream: <field>: ...``)
        names the field that service named, never the stage."""
        d = self._own()
        head = d.split(":", 1)[0] if ":" in d else ""
        return head if head and " " not in head else ""

    @property
    def reason(self) -> str:
        """The message without the field (and without a ``downstream:`` prefix)."""
        d = self._own()
        return d.split(":", 1)[1].strip() if self.field else d

    def _own(self) -> str:
        return self.details[len(DOWNSTREAM):] if self.details.startswith(DOWNSTREAM) else self.details


class UnauthenticatedError(SpecmeshError):
    code = "UNAUTHENTICATED"


class PermissionDeniedError(SpecmeshError):
    code = "PERMISSION_DENIED"


class ResourceExhaustedError(SpecmeshError):
    code = "RESOURCE_EXHAUSTED"


class UnavailableError(SpecmeshError, ConnectionError):
    code = "UNAVAILABLE"


class DeadlineExceededError(SpecmeshError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class CancelledError(SpecmeshError):
    code = "CANCELLED"


class FailedPreconditionError(SpecmeshError):
    code = "FAILED_PRECONDITION"


class NotFoundError(SpecmeshError):
    code = "NOT_FOUND"


class UnimplementedError(SpecmeshError, NotImplementedError):
    code = "UNIMPLEMENTED"


class InternalError(SpecmeshError):
    code = "INTERNAL"


_BY_CODE = {c.code: c for c in (InvalidArgumentError, UnauthenticatedError, PermissionDeniedError,
                                ResourceExhaustedError, UnavailableError, DeadlineExceededError, CancelledError,
                                FailedPreconditionError, NotFoundError, UnimplementedError, InternalError)}


def from_rpc_error(e) -> SpecmeshError:
    """The typed exception for a ``grpc.RpcError`` (``SpecmeshError`` for codes without a class)."""
    code = e.code().name if callable(getattr(e, "code", None)) and e.code() is not None else "UNKNOWN"
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    cls = _BY_CODE.get(code, SpecmeshError)
    return cls(details or "", None if cls is not SpecmeshError else code)


__all__ = ["SpecmeshError", "from_rpc_error"] + [c.__name__ for c in _BY_CODE.values()]
