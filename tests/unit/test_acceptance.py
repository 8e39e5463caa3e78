"""Acceptance rules: greedy chain/tree on crafted data; statistical tests that chain
and tree rejection sampling reproduce the target distribution (and that the test
rejects a deliberately wrong rule); the target-distribution filters."""

from __future__ import annotations


import pytest
import torch
from scipy.stats import chisquare

from specmesh import acceptance as A
from specmesh.types import SIBLINGS_IID, SIBLINGS_WOR, InvalidArgument, SamplingParams, TokenTree
from tests.support import ToyChain

V = 5


def test_greedy_chain():
    assert A.greedy_chain([4, 5, 6, 7], [4, 5, 9]) == A.Acceptance([0, 1], 6)
    assert A.greedy_chain([4, 5, 6, 7], [4, 5, 6]) == A.Acceptance([0, 1, 2], 7)
    assert A.greedy_chain([4, 5], [1]) == A.Acceptance([], 4)
    assert A.greedy_chain([4], []) == A.Acceptance([], 4)


def test_greedy_tree_follows_argmax_child():
    tree = TokenTree([1, 2, 3, 4], [-1, -1, 1, 1])  # root children 1,2; node1's children 3,4
    # argmax rows: root->2, after node0 ->?, after node1 (token 2) -> 4, after node3 (token 4) -> 9
    am = [2, 0, 4, 0, 9]
    assert A.greedy_tree(am, tree) == A.Acceptance([1, 3], 9)
    assert A.greedy_tree([7, 0, 0, 0, 0], tree) == A.Acceptance([], 7)


def test_accept_dispatch_greedy_matches_argmax():
    logits = torch.randn(4, 11)
    tree = TokenTree.chain([int(logits[0].argmax()), int(logits[1].argmax()), (int(logits[2].argmax()) + 1) % 11])
    res = A.accept(logits, tree, SamplingParams(), seed=0)
    assert res.path == [0, 1] and res.next_token == int(logits[2].argmax())


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = A.target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    p = A.target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    kept = (p[0] > 0).nonzero().flatten().tolist()
    assert kept == [0, 1] and full[0] < 0.7 <= full[0] + full[1]
    p = A.target_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p[0], torch.softmax(logits[0] / 0.5, -1))


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(acceptance="yolo"), dict(temperature=float("nan"))])
def test_sampling_params_validation_names_field(bad):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**bad)
    assert e.value.field == next(iter(bad))


# ---------------------------------------------------------------- statistical tests
# A toy "target": the next-token distribution depends on the previous token.
TOY = ToyChain(123, V)
P_TABLE, p_next, q_next, _draw = TOY.P, TOY.p_next, TOY.q_next, TOY.draw


def _chain_round(ctx, gen, rule):
    draft, qs = [], []
    for _ in range(2):
        q = q_next(ctx + draft)
        draft.append(_draw(q, gen))
        qs.append(q)
    probs = torch.stack([p_next(ctx + draft[:i]) for i in range(3)])
    u_acc, u_smp = A.uniforms(int(torch.randint(0, 2**62, (1,), generator=gen)), 2, 2)
    res = rule(probs, draft, torch.stack(qs), u_acc, u_smp)
    return [draft[i] for i in res.path] + [res.next_token]


def _tree_round(ctx, gen, rule):
    # two i.i.d. siblings at depth 0 from q, each with one child drawn from q given it
    q0 = q_next(ctx)
    a, b = _draw(q0, gen), _draw(q0, gen)
    qa, qb = q_next(ctx + [a]), q_next(ctx + [b])
    ca, cb = _draw(qa, gen), _draw(qb, gen)
    tree = TokenTree([a, b, ca, cb], [-1, -1, 0, 1])
    probs = torch.stack([p_next(ctx), p_next(ctx + [a]), p_next(ctx + [b]), p_next(ctx + [a, ca]),
                         p_next(ctx + [b, cb])])
    q = torch.stack([q0, q0, qa, qb])
    u_acc, u_smp = A.uniforms(int(torch.randint(0, 2**62, (1,), generator=gen)), 4, 2)
    res = rule(probs, tree, q, u_acc, u_smp)
    return [tree.tokens[i] for i in res.path] + [res.next_token]


