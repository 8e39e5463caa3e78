"""Acceptance histograms from whatever a run left behind, the ceiling bin and
the preflight verdict.

Sources (``load(source)``), each giving one ``Acceptance`` per strategy/drafter
(or bench system/workload):

- a stats JSON: one ``GenerationStats`` dict (``specmesh generate --json``,
  ``r.stats.to_dict()``), a list of them, JSON lines of them, or a bench
  ``results.json`` (``records[].acceptance_hist``);
- a JSON-lines trace file (the ``jsonl`` exporter): per-round facts from the
  ``specmesh.round`` spans;
- a router's ``/metrics`` (an ``http(s)://`` URL, or a saved scrape):
  ``specmesh_accepted_length_per_round`` buckets, ``specmesh_ceiling_rounds_total``
  and ``specmesh_drafts_total``.

The ceiling bin ``h[B]`` holds the rounds that accepted a whole draft of the
full block length ``B`` (the longest draft a round may have: the request's
draft budget). Per-round sources (trace, metrics) count it against each
request's own budget; a bare histogram uses ``B`` = the longest draft seen (or
``--block``), which is the budget whenever some round drafted the full budget.
A round that accepted a shorter whole draft is not in the ceiling: its drafter
ran out of proposals, a longer block would not have helped it. The block size
binds when the ceiling holds more than ``threshold`` (10%) of the rounds that
drafted (all rounds when the source cannot tell).

This module knows nothing about gRPC or plotting.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

THRESHOLD = 0.10


@dataclass
class Acceptance:
    label: str
    hist: list[int]  # hist[a] = rounds that accepted exactly a drafted tokens
    source: str
    block: int = 0  # B: the ceiling bin's index (longest draft allowed, or seen)
    ceiling_rounds: Optional[int] = None  # counted per round against each request's budget (trace, metrics)
    drafted_rounds: Optional[int] = None  # rounds that verified a non-empty draft, when known
    requests: int = 0

    @property
    def rounds(self) -> int:
        return sum(self.hist)

    @property
    def accepted(self) -> int:
        return sum(a * n for a, n in enumerate(self.hist))

    @property
    def tau(self) -> float:
        """Tokens per target forward in the decode phase."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def exact_ceiling(self) -> bool:
        return self.ceiling_rounds is not None

    @property
    def ceiling_count(self) -> int:
        if self.ceiling_rounds is not None:
            return self.ceiling_rounds
        return self.hist[self.block] if 0 < self.block < len(self.hist) else 0

    @property
    def ceiling_fraction(self) -> float:
        d = self.drafted_rounds if self.drafted_rounds else self.rounds
        return self.ceiling_count / d if d else 0.0

    def binds(self, threshold: float = THRESHOLD) -> bool:
        return self.ceiling_fraction > threshold

    def verdict(self, threshold: float = THRESHOLD) -> str:
        f = self.ceiling_fraction
        if self.rounds == 0 or self.block == 0:
            return "no drafted rounds: nothing to judge"
        of = "drafted rounds" if self.drafted_rounds else "rounds"
        few = f" (only {self.rounds} rounds: weak evidence)" if self.rounds < 30 else ""
        if self.binds(threshold):
            return (f"the block size binds: {f:.1%} of {of} accepted a whole draft of the full block "
                    f"(a={self.block}, > {threshold:.0%}); a longer draft, or a drafter trained for a longer "
                    f"block, pays{few}")
        return (f"the block size does not bind: {f:.1%} of {of} accepted a whole draft of the full block "
                f"(a={self.block}, <= {threshold:.0%}); rounds end at a rejection or a short draft, so a longer "
                f"block would not pay{few}")


def _add(h: list[int], other) -> list[int]:
    out = list(h) + [0] * max(0, len(other) - len(h))
    for i, c in enumerate(other):
        out[i] += int(c)
    return out


def with_block(acc: Acceptance, block: Optional[int]) -> Acceptance:
    """Judge against the top bin ``h[block]`` (``--block``) instead of the per-round count."""
    if block is not None:
        acc.block, acc.ceiling_rounds = block, None
        if len(acc.hist) <= block:
            acc.hist = acc.hist + [0] * (block + 1 - len(acc.hist))
    return acc


def merge(accs: list[Acceptance], label: str = "all") -> Acceptance:
    out = Acceptance(label, [], ",".join(sorted({a.source for a in accs})))
    for a in accs:
        out.hist = _add(out.hist, a.hist)
        out.block = max(out.block, a.block)
        out.requests += a.requests
    if accs:
        out.ceiling_rounds = sum(a.ceiling_count for a in accs)
        if all(a.drafted_rounds is not None for a in accs):
            out.drafted_rounds = sum(a.drafted_rounds for a in accs)
    return out


# ---------------------------------------------------------------- stats / bench JSON

def _stats_label(d: dict) -> str:
    s = str(d.get("strategy", "") or "unknown")
    return s + (f"/{d['drafter']}" if d.get("drafter") else "")


