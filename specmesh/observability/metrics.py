"""Prometheus metrics of the three services (prometheus-client), ``/metrics`` over HTTP.

Each service gets its own ``CollectorRegistry`` (several services can share a
process, as in the tests) and serves it with ``serve(port, host)``; port 0
picks a free port. Every name starts with ``specmesh_``; counters end in
``_total``, durations are histograms in seconds.

- ``RouterMetrics`` (labels ``strategy``, ``drafter``): requests, active
  sessions, time to first token, inter-token latency and end-to-end latency
  (histograms with vLLM's buckets), prompt tokens, rounds, drafts,
  draft/accepted/generated tokens, accepted tokens per
  position, accepted length per round (histogram), rounds in the ceiling bin
  (accepted a whole draft of the full block length, i.e. the request's draft
  budget) and their ratio to rounds with a draft, tokens/s per request, draft /
  verify / prefill / network seconds, fallbacks, round duration. Recorded per
  round by ``requests.RequestObservation`` from the same facts the loop puts in
  the per-response stats, so the counters add up to the responses' stats.
  Requests with a relaxed (lossy) acceptance rule are counted again, with the
  rule as label ``acceptance``: ``specmesh_lossy_requests_total``,
  ``specmesh_lossy_generated_tokens_total``, ``specmesh_lossy_accepted_tokens_total``
  (exact requests never appear there, so any sample of these families is lossy).
- ``VerifierMetrics`` (label ``strategy``, sent by the router in
  ``x-specmesh-strategy``): verify batch size, queue time, forward time, scored
  tree nodes, Verify calls that applied a lossy acceptance rule (label
  ``acceptance``); KV slots used/total, evictions and target forwards read from
  the verifier at scrape time, and its prefix cache's: prompt tokens looked up and
  found (``specmesh_prefix_cache_queries_total`` / ``_hits_total``, vLLM's names),
  bytes stored and budgeted, blocks evicted and held.
- ``DrafterMetrics`` (labels ``drafter``, ``strategy``): proposals, proposed
  tokens, draft time; sessions held, read at scrape time.
- All: ``specmesh_rpc_duration_seconds`` and ``specmesh_rpc_errors_total``
  (labels ``side`` = server | client, ``service``, ``method``, ``code``,
  ``strategy``), fed by ``rpc.ServerInterceptor`` through ``on_call``.

This module knows the services' response messages only by field name and
nothing about tracing.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPT_BUCKETS = tuple(float(i) for i in range(0, 33))  # integer bins: exact histogram per bucket
BATCH_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 160.0, 240.0, 400.0)
# the latency buckets of vLLM's histograms of the same names (time_to_first_token_seconds, ...)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _label(strategy: str) -> str:
    return strategy or "unknown"


def is_lossy(acceptance: str) -> bool:
    """Every rule but "exact" is relaxed (``SamplingParams.lossy``); "" is the default, exact."""
    return bool(acceptance) and acceptance != "exact"


class ServiceMetrics:
    """Registry, RPC metrics and the HTTP endpoint shared by every service."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpc_duration = Histogram("specmesh_rpc_duration_seconds", "Server-side handling time of RPCs",
                                      ["service", "method", "strategy"], buckets=SECONDS, registry=r)
        self.rpc_errors = Counter("specmesh_rpc_errors_total", "RPCs that ended with a non-OK status, by code",
                                  ["side", "service", "method", "code", "strategy"], registry=r)
        self._http = None

    def rpc_error(self, side: str, method: str, code: str, strategy: str = "") -> None:
        service, _, name = method.lstrip("/").partition("/")
        self.rpc_errors.labels(side, service, name, code, _label(strategy)).inc()

    def on_call(self, method: str, strategy: str, request, response, seconds: float, code) -> None:
        """A finished server call (``rpc.ServerInterceptor``)."""
        service, _, name = method.lstrip("/").partition("/")
        self.rpc_duration.labels(service, name, _label(strategy)).observe(seconds)
        if code is not None and code != grpc.StatusCode.OK:
            self.rpc_errors.labels("server", service, name, code.name, _label(strategy)).inc()
        elif response is not None:
            self.on_response(name, _label(strategy), request, response)

    def on_response(self, method: str, strategy: str, request, response) -> None:
        pass

    def on_item(self, method: str, strategy: str, request, item) -> None:
        """One message a server stream sent (before the call's ``on_call``)."""

    # ------------------------------------------------------------ HTTP
    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = a free port); returns the port."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = httpd
        return httpd.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _Callback:
    """A collector whose samples are computed at scrape time by ``fn() -> dict``."""

    def __init__(self, fn: Callable[[], dict], spec: list[tuple[str, str, str, str]]):
        self.fn, self.spec = fn, spec  # (name, help, kind, key in fn())

    def collect(self):
        try:
            d = self.fn()
        except Exception:  # noqa: BLE001 - a failed read shows as missing samples, never a failed scrape
            return
        for name, doc, kind, key in self.spec:
            if d.get(key) is None:
                continue
            fam = CounterMetricFamily(name, doc) if kind == "counter" else GaugeMetricFamily(name, doc)
            fam.add_metric([], float(d[key]))
            yield fam


