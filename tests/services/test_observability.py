"""Observability: tracing setup from OTEL_* variables, the JSON-lines exporter,
stats sources and the ceiling verdict (pure); then, across real gRPC services
on loopback with a tiny random model (seconds), the span tree request -> round
-> RPC client -> RPC server with its attributes on every strategy the router
lists, ``/metrics`` scrapes that parse and agree with the per-response stats,
RPC errors counted by code, and the trace file rendered to PNGs by the CLI.
``tests/e2e/test_observability_e2e.py`` repeats the tree and metrics checks on the
real SmolLM2 (slow). The stack and the checks live in ``tests/support.py``.
"""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from specmesh.observability import stats as st
from specmesh.observability import tracing
from tests.support import (TRACED_SETTINGS, TinyTracedStack, TokenizerCodec, check_metrics_agree,
                           check_request_tree, request_kwargs, samples, scrape, settings, spans_done, spans_of,
                           strategy_cases, total, wait_for)

N = 12
PROMPT = "abcabcabcabc hello hello hello abcabc"


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
    from specmesh.wire.convert import RouterStats
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

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    stack = TinyTracedStack(tmp_path_factory.mktemp("traces") / "tiny.jsonl")
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


def test_span_tree_and_metrics_every_strategy(tiny):
    before = {k: samples(scrape(p)) for k, p in tiny.ports.items()}
    tiny.mem.clear()
    results = _generate_all(tiny)
    assert {s for s, _ in results} >= {"autoregressive", "external", "self", "auto"}
    assert ("external", "suffix") in results and ("external", "prompt_lookup") in results
    assert wait_for(lambda: spans_done(tiny.mem, results.values()))
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
    # suffix and prompt lookup ran in the verifier (context_drafters "verifier"), adaptive lookup on the service
    assert total(after["drafter"], "specmesh_drafter_proposals_total", drafter="adaptive_lookup",
                 strategy="external") > 0
    for d in ("suffix", "prompt_lookup"):
        assert "drafted in the verifier" in results["external", d].stats.strategy_reason
        assert total(after["drafter"], "specmesh_drafter_proposals_total", drafter=d, strategy="external") == \
            total(before["drafter"], "specmesh_drafter_proposals_total", drafter=d, strategy="external")
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
    from specmesh.router.servicer import router_service
    from specmesh import Client
    from specmesh.observability.wiring import instrument
    from specmesh.serving.server import build_server

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    rs = settings(TRACED_SETTINGS, drafter_address=dead, verifier_addresses=[tiny.vserver.address],
                  context_drafters="drafter")  # suffix on the (dead) drafter service, not in the verifier
    rsvc, router = router_service(rs, TokenizerCodec())
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
    assert wait_for(lambda: spans_done(tiny.mem, [r]))
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
