"""The four batched acceptance ops (``specmesh.kernels`` re-exports them): each picks
the Triton kernel (``triton_kernels``) or the vectorised torch reference (``reference``)
per call, as the package docstring describes.

Knows nothing about models, KV caches, sessions or services.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference as _ref
from ._args import DraftQ, lengths, q_spec, uniforms_f64, use_triton

__all__ = ["chain_accept", "tree_accept", "residual_sample", "tree_mask_and_positions"]


def _triton():
    from . import triton_kernels  # imports triton

    return triton_kernels


def chain_accept(target_probs: torch.Tensor,  # [N, K+1, V] probs (logits are fine when greedy)
                 draft_tokens: torch.Tensor,  # [N, K] int
                 draft_q: DraftQ = None,  # None one-hot | [N, K, V] | (ids [N, K, Kq] -1 padded, probs [N, K, Kq])
                 u_accept: Optional[torch.Tensor] = None,  # [N, K]
                 u_sample: Optional[torch.Tensor] = None,  # [N, K+1]
                 draft_lens: Optional[torch.Tensor] = None,  # [N] int; None = K for all
                 greedy: bool = False, *, backend: str = "auto", block_v: Optional[int] = None):
    """Verify a batch of draft chains. Session n uses drafts [0, draft_lens[n]) and
    probability rows [0, draft_lens[n]]; later positions are ignored.

    greedy: accept while draft == argmax(row); next token = argmax at the first
    mismatch, or of row draft_lens[n] (bonus). Otherwise Leviathan/Chen: accept draft i
    iff u_accept[i] * q_i(x_i) < p_i(x_i); at the first rejection i sample
    norm(max(0, p_i - q_i)) (p_i if that has no mass) with u_sample[i]; if all pass,
    sample the bonus from p_k with u_sample[k].
    Returns (accepted_counts [N] int64, next_tokens [N] int64)."""
    if target_probs.dim() != 3 or draft_tokens.dim() != 2 or draft_tokens.shape[0] != target_probs.shape[0] \
            or draft_tokens.shape[1] + 1 != target_probs.shape[1]:
        raise ValueError(f"target_probs must be [N, K+1, V] and draft_tokens [N, K]; got "
                         f"{tuple(target_probs.shape)} and {tuple(draft_tokens.shape)}")
    n, k1, _ = target_probs.shape
    dev = target_probs.device
    lens = lengths(draft_lens, n, k1 - 1, dev)
    q = q_spec(None if greedy else draft_q, n, k1 - 1)
    ua = us = None
    if not greedy:
        ua = uniforms_f64(u_accept, (n, k1 - 1), "u_accept", dev)
        us = uniforms_f64(u_sample, (n, k1), "u_sample", dev)
    if use_triton(backend, target_probs, draft_tokens):
        return _triton().chain_accept(target_probs, draft_tokens, q, ua, us, lens, greedy, block_v)
    return _ref.chain_accept(target_probs, draft_tokens, q, ua, us, lens, greedy)


def tree_accept(target_probs: torch.Tensor,  # [N, T+1, V]; row 0 after the pending token, row i+1 after node i
                tokens: torch.Tensor,  # [N, T] int, drafted token of each node
                parents: torch.Tensor,  # [N, T] int, -1 = child of the pending token; parents[i] < i
                sizes: Optional[torch.Tensor] = None,  # [N] int nodes per tree; None = T for all
                draft_q: DraftQ = None,  # None one-hot | [N, T, V] | (ids [N, T, Kq] -1 padded, probs [N, T, Kq])
                u_accept: Optional[torch.Tensor] = None,  # [N, T], one per node
                u_sample: Optional[torch.Tensor] = None,  # [N, D+1], one per depth (D = levels of the deepest tree)
                greedy: bool = False, max_depth: Optional[int] = None, *,
                backend: str = "auto", block_v: Optional[int] = None):
    """Verify a batch of flattened draft trees (SpecInfer order; a chain is the
    one-child case). Nodes >= sizes[n] are ignored.

    greedy: descend into the first child whose token is the argmax after the current
    node; emit that argmax where none is. Otherwise at the current node try children
    in order: accept c iff u_accept[c] * q_c(x_c) < p(x_c), else p <- norm(max(0, p - q_c))
    (kept when that has no mass) and try the next; when all fail sample p with
    u_sample[depth]. Same as ``specmesh.acceptance.greedy_tree`` / ``rejection_tree``.
    Returns (path [N, Dmax] int64 accepted nodes root to leaf, padded -1, with
    Dmax = max_depth or T; path_lens [N] int64; next_tokens [N] int64). max_depth must
    be at least the number of levels of every tree."""
    if target_probs.dim() != 3 or tokens.dim() != 2 or parents.shape != tokens.shape \
            or tokens.shape[0] != target_probs.shape[0] or tokens.shape[1] + 1 != target_probs.shape[1]:
        raise ValueError(f"target_probs must be [N, T+1, V] and tokens, parents [N, T]; got "
                         f"{tuple(target_probs.shape)}, {tuple(tokens.shape)}, {tuple(parents.shape)}")
    n, t1, _ = target_probs.shape
    dev = target_probs.device
    sz = lengths(sizes, n, t1 - 1, dev)
    q = q_spec(None if greedy else draft_q, n, t1 - 1)
    width = t1 - 1 if max_depth is None else int(max_depth)
    ua = us = None
    if not greedy:
        ua = uniforms_f64(u_accept, (n, t1 - 1), "u_accept", dev)
        us = uniforms_f64(u_sample, (n, 1), "u_sample", dev)
    if use_triton(backend, target_probs, tokens):
        return _triton().tree_accept(target_probs, tokens, parents, sz, q, ua, us, greedy, width, block_v)
    return _ref.tree_accept(target_probs, tokens, parents, sz, q, ua, us, greedy, width)


def residual_sample(p: torch.Tensor,  # [N, V] target probabilities
                    q: Optional[torch.Tensor],  # [N, V] draft probabilities, or None (sample p)
                    u: torch.Tensor,  # [N] uniforms
                    *, backend: str = "auto", block_v: Optional[int] = None) -> torch.Tensor:
    """Fused norm(max(0, p - q)) + inverse-CDF sample with u (p itself where the
    residual has no mass). Returns tokens [N] int64."""
    if p.dim() != 2 or (q is not None and q.shape != p.shape):
        raise ValueError(f"p and q must both be [N, V]; got {tuple(p.shape)} and "
                         f"{None if q is None else tuple(q.shape)}")
    uu = uniforms_f64(u, (p.shape[0],), "u", p.device)
    if use_triton(backend, p):
        return _triton().residual_sample(p, q, uu, block_v)
    return _ref.residual_sample(p, q, uu)


def tree_mask_and_positions(parents: torch.Tensor,  # [N, T] int, padded beyond sizes
                            sizes: Optional[torch.Tensor] = None,  # [N] int; None = T for all
                            prefix_lens: Optional[torch.Tensor] = None,  # [N] int; None = 0
                            *, backend: str = "auto"):
    """Ancestor-or-self attention mask and position ids for a batch of trees.
    Returns (mask [N, T, T] bool, mask[n, i, j] = node j is i or an ancestor of i;
    padded slots i >= size see only themselves, so no softmax row is empty;
    positions [N, T] int64 = prefix_len + depth, padded slots get prefix_len)."""
    if parents.dim() != 2:
        raise ValueError(f"parents must be [N, T], got {tuple(parents.shape)}")
    n, t = parents.shape
    sz = lengths(sizes, n, t, parents.device)
    pre = lengths(prefix_lens, n, 0, parents.device)
    if use_triton(backend, parents):
        return _triton().tree_mask_and_positions(parents, sz, pre)
    return _ref.tree_mask_and_positions(parents, sz, pre)
