"""Observability: tracing setup from OTEL_* variables, the JSON-lines exporter,
stats sources and the ceiling verdict (pure); then, across real gRPC services
on loopback with a tiny random model (seconds), the span tree request -> round
-> RPC client -> RPC server with its attributes on every strategy the router
lists, ``/metrics`` scrapes that parse and agree with the per-response stats,
RPC errors counted by code, and the trace file rendered to PNGs by the CLI.
``tests/test_observability_e2e.py`` repeats the tree and metrics checks on the
real SmolLM2 (slow).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections import defaultdict

import grpc
import pytest

from specmesh.observability import stats as st
from specmesh.observability import tracing

V = 96
N = 12
PROMPT = "abcabcabcabc hello hello hello abcabc"


# ---------------------------------------------------------------- helpers shared with the e2e test

def make_provider(jsonl_path=None):
    """A TracerProvider with an in-memory exporter (and the JSON-lines one), synchronous export."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specmesh.observability.jsonl import JsonLinesSpanExporter

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "specmesh-test"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    if jsonl_path is not None:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(jsonl_path)))
    return provider, mem


def spans_of(mem) -> list[dict]:
    from specmesh.observability.jsonl import span_to_dict

    return [span_to_dict(s) for s in mem.get_finished_spans()]


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def strategy_cases(router, drafters_available) -> list[tuple[str, str]]:
    """(strategy, drafter) for every strategy the router lists, each external drafter the drafter serves."""
    cases = []
    for info in router.strategies():
        name, drafters = info["name"], list(info["drafters"])
        if name == "external":
            cases += [(name, d) for d in drafters if d in drafters_available]
        else:
            cases.append((name, ""))  # the strategy's own default drafter
    return cases


def request_kwargs(strategy: str) -> dict:
    """What a strategy needs beyond the prompt (proactive: a conversation)."""
    return {"conversation_id": "obs-test-conversation"} if strategy == "proactive" else {}


def check_request_tree(spans: list[dict], result, n: int, model: str = "") -> dict:
    """Assert the request -> round -> RPC client -> RPC server shape and attributes; return the request span."""
    by_id = {s["span_id"]: s for s in spans}
    kids = defaultdict(list)
    for s in spans:
        kids[s["parent_id"]].append(s)
    stats = result.stats
    reqs = [s for s in spans if s["name"] == "specmesh.generate"
            and s["attributes"].get("gen_ai.response.id") == result.session_id]
    assert len(reqs) == 1, "one request span per generation"
    req = reqs[0]
    a = req["attributes"]
    parent = by_id.get(req["parent_id"])
    assert parent is not None and parent["name"] == "specmesh.v1.Router/Generate" and parent["kind"] == "SERVER"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == n and a["gen_ai.request.temperature"] == 0.0
    if model:
        assert a["gen_ai.request.model"] == model
    assert a["gen_ai.usage.input_tokens"] == stats.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == stats.new_tokens == len(result.token_ids)
    assert a["gen_ai.response.finish_reasons"] == [stats.finish_reason]
    assert a["specmesh.strategy"] == stats.strategy and a["specmesh.rounds"] == stats.rounds
    assert a["specmesh.accept_hist"] == stats.accept_hist
    assert abs(a["specmesh.tau"] - stats.tau) < 1e-9
    rounds = sorted((c for c in kids[req["span_id"]] if c["name"] == "specmesh.round"),
                    key=lambda s: s["attributes"]["specmesh.round.index"])
    assert [r["attributes"]["specmesh.round.index"] for r in rounds] == list(range(len(rounds)))
    assert rounds[0]["attributes"]["specmesh.round.prefill"], "the first round prefills"
    assert sum(not r["attributes"]["specmesh.round.prefill"] for r in rounds) == stats.rounds
    drafted = accepted = proposes = 0
    for r in rounds:
        ra = r["attributes"]
        for key in ("drafted", "accepted", "tree_size", "draft_ms", "verify_ms", "network_ms", "wall_ms", "depth",
                    "phase", "ceiling", "batch_size"):
            assert f"specmesh.round.{key}" in ra, key
        assert ra["specmesh.strategy"] == stats.strategy
        if not ra["specmesh.round.prefill"]:
            drafted += ra["specmesh.round.drafted"]
            accepted += ra["specmesh.round.accepted"]
        clients = [c for c in kids[r["span_id"]] if c["kind"] == "CLIENT"]
        assert any(c["name"] == "specmesh.v1.Verifier/Verify" for c in clients), "each round verifies"
        for c in clients:
            assert c["trace_id"] == req["trace_id"] and c["attributes"]["rpc.system"] == "grpc"
            servers = [x for x in kids[c["span_id"]] if x["kind"] == "SERVER"]
            assert [x["name"] for x in servers] == [c["name"]], "the server span is the client span's child"
            proposes += c["name"] == "specmesh.v1.Drafter/Propose"
    assert drafted == stats.drafted_tokens and accepted == stats.accepted_tokens
    if stats.strategy == "external":
        assert proposes > 0, "external rounds call the drafter"
    elif stats.strategy in ("autoregressive", "self"):
        assert proposes == 0
    return req


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a scrape (parsing it is part of the test)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(smp: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in smp.items() if n == name and want <= set(ls))


