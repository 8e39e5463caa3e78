"""Triton device functions shared by the acceptance kernels.

Building blocks over one vocabulary block (or one token): the draft q of a node in
its three forms, the lazily re-normalised SpecInfer residual, one step of a blocked
inverse-CDF search and a blocked argmax. Probabilities are promoted to float64 so the
kernels agree with the float64 torch references token for token. Imported only when
triton is available; knows nothing about torch tensors or launch grids.
"""

import triton
import triton.language as tl

Q_ONEHOT = 0  # q is one-hot at the node's drafted token
Q_DENSE = 1  # qd[node, v]
Q_SPARSE = 2  # (qi[node, j], qp[node, j]) for j < Kq, qi == -1 padding; no ids -> one-hot
Q_NONE = 3  # q = 0 (plain sampling)


@triton.jit
def q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, node, tok, offs, vmask, nmask, Q_MODE: tl.constexpr):
    """q of ``node`` (drafted token ``tok``) at vocabulary ids ``offs`` as float64.
    node/tok/offs may be scalars or vectors of one shape; nmask guards node-indexed loads."""
    zero = offs.to(tl.float64) * 0.0
    if Q_MODE == 0:
        q = tl.where(offs == tok, 1.0, 0.0).to(tl.float64)
    elif Q_MODE == 1:
        q = tl.load(qd + node * sqd_t + offs * sqd_v, mask=vmask & nmask, other=0.0).to(tl.float64)
    elif Q_MODE == 2:
        q = zero
        has = offs < 0  # all False, right shape
        for j in range(0, Kq):
            qid = tl.load(qi + node * sqs_t + j, mask=nmask, other=-1)
            qv = tl.load(qp + node * sqs_t + j, mask=nmask, other=0.0).to(tl.float64)
            q = tl.where(offs == qid, qv, q)  # later duplicates win, as in index assignment
            has = has | (qid >= 0)
        q = tl.where(has, q, tl.where(offs == tok, 1.0, 0.0).to(tl.float64))
    else:
        q = zero
    return q


@triton.jit
def p_lazy(row, sp_v, offs, vmask, lo, hi, sums, tidx, tokens,
           qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, Q_MODE: tl.constexpr):
    """SpecInfer working distribution at ``offs``: the target row, then for every node
    c in [lo, hi) with sums[c] > 0 (a rejected sibling whose residual had mass)
    p <- max(0, p - q_c) / sums[c]. Recomputed instead of stored, so no workspace."""
    p = tl.load(row + offs * sp_v, mask=vmask, other=0.0).to(tl.float64)
    for c in range(lo, hi):
        s = tl.sum(tl.where(tidx == c, sums, 0.0))
        if s > 0:
            tc = tl.load(tokens + c)
            q = q_block(qd, sqd_t, sqd_v, qi, qp, sqs_t, Kq, c, tc, offs, vmask, True, Q_MODE)
            p = tl.maximum(p - q, 0.0) / s
    return p


@triton.jit
def scan_step(p, offs, vmask, carry, target, found, last, V):
    """One block of the inverse-CDF search: found = first id whose running cdf exceeds
    target (and has mass); last = last id with mass so far; carry = mass so far."""
    cs = tl.cumsum(p, 0) + carry
    hit = (cs > target) & (p > 0) & vmask
    found = tl.minimum(found, tl.min(tl.where(hit, offs, V)))
    last = tl.maximum(last, tl.max(tl.where((p > 0) & vmask, offs, -1)))
    return carry + tl.sum(p), found, last


@triton.jit
def pick(found, last, V):
    """The sampled id: the search hit, else the last id with mass, else 0."""
    return tl.where(found < V, found, tl.maximum(last, 0))


@triton.jit
def row_argmax(row, sp_v, V, BLOCK_V: tl.constexpr):
    """First index of the maximum of row[0:V] (torch.argmax tie-breaking), int32."""
    best = tl.full([], float("-inf"), tl.float64)
    arg = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row + offs * sp_v, mask=offs < V, other=float("-inf")).to(tl.float64)
        m = tl.max(x, 0)
        a = tl.argmax(x, 0, tie_break_left=True).to(tl.int32)
        better = m > best
        arg = tl.where(better, start + a, arg)
        best = tl.where(better, m, best)
    return arg
