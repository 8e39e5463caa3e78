"""Observability on the real SmolLM2 over real gRPC (slow): for every strategy the
router lists, the span tree request -> round -> RPC client -> RPC server with its
attributes, ``/metrics`` scrapes that agree with the per-response stats, and the
trace file rendered to PNGs by the CLI (``tests/services/test_observability.py``
runs the same checks on a tiny random model in seconds)."""

from __future__ import annotations

from functools import partial

import pytest

from specmesh.observability import stats as st
from tests.support import (TRACED_SETTINGS, TracedStack, check_metrics_agree, check_request_tree, request_kwargs,
                           samples, scrape, settings, spans_done, spans_of, strategy_cases, total, wait_for)

E2E_N = 24
E2E_PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


@pytest.fixture(scope="module")
def real(runtime, tmp_path_factory):
    """Router, drafter and verifier in process on loopback over the session's Runtime,
    instrumented and traced (``TracedStack``)."""
    stack = TracedStack(tmp_path_factory.mktemp("traces") / "real.jsonl", [runtime.verifier], runtime,
                        runtime.vocab_size,
                        settings=partial(settings, TRACED_SETTINGS, max_seq_len=1024, n_slots=4, max_new_tokens=256,
                                         default_max_new_tokens=E2E_N, max_prompt_tokens=512, max_tree_nodes=64,
                                         workers=16, batch_window_ms=2.0))
    stack.rt = runtime
    stack.drafters = {d for d in stack.host.names if d != "draft_lm"}  # draft_lm: a model load, skipped
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
    assert wait_for(lambda: spans_done(real.mem, results.values()))
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
