"""The predicted-outputs drafter (``specmesh.drafters.prediction``): it drafts the
prediction's continuation of the output, the whole budget while the output follows it;
after a draft the target cut short it drafts at most twice what that draft had accepted
(at least ``MIN_DRAFT``), doubling after each draft accepted whole; the accepted /
rejected counts follow what the output kept. Pure: no model, the "target" is a list."""

from __future__ import annotations

from specmesh.drafters.prediction import MIN_DRAFT, PredictionDrafter
from specmesh.types import DraftContext

PROMPT = [900, 901, 902]


def _run(pred: list[int], target: list[int], budget: int) -> tuple[PredictionDrafter, list[int]]:
    """Greedy speculation against ``target`` (the output plain decoding gives): each round
    keeps the drafted tokens that match it and one token of the target's own."""
    d = PredictionDrafter(pred)
    out: list[int] = []
    sizes = []
    while len(out) < len(target):
        draft = d.propose(DraftContext("s", PROMPT + out, len(PROMPT)), budget).tokens
        sizes.append(len(draft))
        a = 0
        while a < len(draft) and len(out) + a < len(target) and draft[a] == target[len(out) + a]:
            a += 1
        out += target[len(out):len(out) + a + 1]
    d.finish("s", PROMPT + out, len(PROMPT))
    assert out == target  # the drafts never change the output
    return d, sizes


def test_the_whole_budget_while_the_output_follows_the_prediction():
    pred = list(range(10, 50))
    d, sizes = _run(pred, pred, budget=16)
    assert sizes[:2] == [16, 16] and d.rejected == 0 and d.accepted >= len(pred) - len(sizes)


def test_after_a_miss_the_drafts_start_small_and_grow_back():
    pred = list(range(10, 70))
    target = pred[:20] + [5, 6, 7] + pred[20:]  # an edit: three tokens the prediction lacks
    d, sizes = _run(pred, target, budget=16)
    # round 1 takes pred[:16] and its bonus; round 2 drafts pred[17:33] and keeps 3 of it
    # before the edit; while the output's tail is not in the prediction nothing is drafted;
    # realigned, the drafts are 2 x 3, then doubled, up to the budget
    assert sizes[:2] == [16, 16] and d.rejected == 13
    after = [n for n in sizes[2:] if n]
    assert after[:3] == [6, 12, 16]


def test_a_draft_rejected_at_its_first_token_leaves_the_minimum():
    pred = list(range(10, 70))
    target = pred[:17] + [5] + pred[18:]  # one token replaced
    d, sizes = _run(pred, target, budget=16)
    assert sizes[1] == 16 and min(n for n in sizes[2:] if n) >= MIN_DRAFT
    assert [n for n in sizes[2:] if n][0] == MIN_DRAFT
