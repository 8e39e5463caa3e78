"""Which torch device to run on: ``resolve_device(spec)``.

Every entry point (``Runtime``, ``specmesh serve`` / ``demo`` / ``bench`` /
``device-check``, the Ray replicas) resolves the user's ``--device`` once, at
start-up, through this function, so a device that does not exist is one clear
``InvalidArgument("device", ...)`` before any model is loaded, never a CUDA error
at the first forward.

Specs: ``auto`` (CUDA when ``torch.cuda.is_available()``, else the CPU), ``cpu``,
``cuda`` (the current CUDA device), ``cuda:N``. ``cpu_bf16_is_fast()`` says whether
this CPU has bf16 matrix instructions (AMX or AVX-512 BF16).

Host reads: every device -> host read on the serving path (a ``.tolist()``, ``.cpu()``,
``int(t)``, ``torch.equal`` of device tensors) goes through ``host_list`` / ``to_host`` /
``host_int`` / ``host_equal``, which count it (``host_reads()``, by label) on every
device, the CPU included, so a CPU test can assert how many reads a round makes: on a
GPU each one waits for the queued kernels. Host -> device copies of fresh host tensors
use ``to_device`` (non-blocking: no wait for the queue; the source is staged before the
call returns). ``lazy_zeros`` allocates a large zeroed buffer whose host memory is taken
as it is written (the KV of every slot, allocated at start). Knows nothing about models.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Optional, Union

import torch

from ..types import InvalidArgument

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when torch.cuda.is_available(), else cpu)"


def resolve_device(spec: Optional[Union[str, torch.device]] = "auto") -> torch.device:
    """The ``torch.device`` for ``spec`` (see module docstring); raises
    ``InvalidArgument("device", ...)`` for garbage or a device this machine lacks."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = "auto" if spec is None else str(spec).strip().lower()
    if text in ("", "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise InvalidArgument("device", f"unknown device {spec!r}; expected {DEVICE_HELP}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise InvalidArgument("device", f"device type {dev.type!r} is not supported; expected {DEVICE_HELP}")
    if not torch.cuda.is_available():
        raise InvalidArgument("device", f"{text} requested but torch.cuda.is_available() is False (torch "
                                        f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                                        f"use --device cpu or auto")
    n = torch.cuda.device_count()
    idx = torch.cuda.current_device() if dev.index is None else dev.index
    if idx >= n:
        raise InvalidArgument("device", f"{text} requested but only {n} GPU{'s' if n != 1 else ''} "
                                        f"visible (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", idx)


def describe(device: torch.device) -> str:
    """One line naming the device (the GPU's name and memory on CUDA)."""
    if device.type != "cuda":
        return "cpu"
    p = torch.cuda.get_device_properties(device)
    return f"{device} ({p.name}, {p.total_memory / 2**30:.0f} GiB)"


def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX tiles or AVX-512 BF16).
    Without them (AVX2 only) torch emulates bf16 matmuls and they run slower than fp32:
    a block-drafter training step took 10.7 s under bf16 autocast vs 0.53 s in fp32 on
    an AVX2-only EPYC, while on an AMX CPU autocast was ~4x faster."""
    cpu = torch.cpu
    return any(bool(getattr(cpu, f, lambda: False)()) for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


# ---------------------------------------------------------------- host reads
_READS: Counter = Counter()
_READS_LOCK = threading.Lock()


def lazy_zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``; on the CPU an anonymous mapping, whose pages
    the OS maps zeroed on first touch, so the resident memory grows with what is written
    (``torch.zeros`` writes, and so commits, every byte at once: 1.75 GiB for the KV of 8
    slots of 8192 positions of Qwen2.5-Coder-1.5B before any request). Page-aligned."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _count(what: str) -> None:
    with _READS_LOCK:
        _READS[what] += 1


def host_list(t: torch.Tensor, what: str) -> list:
    """``t.tolist()``, counted as one host read labelled ``what``."""
    _count(what)
    return t.tolist()


def to_host(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` on the CPU, counted as one host read labelled ``what`` (also on the CPU)."""
    _count(what)
    return t.cpu()


def host_int(t: torch.Tensor, what: str) -> int:
    """``int(t)`` of a one-element tensor, counted as one host read."""
    _count(what)
    return int(t)


def host_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> bool:
    """``torch.equal(a, b)``, counted as one host read."""
    _count(what)
    return torch.equal(a, b)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A fresh host tensor on ``device`` without waiting for the device's queue
    (non-blocking; a no-op on the CPU)."""
    return t.to(device, non_blocking=True)


def host_reads() -> Counter:
    """A copy of the host reads counted so far, by label."""
    with _READS_LOCK:
        return Counter(_READS)


@contextmanager
def counting_host_reads() -> Iterator[Counter]:
    """Yields a Counter that, when the block ends, holds the host reads made inside it
    (every thread's), by label."""
    before = host_reads()
    out: Counter = Counter()
    try:
        yield out
    finally:
        after = host_reads()
        out.update({k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)})
