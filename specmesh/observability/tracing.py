"""Tracer setup from the standard OpenTelemetry environment variables.

``setup_from_env(service_name)`` builds a ``TracerProvider`` when tracing is
asked for and registers it with ``configure``; everything in specmesh that
makes spans asks ``enabled()`` first and does nothing at all when it is off
(the default), so tracing off costs one boolean test per round and per RPC.

Variables read (the OpenTelemetry SDK's own names):

- ``OTEL_SDK_DISABLED=true``: off, whatever else is set.
- ``OTEL_TRACES_EXPORTER``: comma list of ``otlp``, ``console``, ``jsonl`` (a
  specmesh exporter writing one JSON object per span and line) or ``none``.
  Unset means off, unless a trace file is named (then ``jsonl``).
- ``SPECMESH_TRACE_FILE`` or ``OTEL_EXPORTER_JSONL_FILE``: the JSON-lines file
  (default ``specmesh-traces.jsonl``); several processes may append to one file.
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``:
  ``grpc`` (default) or ``http/protobuf``; endpoint, headers, timeouts come from
  the usual ``OTEL_EXPORTER_OTLP_*`` variables, read by the exporters themselves.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (e.g.
  ``parentbased_traceidratio`` and ``0.1``), read by the SDK; the default is
  ``parentbased_always_on``, so a service follows its caller's decision.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (default service name:
  the one passed in, e.g. ``specmesh-router``).

This module knows nothing about gRPC, the router or the services.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from opentelemetry import trace

log = logging.getLogger("specmesh.tracing")

TRACER_NAME = "specmesh"
EXPORTERS = ("otlp", "console", "jsonl", "none")
DEFAULT_TRACE_FILE = "specmesh-traces.jsonl"

_provider = None  # the TracerProvider spans go to, or None: tracing off
_tracer: Optional[trace.Tracer] = None


def enabled() -> bool:
    """True when spans are recorded (a provider is configured)."""
    return _tracer is not None


def tracer() -> trace.Tracer:
    """The specmesh tracer (a no-op tracer when tracing is off)."""
    return _tracer if _tracer is not None else trace.NoOpTracer()


def configure(provider) -> None:
    """Send specmesh spans to ``provider`` (an SDK ``TracerProvider``); None turns
    tracing off. The provider also becomes the global one when none is set yet,
    so other instrumentation joins the same traces."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None
    if provider is not None and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)


def trace_file() -> str:
    return os.environ.get("SPECMESH_TRACE_FILE") or os.environ.get("OTEL_EXPORTER_JSONL_FILE") or DEFAULT_TRACE_FILE


def exporter_names(env=None) -> list[str]:
    """The exporters the environment asks for ([] = tracing off)."""
    env = os.environ if env is None else env
    if str(env.get("OTEL_SDK_DISABLED", "")).strip().lower() == "true":
        return []
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    names = [x.strip().lower() for x in raw.split(",") if x.strip()]
    if not names:
        names = ["jsonl"] if (env.get("SPECMESH_TRACE_FILE") or env.get("OTEL_EXPORTER_JSONL_FILE")) else []
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter(s) {unknown}; known: {list(EXPORTERS)}")
    return [n for n in names if n != "none"]


def make_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "jsonl":
        from .jsonl import JsonLinesSpanExporter

        return JsonLinesSpanExporter(trace_file())
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported; use grpc or http/protobuf")
    return OTLPSpanExporter()


def setup_from_env(service_name: str = "specmesh") -> bool:
    """Configure tracing from the environment; returns whether it is on."""
    names = exporter_names()
    if not names:
        configure(None)
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler from OTEL_TRACES_SAMPLER(_ARG)
    for n in names:
        provider.add_span_processor(BatchSpanProcessor(make_exporter(n)))
    configure(provider)
    log.info("tracing on: exporters %s%s", names, f" (file {trace_file()})" if "jsonl" in names else "")
    return True


def shutdown() -> None:
    """Flush and stop the configured provider (it also does so at interpreter exit)."""
    p = _provider
    configure(None)
    if p is not None:
        p.shutdown()
