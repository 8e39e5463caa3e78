"""Triton kernels for batched acceptance, and the host launchers that call them.

One program per session for the acceptance walks (scalar control flow, vocabulary
streamed in BLOCK_V chunks, any V); one program per (session, row) for greedy
argmax; one per (session, block of nodes) for tree masks. Arguments arrive
normalised by ``kernels._args`` (QSpec, int64 lengths, float64 uniforms). Importing
this module imports triton; ``kernels`` only does so when dispatching here. Runs on
CUDA, or on CPU under TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton_lib as lib
from ._args import QSpec


# ---------------------------------------------------------------------------
# kernels


@triton.jit
def _residual_row(row, sp_v, qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, node, tok, use_q, u, V,
                  Q_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sample from max(0, row - q_node) (or row itself when use_q is false or that has
    no mass) with uniform u: ``specmesh.acceptance.rejection_chain``'s correction."""
    s = tl.full([], 0.0, tl.float64)
    if use_q:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            vm = offs < V
            p = tl.load(row + offs * sp_v, mask=vm, other=0.0).to(tl.float64)
            q = lib.q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, node, tok, offs, vm, True, Q_MODE)
            s += tl.sum(tl.maximum(p - q, 0.0))
    sub = use_q & (s > 0)
    total = s
    if sub == 0:  # no residual mass (or no q): sample the row itself
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            total += tl.sum(tl.load(row + offs * sp_v, mask=offs < V, other=0.0).to(tl.float64))
    target = u * total
    carry = tl.full([], 0.0, tl.float64)
    found = tl.full([], 0, tl.int32) + V
    last = tl.full([], -1, tl.int32)
    start = tl.full([], 0, tl.int32)
    while (start < V) & (found >= V):
        offs = start + tl.arange(0, BLOCK_V)
        vm = offs < V
        p = tl.load(row + offs * sp_v, mask=vm, other=0.0).to(tl.float64)
        if sub:
            q = lib.q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, node, tok, offs, vm, True, Q_MODE)
            p = tl.maximum(p - q, 0.0)
        carry, found, last = lib.scan_step(p, offs, vm, carry, target, found, last, V)
        start += BLOCK_V
    return lib.pick(found, last, V)


