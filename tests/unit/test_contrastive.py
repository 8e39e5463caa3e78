"""Speculative contrastive decoding (``acceptance="contrastive"``) follows vanilla
contrastive decoding (``specmesh.contrastive``) exactly.

- Greedy: through the loop with lookup, layer-skip (self) and draft-LM drafters, in
  fp32 and bf16 (the batch-invariant engine), the tokens equal vanilla greedy CD's.
- Sampled: plain decoding through the verifier draws, seed for seed, what vanilla CD
  draws; with drafters, 3,000 3-token generations on the 6-token model match the
  exact p_cd joint (enumerated with the expert and its layer-skip exit) by chi-square,
  and the same counts reject the plain model's joint (the test sees the difference).
- A verifier without a layer-skip exit refuses contrastive requests (INVALID_ARGUMENT).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from specmesh.contrastive import contrastive_generate, next_distribution
from specmesh.drafters import PromptLookupDrafter
from specmesh.drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.types import InvalidArgument, SamplingParams, TokenTree, VerifyRequest
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_DRAFT, SMALL_N_NEW, SMALL_PROMPT, SMALL_V, chi2, exact_joint, small_target_engine, \
    tiny_engine, tiny_weights

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 5, 6]
N = 40
CD = dict(acceptance="contrastive", cd_alpha=0.1, cd_beta=0.5)


def _verifier(dtype: str, exit_layer: int = 1):
    eng, _ = tiny_engine(dtype=dtype, n_slots=3, max_seq_len=128)
    ver = EngineVerifier(eng)
    ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, exit_layer=exit_layer)
    return ver


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_greedy_speculative_cd_equals_vanilla_cd(dtype, beta):
    ver = _verifier(dtype)
    sp = SamplingParams(**dict(CD, cd_beta=beta))
    ref = contrastive_generate(ver.engine, 1, PROMPT, N, sp, slot=2)
    plain, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N)
    assert ref != plain  # CD is another target than the model's own greedy
    # a different, weaker model (vocabulary V like the tiny target): its drafts are often rejected
    draft_lm = DraftLMDrafter(LlamaEngine(*tiny_weights(seed=3, layers=1), n_slots=2, max_seq_len=128))
    drafted = 0
    for drafter, self_draft in ((None, None), (PromptLookupDrafter(), None), (None, "layerskip"), (draft_lm, None)):
        for budget in (2, 5):
            out, st = generate_tokens(drafter, ver, PROMPT, sampling=sp, max_new_tokens=N, budget=budget,
                                      self_draft=self_draft)
            assert out == ref, (drafter, self_draft, budget)
            assert st.lossy and st.acceptance == "contrastive"
            drafted += st.drafted_tokens
    assert drafted > 0


def test_sampled_plain_decoding_through_the_verifier_is_vanilla_cd_seed_for_seed():
    ver = _verifier("fp32")
    for seed in range(4):
        sp = SamplingParams(temperature=0.9, seed=seed, **CD)
        out, _ = generate_tokens(None, ver, PROMPT, sampling=sp, max_new_tokens=12)
        assert out == contrastive_generate(ver.engine, 1, PROMPT, 12, sp, slot=2)


def test_a_verifier_without_an_amateur_refuses_contrastive():
    eng, _ = tiny_engine(n_slots=2)
    ver = EngineVerifier(eng)
    req = VerifyRequest("s", 0, PROMPT, TokenTree(), SamplingParams(**CD))
    with pytest.raises(InvalidArgument) as e:
        ver.verify(req)
    assert e.value.field == "sampling.cd_amateur"
    ver.set_amateur_exit(2)  # an explicit exit serves it
    assert ver.verify(req).next_token >= 0


# ---------------------------------------------------------------- sampled: the exact p_cd joint

N_SAMPLES = 3000
ALPHA = 1e-3


def cd_joint(sampling: SamplingParams, exit_layer: int = 1) -> dict:
    """P(3 sampled tokens) of vanilla CD on the 6-token model, by enumeration."""
    eng = small_target_engine(1)
    cache: dict = {}

    def dist(prefix):
        if prefix not in cache:
            cache[prefix] = next_distribution(eng, exit_layer, list(SMALL_PROMPT) + list(prefix), sampling)
        return cache[prefix]

    out = {}
    for combo in itertools.product(range(SMALL_V), repeat=SMALL_N_NEW):
        prob = 1.0
        for i, x in enumerate(combo):
            prob *= float(dist(tuple(combo[:i]))[x])
        if prob > 0:
            out[combo] = prob
    return out


def _case(name: str):
    ver = EngineVerifier(small_target_engine(4))
    ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, exit_layer=1, top_k=SMALL_V)
    if name == "layerskip":
        return ver, None, "layerskip"
    if name == "draft_lm":
        return ver, DraftLMDrafter(LlamaEngine(*SMALL_DRAFT, n_slots=2, max_seq_len=64), top_k=SMALL_V), None
    return ver, PromptLookupDrafter(), None


@pytest.mark.slow
@pytest.mark.parametrize("name,temp,top_k", [("layerskip", 1.0, 0), ("draft_lm", 1.0, 0), ("layerskip", 0.7, 3)])
def test_sampled_speculative_cd_matches_the_exact_cd_joint(name, temp, top_k):
    ver, drafter, self_draft = _case(name)
    base = SamplingParams(temperature=temp, top_k=top_k, cd_beta=1.0, cd_alpha=0.05, acceptance="contrastive")
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        sp = SamplingParams(**{**base.__dict__, "seed": seed})
        out, st = generate_tokens(drafter, ver, SMALL_PROMPT, sampling=sp, max_new_tokens=SMALL_N_NEW, budget=2,
                                  self_draft=self_draft, draft_first=True)
        counts[tuple(out)] += 1
        drafted += st.drafted_tokens
        accepted += st.accepted_tokens
    assert drafted > N_SAMPLES // 2 and 0 < accepted < drafted, (drafted, accepted)
    p = chi2(counts, cd_joint(base))
    assert p > ALPHA, f"{name}: chi-square p = {p:.2e} against the exact p_cd joint"
    # the same counts against the plain model's joint: CD is a different distribution and the test sees it
    plain = SamplingParams(temperature=temp, top_k=top_k)
    try:
        p_plain = chi2(counts, exact_joint(SMALL_PROMPT, [None] * SMALL_N_NEW, plain))
    except AssertionError:  # an outcome the plain model cannot produce (top-k): different for sure
        p_plain = 0.0
    assert p_plain < ALPHA, f"{name}: CD output passed as the plain model's (p = {p_plain:.2e})"
