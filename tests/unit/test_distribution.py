"""Sampled speculation follows the target's distribution exactly, through the loop.

For every drafter and strategy, thousands of short sampled generations (3 new
tokens, drafting from the first round) on a tiny random model with a 6-token
vocabulary are compared by a chi-square test with the exact joint distribution of
plain sampling, computed by enumerating every prefix with the target's own
logits (temperature, top-k and top-p applied). Mechanisms that would break it: a
drafter reusing its randomness across rounds (the old per-request seeding of the
self drafters), draws correlated with the acceptance uniforms, an inexact sibling
rule. The same test run with those mechanisms put back must fail (so the test
has the power to see them). Every run has a fixed seed: the outcome is
deterministic, not a matter of luck on a given day.

Draft-ahead (``specmesh.ahead``) is tested the same way with every round drafted
ahead for every outcome and used where one matched; its broken variant (ahead rounds
drawing from the acceptance stream of the round they assume) must fail, and an ahead
round reused under the wrong outcome (the hit check without the tokens) must stay
exact: the exact rule accepts any proposal drawn from the q it is sent, independent
of the uniforms that judge it, so the hit check buys acceptance, the seeding exactness.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import pytest

from specmesh import seeding
from specmesh.ahead import AheadDrafter, OverlapPolicy
from specmesh.blockdraft.serve import BlockSelfDrafter
from specmesh.drafters import CacheDrafter, PromptLookupDrafter, SuffixDrafter, make_drafter
from specmesh.drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from specmesh.engine import LlamaEngine, int4_matmul
from specmesh.loop import AdaptiveBudget, generate_tokens, speculative_generate
from specmesh.strategies.ssr import ThinkFormat, local_side_answer, reasoning_generate
from specmesh.types import SIBLINGS_IID, SIBLINGS_WOR, SamplingParams, TokenTree
from tests.support import SMALL_DRAFT as DRAFT
from tests.support import SMALL_N_NEW as N_NEW
from tests.support import SMALL_PROMPT as PROMPT
from tests.support import SMALL_V as V
from tests.support import chi2, exact_joint, small_block_model, small_uno_adapter
from tests.support import small_target_engine as target_engine

pytestmark = pytest.mark.slow  # thousands of generations per case (minutes on 2 cores); CI runs them

ALPHA = 1e-3  # deterministic seeds: a pass is a pass on every run


def verifier(n_slots: int = 4):
    from specmesh.verifier import EngineVerifier

    return EngineVerifier(target_engine(n_slots))


SAMPLINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t07_k3": SamplingParams(temperature=0.7, top_k=3),
    "t13_p08": SamplingParams(temperature=1.3, top_p=0.8),
}


def sample_counts(run: Callable[[SamplingParams], list[int]], sampling: SamplingParams, n: int,
                  pick: Callable[[list[int]], tuple] = tuple) -> Counter:
    c: Counter = Counter()
    for seed in range(n):
        sp = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            seed=seed)
        c[pick(run(sp))] += 1
    return c


def loop_runner(ver, drafter=None, self_draft: Optional[str] = None, budget: int = 2, draft_first: bool = True):
    def run(sp: SamplingParams) -> list[int]:
        out: list[int] = []
        for chunk in speculative_generate(drafter, ver, PROMPT, sampling=sp, max_new_tokens=N_NEW, budget=budget,
                                          self_draft=self_draft, draft_first=draft_first):
            out += chunk
        return out
    return run


# ---------------------------------------------------------------- drafters

def _block(ver, tree: bool) -> BlockSelfDrafter:
    return BlockSelfDrafter(ver, small_block_model(), tree=tree, amp=False)


class Bound:
    """A cache drafter reading one cache id (what the router's adapter sets)."""

    def __init__(self, cache: CacheDrafter, cache_id: str):
        self.cache, self.cache_id = cache, cache_id

    def propose(self, ctx, budget):
        ctx.cache_id = self.cache_id
        return self.cache.propose(ctx, budget)

    def release(self, sid):
        self.cache.release(sid)

    def finish(self, sid, toks, p):
        self.cache.release(sid)


def make_case(name: str) -> tuple:
    """(verifier, drafter, self_draft, budget) for a drafter / strategy by name."""
    ver = verifier()
    if name == "prompt_lookup":
        return ver, PromptLookupDrafter(), None, 2
    if name == "suffix":
        return ver, SuffixDrafter(), None, 2
    if name == "adaptive_lookup":
        return ver, make_drafter("adaptive_lookup", embeddings=ver.engine.embed, min_similarity=0.0), None, 2
    if name == "draft_lm":
        return ver, DraftLMDrafter(LlamaEngine(*DRAFT, n_slots=2, max_seq_len=64), top_k=V), None, 2
    if name == "layerskip":
        ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, exit_layer=1, top_k=V)
        return ver, None, "layerskip", 2
    if name in ("block", "block_tree"):
        ver.self_drafters[name] = _block(ver, tree=name == "block_tree")
        return ver, None, name, 3
    if name in ("uno", "uno_tree", "uno_separate"):
        from specmesh.uno.serve import UnoDrafter

        ver.self_drafters[name] = UnoDrafter(ver, small_uno_adapter(), tree=name == "uno_tree",
                                             layout="separate" if name == "uno_separate" else "fused", top_k=V)
        return ver, None, name, 3
    if name == "proactive":  # a cache holding anticipated continuations (sampled with other seeds)
        cache = CacheDrafter()
        texts = []
        for s in range(6):
            t, _ = generate_tokens(None, ver, PROMPT, sampling=SamplingParams(temperature=1.0, seed=10_000 + s),
                                   max_new_tokens=4)
            texts.append(PROMPT[-3:] + t)
        cache.seed("conv", texts)
        return ver, Bound(cache, "conv"), None, 2
    raise KeyError(name)


