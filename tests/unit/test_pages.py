"""The weights buffers (specmesh.engine.pages): placed on a 2 MiB boundary, their whole huge
pages advised for transparent huge pages, the values of the tensors put there unchanged."""

import os

import pytest
import torch

from specmesh.engine import pages


def _vm_flags(addr: int) -> list:
    """VmFlags of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_buffer_starts_on_a_huge_page_and_keeps_its_size():
    b = pages.weights_buffer(5 * pages.HUGE_PAGE + 123)
    assert b.dtype == torch.uint8 and b.numel() == 5 * pages.HUGE_PAGE + 123
    assert b.data_ptr() % pages.HUGE_PAGE == 0
    small = pages.weights_buffer(1000)
    assert small.numel() == 1000


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="this kernel has no transparent huge pages")
def test_whole_huge_pages_are_advised_and_the_tail_is_not(monkeypatch):
    asked = []
    advise = pages._advise
    monkeypatch.setattr(pages, "_advise", lambda a, n, *r: asked.append((a, n)) or advise(a, n, *r))
    b = pages.weights_buffer(3 * pages.HUGE_PAGE + 4096)
    b.fill_(7)
    assert asked == [(b.data_ptr(), 3 * pages.HUGE_PAGE)]  # the tail past the last whole page: not asked
    assert "hg" in _vm_flags(b.data_ptr())  # MADV_HUGEPAGE took
    assert "hg" in _vm_flags(b.data_ptr() + 3 * pages.HUGE_PAGE - 1)
    assert int(b.sum()) == 7 * b.numel()
    # (whether the tail's mapping carries the flag depends on what else this process advised:
    # a buffer under malloc's mmap threshold comes from the heap, which earlier loads advised)


def test_turned_off_gives_plain_tensors(monkeypatch):
    monkeypatch.setenv("SPECMESH_HUGEPAGES", "0")
    asked = []
    monkeypatch.setattr(pages, "_advise", lambda *a: asked.append(a))
    t = torch.randn(2000, 1100)
    assert pages.on_huge_pages(t).data_ptr() == t.data_ptr()
    assert pages.weights_buffer(8 * pages.HUGE_PAGE).numel() == 8 * pages.HUGE_PAGE
    assert asked == []  # nothing advised


def test_values_shape_and_dtype_unchanged():
    t = torch.randn(1500, 2100).to(torch.bfloat16).t()  # strided: copied in order
    h = pages.on_huge_pages(t)
    assert h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous() and torch.equal(h, t)
    assert h.data_ptr() % pages.HUGE_PAGE == 0