def _draw_without_replacement(q, k, gen):
    """k distinct tokens: each from q renormalised over the tokens not drawn yet."""
    q, out = q.clone(), []
    for _ in range(k):
        x = _draw(q / q.sum(), gen)
        out.append(x)
        q[x] = 0.0
    return out


def _wor_tree_round(ctx, gen, rule, siblings=SIBLINGS_WOR):
    # three distinct siblings at depth 0 drawn without replacement from q (as a
    # top-k sampling drafter would), the first with one child from q given it
    q0 = q_next(ctx)
    a, b, c = _draw_without_replacement(q0, 3, gen)
    qa = q_next(ctx + [a])
    ca = _draw(qa, gen)
    tree = TokenTree([a, b, c, ca], [-1, -1, -1, 0], siblings=siblings)
    probs = torch.stack([p_next(ctx), p_next(ctx + [a]), p_next(ctx + [b]), p_next(ctx + [c]),
                         p_next(ctx + [a, ca])])
    q = torch.stack([q0, q0, q0, qa])
    u_acc, u_smp = A.uniforms(int(torch.randint(0, 2**62, (1,), generator=gen)), 4, 2)
    res = rule(probs, tree, q, u_acc, u_smp)
    return [tree.tokens[i] for i in res.path] + [res.next_token]


def _wor_as_iid(ctx, gen, rule):
    return _wor_tree_round(ctx, gen, rule, siblings=SIBLINGS_IID)


def _sample_pairs(round_fn, rule, n, seed):
    return TOY.pair_counts(lambda ctx, gen: round_fn(ctx, gen, rule), n, seed)


def _expected_pairs(n):
    return TOY.expected_pairs(n)


def _wrong_chain(probs, draft, q, u_acc, u_smp):
    # a buggy rule: at a rejection, resample from p instead of the residual max(0, p - q)
    k = len(draft)
    for i in range(k):
        if float(u_acc[i]) * float(q[i, draft[i]]) >= float(probs[i, draft[i]]):
            return A.Acceptance(list(range(i)), A.sample(probs[i].double(), float(u_smp[i])))
    return A.Acceptance(list(range(k)), A.sample(probs[k].double(), float(u_smp[k])))


N = 20000


def _pvalue(counts):
    exp = _expected_pairs(N)
    return chisquare(counts.flatten().numpy(), exp.flatten().numpy()).pvalue


def test_chain_rejection_sampling_matches_target():
    assert _pvalue(_sample_pairs(_chain_round, A.rejection_chain, N, seed=1)) > 1e-3


def test_tree_rejection_sampling_matches_target():
    assert _pvalue(_sample_pairs(_tree_round, A.rejection_tree, N, seed=2)) > 1e-3


def test_tree_without_replacement_matches_target():
    """Recursive rejection sampling without replacement: distinct siblings with their real q."""
    assert _pvalue(_sample_pairs(_wor_tree_round, A.rejection_tree, N, seed=4)) > 1e-3


def test_iid_rule_on_siblings_drawn_without_replacement_is_caught():
    """The SpecInfer i.i.d. rule applied to distinct siblings is not exact: the same test fails."""
    assert _pvalue(_sample_pairs(_wor_as_iid, A.rejection_tree, N, seed=4)) < 1e-6


