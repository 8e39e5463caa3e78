"""The verifier's one acceptance call per forward: ``accept_batch`` with the batched
kernel path (forced on the CPU through the kernels' torch reference) decides exactly
what ``accept`` decides request by request — chains and trees, greedy and sampled,
i.i.d. and one-hot siblings, with the host-only cases (empty drafts, typical
acceptance, siblings drawn without replacement) mixed into the same batch."""

from __future__ import annotations

import random

import torch

from specmesh import acceptance as A
from specmesh.types import SIBLINGS_IID, SIBLINGS_WOR, SamplingParams, TokenTree

V = 7


def _tree(rng: random.Random, kind: str) -> TokenTree:
    if kind == "empty":
        return TokenTree()
    n = rng.randint(1, 6)
    toks = [rng.randrange(V) for _ in range(n)]
    if kind == "chain":
        return TokenTree.chain(toks)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return TokenTree(toks, parents)


def _with_q(tree: TokenTree, rng: random.Random, siblings: str) -> TokenTree:
    ids = list(range(V))
    qs = []
    for _ in tree.tokens:
        w = [rng.random() + 0.05 for _ in ids]
        qs.append([x / sum(w) for x in w])
    if siblings == SIBLINGS_WOR:  # one shared q per sibling group, distinct tokens
        by_parent: dict[int, list[float]] = {}
        seen: dict[int, set] = {}
        for i, p in enumerate(tree.parents):
            qs[i] = by_parent.setdefault(p, qs[i])
            used = seen.setdefault(p, set())
            while tree.tokens[i] in used:
                tree.tokens[i] = (tree.tokens[i] + 1) % V
            used.add(tree.tokens[i])
    return TokenTree(tree.tokens, tree.parents, [ids] * len(tree), qs, siblings=siblings)


def test_batched_acceptance_equals_one_by_one():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits, trees, samplings, seeds = [], [], [], []
        for j in range(rng.randint(1, 6)):
            kind = rng.choice(["empty", "chain", "tree", "tree"])
            tree = _tree(rng, kind)
            sp = rng.choice([SamplingParams(), SamplingParams(temperature=0.8, seed=trial),
                             SamplingParams(temperature=1.2, top_k=4, top_p=0.9),
                             SamplingParams(temperature=0.7, acceptance="typical")])
            if not sp.greedy and len(tree) and rng.random() < 0.6:
                tree = _with_q(tree, rng, rng.choice([SIBLINGS_IID, SIBLINGS_WOR]))
            tree.validate(V)
            logits.append(torch.randn(len(tree) + 1, V, generator=g) * 2)
            trees.append(tree)
            samplings.append(sp)
            seeds.append(rng.randrange(2 ** 40))
        one = [A.accept(lg, t, s, sd) for lg, t, s, sd in zip(logits, trees, samplings, seeds)]
        batched = A.accept_batch(logits, trees, samplings, seeds, batched=True, backend="torch")
        assert batched == one, trial
        assert A.accept_batch(logits, trees, samplings, seeds) == one  # CPU default: one by one


def test_batched_sampled_q_is_scattered_from_the_sparse_q():
    """The sampled group's dense q [N, T, V] is built on the device by one scatter of the
    trees' nonzero q entries (top-k subsets, one-hot nodes, lenience applied): the same
    float32 values ``dense_q(tree) * lenience`` gives, and the same decisions as one by
    one, lenient requests included."""
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    trees, samplings = [], []
    for j in range(5):
        tree = _tree(rng, rng.choice(["chain", "tree"]))
        if j % 2 == 0:  # top-3 subsets as q (as the drafters send), one node without q (one-hot)
            ids, probs = [], []
            for tok in tree.tokens:
                sub = sorted({tok, rng.randrange(V), rng.randrange(V)})
                w = [rng.random() + 0.1 for _ in sub]
                ids.append(sub)
                probs.append([x / sum(w) for x in w])
            ids[-1], probs[-1] = [], []
            tree = TokenTree(tree.tokens, tree.parents, ids, probs, siblings=SIBLINGS_IID)
        tree.validate(V)
        trees.append(tree)
        samplings.append(SamplingParams(temperature=0.9, acceptance="lenient", lenience=0.7) if j % 3 == 1
                         else SamplingParams(temperature=0.9))
    t = max(len(tr) for tr in trees)
    idx, val = A._sparse_q(trees, samplings, t, V)
    q = torch.zeros(len(trees) * t * V).index_put_((idx,), val).view(len(trees), t, V)
    for j, (tr, sp) in enumerate(zip(trees, samplings)):
        want = A.dense_q(tr, V) * (sp.lenience if sp.acceptance == "lenient" else 1.0)
        assert torch.equal(q[j, : len(tr)], want) and not q[j, len(tr):].any()
    for trial in range(30):
        logits = [torch.randn(len(tr) + 1, V, generator=g) * 2 for tr in trees]
        seeds = [rng.randrange(2 ** 40) for _ in trees]
        one = [A.accept(lg, tr, sp, sd) for lg, tr, sp, sd in zip(logits, trees, samplings, seeds)]
        assert A.accept_batch(logits, trees, samplings, seeds, batched=True, backend="torch") == one, trial