CASES = [("prompt_lookup", "t1"), ("suffix", "t07_k3"), ("adaptive_lookup", "t13_p08"), ("draft_lm", "t1"),
         ("draft_lm", "t07_k3"), ("layerskip", "t1"), ("layerskip", "t13_p08"), ("block", "t1"),
         ("block_tree", "t07_k3"), ("proactive", "t1"), ("uno", "t1"), ("uno_separate", "t07_k3")]
N_SAMPLES = 3000


class DraftCount:
    """Wraps the verifier to count drafted nodes: the test must exercise the rules."""

    def __init__(self, ver):
        self.ver, self.drafted, self.accepted = ver, 0, 0
        self.vocab_size = ver.vocab_size

    def verify(self, req):
        res = self.ver.verify(req)
        self.drafted += res.drafted
        self.accepted += len(res.accepted)
        return res

    def release(self, sid):
        self.ver.release(sid)

    def __getattr__(self, k):
        return getattr(self.ver, k)


@pytest.mark.parametrize("name,samp", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_sampled_speculation_matches_the_exact_distribution(name, samp):
    sampling = SAMPLINGS[samp]
    ver, drafter, self_draft, budget = make_case(name)
    counter = DraftCount(ver)
    counts = sample_counts(loop_runner(counter, drafter, self_draft, budget), sampling, N_SAMPLES)
    p = chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling))
    assert counter.drafted > N_SAMPLES // 2, f"{name}: only {counter.drafted} drafted tokens"
    assert 0 < counter.accepted < counter.drafted, (name, counter.accepted, counter.drafted)
    assert p > ALPHA, f"{name}/{samp}: chi-square p = {p:.2e}"


ENGINE_CASES = [("int4", "block", "t1"), ("int4", "block_tree", "t07_k3"), ("bf16", "block_tree", "t1")]


@pytest.mark.parametrize("dtype,name,samp", ENGINE_CASES, ids=[f"{d}-{a}-{b}" for d, a, b in ENGINE_CASES])
def test_sampled_speculation_on_a_kernel_target_matches_its_distribution(dtype, name, samp):
    """The int4 / bf16 engine on our kernels (its layers in one C call where they build)
    with the block drafter whose matrices run on the same kernels
    (``FoldedDrafter(weights=dtype)``, what ``BlockSelfDrafter`` picks there): the joint
    of plain sampling on that same engine, by the same chi-square test."""
    from specmesh.engine import bf16_matmul
    from specmesh.verifier import EngineVerifier

    sampling = SAMPLINGS[samp]
    ver = EngineVerifier(target_engine(4, dtype))
    if (int4_matmul if dtype == "int4" else bf16_matmul).load() is not None and ver.engine.attention == "keylist":
        assert ver.engine._layer_stack() is not None  # the layers in one C call
    drafter = BlockSelfDrafter(ver, small_block_model(dtype), tree=name == "block_tree")  # amp: the kernel weights
    if dtype == "int4" or bf16_matmul.load() is not None:
        assert drafter.folded.weights == dtype
        assert any(m.mode == dtype for m in (drafter.folded.layers[0]["qkv"], drafter.folded.layers[0]["down"]))
    ver.self_drafters[name] = drafter
    counter = DraftCount(ver)
    counts = sample_counts(loop_runner(counter, None, name, 3), sampling, N_SAMPLES)
    p = chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling, dtype))
    assert counter.drafted > N_SAMPLES // 2, f"{dtype} {name}: only {counter.drafted} drafted tokens"
    assert 0 < counter.accepted < counter.drafted, (name, counter.accepted, counter.drafted)
    assert p > ALPHA, f"{dtype} {name}/{samp}: chi-square p = {p:.2e}"