def test_trees_must_say_how_siblings_carrying_q_were_drawn():
    q = ([0, 1, 2], [0.5, 0.3, 0.2])
    tree = TokenTree([0, 1], [-1, -1], [q[0], q[0]], [q[1], q[1]])
    with pytest.raises(InvalidArgument) as e:
        tree.validate(V)
    assert e.value.field == "tree.siblings"
    TokenTree([0, 1], [-1, -1], [q[0], q[0]], [q[1], q[1]], siblings=SIBLINGS_WOR).validate(V)
    TokenTree([0, 0], [-1, -1], [q[0], q[0]], [q[1], q[1]], siblings=SIBLINGS_IID).validate(V)
    bad = [TokenTree([0, 0], [-1, -1], [q[0], q[0]], [q[1], q[1]], siblings=SIBLINGS_WOR),  # repeats
           TokenTree([0, 1], [-1, -1], [q[0], [0, 1]], [q[1], [0.5, 0.5]], siblings=SIBLINGS_WOR),  # differ
           TokenTree([0, 1], [-1, -1], [q[0], []], [q[1], []], siblings=SIBLINGS_WOR),  # mixed
           TokenTree([0, 1], [-1, -1], [q[0], []], [q[1], []]),  # mixed, unlabelled
           TokenTree([0], [-1], [q[0]], [q[1]], siblings="sorted"),
           TokenTree([3], [-1], [[3, 4]], [[0.0, 1.0]])]  # own token with zero probability
    for t in bad:
        with pytest.raises(InvalidArgument):
            t.validate(V)
    # independent draws may each have their own q (or none: a deterministic draft)
    TokenTree([0, 1], [-1, -1], [q[0], [0, 1]], [q[1], [0.5, 0.5]], siblings=SIBLINGS_IID).validate(V)
    TokenTree([0, 1], [-1, -1], [q[0], []], [q[1], []], siblings=SIBLINGS_IID).validate(V)
    # one-hot siblings (deterministic drafts) and a single sampled child need no label
    TokenTree([0, 1], [-1, -1]).validate(V)
    TokenTree([0, 1], [-1, 0], [q[0], q[0]], [q[1], q[1]]).validate(V)


def test_statistical_test_rejects_a_wrong_rule():
    assert _pvalue(_sample_pairs(_chain_round, _wrong_chain, N, seed=3)) < 1e-6


def test_chain_and_one_child_tree_agree():
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        probs = torch.softmax(torch.randn(4, V, generator=gen), -1)
        q = torch.softmax(torch.randn(3, V, generator=gen), -1)
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
        u_acc, u_smp = A.uniforms(int(torch.randint(0, 2**31, (1,), generator=gen)), 3, 3)
        a = A.rejection_chain(probs, draft, q, u_acc, u_smp)
        b = A.rejection_tree(probs, TokenTree.chain(draft), q, u_acc, u_smp)
        assert a == b


def test_typical_acceptance_is_labelled_lossy():
    s = SamplingParams(temperature=0.7, acceptance="typical")
    assert s.lossy
    logits = torch.tensor([[5.0, 0, 0, 0, 0], [0, 5.0, 0, 0, 0], [0, 0, 5.0, 0, 0]])
    res = A.accept(logits, TokenTree.chain([0, 1]), s, seed=1)
    assert res.path == [0, 1]


def test_core_rules_agree_with_kernel_references():
    """The core's CUDA path calls kernels/; their torch references equal these rules."""
    from specmesh import kernels

    gen = torch.Generator().manual_seed(9)
    for _ in range(50):
        probs = torch.softmax(torch.randn(4, V, generator=gen), -1)
        q = torch.softmax(torch.randn(3, V, generator=gen), -1)
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
        u_acc, u_smp = A.uniforms(int(torch.randint(0, 2**31, (1,), generator=gen)), 3, 3)
        ref = A.rejection_chain(probs, draft, q, u_acc, u_smp)
        n, nxt = kernels.chain_accept(probs[None], torch.tensor([draft]), q[None], u_acc[None], u_smp[None],
                                      backend="torch")
        assert (int(n[0]), int(nxt[0])) == (len(ref.path), ref.next_token)


def test_logit_entropy_equals_the_entropy_of_the_softmax():
    from specmesh.acceptance import entropy, logit_entropy

    g = torch.Generator().manual_seed(3)
    for scale, dtype in ((1.0, torch.float32), (30.0, torch.float32), (8.0, torch.bfloat16)):
        x = (torch.randn(4096, generator=g) * scale).to(dtype)
        want = entropy(torch.softmax(x.float(), -1)[None])[0]
        assert float(logit_entropy(x)) == pytest.approx(float(want), rel=1e-4, abs=1e-5)
    one_hot = torch.full((100,), -1e4)
    one_hot[7] = 10.0
    assert float(logit_entropy(one_hot)) == pytest.approx(0.0, abs=1e-6)
