"""Training losses for the block drafter, each a small pure function.

All take ``logits`` [A, K, N] (A blocks, K = B-1 drafted slots, N kept tokens) and
``targets`` [A, K] (index into the kept vocabulary, -100 = ignore: the target token
is outside keep_ids or past the sequence end) and return a scalar.

- ``plain_ce``: CE with every slot weighted alike (the baseline of the ablation).
- ``position_weighted_ce``: CE with slot weights w_k = exp(-(k-1)/gamma) (k from 1):
  early slots matter most because a rejection there ends the round.
- ``auf_ce`` (acceptance up to first failure): CE only on slots up to and including
  the drafter's first predicted failure (its argmax != target); later slots are
  unreachable in verification this round, so they get no gradient.
- ``first_error_focal``: focal CE (1 - p_t)^focal_gamma, weighted x2 at the first error.
- ``dpace_ce`` (chain weights): slot k weighted by the prefix product of the
  drafter's own (detached) probabilities of the correct tokens at slots < k — the
  probability that slot k is reached — approximating expected accepted length.
- ``chain_loss`` (differentiable chain): minus the expected accepted length under
  the drafter's own probabilities of the correct tokens, -(1/K) sum_k prod_{j<=k}
  q_j, with gradients through every factor (not detached as in D-PACE); an
  ignored slot ends the chain (nothing after it can be accepted).
- ``combined``: position-weighted CE + first-error focal + chain, the three
  interventions of "teaching diffusion to speculate" together.

``LOSS_KWARGS`` names the keyword arguments each loss takes (``gamma`` for the
position weighting), so callers pass the training options uniformly.

This module knows nothing about models or data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[A, K] per-slot CE (0 where ignored)."""
    a, k, n = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, n).float(), targets.reshape(-1), ignore_index=IGNORE, reduction="none")
    return ce.view(a, k)


def _weighted_mean(per: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    w = w * valid
    return (per * w).sum() / w.sum().clamp_min(1e-8)


def plain_ce(logits, targets):
    valid = (targets != IGNORE).float()
    return _weighted_mean(_ce(logits, targets), torch.ones_like(valid), valid)


def position_weighted_ce(logits, targets, gamma: float = 4.0):
    k = torch.arange(logits.shape[1], device=logits.device, dtype=torch.float32)
    w = torch.exp(-k / gamma)[None].expand(logits.shape[0], -1)  # slot k+1 -> exp(-k/gamma)
    return _weighted_mean(_ce(logits, targets), w, (targets != IGNORE).float())


def _first_fail_mask(logits, targets) -> torch.Tensor:
    """[A, K] 1.0 for slots up to and including the first slot whose argmax is wrong."""
    wrong = (logits.argmax(-1) != targets) | (targets == IGNORE)
    before = torch.cumsum(wrong.long(), 1) - wrong.long()  # errors strictly before slot k
    return (before == 0).float()


def auf_ce(logits, targets):
    return _weighted_mean(_ce(logits, targets), _first_fail_mask(logits, targets), (targets != IGNORE).float())


def first_error_focal(logits, targets, focal_gamma: float = 2.0, first_weight: float = 2.0):
    valid = (targets != IGNORE).float()
    ce = _ce(logits, targets)
    pt = torch.exp(-ce).detach()
    wrong = (logits.argmax(-1) != targets) & (targets != IGNORE)
    first = wrong & ((torch.cumsum(wrong.long(), 1) - wrong.long()) == 0)
    w = (1 - pt) ** focal_gamma * (1 + (first_weight - 1) * first.float())
    return _weighted_mean(ce, w, valid)


def dpace_ce(logits, targets):
    valid = (targets != IGNORE).float()
    ce = _ce(logits, targets)
    p_correct = torch.exp(-ce).detach() * valid
    reach = torch.cumprod(torch.cat([torch.ones_like(p_correct[:, :1]), p_correct[:, :-1]], 1), 1)
    return _weighted_mean(ce, reach, valid)


def chain_loss(logits, targets):
    valid = (targets != IGNORE).float()
    ce = _ce(logits, targets)
    q = torch.exp(-ce) * valid  # drafter's probability of the correct token (0 where ignored)
    reach = torch.cumprod(q, 1)  # [A, K]: probability that slots 1..k are all accepted
    rows = (valid[:, 0] > 0).float()  # blocks with at least their first slot to learn from
    return -(reach.sum(1) * rows).sum() / (rows.sum().clamp_min(1.0) * logits.shape[1])


def combined(logits, targets, gamma: float = 4.0):
    return (position_weighted_ce(logits, targets, gamma) + first_error_focal(logits, targets)
            + chain_loss(logits, targets))


LOSSES = {"plain": plain_ce, "ce": position_weighted_ce, "auf": auf_ce, "focal": first_error_focal, "dpace": dpace_ce,
          "chain": chain_loss, "combined": combined}
LOSS_KWARGS = {"ce": ("gamma",), "combined": ("gamma",)}


def loss_kwargs(name: str, **options) -> dict:
    """The options (e.g. ``gamma=4.0``) that loss ``name`` takes."""
    return {k: options[k] for k in LOSS_KWARGS.get(name, ()) if k in options}
