"""The budget policy under load: a scored token costs beta times the sessions sharing
the verify forward (``AdaptiveBudget.observe_load``), so drafting shrinks and stops as
the verifier's batches grow, and a lone session drafts exactly as before."""

from __future__ import annotations

from specmesh.loop import AdaptiveBudget, VerifyCosts


def _trained(load: int, **kw) -> AdaptiveBudget:
    p = AdaptiveBudget(8, beta=0.05, **kw)
    for _ in range(30):  # steady acceptance of ~0.7 per drafted token, cheap drafts
        p.observe_load(load)
        p.update(4, 3, 0.0, draft_s=0.0004, verify_s=0.01)
    return p


def test_a_lone_session_drafts_as_before():
    alone, unloaded = _trained(1), AdaptiveBudget(8, beta=0.05)
    for _ in range(30):
        unloaded.update(4, 3, 0.0, draft_s=0.0004, verify_s=0.01)
    assert alone.load == 1.0 and alone.beta == unloaded.beta
    assert alone.next() == unloaded.next() > 0


def test_drafting_shrinks_then_stops_as_batches_grow():
    sizes = [_trained(n).next() for n in (1, 4, 16)]
    assert sizes[0] > sizes[1] and sizes[2] == 0, sizes
    assert _trained(16).beta > 15 * _trained(1).beta


def test_block_drafters_full_tree_is_no_longer_cheap_under_load():
    costs = VerifyCosts(prior=0.02)
    alone = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs)
    loaded = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs)
    for _ in range(10):
        loaded.observe_load(32)
    assert alone.max_budget * alone.beta <= AdaptiveBudget.TREE_CHEAP < loaded.max_budget * loaded.beta


def test_a_self_drafters_draft_pass_costs_every_session_in_the_forward():
    costs = VerifyCosts(prior=0.02)
    remote = AdaptiveBudget.for_drafter("block", 8, costs=costs)
    inside = AdaptiveBudget.for_drafter("block", 8, costs=costs)
    for p in (remote, inside):
        p.cost = 0.2  # a draft pass: 0.2 of a one-token forward
    for _ in range(10):
        remote.observe_load(8, drafted_inside=False)
        inside.observe_load(8, drafted_inside=True)
    assert remote.draft_load == 1.0 and inside.draft_load > 7
    assert inside.expected_speedup(4, alpha=0.8) < remote.expected_speedup(4, alpha=0.8)
