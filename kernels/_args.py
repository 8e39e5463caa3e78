"""Argument normalisation shared by the torch references and the Triton launchers.

Turns the public calling conventions (ragged lengths, three forms of draft q,
float32 or float64 uniforms, backend names) into one canonical form. It checks
shapes only as far as is cheap (no host syncs on tensor contents) and knows
nothing about how the ops are computed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

# draft q: None (one-hot at the drafted token), dense [N, K, V], or sparse (ids [N, K, Kq], probs [N, K, Kq])
DraftQ = Union[None, torch.Tensor, Sequence[torch.Tensor]]


@dataclass
class QSpec:
    """Canonical draft q. mode: 0 one-hot, 1 dense, 2 sparse (the Triton kernels use the same codes)."""

    mode: int
    dense: Optional[torch.Tensor] = None  # [N, K, V]
    ids: Optional[torch.Tensor] = None  # [N, K, Kq] int64, -1 = padding
    probs: Optional[torch.Tensor] = None  # [N, K, Kq]

    @property
    def kq(self) -> int:
        return 0 if self.ids is None else int(self.ids.shape[-1])


def q_spec(draft_q: DraftQ, n: int, k: int) -> QSpec:
    """Validate the shape of a draft q given for n sessions x k nodes."""
    if draft_q is None:
        return QSpec(0)
    if isinstance(draft_q, torch.Tensor):
        if draft_q.dim() != 3 or tuple(draft_q.shape[:2]) != (n, k):
            raise ValueError(f"dense draft_q must be [N={n}, K={k}, V], got {tuple(draft_q.shape)}")
        return QSpec(1, dense=draft_q)
    ids, probs = draft_q
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (n, k) or ids.shape != probs.shape:
        raise ValueError(f"sparse draft_q must be (ids, probs) of equal shape [N={n}, K={k}, Kq], "
                         f"got {tuple(ids.shape)} and {tuple(probs.shape)}")
    return QSpec(2, ids=ids.long(), probs=probs)


def lengths(lens: Optional[torch.Tensor], n: int, k: int, device: torch.device) -> torch.Tensor:
    """[N] int64 lengths; ``None`` means every session uses all k slots."""
    if lens is None:
        return torch.full((n,), k, dtype=torch.long, device=device)
    if lens.shape != (n,):
        raise ValueError(f"lengths must be [N={n}], got {tuple(lens.shape)}")
    return lens.to(device=device, dtype=torch.long).contiguous()


def uniforms_f64(u: Optional[torch.Tensor], shape: tuple, name: str, device: torch.device) -> torch.Tensor:
    """Uniforms as float64 (the references compare in double); check the leading shape."""
    if u is None:
        raise ValueError(f"{name} is required in rejection (non-greedy) mode")
    if u.dim() != len(shape) or any(s is not None and a < s for a, s in zip(u.shape, shape)):
        raise ValueError(f"{name} must be at least {shape}, got {tuple(u.shape)}")
    return u.to(device=device, dtype=torch.float64)


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """Dispatch rule: "auto" -> Triton when the inputs are CUDA tensors and triton imports;
    "triton" -> Triton (CUDA, or CPU under TRITON_INTERPRET=1); "torch" -> reference."""
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
    if backend == "auto":
        if not on_cuda:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    if backend == "triton":
        if not on_cuda and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
            raise ValueError('backend="triton" on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)')
        return True
    raise ValueError(f'backend must be "auto", "torch" or "triton", got {backend!r}')