def from_stats_dicts(items: list[dict], source: str = "stats") -> list[Acceptance]:
    groups: dict[str, Acceptance] = {}
    for d in items:
        if isinstance(d.get("stats"), dict):
            d = d["stats"]
        if "records" in d:
            for rec in d["records"]:
                if rec.get("acceptance_hist"):
                    lab = f"{rec.get('system')}/{rec.get('workload')}"
                    g = groups.setdefault(lab, Acceptance(lab, [], "bench"))
                    g.hist = _add(g.hist, rec["acceptance_hist"])
                    g.requests += int(rec.get("prompts") or 0)
            continue
        if "accept_hist" not in d:
            continue
        lab = _stats_label(d)
        g = groups.setdefault(lab, Acceptance(lab, [], source, drafted_rounds=0))
        g.hist = _add(g.hist, d["accept_hist"])
        g.requests += 1
        pd = d.get("position_drafted") or []
        g.block = max(g.block, len(pd))
        if g.drafted_rounds is not None and "position_drafted" in d:
            g.drafted_rounds += int(pd[0]) if pd else 0
        else:
            g.drafted_rounds = None
    for g in groups.values():
        g.block = max(g.block, len(g.hist) - 1)
    return list(groups.values())


# ---------------------------------------------------------------- trace file

def from_spans(spans) -> list[Acceptance]:
    from .traces import requests

    groups: dict[str, Acceptance] = {}
    for req in requests(spans):
        g = groups.setdefault(req.label, Acceptance(req.label, [], "trace", ceiling_rounds=0, drafted_rounds=0))
        g.requests += 1
        g.block = max(g.block, int(req.attrs.get("specmesh.draft_budget", 0)))
        for r in req.rounds:
            if r.a("prefill", False):
                continue
            acc, depth = int(r.a("accepted", 0)), int(r.a("depth", 0))
            g.hist = _add(g.hist, [0] * acc + [1])
            if depth > 0:
                g.drafted_rounds += 1
                g.ceiling_rounds += int(bool(r.a("ceiling", False)))
    return list(groups.values())


# ---------------------------------------------------------------- Prometheus text

def from_metrics_text(text: str, source: str = "metrics") -> list[Acceptance]:
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[tuple, dict[float, float]] = defaultdict(dict)
    ceil: dict[tuple, float] = {}
    drafts: dict[tuple, float] = {}
    reqs: dict[tuple, float] = defaultdict(float)
    depth: dict[tuple, int] = defaultdict(int)  # longest draft seen: the ceiling bin's index
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = (s.labels.get("strategy", ""), s.labels.get("drafter", ""))
            if s.name == "specmesh_accepted_length_per_round_bucket":
                buckets[lab][float(s.labels["le"])] = s.value
            elif s.name == "specmesh_ceiling_rounds_total":
                ceil[lab] = s.value
            elif s.name == "specmesh_drafts_total":
                drafts[lab] = s.value
            elif s.name == "specmesh_requests_total":
                reqs[lab] += s.value
            elif s.name == "specmesh_drafted_positions_total" and s.value > 0:
                depth[lab] = max(depth[lab], int(s.labels.get("position", "0")))
    out = []
    for lab, b in buckets.items():
        edges = sorted(b)
        hist, prev = [], 0.0
        for le in edges:  # integer buckets 0..32: differences are the exact bins
            n = int(round(b[le] - prev))
            prev = b[le]
            if le == float("inf"):
                if n > 0:  # accepted more than the last bucket: kept as one bin past it
                    hist.append(n)
                continue
            while len(hist) < int(le):
                hist.append(0)
            hist.append(n)
        while len(hist) > 1 and hist[-1] == 0:
            hist.pop()
        name = lab[0] + (f"/{lab[1]}" if lab[1] else "")
        out.append(Acceptance(name, hist, source, block=depth.get(lab, 0),
                              ceiling_rounds=int(ceil.get(lab, 0)), drafted_rounds=int(drafts.get(lab, 0)),
                              requests=int(reqs.get(lab, 0))))
    return out


# ---------------------------------------------------------------- any source

def load(source: str) -> list[Acceptance]:
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=10) as r:  # noqa: S310 - a user-given metrics URL
            return from_metrics_text(r.read().decode(), source)
    text = Path(source).read_text(encoding="utf-8")
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            first = json.loads(text.lstrip().split("\n", 1)[0])
        except json.JSONDecodeError:
            first = None
        if isinstance(first, dict) and "span_id" in first:
            from .jsonl import read_spans

            return from_spans(read_spans(source))
        try:
            data = json.loads(text)
            return from_stats_dicts(data if isinstance(data, list) else [data], "stats")
        except json.JSONDecodeError:
            lines = [json.loads(x) for x in text.splitlines() if x.strip().startswith("{")]
            return from_stats_dicts(lines, "stats")
    if "# TYPE specmesh_" in text:
        return from_metrics_text(text, source)
    lines = []  # e.g. the output of `specmesh generate --json`: text, then the stats as one JSON line
    for x in text.splitlines():
        if x.strip().startswith("{"):
            try:
                lines.append(json.loads(x))
            except json.JSONDecodeError:
                pass
    if lines:
        return from_stats_dicts([d for d in lines if isinstance(d, dict)], "stats")
    raise ValueError(f"{source}: not a stats/bench JSON, a trace file or a Prometheus scrape")
