"""The router's view of a request: the ``specmesh.generate`` span, one
``specmesh.round`` span per round, and the router metrics — all from the facts
the draft–verify loop reports.

``RouterObserver(model, metrics)`` lives on the router; ``request(plan, ...)``
returns a ``RequestObservation`` whose ``round_scope`` is passed to
``speculative_generate``. Each round scope

- opens a ``specmesh.round`` span (child of the request span) and makes it
  current, so the RPC client spans made by the drafter/verifier adapters inside
  the round are its children (tracing on only);
- puts a ``rpc.CallScope`` in the context: the strategy header for the peers'
  metrics, and where client-side RPC failures are counted;
- on exit reads the loop's facts (drafted, accepted, depth, tree_size,
  draft_ms, verify_ms, wall_ms, batch_size, prefill; the prefill's prompt split into
  cached_tokens, found in the verifier's prefix cache, and computed_tokens) and the round's network
  time (growth of the adapters' ``network_s``), sets them on the span and
  records the round's metrics.

Round indices count the request's rounds in order (a strategy that runs the
loop in phases, like ssr's thinking then answer, starts the loop's own index
again; ``specmesh.round.phase`` says which phase, each opening with a
prefill/resume round). Work a strategy does outside the loop's rounds (ssr's
side branches) is not a round: its RPCs hang under the Generate server span.

Latency: the observation starts when the router starts the generation (after
validation and tokenization). Tokens count as delivered when the next round
opens or the request finishes (the router hands each round's delta on before
that): the first ones give the time to first token, later rounds give one
inter-token latency per token (the interval since the previous delivery spread
evenly over the round's tokens, so ``_sum / _count`` is the decode time per
output token), and ``end`` gives the end-to-end latency.

The observer also feeds the router's periodic throughput line
(``throughput.ThroughputLog``, when given): prompt tokens at the start, tokens as
they are counted delivered, the request's end.

``finish(stats)`` (just before the final message) sets the gen_ai.* usage and
response attributes and the request-level metrics; ``end(err)`` ends the span
and the active-session count. With tracing off no span is made.

A request whose sampling asks for a relaxed (lossy) acceptance rule is labelled
from its first span on: ``specmesh.lossy`` (true) and ``specmesh.acceptance``
(the rule) on the request span and on every round span, and the lossy counters
of ``RouterMetrics`` (label ``acceptance``) count its requests, generated
tokens and accepted drafted tokens.

It knows nothing about gRPC, protos or tokenizers; a ``plan`` is anything with
ids, strategy, reason, drafter, self_draft, max_new_tokens, budget, sampling.
"""

from __future__ import annotations

import time
from typing import Optional

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from . import rpc, tracing
from .metrics import is_lossy


class RouterObserver:
    def __init__(self, model: str = "", metrics=None, throughput=None):
        self.model, self.metrics = model, metrics
        self.throughput = throughput  # a ``throughput.ThroughputLog``: the periodic log line, or None

    def request(self, plan, session_id: str, stats, verifier=None, drafter=None) -> "RequestObservation":
        return RequestObservation(self, plan, session_id, stats, verifier, drafter)


def _request_attributes(model: str, plan, session_id: str) -> dict:
    sp = plan.sampling
    a = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "specmesh",
         "gen_ai.request.model": model, "gen_ai.request.max_tokens": plan.max_new_tokens,
         "gen_ai.request.temperature": float(sp.temperature), "gen_ai.request.top_p": float(sp.top_p),
         "gen_ai.request.top_k": int(sp.top_k), "gen_ai.request.seed": int(sp.seed) & 0x7FFFFFFFFFFFFFFF,
         "gen_ai.request.stream": True, "gen_ai.usage.input_tokens": len(plan.ids),
         "gen_ai.response.id": session_id, "specmesh.strategy": plan.strategy,
         "specmesh.strategy_reason": plan.reason, "specmesh.drafter": plan.drafter or plan.self_draft or "",
         # where the draft is made: the drafter service, or the verifier (self drafters, and an external
         # request's context-only drafter the verifiers run: router setting context_drafters)
         "specmesh.drafter.site": "drafter" if plan.drafter else ("verifier" if plan.self_draft else ""),
         "specmesh.draft_budget": plan.budget, "specmesh.acceptance": _acceptance(sp),
         "specmesh.lossy": is_lossy(_acceptance(sp))}
    return a


def _acceptance(sampling) -> str:
    return getattr(sampling, "acceptance", "") or "exact"