def check_metrics_agree(before: dict, after: dict, results: list, verifier_before=None, verifier_after=None,
                        drafter_before=None, drafter_after=None) -> None:
    """Router counters moved by exactly the per-response stats of ``results``."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.stats.strategy, r.stats.drafter)].append(r.stats)
    d = lambda name, **lab: total(after, name, **lab) - total(before, name, **lab)  # noqa: E731
    for (strategy, drafter), ss in groups.items():
        lab = dict(strategy=strategy, drafter=drafter)
        assert d("specmesh_rounds_total", **lab) == sum(s.rounds for s in ss)
        assert d("specmesh_draft_tokens_total", **lab) == sum(s.drafted_tokens for s in ss)
        assert d("specmesh_accepted_tokens_total", **lab) == sum(s.accepted_tokens for s in ss)
        assert d("specmesh_generated_tokens_total", **lab) == sum(s.new_tokens for s in ss)
        assert d("specmesh_accepted_length_per_round_count", **lab) == sum(s.rounds for s in ss)
        assert d("specmesh_accepted_length_per_round_sum", **lab) == sum(s.accepted_tokens for s in ss)
        hist = [0] * 40
        for s in ss:
            for a, c in enumerate(s.accept_hist):
                hist[a] += c
        cum = 0
        for a in range(0, 33):
            cum += hist[a]
            assert d("specmesh_accepted_length_per_round_bucket", le=f"{float(a)}", **lab) == cum, a
        npos = max((len(s.position_accepted) for s in ss), default=0)
        for k in range(npos):
            acc = sum(s.position_accepted[k] for s in ss if k < len(s.position_accepted))
            dr = sum(s.position_drafted[k] for s in ss if k < len(s.position_drafted))
            assert d("specmesh_accepted_tokens_by_position_total", position=str(k + 1), **lab) == acc
            assert d("specmesh_drafted_positions_total", position=str(k + 1), **lab) == dr
        for phase in ("draft", "verify", "prefill", "network"):
            want = sum(getattr(s, f"{phase}_s") for s in ss)
            assert d("specmesh_phase_seconds_total", phase=phase, **lab) == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert d("specmesh_tokens_per_second_count", **lab) == len(ss)
    if verifier_after is not None:  # one Verify call per target forward (ssr adds side branches off the loop)
        calls = sum(r.stats.target_forwards for r in results)
        dv = total(verifier_after, "specmesh_verify_batch_size_count") - \
            total(verifier_before, "specmesh_verify_batch_size_count")
        side = any(getattr(r.stats, "side_branches", 0) for r in results)
        assert dv >= calls if side else dv == calls
    if drafter_after is not None:
        ext = [r.stats for r in results if r.stats.strategy == "external"]
        dp = total(drafter_after, "specmesh_drafter_proposed_tokens_total", strategy="external") - \
            total(drafter_before, "specmesh_drafter_proposed_tokens_total", strategy="external")
        assert dp == sum(s.drafted_tokens for s in ext)


# ---------------------------------------------------------------- pure parts

def test_exporters_from_env():
    assert tracing.exporter_names({}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporter_names({"SPECMESH_TRACE_FILE": "/tmp/x.jsonl"}) == ["jsonl"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) == []
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporter_names({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_setup_from_env_writes_jsonl_and_samples(tmp_path, monkeypatch):
    from specmesh.observability.jsonl import read_spans

    path = tmp_path / "t.jsonl"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    monkeypatch.setenv("SPECMESH_TRACE_FILE", str(path))
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    try:
        assert tracing.setup_from_env("specmesh-unit") and tracing.enabled()
        for i in range(400):
            with tracing.tracer().start_as_current_span("unit", attributes={"i": i, "xs": [1, 2]}):
                pass
    finally:
        tracing.shutdown()
    assert not tracing.enabled()
    spans = list(read_spans(path))
    assert 120 < len(spans) < 280, len(spans)  # ratio 0.5 of 400 roots
    s = spans[0]
    assert s["name"] == "unit" and s["service"] == "specmesh-unit" and s["attributes"]["xs"] == [1, 2]
    assert len(s["trace_id"]) == 32 and s["parent_id"] is None and s["end_ns"] >= s["start_ns"]
    with open(path, "a") as f:
        f.write('{"truncated": ')
    assert len(list(read_spans(path))) == len(spans)


def test_otlp_protocol_choice(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert "http" in type(tracing.make_exporter("otlp")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert "grpc" in type(tracing.make_exporter("otlp")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError):
        tracing.make_exporter("otlp")


def test_stats_sources_ceiling_and_verdict(tmp_path):
    a = st.from_stats_dicts([{"strategy": "external", "drafter": "suffix", "accept_hist": [5, 2, 0, 3],
                              "position_drafted": [10, 8, 3]}])[0]
    assert a.label == "external/suffix" and a.rounds == 10 and a.block == 3 and a.drafted_rounds == 10
    assert a.ceiling_fraction == pytest.approx(0.3) and a.binds() and "binds" in a.verdict()
    assert a.tau == pytest.approx((2 + 9 + 10) / 10)
    b = st.from_stats_dicts([{"records": [{"system": "ours_suffix", "workload": "w", "acceptance_hist": [90, 5, 0, 1],
                                           "prompts": 3}, {"system": "hf_ar", "acceptance_hist": None}]}])
    assert len(b) == 1 and b[0].ceiling_fraction == pytest.approx(1 / 96) and not b[0].binds()
    assert "does not bind" in b[0].verdict()
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps({"strategy": "self", "drafter": "layerskip", "accept_hist": [1, 1]})
                           for _ in range(3)))
    c = st.load(str(p))
    assert c[0].hist == [3, 3] and c[0].requests == 3
    m = st.merge(st.from_stats_dicts([{"strategy": "x", "accept_hist": [1, 2]}, {"strategy": "y", "accept_hist": [3]}]))
    assert m.hist == [4, 2] and m.block == 1
    assert st.with_block(m, 4).hist == [4, 2, 0, 0, 0] and m.ceiling_fraction == 0.0


def test_metrics_text_roundtrip_to_histogram():
    from prometheus_client import generate_latest

    from specmesh.observability.metrics import RouterMetrics

    m = RouterMetrics()
    rounds = [(4, 4, 4), (4, 1, 4), (4, 0, 4), (2, 2, 2), (0, 0, 0)]  # (drafted, accepted, depth)
    for dr, ac, de in rounds:  # block 4: (2, 2, 2) accepted a whole but short draft, not the ceiling
        m.record_round("external", "prompt_lookup", dr, ac, de, 0.01, block=4)
    acc = st.from_metrics_text(generate_latest(m.registry).decode())[0]
    assert acc.label == "external/prompt_lookup"
    assert acc.hist == [2, 1, 1, 0, 1] and acc.block == 4
    assert acc.ceiling_rounds == 1 and acc.drafted_rounds == 4 and acc.ceiling_fraction == 0.25
    smp = samples(generate_latest(m.registry).decode())
    assert total(smp, "specmesh_ceiling_bin_ratio") == 0.25
    assert total(smp, "specmesh_accepted_tokens_by_position_total", position="1") == 3


def test_round_scope_without_tracing_makes_no_spans():
    from types import SimpleNamespace

    from specmesh.observability.requests import RouterObserver
    from specmesh.serving.convert import RouterStats
    from specmesh.types import SamplingParams

    tracing.configure(None)
    plan = SimpleNamespace(ids=[1, 2], strategy="external", reason="requested", drafter="suffix", self_draft=None,
                           max_new_tokens=8, budget=4, sampling=SamplingParams())
    stats = RouterStats()
    obs = RouterObserver("m").request(plan, "sid", stats)
    with obs.round_scope(0) as facts:
        facts.update(prefill=True, drafted=0, accepted=0)
    assert obs.span is None
    obs.finish(stats)
    obs.end(None)


# ---------------------------------------------------------------- tiny cluster over real gRPC

from test_grpc_unit import FakeCodec, tiny_weights as _tiny_weights  # noqa: E402 - one tiny-model builder for the gRPC tests


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [2 + ord(c) % (V - 2) for c in text]


class _Codec(FakeCodec):
    tokenizer = _Tokenizer()  # the ssr thinking format reads its markers through it


def _settings(**kw):
    from specmesh.serving.settings import load_settings

    base = dict(max_seq_len=256, n_slots=8, max_new_tokens=64, default_max_new_tokens=16, max_prompt_tokens=128,
                max_tree_nodes=16, batch_window_ms=1.0, workers=8, drain_s=0.0, verifier_retry_s=2.0,
                drafter_backoff_s=0.2, drafter_backoff_max_s=0.5, drafter_timeout_s=1.0)
    base.update(kw)
    return load_settings(**base)


class TinyStack:
    def __init__(self, jsonl_path):
        from drafter_service.servicer import drafter_service
        from router.servicer import router_service
        from specmesh.drafters import CacheDrafter, PromptLookupDrafter, SuffixDrafter
        from specmesh.drafters.adaptive_lookup import AdaptiveLookupDrafter
        from specmesh.drafters.model_drafters import LayerSkipDrafter
        from specmesh.engine import LlamaEngine
        from specmesh.observability.wiring import instrument
        from specmesh.serving.server import build_server
        from specmesh.verifier import EngineVerifier
        from verifier_service.servicer import verifier_service

        self.jsonl_path = jsonl_path
        self.provider, self.mem = make_provider(jsonl_path)
        tracing.configure(self.provider)
        cfg, sd = _tiny_weights()
        v = EngineVerifier(LlamaEngine(cfg, sd, n_slots=8, max_seq_len=256))
        v.self_drafters["layerskip"] = LayerSkipDrafter(v, exit_layer=1)
        self.s = _settings()
        vsvc, self.batcher = verifier_service(self.s, v)
        self.vm = instrument("verifier", vsvc)
        self.vserver = build_server(self.s, [vsvc], 0)
        self.drafters = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter, "cache": CacheDrafter,
                         "adaptive_lookup": lambda: AdaptiveLookupDrafter(vocab_size=V)}
        dsvc = drafter_service(self.s, vocab_size=V, factories=self.drafters)
        self.dm = instrument("drafter", dsvc)
        self.dserver = build_server(self.s, [dsvc], 0)
        rs = _settings(drafter_address=self.dserver.address, verifier_addresses=[self.vserver.address],
                       model="tiny-test-model")
        rsvc, self.router = router_service(rs, _Codec())
        self.rm = instrument("router", rsvc, self.router)
        self.rserver = build_server(rs, [rsvc], 0)
        self.ports = {k: m.serve(0) for k, m in (("router", self.rm), ("verifier", self.vm), ("drafter", self.dm))}
        self.address = self.rserver.address

    def close(self):
        for srv in (self.rserver, self.dserver, self.vserver):
            srv.server.stop(0)
        self.batcher.stop()
        self.router.close()
        for m in (self.rm, self.vm, self.dm):
            m.stop()
        tracing.configure(None)
        self.provider.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    stack = TinyStack(tmp_path_factory.mktemp("traces") / "tiny.jsonl")
    yield stack
    stack.close()


def _generate_all(stack, n=N):
    from specmesh import Client

    results = {}
    with Client(stack.address, timeout=60) as c:
        for strategy, drafter in strategy_cases(stack.router, stack.drafters):
            results[strategy, drafter] = c.generate(PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=n,
                                                    draft_budget=4, raw_prompt=True, **request_kwargs(strategy))
    return results


def _done(mem, results) -> bool:
    names = [(s.name, s.attributes.get("gen_ai.response.id")) for s in mem.get_finished_spans()]
    ids = {sid for n, sid in names if n == "specmesh.generate"}
    gens = sum(n == "specmesh.v1.Router/Generate" for n, _ in names)
    return all(r.session_id in ids for r in results) and gens >= len(results)


def test_span_tree_and_metrics_every_strategy(tiny):
    before = {k: samples(scrape(p)) for k, p in tiny.ports.items()}
    tiny.mem.clear()
    results = _generate_all(tiny)
    assert {s for s, _ in results} >= {"autoregressive", "external", "self", "auto"}
    assert ("external", "suffix") in results and ("external", "prompt_lookup") in results
    assert wait_for(lambda: _done(tiny.mem, results.values()))
    spans = spans_of(tiny.mem)
    for key, r in results.items():
        assert r.stats.new_tokens > 0, key
        check_request_tree(spans, r, N, model="tiny-test-model")
    after = {k: samples(scrape(p)) for k, p in tiny.ports.items()}
    check_metrics_agree(before["router"], after["router"], list(results.values()), before["verifier"],
                        after["verifier"], before["drafter"], after["drafter"])
    # the strategy reached the peers' metrics through the x-specmesh-strategy header
    assert total(after["verifier"], "specmesh_verify_batch_size_count", strategy="self") > \
        total(before["verifier"], "specmesh_verify_batch_size_count", strategy="self")
    assert total(after["verifier"], "specmesh_kv_slots_total") == 8
    assert total(after["drafter"], "specmesh_drafter_proposals_total", drafter="suffix", strategy="external") > 0
    assert wait_for(lambda: total(samples(scrape(tiny.ports["router"])), "specmesh_active_sessions") == 0)
    fin = samples(scrape(tiny.ports["router"]))
    assert total(fin, "specmesh_requests_total") - total(before["router"], "specmesh_requests_total") == len(results)


def test_rpc_errors_counted_by_code(tiny):
    from specmesh import Client
    from specmesh.errors import InvalidArgumentError
    from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

    def count(port, service, method, code, side="server"):
        return total(samples(scrape(port)), "specmesh_rpc_errors_total", side=side, service=service, method=method,
                     code=code)

    r0 = count(tiny.ports["router"], "specmesh.v1.Router", "Generate", "INVALID_ARGUMENT")
    with Client(tiny.address, timeout=30) as c:
        with pytest.raises(InvalidArgumentError):
            c.generate(PROMPT, strategy="no-such-strategy")
    assert wait_for(lambda: count(tiny.ports["router"], "specmesh.v1.Router", "Generate", "INVALID_ARGUMENT") == r0 + 1)
    d0 = count(tiny.ports["drafter"], "specmesh.v1.Drafter", "Propose", "INVALID_ARGUMENT")
    with grpc.insecure_channel(tiny.dserver.address) as ch:
        with pytest.raises(grpc.RpcError):
            drafter_pb2_grpc.DrafterStub(ch).Propose(drafter_pb2.ProposeRequest(session_id="s", drafter="nope"),
                                                    timeout=5)
    assert count(tiny.ports["drafter"], "specmesh.v1.Drafter", "Propose", "INVALID_ARGUMENT") == d0 + 1


def test_dead_drafter_counts_client_side_unavailable(tiny):
    """A router whose drafter is not there: rounds fall back (same output), the
    router counts UNAVAILABLE on its side and the round spans still verify."""
    from router.servicer import router_service
    from specmesh import Client
    from specmesh.observability.wiring import instrument
    from specmesh.serving.server import build_server

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    rs = _settings(drafter_address=dead, verifier_addresses=[tiny.vserver.address])
    rsvc, router = router_service(rs, _Codec())
    m = instrument("router", rsvc, router)
    srv = build_server(rs, [rsvc], 0)
    try:
        with Client(srv.address, timeout=60) as c:
            r = c.generate(PROMPT, strategy="external", drafter="suffix", max_new_tokens=8, raw_prompt=True)
            plain = c.generate(PROMPT, strategy="autoregressive", max_new_tokens=8, raw_prompt=True)
        assert r.token_ids == plain.token_ids and r.stats.fallbacks > 0
        from prometheus_client import generate_latest

        smp = samples(generate_latest(m.registry).decode())
        assert total(smp, "specmesh_rpc_errors_total", side="client", service="specmesh.v1.Drafter",
                     code="UNAVAILABLE", strategy="external") >= 1
        assert total(smp, "specmesh_fallbacks_total", strategy="external") == r.stats.fallbacks
    finally:
        srv.server.stop(0)
        router.close()


def test_trace_file_renders_png(tiny, tmp_path):
    from specmesh.cli import main
    from specmesh.observability.jsonl import read_spans
    from specmesh.observability.traces import find, requests
    from specmesh import Client

    with Client(tiny.address, timeout=60) as c:
        r = c.generate(PROMPT, strategy="external", drafter="prompt_lookup", max_new_tokens=N, draft_budget=4,
                       raw_prompt=True)
    assert wait_for(lambda: _done(tiny.mem, [r]))
    path = tiny.jsonl_path
    reqs = requests(read_spans(path))
    req = find(reqs, r.session_id[:10])
    assert req.session_id == r.session_id and len(req.rounds) == r.stats.rounds + 1
    png = tmp_path / "timeline.png"
    assert main(["trace", "show", str(path), "--request", r.session_id, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["trace", "list", str(path)]) == 0
    hist_png = tmp_path / "acc.png"
    assert main(["stats", str(path), "--out", str(hist_png)]) == 0
    assert hist_png.read_bytes()[:4] == b"\x89PNG"
    # the same histogram from a /metrics scrape and from the response's stats
    scrape_file = tmp_path / "metrics.txt"
    scrape_file.write_text(scrape(tiny.ports["router"]))
    stats_file = tmp_path / "stats.json"
    stats_file.write_text(json.dumps(r.stats.to_dict()))
    assert main(["stats", str(scrape_file), str(stats_file), "--out", ""]) == 0
    assert main(["stats", "--url", f"http://127.0.0.1:{tiny.ports['router']}/metrics", "--json", "--out", ""]) == 0
    one = st.load(str(stats_file))[0]
    assert one.hist == r.stats.accept_hist


# ---------------------------------------------------------------- real SmolLM2 over real gRPC (slow)

E2E_N = 24
E2E_PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


class RealStack:
    """Router, drafter and verifier in process on loopback (as tests/test_grpc_e2e.py), instrumented."""

    def __init__(self, runtime, jsonl_path):
        from drafter_service.servicer import drafter_service
        from router.servicer import router_service
        from specmesh.observability.wiring import instrument
        from specmesh.serving.server import build_server
        from verifier_service.servicer import verifier_service

        self.rt, self.jsonl_path = runtime, jsonl_path
        self.provider, self.mem = make_provider(jsonl_path)
        tracing.configure(self.provider)
        self.s = _settings(max_seq_len=1024, n_slots=4, max_new_tokens=256, default_max_new_tokens=E2E_N,
                           max_prompt_tokens=512, max_tree_nodes=64, workers=16, batch_window_ms=2.0)
        vsvc, self.batcher = verifier_service(self.s, runtime.verifier)
        self.vm = instrument("verifier", vsvc)
        self.vserver = build_server(self.s, [vsvc], 0)
        dsvc = drafter_service(self.s, vocab_size=runtime.vocab_size)
        self.drafters = {d for d in dsvc.servicer.host.names if d != "draft_lm"}  # draft_lm: a model load, skipped
        self.dm = instrument("drafter", dsvc)
        self.dserver = build_server(self.s, [dsvc], 0)
        rs = self.s.model_copy(update=dict(drafter_address=self.dserver.address,
                                           verifier_addresses=[self.vserver.address]))
        rsvc, self.router = router_service(rs, codec=runtime)
        self.rm = instrument("router", rsvc, self.router)
        self.rserver = build_server(rs, [rsvc], 0)
        self.ports = {k: m.serve(0) for k, m in (("router", self.rm), ("verifier", self.vm), ("drafter", self.dm))}
        self.address = self.rserver.address

    close = TinyStack.close


@pytest.fixture(scope="module")
def real(runtime, tmp_path_factory):
    stack = RealStack(runtime, tmp_path_factory.mktemp("traces") / "real.jsonl")
    yield stack
    stack.close()


@pytest.mark.slow
def test_real_span_tree_metrics_and_png_every_strategy(real, tmp_path):
    from specmesh import Client
    from specmesh.cli import main
    from specmesh.loop import generate_tokens

    ids = real.rt.encode(E2E_PROMPT)
    ref = generate_tokens(None, real.rt.verifier, ids, max_new_tokens=E2E_N, stop_ids=real.rt.stop_ids)[0]
    before = {k: samples(scrape(p)) for k, p in real.ports.items()}
    real.mem.clear()
    results = {}
    with Client(real.address, timeout=180) as c:
        for strategy, drafter in strategy_cases(real.router, real.drafters):
            results[strategy, drafter] = c.generate(E2E_PROMPT, strategy=strategy, drafter=drafter,
                                                    max_new_tokens=E2E_N, draft_budget=6, **request_kwargs(strategy))
    assert {s for s, _ in results} >= {"autoregressive", "external", "self", "auto"}
    assert wait_for(lambda: _done(real.mem, results.values()))
    spans = spans_of(real.mem)
    for key, r in results.items():
        if r.stats.strategy != "ssr":  # ssr decodes a reasoning prompt of its own
            assert r.token_ids == ref, key  # greedy: the other strategies return plain decoding's tokens
        check_request_tree(spans, r, E2E_N, model=real.s.model)
    ext = results["external", "prompt_lookup"].stats
    assert ext.accepted_tokens > 0 and ext.tau > 1.0  # the repetitive prompt pays, so acceptance is exercised
    after = {k: samples(scrape(p)) for k, p in real.ports.items()}
    check_metrics_agree(before["router"], after["router"], list(results.values()), before["verifier"],
                        after["verifier"], before["drafter"], after["drafter"])
    assert total(after["verifier"], "specmesh_kv_slots_total") == 4
    # the trace file renders: a timeline per request and the acceptance histogram
    r = results["external", "prompt_lookup"]
    png = tmp_path / "timeline.png"
    assert main(["trace", "show", str(real.jsonl_path), "--request", r.session_id, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc_png = tmp_path / "acceptance.png"
    assert main(["stats", str(real.jsonl_path), "--out", str(acc_png)]) == 0
    assert acc_png.read_bytes()[:4] == b"\x89PNG"
    from_trace = {a.label: a for a in st.load(str(real.jsonl_path))}
    want = st.from_stats_dicts([x.stats.to_dict() for x in results.values()])
    strip = lambda h: list(h[:max((i + 1 for i, c in enumerate(h) if c), default=0)])  # noqa: E731
    for a in want:
        got = from_trace[a.label]
        assert strip(got.hist) == strip(a.hist) and got.drafted_rounds == a.drafted_rounds, a.label
        assert got.ceiling_count == a.hist[got.block] if got.block < len(a.hist) else got.ceiling_count == 0
