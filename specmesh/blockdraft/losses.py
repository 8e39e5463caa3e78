"""Training losses for the block drafter, each a small pure function.

All take ``logits`` [A, K, N] (A blocks, K = B-1 drafted slots, N kept tokens) and
``targets`` [A, K] (index into the kept vocabulary, -100 = ignore: the target token
is outside keep_ids or past the sequence end) and return a scalar.

- ``position_weighted_ce``: CE with slot weights w_k = exp(-(k-1)/gamma) (k from 1):
  early slots matter most because a rejection there ends the round.
- ``auf_ce`` (acceptance up to first failure): CE only on slots up to and including
  the drafter's first predicted failure (its argmax != target); later slots are
  unreachable in verification this round, so they get no gradient.
- ``first_error_focal``: focal CE (1 - p_t)^focal_gamma, weighted x2 at the first error.
- ``dpace_ce`` (chain weights): slot k weighted by the prefix product of the
  drafter's own (detached) probabilities of the correct tokens at slots < k — the
  probability that slot k is reached — approximating expected accepted length.

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


LOSSES = {"ce": position_weighted_ce, "auf": auf_ce, "focal": first_error_focal, "dpace": dpace_ce}
