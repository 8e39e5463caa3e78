"""Server interceptors: bearer-token auth, request size limit, error mapping.

- ``AuthInterceptor``: when a token is configured, every call must carry
  ``authorization: Bearer <token>`` (constant-time compare) or it is refused
  with UNAUTHENTICATED. Health checks stay open (probes carry no token).
- ``ErrorInterceptor``: requests larger than ``max_message_bytes``, and bytes that
  do not decode as the method's message (a string that is not UTF-8), get
  INVALID_ARGUMENT naming ``request`` (gRPC's own hard cap, set higher by the
  server, would say RESOURCE_EXHAUSTED; its failed decode, INTERNAL); exceptions escaping a servicer map to
  status codes: ``InvalidArgument`` -> INVALID_ARGUMENT ("<field>: <why>"),
  ``ResourceExhausted`` -> RESOURCE_EXHAUSTED, ``SessionLost`` ->
  FAILED_PRECONDITION, a failed downstream call keeps its code (UNAVAILABLE,
  DEADLINE_EXCEEDED, ...; an INVALID_ARGUMENT keeps its message too, whose field comes
  first, so a client sees the field the verifier named), ``TimeoutError`` -> DEADLINE_EXCEEDED, a dropped
  request (``concurrent.futures.CancelledError``) -> CANCELLED, anything else
  -> INTERNAL (logged with its traceback; the client sees only the type name).

Servicers therefore only raise domain exceptions. This module knows nothing
about the services, models or sessions.
"""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import CancelledError
from typing import Optional

import grpc

from ..observability.rpc import wrap_handler
from ..types import InvalidArgument, ResourceExhausted, SessionLost

log = logging.getLogger("specmesh.serving")

OPEN_METHODS = ("/grpc.health.v1.Health/",)
# Downstream status codes a server passes on unchanged; others become INTERNAL.
PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED}


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: Optional[str], open_methods=OPEN_METHODS):
        self._expected = f"Bearer {token}".encode() if token else None
        self._open = tuple(open_methods)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self._expected is None or details.method.startswith(self._open):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler

        def deny(_behavior, streaming):
            def refuse(_request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

            def refuse_stream(request, context):
                refuse(request, context)
                yield  # pragma: no cover - abort raises

            return refuse_stream if streaming else refuse

        return wrap_handler(handler, deny)


class _Oversize:
    def __init__(self, n: int):
        self.n = n


class _Undecodable:
    """A request whose bytes are not the method's message (a string field that is not UTF-8,
    a truncated field): INVALID_ARGUMENT naming ``request``, where gRPC itself would answer
    INTERNAL ("Exception deserializing request")."""

    def __init__(self, why: str):
        self.why = why


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception maps to (see module docstring)."""
    if isinstance(e, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e) or "resource exhausted"
    if isinstance(e, SessionLost):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e) or "session lost; re-prefill"
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # "<field>: <why>" as the peer said it: the field stays first
            return code, e.details() or "downstream: invalid argument"
        if code in PASS_THROUGH:
            return code, f"downstream: {e.details()}"
        return grpc.StatusCode.INTERNAL, f"downstream call failed: {code.name}"
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or "timed out"
    if isinstance(e, CancelledError):
        return grpc.StatusCode.CANCELLED, str(e) or "cancelled"
    return grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})"


class ErrorInterceptor(grpc.ServerInterceptor):
    def __init__(self, max_message_bytes: Optional[int] = None):
        self.limit = max_message_bytes

    def _abort(self, e: Exception, context, method: str):
        if context.code() not in (None, grpc.StatusCode.OK):  # the servicer already aborted
            raise e
        code, msg = status_of(e)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", method, exc_info=e)
        context.abort(code, msg)

    def _check(self, request, context):
        if isinstance(request, _Oversize):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request: message of {request.n} bytes exceeds max_message_bytes {self.limit}")
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.why})")

    def intercept_service(self, continuation, details):
        method = details.method

        def checked(requests, context):  # a request stream's messages, each held to the size limit
            for m in requests:
                self._check(m, context)
                yield m

        def guard(behavior, streaming):
            if streaming:
                def run_stream(request, context):
                    if stream_requests:
                        request = checked(request, context)
                    else:
                        self._check(request, context)
                    try:
                        yield from behavior(request, context)
                    except Exception as e:  # noqa: BLE001 - mapped to a status
                        self._abort(e, context, method)
                return run_stream

            def run(request, context):
                self._check(request, context)
                try:
                    return behavior(request, context)
                except Exception as e:  # noqa: BLE001 - mapped to a status
                    self._abort(e, context, method)
            return run

        def sized(deserialize):
            deserialize = deserialize or (lambda b: b)

            def decode(b):
                if self.limit is not None and len(b) > self.limit:
                    return _Oversize(len(b))
                try:
                    return deserialize(b)
                except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, and what else a parser raises
                    return _Undecodable(f"{type(e).__name__}: {str(e)[:200]}")
            return decode

        handler = continuation(details)
        if handler is None or handler.stream_unary:
            return handler  # client-streaming calls (none of ours) are left as they are
        stream_requests = bool(handler.stream_stream)  # Verifier/Decode's grants, reflection
        return wrap_handler(handler, guard, sized)
