"""Lossy acceptance is labelled everywhere: one exact request and one with each
rule that is not the plain model's distribution (the relaxed ``typical``,
``lenient``, ``topk`` and the ``contrastive`` target) through a real router,
drafter and verifier on loopback (tiny random model, the instrumented
``TinyTracedStack`` of tests/support.py): the response's ``lossy`` flag and rule
name, the router's and the verifier's Prometheus metrics (read from /metrics) and
the OpenTelemetry spans (in-memory exporter) of the request and of every round.
A rule's bad parameter is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import pytest

from specmesh.router.strategies import DECODE_LEAD
from tests.support import (TinyTracedStack, check_rule_spans, samples, scrape, spans_done, spans_of, total,
                           wait_for)

N = 16
PROMPT = "abcabcabcabc hello hello hello abcabc"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    stack = TinyTracedStack(tmp_path_factory.mktemp("lossy") / "tiny.jsonl")
    yield stack
    stack.close()


PARAMS = {"typical": {}, "lenient": {"lenience": 0.5}, "topk": {"accept_top_k": 3},
          "contrastive": {"cd_alpha": 0.1, "cd_beta": 0.5}}
CASES = [(s, d, r) for s, d in (("external", "prompt_lookup"), ("self", "")) for r in PARAMS]


@pytest.mark.parametrize("strategy,drafter,rule", CASES)
def test_exact_and_lossy_requests_are_labelled(tiny, strategy, drafter, rule):
    from specmesh import Client

    before = {k: samples(scrape(p)) for k, p in tiny.ports.items()}
    tiny.mem.clear()
    results = {}
    with Client(tiny.address, timeout=60) as c:
        for acceptance in ("exact", rule):
            results[acceptance] = c.generate(PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=N,
                                             draft_budget=4, raw_prompt=True, temperature=0.8, seed=5,
                                             acceptance=acceptance,
                                             acceptance_params=PARAMS[rule] if acceptance == rule else None)
    exact, lossy = results["exact"], results[rule]
    # the response
    assert not exact.stats.lossy and lossy.stats.lossy
    assert exact.stats.acceptance == "exact" and lossy.stats.acceptance == rule
    assert lossy.stats.new_tokens > 0 and lossy.stats.rounds > 0
    # the spans: request span and every round span carry the rule and the flag
    assert wait_for(lambda: spans_done(tiny.mem, results.values()))
    check_rule_spans(spans_of(tiny.mem), results, rule)
    # the router's metrics: the lossy families count the lossy request only, with its rule as label
    after = {k: samples(scrape(p)) for k, p in tiny.ports.items()}
    rt_b, rt_a = before["router"], after["router"]
    lab = dict(strategy=lossy.stats.strategy, drafter=lossy.stats.drafter)
    d = lambda name, **kw: total(rt_a, name, **kw) - total(rt_b, name, **kw)  # noqa: E731
    assert wait_for(lambda: total(samples(scrape(tiny.ports["router"])), "specmesh_lossy_requests_total", **lab)
                    - total(rt_b, "specmesh_lossy_requests_total", **lab) == 1)
    rt_a = samples(scrape(tiny.ports["router"]))
    assert d("specmesh_lossy_requests_total", acceptance=rule, **lab) == 1
    assert d("specmesh_lossy_generated_tokens_total", acceptance=rule, **lab) == lossy.stats.new_tokens
    assert d("specmesh_lossy_accepted_tokens_total", acceptance=rule, **lab) == lossy.stats.accepted_tokens
    assert d("specmesh_lossy_requests_total") == 1  # the exact request is not there
    assert not any(n.startswith("specmesh_lossy") and dict(ls).get("acceptance") == "exact" for n, ls in rt_a)
    assert d("specmesh_requests_total", **lab) == 2  # both are still ordinary requests
    # the verifier: one lossy Verify call (or Decode step) per target forward of the lossy request, none for
    # the exact one, plus the steps of a Decode stream that the verifier decoded ahead and the router
    # dropped when drafting resumed: at most DECODE_LEAD a stream (docs/design.md "Decoding ahead")
    vb, va = before["verifier"], after["verifier"]
    spans = spans_of(tiny.mem)
    trace_id = next(s["trace_id"] for s in spans if s["name"] == "specmesh.generate"
                    and s["attributes"].get("gen_ai.response.id") == lossy.session_id)
    streams = sum(s["name"] == "specmesh.v1.Verifier/Decode" and s["kind"] == "CLIENT" and s["trace_id"] == trace_id
                  for s in spans)
    calls = total(va, "specmesh_verify_lossy_calls_total", acceptance=rule, strategy=strategy) - \
        total(vb, "specmesh_verify_lossy_calls_total", acceptance=rule, strategy=strategy)
    assert lossy.stats.target_forwards <= calls <= lossy.stats.target_forwards + DECODE_LEAD * streams, \
        (calls, streams)
    assert total(va, "specmesh_verify_lossy_calls_total") - total(vb, "specmesh_verify_lossy_calls_total") == calls


def test_trace_cli_marks_the_lossy_request(tiny, tmp_path, capsys):
    from specmesh import Client
    from specmesh.cli import main

    with Client(tiny.address, timeout=60) as c:
        r = c.generate(PROMPT, strategy="external", drafter="prompt_lookup", max_new_tokens=8, raw_prompt=True,
                       temperature=0.8, seed=2, acceptance="typical")
    assert wait_for(lambda: spans_done(tiny.mem, [r]))
    capsys.readouterr()
    assert main(["trace", "show", str(tiny.jsonl_path), "--request", r.session_id,
                 "--out", str(tmp_path / "t.png")]) == 0
    assert "LOSSY acceptance (typical)" in capsys.readouterr().out
    assert main(["trace", "list", str(tiny.jsonl_path)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if r.session_id in x]
    assert line and "LOSSY" in line[0]


@pytest.mark.parametrize("params,field", [({"lenience": 1.5}, "lenience"), ({"accept_top_k": 0}, "accept_top_k"),
                                          ({"cd_beta": -1.0}, "cd_beta"), ({"cd_alpha": 2.0}, "cd_alpha"),
                                          ({"cd_amateur": "gpt2"}, "cd_amateur")])
def test_bad_rule_parameters_are_invalid_argument(tiny, params, field):
    from specmesh import Client
    from specmesh.errors import InvalidArgumentError

    with Client(tiny.address, timeout=60) as c:
        with pytest.raises(InvalidArgumentError) as e:
            c.generate(PROMPT, strategy="self", max_new_tokens=4, raw_prompt=True, temperature=0.8,
                       acceptance="lenient", acceptance_params=params)
    assert e.value.field == f"sampling.{field}", e.value