# ---------------------------------------------------------------- the test has power

def _old_seeding(ctx, device=None):
    """The bug this file guards against: the draft's randomness keyed by the request
    only, so every round of a request reuses the same draws."""
    return seeding.generator(ctx.sampling.seed, seeding.DRAFT, device)


def _shared_stream(ctx, device=None):
    """A drafter drawing from the verifier's acceptance stream: draft and test correlated."""
    rs = ctx.round_seed if ctx.round_seed is not None else seeding.round_seed(ctx.sampling.seed, len(ctx.tokens))
    return seeding.generator(rs, seeding.ACCEPT, device)


@pytest.mark.parametrize("broken", [_old_seeding, _shared_stream], ids=["old-seeding", "shared-stream"])
def test_the_same_test_fails_with_broken_draft_randomness(broken, monkeypatch):
    import specmesh.drafters.model_drafters as md

    monkeypatch.setattr(md, "draft_generator", broken)
    sampling = SAMPLINGS["t1"]
    ver, drafter, self_draft, budget = make_case("layerskip")
    counts = sample_counts(loop_runner(ver, drafter, self_draft, budget), sampling, N_SAMPLES)
    p = chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling))
    assert p < ALPHA, f"the broken variant passed (p = {p:.3f}): the test has no power"


# ---------------------------------------------------------------- ssr: lossless w.r.t. full-CoT decoding

def test_ssr_sampled_answer_matches_full_cot_decoding():
    """One thinking token (the budget), the forced close (4, 5), two answer tokens: the
    answer is drafted from side branches' answers (sampled on their own stream) and must
    follow plain sampling of the same procedure exactly."""
    from specmesh.loop import BudgetPolicy

    fmt = ThinkFormat(open_ids=(), close_ids=(4, 5), end_seqs=((5, 5, 5, 5),), line_ids=())
    ver = verifier(6)
    cache = CacheDrafter()
    sampling = SAMPLINGS["t1"]
    counter = DraftCount(ver)

    def run(sp: SamplingParams) -> list[int]:
        side = local_side_answer(ver, [], 3, sampling=sp)
        out: list[int] = []
        for ch in reasoning_generate(counter, PROMPT, fmt, sampling=sp, max_new_tokens=5, thinking_budget=1,
                                     drafter=SuffixDrafter(), answer_drafter=Bound(cache, "ssr"), side_answer=side,
                                     seed=lambda texts: cache.seed("ssr", texts, replace=True), side_async=False,
                                     fractions=(0.5,), budget=lambda: BudgetPolicy(2)):
            out += ch
        assert out[1:3] == [4, 5]
        return out

    counts = sample_counts(run, sampling, N_SAMPLES, pick=lambda o: (o[0], o[3], o[4]))
    assert counter.drafted > N_SAMPLES // 2 and 0 < counter.accepted < counter.drafted
    p = chi2(counts, exact_joint(PROMPT, [None, 4, 5, None, None], sampling))
    assert p > ALPHA, f"ssr: chi-square p = {p:.2e}"


# ---------------------------------------------------------------- draft-ahead (specmesh.ahead)

class Settled(DraftCount):
    """The verifier of a draft-ahead run, counting: each verify lasts until the drafter's
    ahead work for the session is done (every outcome drafted), so the next round comes
    from the ahead cache wherever an outcome matched — the race forced, not timed."""

    def __init__(self, ver, ahead):
        super().__init__(ver)
        self.ahead = ahead

    def verify(self, req):
        res = super().verify(req)
        assert self.ahead.settle(req.session_id, 60)
        return res


