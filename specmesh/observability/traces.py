"""Requests and rounds read back from span dicts (``jsonl.read_spans`` or an
in-memory exporter converted with ``jsonl.span_to_dict``).

``requests(spans)`` finds every ``specmesh.generate`` span and its
``specmesh.round`` children (ordered by index) and the RPC spans under each
round; ``find(requests, ref)`` picks one by trace id, span id or session id
(``gen_ai.response.id``), or a unique prefix of one.

This module knows the span names and attribute keys specmesh writes, nothing
about how they were exported.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

REQUEST_SPAN = "specmesh.generate"
ROUND_SPAN = "specmesh.round"


@dataclass
class Round:
    span: dict
    rpcs: list[dict] = field(default_factory=list)  # client spans (and their server children) under the round

    @property
    def attrs(self) -> dict:
        return self.span.get("attributes", {})

    def a(self, key: str, default=0):
        return self.attrs.get(f"specmesh.round.{key}", default)

    @property
    def index(self) -> int:
        return int(self.a("index", 0))


@dataclass
class Request:
    span: dict
    rounds: list[Round] = field(default_factory=list)

    @property
    def attrs(self) -> dict:
        return self.span.get("attributes", {})

    @property
    def trace_id(self) -> str:
        return self.span["trace_id"]

    @property
    def session_id(self) -> str:
        return str(self.attrs.get("gen_ai.response.id", ""))

    @property
    def strategy(self) -> str:
        return str(self.attrs.get("specmesh.strategy", ""))

    @property
    def drafter(self) -> str:
        return str(self.attrs.get("specmesh.drafter", ""))

    @property
    def label(self) -> str:
        return self.strategy + (f"/{self.drafter}" if self.drafter else "")


def requests(spans: Iterable[dict]) -> list[Request]:
    """Every request in ``spans``, in the order their spans started."""
    spans = list(spans)
    children: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        if s.get("parent_id"):
            children[s["parent_id"]].append(s)
    out = []
    for s in spans:
        if s.get("name") != REQUEST_SPAN:
            continue
        req = Request(s)
        for c in children.get(s["span_id"], []):
            if c.get("name") == ROUND_SPAN:
                rnd = Round(c)
                stack = list(children.get(c["span_id"], []))
                while stack:
                    x = stack.pop()
                    rnd.rpcs.append(x)
                    stack += children.get(x["span_id"], [])
                req.rounds.append(rnd)
        req.rounds.sort(key=lambda r: (r.index, r.span.get("start_ns") or 0))
        out.append(req)
    out.sort(key=lambda r: r.span.get("start_ns") or 0)
    return out


def find(reqs: list[Request], ref: Optional[str]) -> Request:
    """The request named by ``ref`` (trace id, request span id, session id, or a
    unique prefix of one); the last request when ``ref`` is None."""
    if not reqs:
        raise LookupError("no specmesh.generate spans in the trace")
    if not ref:
        return reqs[-1]
    ref = ref.lower()
    exact = [r for r in reqs if ref in (r.trace_id, r.span["span_id"], r.session_id.lower())]
    if exact:
        return exact[-1]
    pre = [r for r in reqs if r.trace_id.startswith(ref) or r.span["span_id"].startswith(ref)
           or r.session_id.lower().startswith(ref)]
    if len(pre) == 1:
        return pre[0]
    if not pre:
        raise LookupError(f"no request matches {ref!r}")
    raise LookupError(f"{len(pre)} requests match {ref!r}; give more characters")


def phases(rnd: Round) -> dict:
    """A round's time split in ms: draft (drafting, without the drafter's
    network time), network (wire time of its RPCs), verify (target forward)
    and other (the rest of the round's wall time: batching queue, acceptance,
    conversions, the router's own work)."""
    wall = float(rnd.a("wall_ms", 0.0))
    net = float(rnd.a("network_ms", 0.0))
    draft = max(0.0, float(rnd.a("draft_ms", 0.0)) - float(rnd.a("drafter_network_ms", 0.0)))
    verify = float(rnd.a("verify_ms", 0.0))
    return {"draft": draft, "network": net, "verify": verify, "other": max(0.0, wall - draft - net - verify)}
