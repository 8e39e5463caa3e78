"""The opt-in verify rules beyond exact, each against its own claim.

- ``lenient`` with l = 1 is the exact rule (same tokens for the same inputs, chain and
  tree, greedy and sampled) and passes the chi-square test against the target; with
  l < 1 a draft x ~ q is accepted with probability min(1, p(x) / (l q(x))) and a
  rejection samples norm(max(0, p - l q)) — the one-token output distribution
  q(y) min(1, p/(lq)) + P(reject) r(y) is tested by chi-square, the acceptance rate
  against its formula, and a test with the wrong residual fails.
- ``topk`` accepts exactly the drafts in the target's top k; k = 1 greedy is exact greedy.
- ``contrastive`` scores: the formula, the plausibility set, alpha = beta = 0 is the
  expert.
- The batched path (kernels' torch reference) decides what ``accept`` decides for
  lenient and contrastive requests; parameters are validated and name their field.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from specmesh import acceptance as A
from specmesh.types import InvalidArgument, SamplingParams, TokenTree
from tests.support import ToyChain

V = 5
TOY = ToyChain(321, V)
P_TABLE, p_next, q_next, _draw = TOY.P, TOY.p_next, TOY.q_next, TOY.draw


def _seed(gen):
    return int(torch.randint(0, 2**62, (1,), generator=gen))


# ---------------------------------------------------------------- lenient, l = 1: the exact rule

def _random_tree_case(gen):
    q0 = q_next([])
    a, b = _draw(q0, gen), _draw(q0, gen)
    ca = _draw(q_next([a]), gen)
    tree = TokenTree([a, b, ca], [-1, -1, 0], siblings="iid")
    probs = torch.stack([p_next([]), p_next([a]), p_next([b]), p_next([a, ca])])
    q = torch.stack([q0, q0, q_next([a])])
    return probs, tree, q


def test_lenient_one_is_the_exact_rule_token_for_token():
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        probs = torch.softmax(torch.randn(4, V, generator=gen), -1)
        q = torch.softmax(torch.randn(3, V, generator=gen), -1)
        draft = [_draw(q[i], gen) for i in range(3)]
        ua, us = A.uniforms(_seed(gen), 3, 3)
        assert A.rejection_chain(probs, draft, q, ua, us, lenience=1.0) == A.rejection_chain(probs, draft, q, ua, us)
        pt, tree, qt = _random_tree_case(gen)
        ua, us = A.uniforms(_seed(gen), 3, 2)
        assert A.rejection_tree(pt, tree, qt, ua, us, lenience=1.0) == A.rejection_tree(pt, tree, qt, ua, us)
    # through the dispatcher, sampled and greedy, chain and tree
    for _ in range(100):
        logits = torch.randn(4, V, generator=gen) * 2
        chain = TokenTree.chain([_draw(torch.softmax(logits[i], -1), gen) for i in range(3)])
        tree = TokenTree([int(logits[0].argmax()), 1, 2], [-1, -1, 0])
        for t, temp, s in itertools.product((chain, tree), (0.0, 0.8), range(2)):
            exact = SamplingParams(temperature=temp, seed=s)
            len1 = SamplingParams(temperature=temp, seed=s, acceptance="lenient", lenience=1.0)
            assert A.accept(logits, t, len1, seed=s) == A.accept(logits, t, exact, seed=s)


def _pairs(round_fn, n, seed):
    return TOY.pair_counts(round_fn, n, seed)


def _expected_pairs(n):
    return TOY.expected_pairs(n)


def _lenient_chain_round(ctx, gen, lenience=1.0):
    draft, qs = [], []
    for _ in range(2):
        q = q_next(ctx + draft)
        draft.append(_draw(q, gen))
        qs.append(q)
    probs = torch.stack([p_next(ctx + draft[:i]) for i in range(3)])
    ua, us = A.uniforms(_seed(gen), 2, 2)
    res = A.rejection_chain(probs, draft, torch.stack(qs), ua, us, lenience=lenience)
    return [draft[i] for i in res.path] + [res.next_token]


def _lenient_tree_round(ctx, gen, lenience=1.0):
    q0 = q_next(ctx)
    a, b = _draw(q0, gen), _draw(q0, gen)
    qa, qb = q_next(ctx + [a]), q_next(ctx + [b])
    ca, cb = _draw(qa, gen), _draw(qb, gen)
    tree = TokenTree([a, b, ca, cb], [-1, -1, 0, 1], siblings="iid")
    probs = torch.stack([p_next(ctx), p_next(ctx + [a]), p_next(ctx + [b]), p_next(ctx + [a, ca]),
                         p_next(ctx + [b, cb])])
    ua, us = A.uniforms(_seed(gen), 4, 2)
    res = A.rejection_tree(probs, tree, torch.stack([q0, q0, qa, qb]), ua, us, lenience=lenience)
    return [tree.tokens[i] for i in res.path] + [res.next_token]


N = 20000


@pytest.mark.parametrize("round_fn", [_lenient_chain_round, _lenient_tree_round], ids=["chain", "tree"])
def test_lenient_one_matches_the_target_distribution(round_fn):
    counts = _pairs(round_fn, N, seed=11)
    assert chisquare(counts.flatten().numpy(), _expected_pairs(N).flatten().numpy()).pvalue > 1e-3


def test_lenient_below_one_is_not_the_target_distribution():
    """The same test sees the bias of l = 0.5 (the rule is lossy, as labelled)."""
    counts = _pairs(lambda c, g: _lenient_chain_round(c, g, 0.5), N, seed=12)
    assert chisquare(counts.flatten().numpy(), _expected_pairs(N).flatten().numpy()).pvalue < 1e-6


# ---------------------------------------------------------------- lenient, l < 1: its own formula

P1 = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08], dtype=torch.float64)
Q1 = torch.tensor([0.10, 0.45, 0.05, 0.30, 0.10], dtype=torch.float64)


def _lenient_law(p, q, l):
    """One drafted token x ~ q, accepted w.p. min(1, p/(l q)), else y ~ norm(max(0, p - l q)):
    (P(accept), law of the emitted token)."""
    acc = torch.minimum(q, p / l)  # q(y) * min(1, p(y) / (l q(y)))
    resid = (p - l * q).clamp_min(0)
    p_acc = float(acc.sum())
    return p_acc, acc + (1 - p_acc) * resid / resid.sum()


def _one_token_counts(l, n, seed, rule=None):
    gen = torch.Generator().manual_seed(seed)
    counts, accepted = torch.zeros(V), 0
    probs = torch.stack([P1, P1]).float()
    for _ in range(n):
        x = _draw(Q1, gen)
        ua, us = A.uniforms(_seed(gen), 1, 1)
        res = (rule or A.rejection_chain)(probs, [x], Q1[None].float(), ua, us, lenience=l)
        if res.path:
            accepted += 1
            counts[x] += 1
        else:
            counts[res.next_token] += 1
    return counts, accepted


@pytest.mark.parametrize("l", [0.5, 0.7, 0.9])
def test_lenient_accepts_with_min_1_p_over_lq_and_samples_the_residual(l):
    n = 20000
    counts, accepted = _one_token_counts(l, n, seed=int(l * 100))
    p_acc, law = _lenient_law(P1, Q1, l)
    assert 0.05 < p_acc < 0.95  # both branches exercised
    # acceptance rate: binomial, 5 standard deviations
    assert abs(accepted / n - p_acc) < 5 * math.sqrt(p_acc * (1 - p_acc) / n), (accepted / n, p_acc)
    assert chisquare(counts.numpy(), (law * n).numpy()).pvalue > 1e-3
    # the law differs from the target's (the rule is lossy) and l = 1 gives the target back
    assert float((law - P1).abs().max()) > 0.01
    assert torch.allclose(_lenient_law(P1, Q1, 1.0)[1], P1)


def test_lenient_with_a_wrong_residual_is_caught():
    """A rule that resamples max(0, p - q) (the exact residual) after the lenient test
    does not follow the lenient law: the test has the power to see it."""
    def wrong(probs, draft, q, ua, us, lenience=1.0):
        x = draft[0]
        if float(ua[0]) * lenience * float(q[0, x]) < float(probs[0, x]):
            return A.Acceptance([0], A.sample(probs[1].double(), float(us[1])))
        return A.Acceptance([], A.sample((probs[0].double() - q[0].double()).clamp_min(0), float(us[0])))

    n = 20000
    counts, _ = _one_token_counts(0.5, n, seed=77, rule=wrong)
    _, law = _lenient_law(P1, Q1, 0.5)
    assert chisquare(counts.numpy(), (law * n).numpy()).pvalue < 1e-4  # (fixed seed; a pass needs > 1e-3)


def test_lenient_greedy_accepts_by_probability_ratio():
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, -3.0], [0.0, 3.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    p0 = torch.softmax(logits[0], -1)
    ratio = float(p0[1] / p0[0])  # exp(-0.5) ~ 0.61
    chain = TokenTree.chain([1, 1])
    at = lambda l: A.accept(logits, chain, SamplingParams(acceptance="lenient", lenience=l), seed=0)  # noqa: E731
    assert at(ratio - 1e-3) == A.Acceptance([0, 1], 0)  # 1 passes at row 0, 1 is the argmax at row 1
    assert at(ratio + 1e-3) == A.Acceptance([], 0)  # 1 fails at row 0: the argmax is emitted
    assert at(1.0) == A.accept(logits, chain, SamplingParams(), seed=0)


# ---------------------------------------------------------------- topk

def test_topk_accepts_iff_in_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    for k, x in itertools.product(range(1, V + 1), range(V)):
        res = A.accept(logits, TokenTree.chain([x]), SamplingParams(acceptance="topk", accept_top_k=k), seed=0)
        assert bool(res.path) == (x < k), (k, x)
        assert res.next_token == (0 if not res.path else 0)  # greedy correction / bonus: the argmax
        sp = SamplingParams(temperature=1.0, acceptance="topk", accept_top_k=k, seed=3)
        assert bool(A.accept(logits, TokenTree.chain([x]), sp, seed=3).path) == (x < k)


def test_topk_sampled_top_p_zero_mass_never_passes():
    logits = torch.tensor([[3.0, 2.9, -5.0, -6.0, -7.0]] * 2)
    sp = SamplingParams(temperature=1.0, top_k=2, acceptance="topk", accept_top_k=4, seed=1)
    assert A.accept(logits, TokenTree.chain([2]), sp, seed=1).path == []  # in the logits' top 4, but p = 0


def test_topk_one_greedy_is_exact_greedy():
    gen = torch.Generator().manual_seed(4)
    for _ in range(300):
        logits = torch.randn(5, V, generator=gen)
        logits[:, 3] = logits[:, 1]  # ties: the argmax is the first index, as in exact greedy
        toks = [int(torch.randint(0, V, (1,), generator=gen)) for _ in range(4)]
        for t in (TokenTree.chain(toks), TokenTree(toks, [-1, -1, 0, 1])):
            assert A.accept(logits, t, SamplingParams(acceptance="topk", accept_top_k=1), seed=0) == \
                A.accept(logits, t, SamplingParams(), seed=0)


def test_topk_tree_takes_the_first_passing_child():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    tree = TokenTree([4, 2, 1], [-1, -1, -1])  # children in sibling order: 4 fails, 2 passes (k = 3)
    res = A.accept(logits, tree, SamplingParams(acceptance="topk", accept_top_k=3), seed=0)
    assert res == A.Acceptance([1], 0)


# ---------------------------------------------------------------- contrastive scores

def test_contrastive_scores_formula_and_plausibility():
    e = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    a = torch.tensor([[1.0, 2.0, 0.5, 0.0]])
    s = A.contrastive_logits(e, a, alpha=0.1, beta=0.5)
    le, la = torch.log_softmax(e.double(), -1), torch.log_softmax(a.double(), -1)
    keep = torch.softmax(e.double(), -1) >= 0.1 * torch.softmax(e.double(), -1).max()
    assert keep.tolist() == [[True, True, True, False]]
    want = ((1.5 * le - 0.5 * la).masked_fill(~keep, float("-inf"))).float()
    assert torch.equal(s, want)
    # beta = 0, alpha = 0: the expert itself; beta > 0 moves mass away from what the amateur likes
    torch.testing.assert_close(torch.softmax(A.contrastive_logits(e, a, 0.0, 0.0), -1), torch.softmax(e, -1))
    assert int(s.argmax()) == 0 and float(torch.softmax(s, -1)[0, 1]) < float(torch.softmax(e, -1)[0, 1])
    with pytest.raises(ValueError):
        A.accept(e, TokenTree(), SamplingParams(acceptance="contrastive"), seed=0)  # no amateur given


def test_contrastive_accepts_against_the_contrastive_target():
    e = torch.tensor([[2.0, 1.9, 0.0, -3.0]] * 2)
    a = torch.tensor([[3.0, 0.0, 0.0, 0.0]] * 2)  # the amateur likes token 0: CD prefers token 1
    sp = SamplingParams(acceptance="contrastive", cd_alpha=0.1, cd_beta=1.0)
    assert A.accept(e, TokenTree.chain([1]), sp, seed=0, amateur=a) == A.Acceptance([0], 1)
    assert A.accept(e, TokenTree.chain([0]), sp, seed=0, amateur=a) == A.Acceptance([], 1)


# ---------------------------------------------------------------- batched path and validation

def test_batched_path_decides_what_accept_decides():
    gen = torch.Generator().manual_seed(8)
    reqs = []
    for j in range(24):
        logits = torch.randn(4, V, generator=gen) * 2
        amateur = torch.randn(4, V, generator=gen)
        q = torch.softmax(torch.randn(V, generator=gen), -1)
        toks = [_draw(q, gen) for _ in range(3)]
        qids, qps = [list(range(V))] * 3, [q.tolist()] * 3
        tree = TokenTree.chain(toks, qids, qps) if j % 2 else TokenTree(toks, [-1, -1, 0], qids, qps, siblings="iid")
        rule = ["lenient", "contrastive", "exact"][j % 3]
        sp = SamplingParams(temperature=[0.0, 0.9][(j // 3) % 2], acceptance=rule, lenience=0.4, cd_beta=0.7,
                            seed=j)
        reqs.append((logits, tree, sp, j, amateur if rule == "contrastive" else None))
    batched = A.accept_batch(*[[r[i] for r in reqs] for i in range(4)], batched=True, backend="torch",
                             amateurs=[r[4] for r in reqs])
    single = [A.accept(lg, t, sp, sd, amateur=am) for lg, t, sp, sd, am in reqs]
    assert batched == single


@pytest.mark.parametrize("bad", [dict(lenience=0.0), dict(lenience=1.5), dict(lenience=float("nan")),
                                 dict(accept_top_k=0), dict(accept_top_k=2.5), dict(cd_alpha=-0.1),
                                 dict(cd_alpha=1.1), dict(cd_beta=-1.0), dict(cd_beta=float("inf")),
                                 dict(cd_amateur="gpt"), dict(typical_epsilon=0.0), dict(typical_delta=-1.0)])
def test_rule_parameters_are_validated(bad):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**bad)
    assert e.value.field == next(iter(bad))


def test_every_rule_but_exact_is_labelled_lossy():
    for rule in ("typical", "lenient", "topk", "contrastive"):
        assert SamplingParams(acceptance=rule).lossy
    assert not SamplingParams().lossy
