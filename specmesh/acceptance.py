"""Acceptance rules for draft–verify, as small pure functions.

Each rule takes the target's per-position distributions, the drafted tokens (a
chain or a flattened tree), the draft distributions q and explicit uniforms, and
returns the accepted path plus the target's next token. Randomness is always
passed in (``uniforms(...)`` draws them from a seeded generator), so a rule is a
deterministic function of its inputs and the Triton kernels in ``kernels/`` can be
checked against these token for token.

Row convention: ``probs[0]`` is the target's distribution after the last
committed (pending) token, ``probs[i + 1]`` the distribution after tree node i.

This module knows nothing about models, sessions, KV caches or gRPC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import seeding
from .rowops import argmax_rows
from .types import SIBLINGS_WOR, SamplingParams, TokenTree


@dataclass
class Acceptance:
    path: list[int]  # accepted tree nodes, root to leaf
    next_token: int  # correction at the first rejection, or the bonus token


# ---------------------------------------------------------------------------
# target distribution


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] float32 probabilities after temperature, top-k, top-p
    (the order Hugging Face applies them). Greedy (temperature 0) gives one-hot argmax."""
    logits = logits.float()
    if sampling.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    z = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        cum = torch.softmax(sorted_z, -1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (cum - torch.softmax(sorted_z, -1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.softmax(z, -1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of [n, V] probabilities."""
    p = probs.clamp_min(1e-30)
    return -(probs * p.log()).sum(-1)


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token from unnormalised [V] weights with uniform u in [0, 1)."""
    cdf = probs.double().cumsum(0)
    target = u * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:  # never land on a zero-mass token at the edge
        idx -= 1
    return idx


def uniforms(seed: int, n_nodes: int, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_accept [n_nodes], u_sample [depth + 1]) from the round seed's acceptance
    stream (``seeding.ACCEPT``: independent of the drafter's draws)."""
    g = seeding.generator(seed, seeding.ACCEPT)
    u = torch.rand(n_nodes + depth + 1, generator=g, dtype=torch.float64)
    return u[:n_nodes], u[n_nodes:]


def dense_q(tree: TokenTree, vocab: int) -> torch.Tensor:
    """[n, V] draft distributions; a one-hot row where the node carries no q."""
    q = torch.zeros(len(tree), vocab, dtype=torch.float32)
    for i, tok in enumerate(tree.tokens):
        ids = tree.q_ids[i] if tree.q_ids is not None else None
        if ids:
            q[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(tree.q_probs[i], dtype=torch.float32)
        else:
            q[i, tok] = 1.0
    return q


def _children(tree: TokenTree) -> dict[int, list[int]]:
    """node (-1 = root) -> its children in sibling order."""
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents):
        kids.setdefault(par, []).append(i)
    return kids


def _row(node: int) -> int:
    return node + 1  # probs row holding the distribution *after* ``node`` (-1 = pending)


# ---------------------------------------------------------------------------
# greedy


def greedy_chain(argmax: list[int], draft: list[int]) -> Acceptance:
    """Accept the longest prefix where draft[i] == argmax[i]; emit argmax at the first
    mismatch, or the bonus argmax[k] when all k drafts match. argmax has k + 1 entries."""
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return Acceptance(list(range(n)), int(argmax[n]))


def greedy_tree(argmax: list[int], tree: TokenTree) -> Acceptance:
    """Descend from the root into the child whose token equals the target's argmax;
    stop when none does and emit the argmax there. argmax has len(tree) + 1 entries."""
    kids = _children(tree)
    path, cur = [], -1
    while True:
        want = argmax[_row(cur)]
        nxt = next((c for c in kids.get(cur, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(path, int(want))
        path.append(nxt)
        cur = nxt


# ---------------------------------------------------------------------------
# lossless rejection sampling


def rejection_tree(probs: torch.Tensor, tree: TokenTree, q: torch.Tensor,
                   u_accept: torch.Tensor, u_sample: torch.Tensor) -> Acceptance:
    """Multi-candidate rejection sampling (a chain is the one-child case: Leviathan/Chen).

    At node ``cur`` with target distribution p, try the children c in order, each
    drawn from proposal q_c:
      accept c w.p. min(1, p(x_c) / q_c(x_c))   (test: u_accept[c] * q_c(x_c) < p(x_c));
      on rejection p <- norm(max(0, p - q_c)) and try the next sibling.
    Descend into an accepted child; when every child fails (or there is none),
    sample the next token from the current p with u_sample[depth].
    Exact for any proposals as long as q_c is the distribution x_c was really drawn
    from given the siblings before it (each step is an exact sampler of its p):
      - one-hot (deterministic drafts): q_c = onehot(x_c);
      - siblings drawn i.i.d. (SpecInfer): q_c = q, the shared distribution;
      - drawn without replacement (``tree.siblings == SIBLINGS_WOR``; recursive
        rejection sampling): q_c = q with the earlier siblings' tokens removed,
        renormalised.
    probs: [len(tree)+1, V]; q: [len(tree), V] (each node's shared sibling q)."""
    kids = _children(tree)
    wor = tree.siblings == SIBLINGS_WOR
    path, cur, depth = [], -1, 0
    while True:
        p = probs[_row(cur)].double()
        accepted = None
        drawn: list[int] = []
        for c in kids.get(cur, []):
            x = tree.tokens[c]
            qc = q[c].double()
            if wor and drawn:
                qc = qc.clone()
                qc[drawn] = 0.0
                qc = qc / qc.sum()
            if float(u_accept[c]) * float(qc[x]) < float(p[x]):
                accepted = c
                break
            drawn.append(x)
            resid = (p - qc).clamp_min(0.0)
            if float(resid.sum()) > 0:
                p = resid / resid.sum()
        if accepted is None:
            return Acceptance(path, sample(p, float(u_sample[depth])))
        path.append(accepted)
        cur = accepted
        depth += 1


def rejection_chain(probs: torch.Tensor, draft: list[int], q: torch.Tensor,
                    u_accept: torch.Tensor, u_sample: torch.Tensor) -> Acceptance:
    """Leviathan/Chen speculative sampling over a chain of k drafts.
    accept x_i~q_i w.p. min(1, p_i(x_i)/q_i(x_i)); at the first rejection i sample
    from norm(max(0, p_i - q_i)) with u_sample[i]; if all pass sample the bonus from
    p_k with u_sample[k]. probs: [k+1, V], q: [k, V]."""
    k = len(draft)
    if k:
        idx = torch.arange(k)
        x = torch.tensor(draft, dtype=torch.long)
        px = probs[idx, x].double()
        qx = q[idx, x].double()
        ok = u_accept[:k].double() * qx < px
        n = int(ok.long().cumprod(0).sum())
    else:
        n = 0
    if n < k:
        resid = (probs[n].double() - q[n].double()).clamp_min(0.0)
        dist = resid if float(resid.sum()) > 0 else probs[n].double()
        return Acceptance(list(range(n)), sample(dist, float(u_sample[n])))
    return Acceptance(list(range(k)), sample(probs[k].double(), float(u_sample[k])))


# ---------------------------------------------------------------------------
# relaxed (lossy, opt-in)


def typical_tree(probs: torch.Tensor, tree: TokenTree, u_sample: torch.Tensor,
                 epsilon: float, delta: float) -> Acceptance:
    """LOSSY typical acceptance (Medusa): accept child x of the current node when
    p(x) > min(epsilon, delta * exp(-H(p))); take the first passing child in sibling
    order; when none passes sample from p. Output no longer follows the target
    distribution exactly; callers must label it."""
    kids = _children(tree)
    path, cur, depth = [], -1, 0
    while True:
        p = probs[_row(cur)].double()
        h = float(entropy(p.unsqueeze(0))[0])
        thresh = min(epsilon, delta * math.exp(-h))
        nxt = next((c for c in kids.get(cur, []) if float(p[tree.tokens[c]]) > thresh), None)
        if nxt is None:
            return Acceptance(path, sample(p, float(u_sample[depth])))
        path.append(nxt)
        cur = nxt
        depth += 1


# ---------------------------------------------------------------------------
# dispatch


def _accept_cuda(probs: torch.Tensor, tree: TokenTree, sampling: SamplingParams, seed: int) -> Acceptance:
    """The same rules through the Triton kernels of ``kernels/`` (CUDA tensors)."""
    import kernels

    dev = probs.device
    greedy = sampling.greedy
    depth = (max(tree.depths()) + 1) if len(tree) else 0
    u_acc, u_smp = uniforms(seed, len(tree), depth)
    q = None if greedy else dense_q(tree, probs.shape[-1]).to(dev)[None]
    ua, us = u_acc.to(dev)[None], u_smp.to(dev)[None]
    toks = torch.tensor([tree.tokens], dtype=torch.long, device=dev)
    if tree.is_chain:
        n, nxt = kernels.chain_accept(probs[None], toks, q, ua, us, greedy=greedy)
        return Acceptance(list(range(int(n[0]))), int(nxt[0]))
    par = torch.tensor([tree.parents], dtype=torch.long, device=dev)
    path, plen, nxt = kernels.tree_accept(probs[None], toks, par, draft_q=q, u_accept=ua, u_sample=us,
                                          greedy=greedy, max_depth=max(depth, 1))
    return Acceptance([int(x) for x in path[0, : int(plen[0])]], int(nxt[0]))


def accept(logits: torch.Tensor, tree: TokenTree, sampling: SamplingParams, seed: int,
           probs: Optional[torch.Tensor] = None) -> Acceptance:
    """Apply the rule ``sampling`` asks for to [len(tree)+1, V] target logits.
    CUDA tensors go through the Triton kernels (same uniforms, same tokens)."""
    if logits.is_cuda and sampling.acceptance == "exact" and len(tree) and tree.siblings != SIBLINGS_WOR:
        return _accept_cuda(logits if sampling.greedy else target_probs(logits, sampling), tree, sampling, seed)
    if sampling.greedy:
        am = argmax_rows(logits).tolist()
        return greedy_chain(am, tree.tokens) if tree.is_chain else greedy_tree(am, tree)
    if probs is None:
        probs = target_probs(logits, sampling)
    depth = (max(tree.depths()) + 1) if len(tree) else 0
    u_acc, u_smp = uniforms(seed, len(tree), depth)
    if sampling.acceptance == "typical":
        return typical_tree(probs, tree, u_smp, sampling.typical_epsilon, sampling.typical_delta)
    q = dense_q(tree, probs.shape[-1])
    if tree.is_chain:
        return rejection_chain(probs, tree.tokens, q, u_acc, u_smp)
    return rejection_tree(probs, tree, q, u_acc, u_smp)
