"""Path-conditioned tree scoring (blockdraft.tree.PathCalibration) and the tree study's pure parts."""

import pytest

from specmesh.blockdraft.tree import Calibration, PathCalibration, best_first_tree, load_scorer
from specmesh.blockdraft.treestudy import (Anchor, StudyData, accepted_length, best_budget, entropy_bin, linear_cost,
                                           entropy_edges, evaluate, path_samples, tree_tau)


def test_path_calibration_separates_classes_and_backs_off_to_blind():
    # slot 0, prob 0.3: on the drafter's own path accepted 60%; one deviation deep, 5%
    s = [(0, 0.3, i < 60, 0) for i in range(100)] + [(0, 0.3, i < 5, 1) for i in range(100)]
    pc = PathCalibration.fit(s, 1)
    assert pc(0, 0.3, 0) > 0.5 and pc(0, 0.3, 1) < 0.15
    blind = Calibration.fit(s, 1)
    assert pc(0, 0.3, 2) == pytest.approx(blind(0, 0.3))  # no samples of class 2: the prefix-blind rate
    again = load_scorer({**blind.to_dict(), "path": pc.to_dict()})
    assert isinstance(again, PathCalibration) and again(0, 0.3, 1) == pytest.approx(pc(0, 0.3, 1))
    assert isinstance(load_scorer(blind.to_dict()), Calibration)


def test_path_scorer_prefers_the_main_chain_over_children_of_alternatives():
    cands = [[(10, 0.5), (11, 0.4)], [(20, 0.5), (21, 0.4)], [(30, 0.9)]]
    blind = Calibration()  # identity: the raw marginals
    t = best_first_tree(cands, 5, blind)
    t.validate(100)
    # prefix-blind: 10 .5, 11 .4, 20|10 .25, 30|20 .225, then 20|11 (.2) before 21|10 (.2, pushed later)
    assert t.tokens == [10, 11, 20, 30, 20] and t.parents == [-1, -1, 0, 2, 1]
    # a scorer that says children of a non-top node are almost never accepted: 10 .5, 20|10 .25, 30 .125, 11 .01
    rates = [[[0.5] * 8, [0.01] * 8, [0.01] * 8] for _ in range(3)]
    pc = PathCalibration(Calibration(rates=[[0.5] * 8] * 3), rates)
    t2 = best_first_tree(cands, 5, pc)
    t2.validate(100)
    assert t2.tokens == [10, 20, 30, 11, 21] and t2.parents == [-1, 0, 1, -1, 0]


def test_accepted_length_walks_the_target_path():
    tokens, parents = [1, 2, 3, 4], [-1, -1, 0, 1]
    assert accepted_length(tokens, parents, [2, 4, 9]) == 2
    assert accepted_length(tokens, parents, [1, 3]) == 2
    assert accepted_length(tokens, parents, [5]) == 0
    assert accepted_length(tokens, parents, []) == 0


def _anchor(truth, fold=0, ent=1.0, workload="w"):
    cands = [[(1, 0.6), (2, 0.3)], [(3, 0.6), (4, 0.3)], [(5, 0.6), (6, 0.3)]]
    return Anchor(workload, fold, cands, truth, ent)


def test_path_samples_follow_the_target_and_count_deviations():
    s = path_samples(_anchor([2, 3, 9]))
    # slot 0: both candidates, the second accepted (class 1); slot 1 under it: class 1 / 2; slot 2: none accepted
    assert [(k, ok, c) for k, _, ok, c in s] == [(0, False, 0), (0, True, 1), (1, True, 1), (1, False, 2),
                                                 (2, False, 1), (2, False, 2)]
    assert path_samples(_anchor([7, 3]))[-1][0] == 0  # slot 0 missed: nothing deeper


def test_budgets_and_entropy_bins():
    assert best_budget({4: 2.0, 8: 2.1}, linear_cost(0.2, 0.05)) == 4  # 2.0/1.4 > 2.1/1.6
    assert best_budget({4: 1.1}, linear_cost(0.2, 0.05)) == 0  # drafting does not pay
    assert best_budget({16: 3.0, 4: 2.0}, linear_cost(0.1, 0.0)) == 16
    anchors = [_anchor([1], ent=h) for h in (0.1, 0.2, 1.0, 2.0)]
    edges = entropy_edges(anchors, 2)
    assert edges == [1.0] and entropy_bin(edges, 0.5) == 0 and entropy_bin(edges, 1.0) == 1