# ---------------------------------------------------------------- router

class RouterMetrics(ServiceMetrics):
    LABELS = ["strategy", "drafter"]

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        super().__init__(registry)
        r, L = self.registry, self.LABELS
        self.requests = Counter("specmesh_requests_total", "Generations ended, by finish reason "
                                "(stop, length, cancelled, error)", L + ["finish_reason"], registry=r)
        self.active = Gauge("specmesh_active_sessions", "Generations in progress", L, registry=r)
        self.rounds = Counter("specmesh_rounds_total", "Draft-verify rounds after prefill", L, registry=r)
        self.drafts = Counter("specmesh_drafts_total", "Rounds that verified a non-empty draft", L, registry=r)
        self.draft_tokens = Counter("specmesh_draft_tokens_total", "Drafted tokens sent to the verifier", L,
                                    registry=r)
        self.accepted_tokens = Counter("specmesh_accepted_tokens_total", "Drafted tokens the target accepted", L,
                                       registry=r)
        self.pos_drafted = Counter("specmesh_drafted_positions_total",
                                   "Rounds whose draft reached depth `position` (1-based)", L + ["position"],
                                   registry=r)
        self.pos_accepted = Counter("specmesh_accepted_tokens_by_position_total",
                                    "Rounds that accepted the drafted token at depth `position` (1-based)",
                                    L + ["position"], registry=r)
        self.accept_len = Histogram("specmesh_accepted_length_per_round", "Drafted tokens accepted per round",
                                    L, buckets=ACCEPT_BUCKETS, registry=r)
        self.ceiling = Counter("specmesh_ceiling_rounds_total", "Rounds in the ceiling bin: accepted the whole "
                               "draft at the full block length (the request's draft budget)", L, registry=r)
        self.ceiling_ratio = Gauge("specmesh_ceiling_bin_ratio",
                                   "Ceiling rounds / rounds with a draft, since start", L, registry=r)
        self.generated = Counter("specmesh_generated_tokens_total", "Tokens generated (stop token excluded)", L,
                                 registry=r)
        self.prompt_tokens = Counter("specmesh_prompt_tokens_total", "Prompt tokens of the generations started",
                                     L, registry=r)
        self.ttft = Histogram("specmesh_time_to_first_token_seconds", "Time from the start of a generation to "
                              "its first token handed to the transport", L, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specmesh_inter_token_latency_seconds", "Time between a round's tokens and the "
                             "previous ones, spread evenly over the round's tokens (one observation per token "
                             "after the first)", L, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specmesh_e2e_request_latency_seconds", "Time from the start of a generation to its "
                             "end (completed or cancelled; failed ones are not observed)", L,
                             buckets=E2E_BUCKETS, registry=r)
        self.tps = Histogram("specmesh_tokens_per_second", "Generated tokens per second of each request", L,
                             buckets=TPS_BUCKETS, registry=r)
        self.phase = Counter("specmesh_phase_seconds_total", "Time per phase as in the per-response stats "
                             "(draft, verify, prefill, network; network is also inside the others)",
                             L + ["phase"], registry=r)
        self.fallbacks = Counter("specmesh_fallbacks_total", "Rounds decoded without a draft because the drafter "
                                 "failed or was down", L, registry=r)
        self.round_time = Histogram("specmesh_round_duration_seconds", "Wall time of a round in the router", L,
                                    buckets=SECONDS, registry=r)
        LA = L + ["acceptance"]
        self.lossy_requests = Counter("specmesh_lossy_requests_total", "Generations ended that used a relaxed "
                                      "(lossy) acceptance rule, by rule", LA, registry=r)
        self.lossy_generated = Counter("specmesh_lossy_generated_tokens_total", "Tokens generated under a relaxed "
                                       "(lossy) acceptance rule, by rule", LA, registry=r)
        self.lossy_accepted = Counter("specmesh_lossy_accepted_tokens_total", "Drafted tokens accepted by a "
                                      "relaxed (lossy) acceptance rule, by rule", LA, registry=r)
        self.ahead = Counter("specmesh_draft_ahead", "Rounds of drafters that can draft ahead, by how the draft was "
                             "obtained: hit (from a round drafted while the previous one verified), miss (drafted "
                             "afresh), off (no draft-ahead asked)", L + ["result"], registry=r)
        self.ahead_wasted = Counter("specmesh_draft_ahead_wasted_tokens", "Drafted-ahead tokens of outcomes that "
                                    "did not happen", L, registry=r)
        self._counts: dict[tuple, list[int]] = {}  # (strategy, drafter) -> [drafted rounds, ceiling rounds]
        self._lock = threading.Lock()

    def on_call(self, method: str, strategy: str, request, response, seconds: float, code) -> None:
        # clients send no strategy header: label Generate calls with the requested strategy
        if not strategy and request is not None:
            strategy = getattr(request, "strategy", "") or "default"
        super().on_call(method, strategy, request, response, seconds, code)

    def request_started(self, strategy: str, drafter: str, prompt_tokens: int = 0) -> None:
        self.active.labels(strategy, drafter).inc()
        if prompt_tokens > 0:
            self.prompt_tokens.labels(strategy, drafter).inc(prompt_tokens)

    def request_ended(self, strategy: str, drafter: str, finish_reason: str, acceptance: str = "exact",
                      e2e_s: Optional[float] = None) -> None:
        self.active.labels(strategy, drafter).dec()
        self.requests.labels(strategy, drafter, finish_reason or "unknown").inc()
        if is_lossy(acceptance):
            self.lossy_requests.labels(strategy, drafter, acceptance).inc()
        if e2e_s is not None and finish_reason != "error":
            self.e2e.labels(strategy, drafter).observe(e2e_s)

    def tokens_emitted(self, strategy: str, drafter: str, n: int, since_start_s: float,
                       since_last_s: Optional[float]) -> None:
        """``n`` tokens left the router at once: the first ones of the request
        (``since_last_s`` None: TTFT, and the rest of the batch 0 s apart) or a later
        round's (``since_last_s`` spread over them: one inter-token latency per token)."""
        if n <= 0:
            return
        lab = (strategy, drafter)
        if since_last_s is None:
            self.ttft.labels(*lab).observe(since_start_s)
            for _ in range(n - 1):
                self.itl.labels(*lab).observe(0.0)
        else:
            per = since_last_s / n
            for _ in range(n):
                self.itl.labels(*lab).observe(per)

    def record_round(self, strategy: str, drafter: str, drafted: int, accepted: int, depth: int,
                     wall_s: float, block: int = 0, acceptance: str = "exact") -> None:
        """One round after prefill: the same numbers ``GenerationStats.record_round`` adds;
        ``block`` is the longest draft allowed (the ceiling bin is ``accepted == block``);
        ``acceptance`` is the request's rule (accepted tokens of a lossy one are counted again)."""
        lab = (strategy, drafter)
        if accepted and is_lossy(acceptance):
            self.lossy_accepted.labels(strategy, drafter, acceptance).inc(accepted)
        self.rounds.labels(*lab).inc()
        self.accept_len.labels(*lab).observe(accepted)
        self.round_time.labels(*lab).observe(wall_s)
        if drafted > 0:
            self.drafts.labels(*lab).inc()
            self.draft_tokens.labels(*lab).inc(drafted)
        if accepted:
            self.accepted_tokens.labels(*lab).inc(accepted)
        for k in range(depth):
            self.pos_drafted.labels(*lab, str(k + 1)).inc()
            if k < accepted:
                self.pos_accepted.labels(*lab, str(k + 1)).inc()
        if depth > 0:
            ceiling = accepted >= max(depth, block)
            if ceiling:
                self.ceiling.labels(*lab).inc()
            with self._lock:
                c = self._counts.setdefault(lab, [0, 0])
                c[0] += 1
                c[1] += int(ceiling)
                self.ceiling_ratio.labels(*lab).set(c[1] / c[0])

    def record_ahead(self, strategy: str, drafter: str, result: str, wasted: int = 0) -> None:
        """One round's draft-ahead result (hit / miss / off) and its wasted ahead tokens."""
        self.ahead.labels(strategy, drafter, result).inc()
        if wasted > 0:
            self.ahead_wasted.labels(strategy, drafter).inc(wasted)

    def add_generated(self, strategy: str, drafter: str, n: int, acceptance: str = "exact") -> None:
        if n > 0:
            self.generated.labels(strategy, drafter).inc(n)
            if is_lossy(acceptance):
                self.lossy_generated.labels(strategy, drafter, acceptance).inc(n)

    def request_finished(self, strategy: str, drafter: str, stats) -> None:
        """Request-level sums from the final stats (before the final message goes out)."""
        lab = (strategy, drafter)
        for phase in ("draft", "verify", "prefill", "network"):
            v = float(getattr(stats, f"{phase}_s", 0.0) or 0.0)
            if v > 0:
                self.phase.labels(*lab, phase).inc(v)
        if stats.fallbacks:
            self.fallbacks.labels(*lab).inc(stats.fallbacks)
        if stats.total_s > 0:
            self.tps.labels(*lab).observe(stats.tokens_per_s)


