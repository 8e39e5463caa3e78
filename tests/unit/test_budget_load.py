"""The budget policy under load: a scored token costs beta times the sessions sharing
the verify forward (``AdaptiveBudget.observe_load``), and at least its share of the
batched forward fitted as t = a + b * rows (``ForwardCosts``), so drafting shrinks and
stops as the verifier's batches grow, and a lone session drafts exactly as before."""

from __future__ import annotations

import random

import pytest

from specmesh.loop import AdaptiveBudget, ForwardCosts, VerifyCosts


def _trained(load: int, **kw) -> AdaptiveBudget:
    p = AdaptiveBudget(8, beta=0.05, **kw)
    p.update(0, 0, 0.0, verify_s=0.009)  # a plain round: the cost model's unit (``needs_unit``)
    for _ in range(30):  # steady acceptance of ~0.7 per drafted token, cheap drafts; 4 drafted rows
        p.observe_load(load)  # cost 0.05 of a plain round each (the verifier's curve)
        p.update(4, 3, 0.0, draft_s=0.0004, verify_s=0.009 * 1.2)
    return p


def test_a_lone_session_drafts_as_before():
    alone, unloaded = _trained(1), AdaptiveBudget(8, beta=0.05)
    unloaded.update(0, 0, 0.0, verify_s=0.009)
    for _ in range(30):
        unloaded.update(4, 3, 0.0, draft_s=0.0004, verify_s=0.009 * 1.2)
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


def _fed(a: float, b: float, n: int = 60) -> ForwardCosts:
    """A forward model fed batches of 1-8 sessions with 0-8 draft rows each."""
    fc, rng = ForwardCosts(), random.Random(0)
    for _ in range(n):
        rows = sum(1 + rng.choice((0, 0, 4, 8)) for _ in range(rng.randint(1, 8)))
        fc.observe(rows, a + b * rows)
    return fc


def test_the_forward_fit_recovers_a_and_b():
    a, b = _fed(0.004, 0.0015).fit()
    assert a == pytest.approx(0.004, rel=1e-6) and b == pytest.approx(0.0015, rel=1e-6)
    assert _fed(0.004, 0.0015).beta_load(1) == pytest.approx(0.0015 / 0.0055)
    assert ForwardCosts().fit() is None and ForwardCosts().beta_load(4) is None


def test_the_forward_fit_waits_for_rows_that_vary():
    flat = ForwardCosts()
    for _ in range(50):  # every session plain: the slope cannot be told
        flat.observe(4, 0.01)
    assert flat.fit() is None
    fitted = _fed(0.004, 0.0015)
    for _ in range(300):  # drafting stopped: the rows stop varying ...
        fitted.observe(4, 0.004 + 0.0015 * 4)
    before = fitted.fit()
    assert before == pytest.approx((0.004, 0.0015))
    for _ in range(50):  # ... and the last good line is kept, whatever the flat points say
        fitted.observe(4, 0.03)
    assert fitted.fit() == before
    fitted.observe(0, 0.01)  # unknown rows (an older verifier): ignored
    fitted.observe(4, 0.0)
    assert fitted.fit() == before


def _block_tree(costs: VerifyCosts, load: int, rounds: int = 30) -> AdaptiveBudget:
    """A self ``block_tree`` policy whose rounds accept ~3 of 8, in batches of ``load``
    whose forwards follow the shared costs' fitted line."""
    p = AdaptiveBudget.for_drafter("block_tree", 8, costs=costs)
    for _ in range(rounds):
        p.observe_load(load, drafted_inside=True)
        p.update(8, 3, 0.0, draft_s=0.0005, verify_s=0.01)
    return p


def test_a_lone_stream_is_priced_as_before_whatever_the_batches_cost():
    plain, fitted = VerifyCosts(prior=0.02), VerifyCosts(prior=0.02)
    fitted.forward = _fed(0.0005, 0.004)  # compute-bound: a row costs 8 x the fixed part
    for costs in (plain, fitted):
        for _ in range(5):
            costs.observe(1, 0.01)
            costs.observe(8, 0.0114)
    alone, alone_fitted = _block_tree(plain, 1), _block_tree(fitted, 1)
    assert alone_fitted.beta == alone.beta == pytest.approx(plain.beta)
    assert alone_fitted.next() == alone.next() == 8
    # and a lone stream that reports rows feeds the model but drafts the same
    p = AdaptiveBudget(8, beta=0.05)
    q = AdaptiveBudget(8, beta=0.05)
    for x in (p, q):
        x.update(0, 0, 0.0, verify_s=0.009)
    for _ in range(30):
        p.observe_load(1)
        q.observe_load(1, rows=9, forward_s=0.012)
        q.observe_load(1, rows=1, forward_s=0.010)
        for x in (p, q):
            x.update(4, 3, 0.0, draft_s=0.0004, verify_s=0.01)
    assert q.costs.forward.fit() is not None and q.beta == p.beta and q.next() == p.next() > 0


