"""gRPC interceptors: trace context over metadata, RPC spans, strategy header,
RPC errors by code.

- ``ServerInterceptor(observer)`` (outermost on every specmesh server): when
  tracing is on, extracts the W3C ``traceparent`` from the call's metadata and
  makes a SERVER span named after the method (``specmesh.v1.Verifier/Verify``)
  current while the handler runs, so the drafter's and verifier's spans are
  children of the router's client span. It hands every finished call to
  ``observer.on_call(method, strategy, request, response, seconds, code)`` (the
  service's metrics; the last message for a streaming call, whose request is
  its first message where the requests are a stream too) and counts nothing
  itself. Health checks and reflection are left alone.
- ``ClientInterceptor(target)`` (on the router's channels to the drafter and
  verifiers): when tracing is on, a CLIENT span per call, parented by the
  current span (the round) and injected into the metadata; inside a round
  (``call_scope``) it also sends ``x-specmesh-strategy`` so the peers can
  label their metrics, and counts failed calls by status code in the round's
  metrics (a dead peer's UNAVAILABLE never reaches that peer's own counters).

Streaming handlers never keep a context attached across a ``yield``: the span
is attached around each step of the inner iterator, so a generator closed from
another thread or by the garbage collector cannot detach the wrong context.

``wrap_handler`` (a copy of a method handler with its behaviour wrapped) is the
helper every server interceptor uses, ``specmesh.serving.interceptors`` too.

This module knows nothing about the services' messages or metrics names.
"""

from __future__ import annotations

import collections
import contextvars
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import tracing

STRATEGY_HEADER = "x-specmesh-strategy"
UNTRACED = ("/grpc.",)  # health checking, reflection


@dataclass
class CallScope:
    """What the router's calls inside one round carry: the strategy label and
    the metrics that count client-side failures (or None)."""

    strategy: str
    metrics: Any = None


_scope: contextvars.ContextVar[Optional[CallScope]] = contextvars.ContextVar("specmesh_call_scope", default=None)


def enter_scope(scope: CallScope):
    return _scope.set(scope)


def exit_scope(token) -> None:
    _scope.reset(token)


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return service, name


def rpc_attributes(method: str) -> dict:
    service, name = _split(method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _finish_span(span, code: Optional[grpc.StatusCode], err: Optional[BaseException] = None) -> None:
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
        if err is not None and not isinstance(err, GeneratorExit) and type(err).__name__ != "Exception":
            span.record_exception(err)
    span.end()


# ---------------------------------------------------------------- server

def _status(context, err: Optional[BaseException]) -> grpc.StatusCode:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code
    if err is None:
        return grpc.StatusCode.OK
    return grpc.StatusCode.CANCELLED if isinstance(err, GeneratorExit) else grpc.StatusCode.UNKNOWN


def wrap_handler(handler: Optional[grpc.RpcMethodHandler], wrap_behavior: Callable, deserializer=None):
    """A copy of ``handler`` whose behaviour is ``wrap_behavior(behavior, streaming_response)``."""
    if handler is None:
        return None
    deser = deserializer(handler.request_deserializer) if deserializer else handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_behavior(handler.unary_unary, False), deser, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_behavior(handler.unary_stream, True), deser, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_behavior(handler.stream_unary, False), deser, ser)
    return grpc.stream_stream_rpc_method_handler(wrap_behavior(handler.stream_stream, True), deser, ser)


def _server_span(method: str, metadata, context):
    parent = propagate.extract({k: v for k, v in metadata if isinstance(v, str)})
    attrs = rpc_attributes(method)
    peer = context.peer() or ""
    if peer.startswith(("ipv4:", "ipv6:")):
        attrs["network.peer.address"] = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    return tracing.tracer().start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER, attributes=attrs)


