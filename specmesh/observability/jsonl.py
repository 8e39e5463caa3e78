"""A JSON-lines span exporter (offline traces) and its reader.

Each finished span becomes one line:

    {"name": "specmesh.round", "trace_id": "<32 hex>", "span_id": "<16 hex>",
     "parent_id": "<16 hex>" | null, "kind": "INTERNAL", "start_ns": ..., "end_ns": ...,
     "status": "UNSET" | "OK" | "ERROR", "status_message": ..., "attributes": {...},
     "events": [{"name": ..., "time_ns": ..., "attributes": {...}}], "service": "specmesh-router"}

Lines are appended with one ``write`` on a file opened ``O_APPEND``, so the
router, drafter and verifier processes can share one file. ``read_spans``
skips lines that are not spans (a truncated last line, blank lines).

This module knows nothing about what the spans mean.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator, Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


def span_to_dict(span) -> dict:
    """A ReadableSpan as the line's dict."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": {k: _jsonable(v) for k, v in
                                                                          (e.attributes or {}).items()}}
                   for e in span.events],
        "service": (span.resource.attributes.get("service.name") if span.resource is not None else None),
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(path: str | os.PathLike) -> Iterator[dict]:
    """The spans of a JSON-lines trace file, in file order."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(d, dict) and "span_id" in d and "name" in d:
                yield d