def ahead_runner(ver, ahead, budget: int = 2):
    def run(sp: SamplingParams) -> list[int]:
        out: list[int] = []
        for chunk in speculative_generate(ahead, ver, PROMPT, sampling=sp, max_new_tokens=N_NEW, budget=budget,
                                          draft_first=True, draft_ahead=OverlapPolicy("on")):
            out += chunk
        return out
    return run


AHEAD_CASES = [("draft_lm", "t1"), ("draft_lm", "t07_k3"), ("prompt_lookup", "t13_p08"), ("suffix", "t1"),
               ("adaptive_lookup", "t07_k3")]


class Guessing:
    """A lookup drafter that guesses every token (lookups guess only their own continuation:
    with these the ahead fan-out covers every outcome of a round, as the draft LM's does)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def propose(self, ctx, budget):
        return self.inner.propose(ctx, budget)

    def guess(self, ctx, n):
        return list(range(V))[:n]

    def release(self, sid):
        self.inner.release(sid)

    def finish(self, sid, toks, p):
        self.inner.finish(sid, toks, p)


def _ahead_counts(name: str, samp: str):
    sampling = SAMPLINGS[samp]
    ver, drafter, _, budget = make_case(name)
    if not hasattr(drafter, "guess"):
        drafter = Guessing(drafter)
    ahead = AheadDrafter(drafter, width=V, max_outcomes=64)  # every outcome of the round: hits wherever one
    counter = Settled(ver, ahead)  # can happen (the width the drafter offers: lookups guess fewer tokens)
    counts = sample_counts(ahead_runner(counter, ahead, budget), sampling, N_SAMPLES)
    return chi2(counts, exact_joint(PROMPT, [None] * N_NEW, sampling)), counter, ahead


@pytest.mark.parametrize("name,samp", AHEAD_CASES, ids=[f"{a}-{b}" for a, b in AHEAD_CASES])
def test_sampled_speculation_with_draft_ahead_matches_the_exact_distribution(name, samp):
    """Overlap on: rounds drafted ahead for the likely outcomes of the round being verified,
    used where the real outcome is one of them (a hit), else drafted afresh."""
    p, counter, ahead = _ahead_counts(name, samp)
    assert counter.drafted > N_SAMPLES // 2 and 0 < counter.accepted < counter.drafted
    assert ahead.hits > N_SAMPLES // 10, f"{name}: only {ahead.hits} hits ({ahead.misses} misses)"
    assert p > ALPHA, f"{name}/{samp} with draft-ahead: chi-square p = {p:.2e}"


def test_the_same_test_fails_when_ahead_rounds_draw_from_the_acceptance_stream(monkeypatch):
    """Broken: the ahead rounds' draws come from the acceptance stream of the round they
    assume (the uniforms that judge them on a hit), not the drafter's own stream."""
    import threading

    import specmesh.drafters.model_drafters as md

    def ahead_on_accept(ctx, device=None):
        if threading.current_thread().name.startswith("draft-ahead"):
            return seeding.generator(seeding.round_seed(ctx.sampling.seed, len(ctx.tokens)), seeding.ACCEPT, device)
        return seeding.draft_generator(ctx, device)

    monkeypatch.setattr(md, "draft_generator", ahead_on_accept)
    p, _, ahead = _ahead_counts("draft_lm", "t1")
    assert ahead.hits > N_SAMPLES // 10
    assert p < ALPHA, f"the broken variant passed (p = {p:.3f}): the test has no power"


def _any_round_of_that_length(self, st, ctx):
    """The hit check without the tokens: any ahead round assuming the same committed length,
    whatever outcome it assumed."""
    return next((e for (n, _), e in st.entries.items() if n == len(ctx.tokens)), None)


def test_an_ahead_round_reused_under_the_wrong_outcome(monkeypatch):
    """A round drafted for another outcome of the same length, with its own q and draws
    keyed by that length: the exact rule accepts any proposal drawn from the q it is sent,
    independent of its uniforms, so this stays exact — the hit check buys acceptance (and
    draw-for-draw identity with drafting afresh), the seeding buys exactness."""
    monkeypatch.setattr(AheadDrafter, "_find", _any_round_of_that_length)
    p, _, ahead = _ahead_counts("draft_lm", "t1")
    assert ahead.hits > N_SAMPLES // 10
    assert p > ALPHA, f"p = {p:.2e}"
