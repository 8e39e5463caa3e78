"""Seeded sampled output does not depend on the draft: one-hot drafts are verified by
matching the target's own draws, keyed by position (``acceptance.match_tree``,
``seeding.position_uniform``).

On the small bf16 model (row-invariant: a position's logits do not depend on how many
rows share its forward), every drafter whose drafts are one-hot, at every draft
budget, fixed or adaptive, gives token for token the output of plain sampling with
the same seed; so does a model drafter told to draft its argmax
(``LoopOptions.one_hot_drafts``, what the router's ``auto`` sets). A temperature
below ``types.GREEDY_BELOW`` is greedy decoding.
"""

from __future__ import annotations

import pytest
import torch

from specmesh import acceptance as A
from specmesh import seeding
from specmesh.drafters import PromptLookupDrafter, SuffixDrafter
from specmesh.drafters.model_drafters import DraftLMDrafter
from specmesh.drafters.prediction import PredictionDrafter
from specmesh.engine import LlamaEngine
from specmesh.loop import AdaptiveBudget, generate_tokens
from specmesh.types import GREEDY_BELOW, GenerationStats, SamplingParams, TokenTree
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_DRAFT, SMALL_PROMPT, SMALL_V, small_target_engine

N_NEW = 12
SEEDS = range(24)
SAMPLING = dict(temperature=0.9, top_k=5)


def _verifier() -> EngineVerifier:
    return EngineVerifier(small_target_engine(4, dtype="bf16"))


def _run(drafter, budget, seed: int, **kw) -> list[int]:
    out, _ = generate_tokens(drafter, _verifier(), SMALL_PROMPT, sampling=SamplingParams(seed=seed, **SAMPLING),
                             max_new_tokens=N_NEW, budget=budget, **kw)
    return out


@pytest.fixture(scope="module")
def plain() -> dict[int, list[int]]:
    return {s: _run(None, 1, s) for s in SEEDS}


DRAFTERS = {
    "prompt_lookup": PromptLookupDrafter,
    "suffix": SuffixDrafter,
    "prediction": lambda: PredictionDrafter([1, 2, 3, 0, 1, 2, 3, 0, 4, 5, 1, 2]),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("budget", [1, 3, 6, "adaptive"])
def test_one_hot_drafts_give_plain_sampling_token_for_token(plain, name, budget):
    drafted = 0
    for s in SEEDS:
        pol = AdaptiveBudget(6) if budget == "adaptive" else budget
        st = GenerationStats()
        out, _ = generate_tokens(DRAFTERS[name](), _verifier(), SMALL_PROMPT, stats=st,
                                 sampling=SamplingParams(seed=s, **SAMPLING), max_new_tokens=N_NEW, budget=pol,
                                 draft_first=True)
        drafted += st.drafted_tokens
        assert out == plain[s], (name, budget, s)
    assert drafted > 0  # the rule was exercised


def test_a_model_drafter_told_to_draft_one_hot_gives_plain_sampling(plain):
    for s in SEEDS[:12]:
        lm = DraftLMDrafter(LlamaEngine(*SMALL_DRAFT, n_slots=2, max_seq_len=64), top_k=SMALL_V)
        assert _run(lm, 3, s, one_hot_drafts=True, draft_first=True) == plain[s]


def test_the_draws_are_keyed_by_position_not_by_round():
    """The same position's draw whatever round it falls in: a chain drafted at committed
    length 10 judges its depth-2 node with the uniform of committed length 12."""
    sp = SamplingParams(temperature=1.0, seed=7)
    draws = A.position_draws(seeding.round_seed(7, 10), sp, 10)
    assert draws(2) == seeding.position_uniform(7, 12) == A.uniforms(seeding.round_seed(7, 12), 0, 0)[1][0]
    assert draws(0) == A.uniforms(seeding.round_seed(7, 10), 0, 0)[1][0]  # plain decoding's draw there


def test_match_accepts_the_child_equal_to_the_targets_draw():
    logits = torch.tensor([[0.0, 3.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    tree = TokenTree([2, 1, 0], [-1, -1, 1])  # siblings 2 and 1 under the root; 0 under node 1
    sp = SamplingParams(temperature=0.3, seed=3)
    for committed in range(40):
        res = A.accept(logits, tree, sp, seeding.round_seed(3, committed), committed=committed)
        y0 = A.sample(A.target_probs(logits[0:1], sp)[0].double(), seeding.position_uniform(3, committed))
        if y0 == 1:
            assert res.path[:1] == [1]
        elif y0 == 2:
            assert res.path == [0]
        else:
            assert res.path == [] and res.next_token == y0


def test_a_temperature_below_the_floor_is_greedy():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 4
    res = A.accept(logits, TokenTree(), SamplingParams(temperature=1e-38, seed=1), 0)
    assert res.next_token == int(logits[0].argmax())
    with pytest.raises(Exception, match="temperature"):
        SamplingParams(temperature=float("inf"))