# ---------------------------------------------------------------- verifier

class VerifierMetrics(ServiceMetrics):
    def __init__(self, verifier=None, registry: Optional[CollectorRegistry] = None):
        super().__init__(registry)
        r = self.registry
        self.batch = Histogram("specmesh_verify_batch_size", "Sessions in the forward that served a Verify call "
                               "(or a Decode step)",
                               ["strategy"], buckets=BATCH_BUCKETS, registry=r)
        self.queue = Histogram("specmesh_verify_queue_seconds", "Verify handler time outside the batch forward "
                               "and self-drafting: waiting for a batch, acceptance, conversion", ["strategy"],
                               buckets=SECONDS, registry=r)
        self.forward = Histogram("specmesh_verify_forward_seconds", "Time of the batched target forward",
                                 ["strategy"], buckets=SECONDS, registry=r)
        self.nodes = Counter("specmesh_verify_tree_nodes_total", "Draft tree nodes scored", ["strategy"],
                             registry=r)
        self.lossy = Counter("specmesh_verify_lossy_calls_total", "Verify calls that applied a relaxed (lossy) "
                             "acceptance rule, by rule", ["strategy", "acceptance"], registry=r)
        if verifier is not None:
            r.register(_Callback(verifier.info, [
                ("specmesh_kv_slots_used", "KV slots holding a session", "gauge", "slots_used"),
                ("specmesh_kv_slots_total", "KV slots of the verifier", "gauge", "slots_total"),
                ("specmesh_active_sessions", "Sessions holding a KV slot", "gauge", "slots_used"),
                ("specmesh_kv_evictions", "Idle sessions evicted to free a slot", "counter", "evictions"),
                ("specmesh_target_forwards", "Target forwards run", "counter", "forwards"),
                ("specmesh_cuda_graph_captures", "CUDA graphs captured while serving (buckets the warm-up "
                 "missed; each capture stalls the forward that needed it)", "counter", "cuda_graph_captures"),
                # the prefix cache, named after vLLM's prefix_cache_queries / prefix_cache_hits (tokens)
                ("specmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "counter",
                 "prefix_cache_queries"),
                ("specmesh_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", "counter",
                 "prefix_cache_hits"),
                ("specmesh_prefix_cache_bytes", "Bytes of the KV blocks the prefix cache stores", "gauge",
                 "prefix_cache_bytes"),
                ("specmesh_prefix_cache_budget_bytes", "The prefix cache's storage budget", "gauge",
                 "prefix_cache_budget_bytes"),
                ("specmesh_prefix_cache_evictions", "Prefix-cache blocks evicted (least recently used) to make room",
                 "counter", "prefix_cache_evictions"),
                ("specmesh_prefix_cache_blocks_held", "Prefix-cache blocks live sessions hold (not evictable)",
                 "gauge", "prefix_cache_blocks_held"),
            ]))

    def on_item(self, method: str, strategy: str, request, item) -> None:
        if method == "Decode":  # each step of a Decode stream is a Verify round (plain or self-drafted)
            self.on_response("Verify", strategy, request, item)

    def on_response(self, method: str, strategy: str, request, response) -> None:
        if method != "Verify":
            return
        self.batch.labels(strategy).observe(response.batch_size)
        self.forward.labels(strategy).observe(response.verify_ms / 1e3)
        q = response.server_ms - response.verify_ms - response.draft_ms
        self.queue.labels(strategy).observe(max(0.0, q) / 1e3)
        if response.tree_size:
            self.nodes.labels(strategy).inc(response.tree_size)
        sampling = getattr(request, "sampling", None)
        acceptance = sampling.acceptance if sampling is not None else ""
        if is_lossy(acceptance):
            self.lossy.labels(strategy, acceptance).inc()


# ---------------------------------------------------------------- drafter

class DrafterMetrics(ServiceMetrics):
    def __init__(self, host=None, registry: Optional[CollectorRegistry] = None):
        super().__init__(registry)
        r = self.registry
        self.proposals = Counter("specmesh_drafter_proposals_total", "Propose calls answered",
                                 ["drafter", "strategy"], registry=r)
        self.tokens = Counter("specmesh_drafter_proposed_tokens_total", "Draft tree nodes proposed",
                              ["drafter", "strategy"], registry=r)
        self.draft_time = Histogram("specmesh_drafter_draft_seconds", "Drafting time per proposal",
                                    ["drafter", "strategy"], buckets=SECONDS, registry=r)
        if host is not None:
            r.register(_Callback(host.info, [
                ("specmesh_active_sessions", "Sessions the drafter holds", "gauge", "sessions")]))

    def on_response(self, method: str, strategy: str, request, response) -> None:
        if method != "Propose":
            return
        d = request.drafter or "unknown"
        self.proposals.labels(d, strategy).inc()
        self.tokens.labels(d, strategy).inc(len(response.tree.tokens))
        self.draft_time.labels(d, strategy).observe(response.draft_ms / 1e3)