def _stats_attributes(model: str, s) -> dict:
    a = {"gen_ai.usage.output_tokens": s.new_tokens, "gen_ai.response.model": model,
         "gen_ai.response.finish_reasons": [s.finish_reason or "unknown"], "specmesh.rounds": s.rounds,
         "specmesh.target_forwards": s.target_forwards, "specmesh.tau": float(s.tau),
         "specmesh.drafted_tokens": s.drafted_tokens, "specmesh.accepted_tokens": s.accepted_tokens,
         "specmesh.accept_hist": list(s.accept_hist), "specmesh.draft_s": s.draft_s, "specmesh.verify_s": s.verify_s,
         "specmesh.prefill_s": s.prefill_s, "specmesh.total_s": s.total_s, "specmesh.ttft_s": s.ttft_s,
         "specmesh.tokens_per_s": float(s.tokens_per_s), "specmesh.fallbacks": s.fallbacks,
         "specmesh.lossy": bool(s.lossy), "specmesh.cached_tokens": int(getattr(s, "cached_tokens", 0))}
    for k in ("network_s", "reprefills", "verifier"):
        if hasattr(s, k):
            a[f"specmesh.{k}"] = getattr(s, k)
    return a


class RequestObservation:
    def __init__(self, owner: RouterObserver, plan, session_id: str, stats, verifier=None, drafter=None):
        self.model, self.metrics = owner.model, owner.metrics
        self.stats, self.verifier, self.drafter = stats, verifier, drafter
        self.strategy = plan.strategy
        self.drafter_name = plan.drafter or plan.self_draft or ""
        self.acceptance = _acceptance(plan.sampling)  # the verify rule; any but "exact" is lossy
        self.lossy = is_lossy(self.acceptance)
        self.block = int(plan.budget)  # the longest draft a round may have: the ceiling bin
        self.call_scope = rpc.CallScope(plan.strategy, self.metrics)
        self.finished = self.ended = False
        self._generated = 0
        self.t0 = time.perf_counter()
        self._last_emit: Optional[float] = None  # when tokens last left the router (TTFT / inter-token latency)
        self.rounds_seen = 0
        self.phase = -1
        self.span = self.ctx = None
        self.last_round_ctx = None  # the previous round's span: a draft-ahead span's parent
        if tracing.enabled():
            self.span = tracing.tracer().start_span("specmesh.generate",
                                                    attributes=_request_attributes(self.model, plan, session_id))
            self.ctx = trace.set_span_in_context(self.span)
        if self.metrics is not None:
            self.metrics.request_started(self.strategy, self.drafter_name, len(getattr(plan, "ids", ()) or ()))
        self.throughput = owner.throughput
        if self.throughput is not None:
            self.throughput.started(len(getattr(plan, "ids", ()) or ()))

    def round_scope(self, index: int) -> "RoundScope":
        return RoundScope(self, index)

    def network_s(self) -> tuple[float, float]:
        """(all network seconds so far, of which the drafter's)."""
        d = getattr(self.drafter, "network_s", 0.0) if self.drafter is not None else 0.0
        v = getattr(self.verifier, "network_s", 0.0) if self.verifier is not None else 0.0
        return d + v, d

    def _flush_generated(self) -> None:
        """Tokens committed since the last call have been handed on (the router yields
        each round's delta before the next round opens): count them, and time them."""
        n = self.stats.new_tokens - self._generated
        if n > 0:
            if self.throughput is not None:
                self.throughput.generated(n)
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.add_generated(self.strategy, self.drafter_name, n, self.acceptance)
                last = None if self._last_emit is None else now - self._last_emit
                self.metrics.tokens_emitted(self.strategy, self.drafter_name, n, now - self.t0, last)
            self._last_emit = now
        self._generated = self.stats.new_tokens

    def finish(self, stats) -> None:
        """The generation completed (call before sending the final message)."""
        self.finished = True
        self._flush_generated()
        if self.metrics is not None:
            self.metrics.request_finished(self.strategy, self.drafter_name, stats)
        if self.span is not None and self.span.is_recording():
            self.span.set_attributes(_stats_attributes(self.model, stats))

    def end(self, err: Optional[BaseException] = None) -> None:
        """The generator is done (normally, cancelled or failed); idempotent."""
        if self.ended:
            return
        self.ended = True
        if self.finished and isinstance(err, GeneratorExit):
            err = None  # closed after the final message went out
        if err is None and self.finished:
            outcome = self.stats.finish_reason or "unknown"
        elif err is None or isinstance(err, GeneratorExit):
            outcome = "cancelled"
        else:
            outcome = "error"
        self._flush_generated()
        if self.throughput is not None:
            self.throughput.ended()
        if self.metrics is not None:
            self.metrics.request_ended(self.strategy, self.drafter_name, outcome, self.acceptance,
                                       time.perf_counter() - self.t0)
        if self.span is not None:
            if not self.finished and self.span.is_recording():
                self.span.set_attributes(_stats_attributes(self.model, self.stats))
            if outcome == "error":
                self.span.set_status(Status(StatusCode.ERROR, type(err).__name__))
                self.span.record_exception(err)
            elif outcome == "cancelled":
                self.span.set_attribute("specmesh.cancelled", True)
            self.span.end()


AHEAD_MS = ("ahead_ms", "drafter_busy_ms", "drafter_idle_ms", "verifier_busy_ms", "verifier_idle_ms")


