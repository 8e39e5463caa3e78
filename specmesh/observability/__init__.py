"""Observability of specmesh: OpenTelemetry traces and Prometheus metrics.

  tracing    tracer provider from the standard ``OTEL_*`` variables (otlp, console,
             the specmesh ``jsonl`` file exporter, none); off by default and then free
  jsonl      the JSON-lines span exporter and its reader
  rpc        gRPC client/server interceptors: W3C trace context over metadata,
             client/server spans, the strategy header, RPC errors by code
  requests   the router's request span (``specmesh.generate``) and round spans
             (``specmesh.round``), and the router metrics recorded from the same facts
  metrics    prometheus-client registries of the router, verifier and drafter,
             ``/metrics`` over HTTP
  wiring     ``instrument(kind, service)``: attach a service's metrics
  traces     requests and rounds read back from exported spans
  stats      acceptance histograms from stats/bench JSON, trace files or a
             ``/metrics`` scrape, the ceiling bin and the preflight verdict
  plots      the round timeline PNG and the acceptance histogram PNG

Nothing here changes what the services compute; every hook only reads. The commands
``specmesh trace show|list`` and ``specmesh stats`` are ``specmesh.cli.observability``.
"""