@triton.jit
def _residual_kernel(p, sp_n, sp_v, q, sq_n, sq_v, u, out, V,
                     Q_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    un = tl.load(u + n)
    tok = _residual_row(p + n * sp_n, sp_v, q + n * sq_n, 0, sq_v, q, q, 0, 0, 0, 0,
                        Q_MODE == 1, un, V, Q_MODE, BLOCK_V)
    tl.store(out + n, tok)


@triton.jit
def _chain_kernel(probs, sp_n, sp_r, sp_v, tokens, st_n, lens,
                  qd, sqd_n, sqd_t, sqd_v, qi, qp, sqs_n, sqs_t, Kq,
                  ua, sua_n, us, sus_n, acc_out, next_out, V,
                  Q_MODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Leviathan/Chen over one session's chain: vectorised accept tests, then one
    residual (or bonus) sample."""
    n = tl.program_id(0).to(tl.int64)
    probs += n * sp_n
    tokens += n * st_n
    qd += n * sqd_n
    qi += n * sqs_n
    qp += n * sqs_n
    k = tl.load(lens + n).to(tl.int32)
    i = tl.arange(0, BLOCK_K)
    valid = i < k
    x = tl.load(tokens + i, mask=valid, other=0)
    px = tl.load(probs + i * sp_r + x * sp_v, mask=valid, other=0.0).to(tl.float64)
    qx = lib.q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, i, x, x, valid, valid, Q_MODE)
    u = tl.load(ua + n * sua_n + i, mask=valid, other=1.0)
    bad = valid & ~(u * qx < px)
    nacc = tl.minimum(tl.min(tl.where(bad, i, BLOCK_K)), k)
    rejected = nacc < k
    xr = tl.load(tokens + nacc, mask=rejected, other=0)
    un = tl.load(us + n * sus_n + nacc)
    tok = _residual_row(probs + nacc * sp_r, sp_v, qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, nacc, xr,
                        rejected, un, V, Q_MODE, BLOCK_V)
    tl.store(acc_out + n, nacc)
    tl.store(next_out + n, tok)


@triton.jit
def _argmax_kernel(x, sx_n, sx_r, sx_v, lens, am, sam_n, V, BLOCK_V: tl.constexpr):
    """am[n, r] = argmax x[n, r] for rows r <= lens[n] (later rows are left alone)."""
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    if r <= tl.load(lens + n):
        tl.store(am + n * sam_n + r, lib.row_argmax(x + n * sx_n + r * sx_r, sx_v, V, BLOCK_V))


@triton.jit
def _greedy_chain_kernel(am, sam_n, tokens, st_n, lens, acc_out, next_out, BLOCK_K: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    k = tl.load(lens + n).to(tl.int32)
    i = tl.arange(0, BLOCK_K)
    valid = i < k
    x = tl.load(tokens + n * st_n + i, mask=valid, other=0)
    a = tl.load(am + n * sam_n + i, mask=valid, other=0)
    nacc = tl.minimum(tl.min(tl.where(valid & (x != a), i, BLOCK_K)), k)
    tl.store(acc_out + n, nacc)
    tl.store(next_out + n, tl.load(am + n * sam_n + nacc))


@triton.jit
def _greedy_tree_kernel(am, sam_n, tokens, st_n, parents, spa_n, sizes, path, spath_n, W,
                        plen_out, next_out):
    """Descend into the first child whose token is the argmax after the current node."""
    n = tl.program_id(0).to(tl.int64)
    am += n * sam_n
    tokens += n * st_n
    parents += n * spa_n
    size = tl.load(sizes + n).to(tl.int32)
    cur = tl.full([], -1, tl.int32)
    depth = tl.full([], 0, tl.int32)
    going = tl.full([], 1, tl.int32)
    want = tl.full([], 0, tl.int32)
    while going > 0:
        want = tl.load(am + cur + 1).to(tl.int32)
        acc = tl.full([], -1, tl.int32)
        c = cur + 1
        while (c < size) & (acc < 0):
            hit = (tl.load(parents + c) == cur) & (tl.load(tokens + c) == want)
            acc = tl.where(hit, c, acc)
            c += 1
        tl.store(path + n * spath_n + depth, acc, mask=(acc >= 0) & (depth < W))
        depth += (acc >= 0).to(tl.int32)
        going = (acc >= 0).to(tl.int32)
        cur = tl.where(acc >= 0, acc, cur)
    tl.store(plen_out + n, depth)
    tl.store(next_out + n, want)


@triton.jit
def _tree_kernel(probs, sp_n, sp_r, sp_v, tokens, st_n, parents, spa_n, sizes,
                 qd, sqd_n, sqd_t, sqd_v, qi, qp, sqs_n, sqs_t, Kq,
                 ua, sua_n, us, sus_n, n_us, path, spath_n, W, plen_out, next_out, V,
                 Q_MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """SpecInfer walk over one session's tree: try the children of the current node in
    order, re-normalising the residual after each rejection; descend or sample."""
    n = tl.program_id(0).to(tl.int64)
    probs += n * sp_n
    tokens += n * st_n
    parents += n * spa_n
    qd += n * sqd_n
    qi += n * sqs_n
    qp += n * sqs_n
    ua += n * sua_n
    us += n * sus_n
    size = tl.load(sizes + n).to(tl.int32)
    tidx = tl.arange(0, BLOCK_T)
    cur = tl.full([], -1, tl.int32)
    depth = tl.full([], 0, tl.int32)
    going = tl.full([], 1, tl.int32)
    result = tl.full([], 0, tl.int32)
    while going > 0:
        row = probs + (cur + 1) * sp_r
        lo = cur + 1
        sums = tl.zeros([BLOCK_T], tl.float64)  # residual mass after each rejected sibling
        acc = tl.full([], -1, tl.int32)
        c = cur + 1
        while (c < size) & (acc < 0):
            if tl.load(parents + c) == cur:
                x = tl.load(tokens + c)
                px = lib.p_lazy(row, sp_v, x, True, lo, c, sums, tidx, tokens,
                                qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, Q_MODE)
                qx = lib.q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, c, x, x, True, True, Q_MODE)
                if tl.load(ua + c) * qx < px:
                    acc = c
                else:
                    s = tl.full([], 0.0, tl.float64)
                    for start in range(0, V, BLOCK_V):
                        offs = start + tl.arange(0, BLOCK_V)
                        vm = offs < V
                        p = lib.p_lazy(row, sp_v, offs, vm, lo, c, sums, tidx, tokens,
                                       qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, Q_MODE)
                        q = lib.q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, c, x, offs, vm, True, Q_MODE)
                        s += tl.sum(tl.maximum(p - q, 0.0))
                    sums = tl.where(tidx == c, s, sums)
            c += 1
        if acc >= 0:
            tl.store(path + n * spath_n + depth, acc, mask=depth < W)
            depth += 1
            cur = acc
        else:
            total = tl.full([], 0.0, tl.float64)
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                total += tl.sum(lib.p_lazy(row, sp_v, offs, offs < V, lo, size, sums, tidx, tokens,
                                           qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, Q_MODE))
            target = tl.load(us + tl.minimum(depth, n_us - 1)) * total
            carry = tl.full([], 0.0, tl.float64)
            found = tl.full([], 0, tl.int32) + V
            last = tl.full([], -1, tl.int32)
            start = tl.full([], 0, tl.int32)
            while (start < V) & (found >= V):
                offs = start + tl.arange(0, BLOCK_V)
                vm = offs < V
                p = lib.p_lazy(row, sp_v, offs, vm, lo, size, sums, tidx, tokens,
                               qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, Q_MODE)
                carry, found, last = lib.scan_step(p, offs, vm, carry, target, found, last, V)
                start += BLOCK_V
            result = lib.pick(found, last, V)
            going = going * 0
    tl.store(plen_out + n, depth)
    tl.store(next_out + n, result)


@triton.jit
def _mask_kernel(parents, spa_n, sizes, prefix, mask, sm_n, sm_i, pos, spos_n, T, BLOCK_T: tl.constexpr):
    """Rows [pid1*BLOCK_T, +BLOCK_T) of one session: walk each node's ancestors,
    marking mask[i, ancestor] (the diagonal too) and counting the depth."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    im = i < T
    size = tl.load(sizes + n).to(tl.int32)
    real = im & (i < size)
    mask += n * sm_n
    parents += n * spa_n
    tl.store(mask + i * sm_i + i, 1, mask=im)
    cur = tl.load(parents + i, mask=real, other=-1).to(tl.int32)
    depth = tl.zeros([BLOCK_T], tl.int32)
    steps = tl.full([], 0, tl.int32)
    while (tl.max(cur, 0) >= 0) & (steps < T):
        ok = cur >= 0
        tl.store(mask + i * sm_i + cur, 1, mask=ok)
        depth += ok.to(tl.int32)
        cur = tl.load(parents + cur, mask=ok, other=-1).to(tl.int32)
        steps += 1
    tl.store(pos + n * spos_n + i, tl.load(prefix + n) + depth, mask=im)


# ---------------------------------------------------------------------------
# launchers


def _block_v(v: int, block_v) -> int:
    return int(block_v) if block_v else min(2048, triton.next_power_of_2(max(v, 16)))


def _warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _q_args(q: QSpec, like: torch.Tensor):
    """(qd, sqd_n, sqd_t, sqd_v, qi, qp, sqs_n, sqs_t, Kq) with dummies for absent forms."""
    if q.mode == 1:
        d = q.dense
        return (d, d.stride(0), d.stride(1), d.stride(2), like, like, 0, 0, 0)
    if q.mode == 2:
        ids = q.ids.to(torch.int32).contiguous()
        pr = q.probs.contiguous()
        return (like, 0, 0, 0, ids, pr, ids.stride(0), ids.stride(1), ids.shape[2])
    return (like, 0, 0, 0, like, like, 0, 0, 0)


def residual_sample(p: torch.Tensor, q, u: torch.Tensor, block_v=None) -> torch.Tensor:
    """p [N, V], q [N, V] or None, u [N] float64 -> [N] int64."""
    n, v = p.shape
    out = torch.zeros(n, dtype=torch.long, device=p.device)
    if n == 0:
        return out
    qq = p if q is None else q
    bv = _block_v(v, block_v)
    _residual_kernel[(n,)](p, p.stride(0), p.stride(1), qq, qq.stride(0), qq.stride(1), u.contiguous(), out, v,
                           Q_MODE=lib.Q_NONE if q is None else lib.Q_DENSE, BLOCK_V=bv, num_warps=_warps(bv))
    return out


def chain_accept(probs, tokens, q: QSpec, u_accept, u_sample, lens, greedy: bool, block_v=None):
    """probs [N, K+1, V], tokens [N, K], lens [N] -> (accepted [N], next_token [N])."""
    n, k1, v = probs.shape
    dev = probs.device
    acc = torch.zeros(n, dtype=torch.long, device=dev)
    nxt = torch.zeros(n, dtype=torch.long, device=dev)
    if n == 0:
        return acc, nxt
    tok = tokens.to(torch.int32).contiguous()
    bk = triton.next_power_of_2(max(k1 - 1, 1))
    bv = _block_v(v, block_v)
    if greedy:
        am = torch.zeros(n, k1, dtype=torch.int32, device=dev)
        _argmax_kernel[(n, k1)](probs, probs.stride(0), probs.stride(1), probs.stride(2), lens, am, am.stride(0),
                                v, BLOCK_V=bv, num_warps=_warps(bv))
        _greedy_chain_kernel[(n,)](am, am.stride(0), tok, tok.stride(0), lens, acc, nxt, BLOCK_K=bk)
        return acc, nxt
    ua, us = u_accept.contiguous(), u_sample.contiguous()
    _chain_kernel[(n,)](probs, probs.stride(0), probs.stride(1), probs.stride(2), tok, tok.stride(0), lens,
                        *_q_args(q, probs), ua, ua.stride(0), us, us.stride(0), acc, nxt, v,
                        Q_MODE=q.mode, BLOCK_K=bk, BLOCK_V=bv, num_warps=_warps(bv))
    return acc, nxt


def tree_accept(probs, tokens, parents, sizes, q: QSpec, u_accept, u_sample, greedy: bool, width: int,
                block_v=None):
    """probs [N, T+1, V], tokens/parents [N, T], sizes [N]
    -> (path [N, width] padded -1, path_len [N], next_token [N])."""
    n, t1, v = probs.shape
    dev = probs.device
    path = torch.full((n, width), -1, dtype=torch.long, device=dev)
    plen = torch.zeros(n, dtype=torch.long, device=dev)
    nxt = torch.zeros(n, dtype=torch.long, device=dev)
    if n == 0:
        return path, plen, nxt
    tok = tokens.to(torch.int32).contiguous()
    par = parents.to(torch.int32).contiguous()
    bv = _block_v(v, block_v)
    if greedy:
        am = torch.zeros(n, t1, dtype=torch.int32, device=dev)
        _argmax_kernel[(n, t1)](probs, probs.stride(0), probs.stride(1), probs.stride(2), sizes, am, am.stride(0),
                                v, BLOCK_V=bv, num_warps=_warps(bv))
        _greedy_tree_kernel[(n,)](am, am.stride(0), tok, tok.stride(0), par, par.stride(0), sizes,
                                  path, path.stride(0), width, plen, nxt)
        return path, plen, nxt
    ua, us = u_accept.contiguous(), u_sample.contiguous()
    _tree_kernel[(n,)](probs, probs.stride(0), probs.stride(1), probs.stride(2), tok, tok.stride(0),
                       par, par.stride(0), sizes, *_q_args(q, probs), ua, ua.stride(0), us, us.stride(0),
                       us.shape[1], path, path.stride(0), width, plen, nxt, v,
                       Q_MODE=q.mode, BLOCK_T=triton.next_power_of_2(max(t1 - 1, 1)), BLOCK_V=bv,
                       num_warps=_warps(bv))
    return path, plen, nxt


def tree_mask_and_positions(parents, sizes, prefix_lens, block_t: int = 64):
    """parents [N, T], sizes [N], prefix_lens [N] -> (mask [N, T, T] bool, positions [N, T] int64)."""
    n, t = parents.shape
    dev = parents.device
    mask = torch.zeros(n, t, t, dtype=torch.uint8, device=dev)
    pos = torch.zeros(n, t, dtype=torch.long, device=dev)
    if n and t:
        par = parents.to(torch.int32).contiguous()
        bt = min(block_t, triton.next_power_of_2(t))
        _mask_kernel[(n, triton.cdiv(t, bt))](par, par.stride(0), sizes, prefix_lens.contiguous(), mask,
                                               mask.stride(0), mask.stride(1), pos, pos.stride(0), t,
                                               BLOCK_T=bt)
    return mask.view(torch.bool), pos