def test_evaluate_cross_fits_and_reports_every_budget():
    anchors = [_anchor([1, 3, 5], fold=f, ent=0.5) for f in (0, 1) for _ in range(5)]
    anchors += [_anchor([2, 4, 6], fold=f, ent=3.0) for f in (0, 1) for _ in range(5)]
    res = evaluate(StudyData(anchors), budgets=(1, 3, 6), c=0.1, beta=0.01, bins=2)
    assert res["tau"]["path"]["all"]["1"] == pytest.approx(1.5)  # the top chain's first node: half the rounds
    assert res["tau"]["path"]["all"]["6"] > res["tau"]["path"]["all"]["1"]
    assert tree_tau(anchors[0], 0, Calibration()) == 1
    assert set(res["tokens_per_cost"]) == {"switched", "1", "3", "6"}
    # measured verify costs (a step function): 6 nodes cost as much as 1 -> the schedule takes 6 everywhere
    res = evaluate(StudyData(anchors), budgets=(1, 3, 6), c=0.1, bins=2, verify_cost={1: 1.0, 3: 1.0, 6: 1.0})
    assert res["schedule_budgets_per_fold"] == {0: [6, 6], 1: [6, 6]}
    assert res["cost_model"]["round_cost"]["6"] == pytest.approx(1.1)


def test_tree_schedule_switches_the_budget_by_entropy_with_live_costs():
    from specmesh.loop import AdaptiveBudget, TreeSchedule, VerifyCosts

    sched = TreeSchedule([1.0], [{4: 2.6, 8: 3.0, 16: 3.1}, {4: 1.3, 8: 1.32, 16: 1.33}])
    assert TreeSchedule.from_dict(sched.to_dict()) == sched
    assert sched.budget(0.2, c=0.1, beta=0.01, cap=16) == 8  # 3.0/1.18 > 3.1/1.26 > 2.6/1.14
    assert sched.budget(0.2, c=0.1, beta=0.0, cap=16) == 16  # scored tokens free (a GPU): the largest tree
    assert sched.budget(0.2, c=0.1, beta=0.01, cap=4) == 4  # never above the caller's cap
    assert sched.budget(2.5, c=0.1, beta=0.01, cap=16) == 4  # high entropy: a small tree still pays
    assert sched.budget(2.5, c=0.4, beta=0.05, cap=16) == 0  # ... or nothing does
    pol = AdaptiveBudget.for_drafter("block_tree", 16, costs=VerifyCosts(prior=0.01), schedule=sched)
    assert pol.schedule is sched and pol.next() == sched.budget(0.0, 0.0, pol.beta, 16) == 8  # before any round: bin 0
    pol.update(16, 3, entropy=2.5, draft_s=0.01, verify_s=0.1)  # the draft costs 0.1 of a forward
    pol.costs.observe(0, 0.1)  # a plain round measured (else the next round would be one)
    assert pol.next() == sched.budget(2.5, pol.cost, pol.beta, 16)
    assert AdaptiveBudget.for_drafter("block", 8, schedule=sched).schedule is None  # chains: no schedule


def test_tree_schedule_is_scaled_by_what_served_rounds_accept():
    """The offline table says 8 nodes accept 2 tokens; served rounds accept none: the
    policy's scale falls and it stops drafting (re-probing now and then); rounds that
    accept what the table says keep it at 1."""
    from specmesh.loop import AdaptiveBudget, TreeSchedule, VerifyCosts

    sched = TreeSchedule([9.0], [{4: 2.0, 8: 3.0}, {4: 1.0, 8: 1.0}])
    assert sched.tau(0.5, 8) == 3.0 and sched.tau(0.5, 6) == 2.0 and sched.tau(0.5, 2) == 1.0
    assert sched.budget(0.5, c=0.3, beta=0.1, cap=8) == 8  # 3.0 / 2.1 > 2.0 / 1.7 > 1
    assert sched.budget(0.5, c=0.3, beta=0.1, cap=8, scale=0.3) == 0  # 1.6 / 2.1, 1.3 / 1.7: nothing pays
    good = AdaptiveBudget.for_drafter("block_tree", 8, costs=VerifyCosts(prior=0.1), schedule=sched, ema=0.5)
    bad = AdaptiveBudget.for_drafter("block_tree", 8, costs=VerifyCosts(prior=0.1), schedule=sched, ema=0.5)
    for pol, accepted in ((good, 2), (bad, 0)):
        pol.cost = 0.3
        for _ in range(6):
            k = pol.next()
            pol.update(k, min(k, accepted), entropy=0.5) if k else pol.update(0, 0, entropy=0.5)
    assert good.tau_scale == pytest.approx(1.0) and good.next() == 8
    # one drafted round accepting 0 of the 2 predicted: (0.5 + 0) / (0.5 + 1) = 1/3, then off
    assert bad.tau_scale == pytest.approx(1 / 3) and bad.next() == 0