@pytest.mark.parametrize("load", [4, 6, 8])
def test_a_compute_bound_batch_stops_drafting_and_a_memory_bound_one_does_not(load):
    compute, memory = VerifyCosts(prior=0.017), VerifyCosts(prior=0.017)
    compute.forward = _fed(0.001, 0.004)  # 2 cores: a row costs about a plain session's step
    memory.forward = _fed(0.02, 0.00005)  # bound by the weights: rows are nearly free
    for costs in (compute, memory):
        for _ in range(5):  # alone: beta ~ 0.017
            costs.observe(1, 0.01)
            costs.observe(8, 0.01136)
    loaded = _block_tree(compute, load)
    assert loaded.beta == pytest.approx(compute.forward.beta_load(loaded.load)) and loaded.beta > 0.8
    assert loaded.next() <= 1  # k = 0 (or a re-probe's smallest draft)
    assert loaded.expected_speedup(1) < 1
    assert _block_tree(memory, load).next() > 0
    # the self drafter's pass is still priced by the load
    assert loaded.draft_load == pytest.approx(loaded.load)


def test_drafting_returns_when_the_load_drops():
    costs = VerifyCosts(prior=0.017)
    costs.forward = _fed(0.001, 0.004)
    for _ in range(5):
        costs.observe(1, 0.01)
        costs.observe(8, 0.01136)
    p = _block_tree(costs, 8)
    ks = [p.next() for _ in range(3)]
    assert max(ks) <= 1
    for _ in range(12):  # alone again: the load EMA decays below LOAD_PRICED
        p.observe_load(1, drafted_inside=True)
        p.update(0, 0, 0.0, verify_s=0.01)
    assert p.load <= AdaptiveBudget.LOAD_PRICED and p.draft_load == p.load
    assert p.next() == 8


def test_the_loop_feeds_the_batched_forwards_rows_and_time():
    from specmesh.loop import generate_tokens
    from specmesh.types import TokenTree, VerifyResult

    class Verifier:  # every forward shared with 3 other plain sessions
        vocab_size = 100

        def verify(self, req):
            n = len(req.tree)
            return VerifyResult([], 5, n, n, verify_ms=2.0 + n, batch_size=4,
                                batch_rows=3 + len(req.append_tokens) + n)

        def release(self, sid):
            pass

    class Drafter:
        def propose(self, ctx, budget):
            return TokenTree.chain([7] * budget)

        def finish(self, *a):
            pass

    seen = []

    class Spy(ForwardCosts):
        def observe(self, rows, forward_s):
            seen.append((rows, forward_s))
            super().observe(rows, forward_s)

    pol = AdaptiveBudget(4, beta=0.05)
    pol.costs.forward = Spy()
    generate_tokens(Drafter(), Verifier(), [1, 2, 3], max_new_tokens=6, budget=pol)
    assert len(seen) == 5 and pol.load > 3  # every round after the prefill
    assert all(t == pytest.approx((2.0 + rows - 4) / 1e3) for rows, t in seen) and seen[0][0] == 8


def test_a_new_request_under_load_starts_priced_as_loaded():
    """The verifier's recent load is shared (``VerifyCosts.load``): a generation that starts
    while others keep the batches full prices its first drafts as loaded, and one that starts
    on an idle verifier as alone."""
    costs = VerifyCosts(prior=0.05)
    assert AdaptiveBudget(8, costs=costs).load == 1.0
    busy = AdaptiveBudget(8, costs=costs)
    for _ in range(10):
        busy.observe_load(8)
    late = AdaptiveBudget(8, costs=costs)
    assert late.load == pytest.approx(costs.load) and late.load > 7
    assert late.beta > 7 * AdaptiveBudget(8, costs=VerifyCosts(prior=0.05)).beta
    for _ in range(20):
        busy.observe_load(1)
    assert AdaptiveBudget(8, costs=costs).load < 1.01
