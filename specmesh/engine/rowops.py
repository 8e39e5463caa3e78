"""Exact row-wise argmax and top-k over a vocabulary-sized last dimension, fast on CPU.

PyTorch's CPU ``argmax`` and ``topk`` along a 49k-wide last dimension run at well
under 1 GB/s (about 0.5 ms for the 9 rows of a verify round on 2 cores) while
``amax`` is vectorised (~0.03 ms). Both functions below first reduce fixed-width
chunks with ``amax``, then search only the chunks that can hold the answer:
``argmax_rows`` returns exactly ``x.argmax(-1)`` (the first index of the row
maximum); ``topk_rows`` returns the same values as ``x.topk(k, -1)`` (among equal
values at the k-th place it may pick other indices). Other shapes, and CUDA
tensors, go straight to torch.

Knows nothing about models or sampling.
"""

from __future__ import annotations

import torch

CHUNK = 1024


def _chunked(x: torch.Tensor, k: int) -> bool:
    """Worth it: a CPU matrix whose rows split into at least 4k chunks (fewer, and the
    second search costs what it saves)."""
    return x.dim() == 2 and not x.is_cuda and x.shape[-1] % CHUNK == 0 and x.shape[-1] // CHUNK >= 4 * max(k, 1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for x [n, V]."""
    if not _chunked(x, 1):
        return x.argmax(-1)
    n, V = x.shape
    xc = x.reshape(n, V // CHUNK, CHUNK)
    c = xc.amax(-1).argmax(-1)  # the first chunk holding the row maximum
    return c * CHUNK + xc[torch.arange(n), c].argmax(-1)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [n, V], descending:
    every top-k entry lies in one of the k chunks with the largest maxima."""
    if not _chunked(x, k):
        top = x.topk(k, -1)
        return top.values, top.indices
    n, V = x.shape
    xc = x.reshape(n, V // CHUNK, CHUNK)
    chunks = xc.amax(-1).topk(k, -1).indices.sort(-1).values  # [n, k], ascending
    sub = xc.gather(1, chunks[..., None].expand(-1, -1, CHUNK)).reshape(n, k * CHUNK)
    vals, i = sub.topk(k, -1)
    return vals, chunks.gather(1, i // CHUNK) * CHUNK + i % CHUNK