def test_block_draft_cost_is_relative_to_a_one_token_forward():
    """c for a one-pass drafter: draft seconds over a short round's verify seconds (the
    cost model's unit), not over the drafted round's longer verify."""
    from specmesh.loop import AdaptiveBudget, VerifyCosts

    costs = VerifyCosts(ema=1.0)
    assert costs.short_seconds is None
    pol = AdaptiveBudget.for_drafter("block", 8, costs=costs, ema=1.0)
    pol.update(8, 2, draft_s=0.002, verify_s=0.010)  # no short round yet: the round's own verify
    assert pol.cost == pytest.approx(0.2)
    pol.update(0, 0, verify_s=0.005)  # a plain round: 5 ms
    assert costs.short_seconds == pytest.approx(0.005)
    pol.update(8, 2, draft_s=0.002, verify_s=0.010)
    assert pol.cost == pytest.approx(0.4)


def test_schedule_from_anchors():
    from specmesh.blockdraft.treestudy import schedule_from

    anchors = [_anchor([1, 3, 5], ent=0.5) for _ in range(3)] + [_anchor([9], ent=3.0) for _ in range(3)]
    s = schedule_from(anchors, Calibration(), budgets=(1, 3), bins=2)
    assert s.edges == [3.0]
    assert s.taus[0] == {1: 2.0, 3: 3.0}  # three nodes: 1, 3 under it, then 2 (0.3 > 0.216)
    assert s.taus[1] == {1: 1.0, 3: 1.0}


def test_router_policy_and_checkpoint_schedule(tmp_path, monkeypatch):
    import json

    from specmesh.blockdraft.serve import SCHEDULE_FILE, load_schedule
    from specmesh.loop import TreeSchedule, VerifyCosts
    from specmesh.strategies.adapt import TreeBudget

    sched = TreeSchedule([1.0], [{2: 1.5, 4: 2.0}, {2: 1.2, 4: 1.25}])
    assert load_schedule(tmp_path) is None
    (tmp_path / SCHEDULE_FILE).write_text(json.dumps(sched.to_dict()))
    assert load_schedule(tmp_path) == sched
    pol = TreeBudget.for_drafter("block_tree", 8, costs=VerifyCosts(prior=0.0), schedule=load_schedule(tmp_path))
    assert pol.next() == 4
    pol.update(4, 0, entropy=3.0, draft_s=0.02, verify_s=0.1)
    pol.costs.observe(0, 0.1)  # a plain round measured (else the next round would be one)
    assert pol.next() == sched.budget(3.0, pol.cost, pol.beta, 8)

    from specmesh.router.strategies import Collaborators, Strategies
    from specmesh.serving.settings import ServeSettings

    monkeypatch.setenv("SPECMESH_BLOCK_DRAFTER", str(tmp_path))
    st = Strategies(Collaborators(ServeSettings(), None, None, None, 100))
    assert st.tree_schedule() == sched


@pytest.mark.parametrize("n", [0, 1, 5, 32, 33, 64, 70])
def test_ancestor_mask_equals_walking_the_parents(n):
    """``trees.ancestor_mask`` against a walk up each node's parents, for chains and random
    trees, including 64+ nodes (bit 63 and a second 32-bit chunk)."""
    import random

    import torch

    from specmesh.trees import ancestor_mask

    rng = random.Random(n)
    for parents in (list(range(-1, n - 1)), [-1 if i == 0 else rng.randrange(-1, i) for i in range(n)]):
        want = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                want[i, j] = True
                j = parents[j]
        got = ancestor_mask(parents)
        assert got.dtype == torch.bool and torch.equal(got, want)
