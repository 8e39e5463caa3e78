"""Torch references for the acceptance kernels, batched over sessions.

Each function is the batch form of a rule in ``specmesh.acceptance`` and agrees with
it token for token on the same uniforms: comparisons and inverse-CDF sampling are done
in float64 exactly as there (cumsum, ``cdf[-1]`` as the total, searchsorted right=True,
step back off zero-mass tokens). Vectorised over the batch; loops remain only over
tree levels and sibling slots. Arguments arrive already normalised by ``kernels._args``;
this module knows nothing about Triton or dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._args import QSpec


def sample_rows(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """dist [M, V] non-negative weights, u [M] float64 -> [M] int64 tokens
    (``specmesh.acceptance.sample`` row by row)."""
    m, v = dist.shape
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=dist.device)
    dist = dist.double()
    cdf = dist.cumsum(-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(v - 1)
    # step back to the last positive-mass token at or before idx (or 0)
    ar = torch.arange(v, device=dist.device)
    ok = (dist > 0) & (ar.unsqueeze(0) <= idx.unsqueeze(1))
    return torch.where(ok, ar, torch.zeros_like(ar)).amax(-1)


def _gather_q(q: QSpec, n_idx: torch.Tensor, node: torch.Tensor, tok: torch.Tensor,
              x: Optional[torch.Tensor], vocab: int) -> torch.Tensor:
    """q of node ``node`` of session ``n_idx`` (drafted token ``tok``) in float64, as full
    rows [M, V] when x is None, else its value at token x [M]. All index tensors [M]."""
    if q.mode == 1:
        if x is None:
            return q.dense[n_idx, node].double()
        return q.dense[n_idx, node, x].double()
    if q.mode == 0:
        ids = tok.unsqueeze(1)
        vals = torch.ones_like(ids, dtype=torch.float64)
    else:  # sparse; -1 ids are padding, a node with no ids is a one-hot draft
        ids, vals = q.ids[n_idx, node], q.probs[n_idx, node].double()
        valid = ids >= 0
        empty = ~valid.any(1, keepdim=True)
        ids = torch.cat([torch.where(valid, ids, torch.zeros_like(ids)), tok.unsqueeze(1)], 1)
        vals = torch.cat([torch.where(valid, vals, torch.zeros_like(vals)), empty.double()], 1)
    if x is None:
        return torch.zeros(ids.shape[0], vocab, dtype=torch.float64, device=ids.device).scatter_add_(1, ids, vals)
    return torch.where(ids == x.unsqueeze(1), vals, torch.zeros_like(vals)).sum(1)


def residual_sample(p: torch.Tensor, q: Optional[torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """p [N, V], q [N, V] or None, u [N] float64 -> [N] int64: sample norm(max(0, p - q)),
    or p itself where that residual has no mass (or q is None)."""
    p = p.double()
    if q is None:
        return sample_rows(p, u)
    resid = (p - q.double()).clamp_min(0.0)
    dist = torch.where((resid.sum(-1) > 0).unsqueeze(1), resid, p)
    return sample_rows(dist, u)


def chain_accept(probs: torch.Tensor, tokens: torch.Tensor, q: QSpec, u_accept: Optional[torch.Tensor],
                 u_sample: Optional[torch.Tensor], lens: torch.Tensor, greedy: bool):
    """probs [N, K+1, V], tokens [N, K], lens [N], u_accept [N, K], u_sample [N, K+1]
    -> (accepted [N], next_token [N]), both int64."""
    n, k1, v = probs.shape
    k = k1 - 1
    dev = probs.device
    ar = torch.arange(n, device=dev)
    pos = torch.arange(k, device=dev).unsqueeze(0)
    valid = pos < lens.unsqueeze(1)  # [N, K]
    x = torch.where(valid, tokens.long(), torch.zeros_like(tokens, dtype=torch.long))
    if greedy:
        am = probs.argmax(-1)  # [N, K+1]
        nacc = ((x == am[:, :k]) & valid).long().cumprod(1).sum(1)
        return nacc, am[ar, nacc]
    px = probs[:, :k].gather(2, x.unsqueeze(2)).squeeze(2).double()
    nodes = pos.expand(n, k)
    qx = _gather_q(q, ar.repeat_interleave(k), nodes.reshape(-1), x.reshape(-1), x.reshape(-1), v).view(n, k)
    ok = (u_accept[:, :k] * qx < px) & valid
    nacc = ok.long().cumprod(1).sum(1)
    rejected = nacc < lens
    node = nacc.clamp_max(max(k - 1, 0))
    p = probs[ar, nacc].double()
    if k > 0:
        qrow = _gather_q(q, ar, node, x[ar, node], None, v)
        resid = (p - qrow).clamp_min(0.0)
        use = rejected & (resid.sum(-1) > 0)
        p = torch.where(use.unsqueeze(1), resid, p)
    return nacc, sample_rows(p, u_sample[ar, nacc])


def _children(parents: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """parents [N, T] -> kids [N, T+1, C]: children of node s-1 (slot 0 = root) in order, -1 pad."""
    n, t = parents.shape
    dev = parents.device
    real = torch.arange(t, device=dev).unsqueeze(0) < sizes.unsqueeze(1)
    slot = torch.where(real, parents.long() + 1, torch.full_like(parents, t + 1, dtype=torch.long))
    onehot = torch.nn.functional.one_hot(slot, t + 2)  # [N, T, T+2]
    rank = ((onehot.cumsum(1) * onehot).sum(-1) - 1).masked_fill(~real, 0)  # position among siblings
    c = int(rank.max()) + 1 if t else 1  # padded nodes all land in the dropped slot T+1
    kids = torch.full((n, t + 2, max(c, 1)), -1, dtype=torch.long, device=dev)
    nodes = torch.arange(t, device=dev).expand(n, t)
    kids[torch.arange(n, device=dev).unsqueeze(1).expand(n, t), slot, rank] = nodes
    return kids[:, : t + 1]


def tree_accept(probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, sizes: torch.Tensor,
                q: QSpec, u_accept: Optional[torch.Tensor], u_sample: Optional[torch.Tensor],
                greedy: bool, width: int):
    """probs [N, T+1, V] (row 0 after the pending token, row i+1 after node i), tokens and
    parents [N, T], sizes [N], u_accept [N, T], u_sample [N, D+1]
    -> (path [N, width] node ids padded -1, path_len [N], next_token [N]), all int64."""
    n, t1, v = probs.shape
    dev = probs.device
    ar = torch.arange(n, device=dev)
    kids = _children(parents, sizes)  # [N, T+1, C]
    tok = torch.cat([tokens.long(), torch.full((n, 1), -1, dtype=torch.long, device=dev)], 1)  # [N, T+1], -1 pad
    am = probs.argmax(-1) if greedy else None  # [N, T+1]
    cur = torch.full((n,), -1, dtype=torch.long, device=dev)
    depth = torch.zeros(n, dtype=torch.long, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    nxt = torch.zeros(n, dtype=torch.long, device=dev)
    path = torch.full((n, width), -1, dtype=torch.long, device=dev)
    for _ in range(t1):
        active = ~done
        if not bool(active.any()):
            break
        row = cur + 1
        cand = kids[ar, row]  # [N, C]
        ctok = tok.gather(1, torch.where(cand >= 0, cand, t1 - 1))  # -1 where no child
        if greedy:
            want = am[ar, row]
            match = (ctok == want.unsqueeze(1)) & (cand >= 0)
            first = match.long().argmax(1)
            acc = torch.where(match.any(1), cand[ar, first], torch.full_like(cur, -1))
            stop_tok = want
        else:
            p = probs[ar, row].double()  # working distribution, [N, V]
            acc = torch.full_like(cur, -1)
            for j in range(cand.shape[1]):
                c = cand[:, j]
                trying = active & (acc < 0) & (c >= 0)
                if not bool(trying.any()):
                    break
                cc, x = c.clamp_min(0), ctok[:, j].clamp_min(0)
                qrow = _gather_q(q, ar, cc, x, None, v)
                ok = trying & (u_accept[ar, cc] * qrow.gather(1, x.unsqueeze(1)).squeeze(1)
                               < p.gather(1, x.unsqueeze(1)).squeeze(1))
                acc = torch.where(ok, c, acc)
                resid = (p - qrow).clamp_min(0.0)
                s = resid.sum(-1, keepdim=True)
                upd = (trying & ~ok).unsqueeze(1) & (s > 0)
                p = torch.where(upd, resid / s, p)
            stop_tok = sample_rows(p, u_sample[ar, depth.clamp_max(u_sample.shape[1] - 1)])
        stop = active & (acc < 0)
        nxt = torch.where(stop, stop_tok, nxt)
        done = done | stop
        go = active & (acc >= 0)
        rows = go & (depth < width)
        path[ar[rows], depth[rows]] = acc[rows]
        cur = torch.where(go, acc, cur)
        depth = depth + go.long()
    return path, depth, nxt


def tree_mask_and_positions(parents: torch.Tensor, sizes: torch.Tensor, prefix_lens: torch.Tensor):
    """parents [N, T], sizes [N], prefix_lens [N] -> (mask [N, T, T] bool, positions [N, T] int64).
    mask[n, i, j]: j is i or an ancestor of i (padded slots i >= size see only themselves);
    positions = prefix_len + depth (padded slots: prefix_len)."""
    n, t = parents.shape
    dev = parents.device
    idx = torch.arange(t, device=dev)
    real = idx.unsqueeze(0) < sizes.unsqueeze(1)
    mask = torch.eye(t, dtype=torch.bool, device=dev).expand(n, t, t).clone()
    cur = torch.where(real, parents.long(), torch.full_like(parents, -1, dtype=torch.long))
    depth = torch.zeros(n, t, dtype=torch.long, device=dev)
    bn = torch.arange(n, device=dev).unsqueeze(1).expand(n, t)
    bi = idx.unsqueeze(0).expand(n, t)
    for _ in range(t):
        ok = cur >= 0
        if not bool(ok.any()):
            break
        mask[bn[ok], bi[ok], cur[ok]] = True
        depth += ok.long()
        cur = torch.where(ok, parents.long().gather(1, cur.clamp_min(0)), cur)
    return mask, prefix_lens.long().unsqueeze(1) + depth
