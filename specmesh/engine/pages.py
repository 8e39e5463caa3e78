"""Where the weights a token reads live: buffers the kernel may back with transparent
huge pages.

A decoding step streams every weight once (~1 GB for Qwen2.5-Coder-1.5B's Q4_K_M tiles).
On 4 KiB pages that is ~250,000 TLB misses and page walks a token; on 2 MiB pages ~500.
Linux backs an anonymous region with huge pages where asked (``madvise(MADV_HUGEPAGE)``,
the default ``enabled=madvise`` mode; ``always`` does it anyway, ``never`` ignores the
advice), so a weights buffer is placed on a 2 MiB boundary and its whole huge pages are
advised before anything is written to them. ``SPECMESH_HUGEPAGES=0`` turns it off.

Knows nothing of kernels, layouts or models: bytes, pages and tensors.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

HUGE_PAGE = 2 << 20  # an x86-64 transparent huge page
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("SPECMESH_HUGEPAGES", "1") != "0"


def _on_huge(nbytes: int) -> bool:
    """Whether a buffer of ``nbytes`` goes on huge pages: 4 MiB or more (whole huge pages to
    advise), where turned on."""
    return nbytes >= 2 * HUGE_PAGE and enabled()


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _advise(addr: int, length: int, advice: int = MADV_HUGEPAGE) -> bool:
    try:
        return _libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def release_tail(t: torch.Tensor, keep: int) -> torch.Tensor:
    """The first ``keep`` bytes of the contiguous tensor ``t`` (a uint8 view), the whole
    pages after them handed back to the system (``MADV_DONTNEED``: no longer resident;
    nothing may read them again: the view returned ends before them). Linux only; elsewhere
    the view alone."""
    import mmap

    if sys.platform.startswith("linux"):
        page = mmap.PAGESIZE
        lo = -(-(t.data_ptr() + keep) // page) * page
        hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if hi > lo:
            _advise(lo, hi - lo, MADV_DONTNEED)
    return t.view(torch.uint8)[:keep]


def weights_buffer(nbytes: int) -> torch.Tensor:
    """An empty uint8 tensor of ``nbytes`` starting on a 2 MiB boundary, its whole huge
    pages advised. The allocation is up to 2 MiB longer in address space, never touched
    (so never resident); the tail past the last whole huge page stays on small pages, so
    the buffer holds no memory it does not use. Below 4 MiB, or where turned off, a plain
    tensor."""
    if not _on_huge(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[off: off + nbytes]  # a view: it keeps the allocation alive
    _advise(buf.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return buf


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a ``weights_buffer`` (same dtype and shape, contiguous); ``t``
    itself where the buffer would be a plain tensor anyway."""
    n = t.numel() * t.element_size()
    if not _on_huge(n):
        return t.contiguous()
    out = weights_buffer(n).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
