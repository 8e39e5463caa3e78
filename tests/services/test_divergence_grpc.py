"""Divergence decoding through the real services (router, drafter service, verifier on
loopback; tiny random target, a perturbed copy as its specialist inside the verifier,
``tests.support.tiny_divergence_verifier``), labelled lossy like the other rules
(tests/services/test_lossy.py): the response's flag and rule, the router's and the
verifier's metrics, the request and round spans. Its INVALID_ARGUMENT cases: a bad
threshold names ``sampling.jsd_threshold``; drafts that are not the specialist's are
refused, saying so."""

from __future__ import annotations

import functools

import pytest

from tests.support import (TRACED_SETTINGS, V, TokenizerCodec, TracedStack, check_rule_spans, samples, scrape,
                           settings, spans_done,
                           spans_of, tiny_divergence_verifier, total, wait_for)

N = 16
PROMPT = "abcabcabcabc hello hello hello abcabc"


class DivergenceStack(TracedStack):
    def __init__(self, jsonl_path):
        from specmesh.drafters import PromptLookupDrafter

        super().__init__(jsonl_path, [tiny_divergence_verifier], TokenizerCodec(), V,
                         settings=functools.partial(settings, TRACED_SETTINGS),
                         drafters={"prompt_lookup": PromptLookupDrafter}, router_settings={"model": "tiny-test-model"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = DivergenceStack(tmp_path_factory.mktemp("divergence") / "tiny.jsonl")
    yield s
    s.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_divergence_is_labelled_lossy_end_to_end(stack, temperature):
    from specmesh import Client

    before = {k: samples(scrape(p)) for k, p in stack.ports.items()}
    stack.mem.clear()
    with Client(stack.address, timeout=60) as c:
        exact = c.generate(PROMPT, strategy="self", drafter="specialist", max_new_tokens=N, draft_budget=4,
                           raw_prompt=True, temperature=temperature, seed=5)
        div = c.generate(PROMPT, strategy="self", drafter="specialist", max_new_tokens=N, draft_budget=4,
                         raw_prompt=True, temperature=temperature, seed=5, acceptance="divergence",
                         acceptance_params={"jsd_threshold": 0.3})
        zero = c.generate(PROMPT, strategy="self", drafter="specialist", max_new_tokens=N, draft_budget=4,
                          raw_prompt=True, temperature=temperature, seed=5, acceptance="divergence",
                          acceptance_params={"jsd_threshold": 0.0})
    assert not exact.stats.lossy and exact.stats.acceptance == "exact"
    assert div.stats.lossy and div.stats.acceptance == "divergence" and div.stats.drafter == "specialist"
    assert div.stats.rounds > 0 and div.stats.drafted_tokens > 0 and div.stats.accepted_tokens > 0
    # tau = 0: nothing differs in distribution by exactly 0, so every token is the target's —
    # the exact request's output (greedy: token for token; sampled: seed for seed, as no
    # round accepts and the emitted draws are plain decoding's)
    assert zero.stats.accepted_tokens == 0 and zero.stats.lossy
    if temperature == 0.0:
        assert zero.token_ids == exact.token_ids
    # spans: the request span and every round span carry the rule and the flag
    results = {"exact": exact, "divergence": div}
    assert wait_for(lambda: spans_done(stack.mem, [exact, div, zero]))
    check_rule_spans(spans_of(stack.mem), results, "divergence")
    # metrics: the lossy families count the two divergence requests with their rule as label
    lab = dict(strategy=div.stats.strategy, drafter=div.stats.drafter)
    rt_b = before["router"]
    assert wait_for(lambda: total(samples(scrape(stack.ports["router"])), "specmesh_lossy_requests_total",
                                  acceptance="divergence", **lab)
                    - total(rt_b, "specmesh_lossy_requests_total", acceptance="divergence", **lab) == 2)
    rt_a = samples(scrape(stack.ports["router"]))
    assert total(rt_a, "specmesh_lossy_generated_tokens_total", acceptance="divergence", **lab) - \
        total(rt_b, "specmesh_lossy_generated_tokens_total", acceptance="divergence", **lab) == \
        div.stats.new_tokens + zero.stats.new_tokens
    assert total(rt_a, "specmesh_lossy_requests_total") - total(rt_b, "specmesh_lossy_requests_total") == 2
    vb, va = before["verifier"], samples(scrape(stack.ports["verifier"]))
    assert total(va, "specmesh_verify_lossy_calls_total", acceptance="divergence") - \
        total(vb, "specmesh_verify_lossy_calls_total", acceptance="divergence") == \
        div.stats.target_forwards + zero.stats.target_forwards


@pytest.mark.parametrize("value", [1.5, -0.2])
def test_bad_threshold_is_invalid_argument(stack, value):
    from specmesh import Client
    from specmesh.errors import InvalidArgumentError

    with Client(stack.address, timeout=60) as c:
        with pytest.raises(InvalidArgumentError) as e:
            c.generate(PROMPT, strategy="self", drafter="specialist", max_new_tokens=4, raw_prompt=True,
                       acceptance="divergence", acceptance_params={"jsd_threshold": value})
    assert e.value.field == "sampling.jsd_threshold", e.value


def test_drafts_not_from_the_specialist_are_refused(stack):
    from specmesh import Client
    from specmesh.errors import InvalidArgumentError

    with Client(stack.address, timeout=60) as c:
        with pytest.raises(InvalidArgumentError) as e:
            c.generate(PROMPT, strategy="self", drafter="layerskip", max_new_tokens=8, raw_prompt=True,
                       draft_budget=3, acceptance="divergence")
    # raised by the verifier at the first drafted round: the router passes it on, the field first
    assert "sampling.acceptance" in str(e.value) and "specialist's own drafts" in str(e.value), e.value


def test_divergence_naming_no_strategy_gets_the_specialist(stack):
    """The SDK without strategy/drafter (what `specmesh generate --acceptance divergence`
    and an OpenAI request send): the router drafts with the verifier's specialist."""
    from specmesh import Client

    with Client(stack.address, timeout=60) as c:
        named = c.generate(PROMPT, strategy="self", drafter="specialist", max_new_tokens=N, draft_budget=4,
                           raw_prompt=True, seed=5, acceptance="divergence")
        bare = c.generate(PROMPT, max_new_tokens=N, draft_budget=4, raw_prompt=True, seed=5, acceptance="divergence")
    assert (bare.stats.strategy, bare.stats.drafter) == ("self", "specialist"), bare.stats.strategy_reason
    assert "divergence" in bare.stats.strategy_reason and bare.stats.lossy
    assert bare.token_ids == named.token_ids