class ServerInterceptor(grpc.ServerInterceptor):
    def __init__(self, observer=None):
        self.observer = observer

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if handler is None or handler.stream_unary or method.startswith(UNTRACED):
            return handler
        traced, obs = tracing.enabled(), self.observer
        stream_requests = bool(handler.stream_stream)  # Verifier/Decode: observed as its first message
        if not traced and obs is None:
            return handler
        metadata = tuple(details.invocation_metadata or ())
        strategy = next((v for k, v in metadata if k == STRATEGY_HEADER), "")

        def observe(behavior, streaming):
            def run(request, context):
                span = _server_span(method, metadata, context) if traced else None
                token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
                t0, response, err = time.perf_counter(), None, None
                try:
                    response = behavior(request, context)
                    return response
                except BaseException as e:
                    err = e
                    raise
                finally:
                    if token is not None:
                        otel_context.detach(token)
                    code = _status(context, err)
                    if span is not None:
                        _finish_span(span, code, err)
                    if obs is not None:
                        obs.on_call(method, strategy, request, response, time.perf_counter() - t0, code)

            def run_stream(request, context):
                span = _server_span(method, metadata, context) if traced else None
                ctx = trace.set_span_in_context(span) if span is not None else None
                t0, last, err, it = time.perf_counter(), None, None, None
                first: list = []  # a request stream's first message (what the call asked for)
                requests = _first_kept(request, first) if stream_requests else request
                try:
                    while True:
                        token = otel_context.attach(ctx) if ctx is not None else None
                        try:
                            if it is None:
                                it = iter(behavior(requests, context))
                            item = next(it)
                        except StopIteration:
                            break
                        finally:
                            if token is not None:
                                otel_context.detach(token)
                        last = item
                        if stream_requests:
                            request = first[0] if first else None
                        if obs is not None:
                            obs.on_item(method.rpartition("/")[2], strategy, request, item)
                        yield item
                except BaseException as e:
                    err = e
                    raise
                finally:
                    if it is not None and err is not None and hasattr(it, "close"):
                        it.close()
                    code = _status(context, err)
                    if span is not None:
                        _finish_span(span, code, err)
                    if obs is not None:
                        if stream_requests:
                            request = first[0] if first else None
                        obs.on_call(method, strategy, request, last, time.perf_counter() - t0, code)

            return run_stream if streaming else run

        return wrap_handler(handler, observe)


def _first_kept(requests, first: list):
    """``requests`` unchanged, its first message also put in ``first``."""
    for m in requests:
        if not first:
            first.append(m)
        yield m


# ---------------------------------------------------------------- client

class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class ClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamStreamClientInterceptor):
    def __init__(self, target: str = ""):
        host, _, port = target.rpartition(":")
        self.attrs = {"server.address": host.strip("[]") or target}
        if port.isdigit():
            self.attrs["server.port"] = int(port)

    def _prepare(self, details):
        scope, traced = _scope.get(), tracing.enabled()
        if scope is None and not traced:
            return details, None, None
        md = list(details.metadata or ())
        if scope is not None and scope.strategy:
            md.append((STRATEGY_HEADER, scope.strategy))
        span = None
        if traced:
            method = details.method.decode() if isinstance(details.method, bytes) else details.method
            span = tracing.tracer().start_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                               attributes={**rpc_attributes(method), **self.attrs})
            carrier: dict = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            md.extend(carrier.items())
        new = _Details(details.method, details.timeout, tuple(md), details.credentials,
                       getattr(details, "wait_for_ready", None), getattr(details, "compression", None))
        return new, span, scope

    def _done(self, method, span, scope):
        def done(call):
            try:
                code = call.code()
            except Exception:  # noqa: BLE001 - a call object without a code: count as unknown
                code = grpc.StatusCode.UNKNOWN
            if span is not None:
                _finish_span(span, code)
            if scope is not None and scope.metrics is not None and code not in (None, grpc.StatusCode.OK):
                scope.metrics.rpc_error("client", method, code.name, scope.strategy)
        return done

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details, span, scope = self._prepare(client_call_details)
        outcome = continuation(details, request)
        if span is not None or scope is not None:
            m = details.method.decode() if isinstance(details.method, bytes) else details.method
            outcome.add_done_callback(self._done(m, span, scope))
        return outcome

    def intercept_unary_stream(self, continuation, client_call_details, request):
        details, span, scope = self._prepare(client_call_details)
        call = continuation(details, request)
        if span is not None or scope is not None:
            m = details.method.decode() if isinstance(details.method, bytes) else details.method
            call.add_done_callback(self._done(m, span, scope))
        return call

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return self.intercept_unary_stream(continuation, client_call_details, request_iterator)


def intercept(channel: grpc.Channel, target: str = "") -> grpc.Channel:
    """``channel`` with the client interceptor (trace context, strategy header)."""
    return grpc.intercept_channel(channel, ClientInterceptor(target))