def ahead_span(parent, f: dict) -> None:
    """The drafter's draft-ahead work behind this round, as a ``specmesh.draft_ahead`` span
    under the previous round (whose verify it overlapped), placed at its own times
    (``ahead_span``: perf_counter seconds of this process, converted to the span clock)."""
    t0, t1 = f["ahead_span"]
    now_perf, now_ns = time.perf_counter(), time.time_ns()
    sp = tracing.tracer().start_span("specmesh.draft_ahead", context=parent,
                                     start_time=now_ns - int((now_perf - t0) * 1e9),
                                     attributes={"specmesh.ahead.result": str(f.get("ahead", "")),
                                                 "specmesh.ahead.outcomes": int(f.get("ahead_outcomes", 0)),
                                                 "specmesh.ahead.wasted": int(f.get("wasted", 0))})
    sp.end(end_time=now_ns - int((now_perf - t1) * 1e9))


class RoundScope:
    """Context manager around one round; yields the dict the loop fills."""

    __slots__ = ("req", "index", "loop_index", "facts", "t0", "pd0", "net0", "span", "_ctx_token", "_scope_token")

    def __init__(self, req: RequestObservation, loop_index: int):
        self.req, self.loop_index = req, loop_index
        self.index = req.rounds_seen
        req.rounds_seen += 1
        if loop_index == 0:
            req.phase += 1
        self.span = self._ctx_token = None

    def __enter__(self) -> dict:
        req = self.req
        req._flush_generated()
        self.facts: dict = {}
        self.t0 = time.perf_counter()
        self.pd0 = sum(req.stats.position_drafted)
        self.net0 = req.network_s()
        self._scope_token = rpc.enter_scope(req.call_scope)
        if req.ctx is not None:
            self.span = tracing.tracer().start_span(
                "specmesh.round", context=req.ctx,
                attributes={"specmesh.round.index": self.index, "specmesh.round.phase": max(req.phase, 0),
                            "specmesh.strategy": req.strategy, "specmesh.drafter": req.drafter_name,
                            "specmesh.acceptance": req.acceptance, "specmesh.lossy": req.lossy})
            self._ctx_token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.facts

    def __exit__(self, et, ev, tb) -> bool:
        req, f, span = self.req, self.facts, self.span
        if self._ctx_token is not None:
            otel_context.detach(self._ctx_token)
        rpc.exit_scope(self._scope_token)
        wall_s = time.perf_counter() - self.t0
        if f:
            depth = int(f["depth"]) if "depth" in f else sum(req.stats.position_drafted) - self.pd0
            prefill = bool(f.get("prefill"))
            drafted, accepted = int(f.get("drafted", 0)), int(f.get("accepted", 0))
            if req.metrics is not None and not prefill:
                req.metrics.record_round(req.strategy, req.drafter_name, drafted, accepted, depth, wall_s,
                                         req.block, req.acceptance)
            if req.metrics is not None and "ahead" in f:
                req.metrics.record_ahead(req.strategy, req.drafter_name, str(f["ahead"]).split(":")[0],
                                         int(f.get("wasted", 0)))
            if span is not None and span.is_recording():
                net, dnet = req.network_s()
                span.set_attributes({
                    "specmesh.round.prefill": prefill, "specmesh.round.drafted": drafted,
                    "specmesh.round.accepted": accepted, "specmesh.round.depth": depth,
                    "specmesh.round.tree_size": int(f.get("tree_size", 0)),
                    "specmesh.round.ceiling": depth > 0 and accepted >= max(depth, req.block),
                    "specmesh.round.draft_ms": float(f.get("draft_ms", 0.0)),
                    "specmesh.round.verify_ms": float(f.get("verify_ms", 0.0)),
                    "specmesh.round.network_ms": (net - self.net0[0]) * 1e3,
                    "specmesh.round.drafter_network_ms": (dnet - self.net0[1]) * 1e3,
                    "specmesh.round.wall_ms": float(f.get("wall_ms", wall_s * 1e3)),
                    "specmesh.round.batch_size": int(f.get("batch_size", 1)),
                    "specmesh.round.verify_source": str(f.get("verify_source", "verify"))})
                if "cached_tokens" in f:  # the prefill: its prompt split into cached and computed tokens
                    span.set_attributes({"specmesh.round.cached_tokens": int(f["cached_tokens"]),
                                         "specmesh.round.computed_tokens": int(f.get("computed_tokens", 0))})
                if "ahead" in f:
                    span.set_attributes({"specmesh.round.ahead": str(f["ahead"]),
                                         "specmesh.round.ahead_wasted": int(f.get("wasted", 0))})
                    span.set_attributes({f"specmesh.round.{k}": float(f[k]) for k in AHEAD_MS if k in f})
            if "ahead_span" in f and f["ahead_span"] is not None and req.ctx is not None:
                ahead_span(req.last_round_ctx or req.ctx, f)
        if span is not None:
            req.last_round_ctx = trace.set_span_in_context(span)
        if span is not None:
            if ev is not None:
                span.set_status(Status(StatusCode.ERROR, type(ev).__name__))
                span.record_exception(ev)
            span.end()
        return False
