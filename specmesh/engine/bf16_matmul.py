"""bf16 matmul on the CPU for the bf16 engine: a small C kernel (AVX-512 BF16) that
streams the weights once per call, whatever the number of rows up to 8 a pass.

Why it exists: torch's CPU bf16 ``linear`` read a decode step's weights at ~13 GB/s
on a 2-core Intel Xeon where the memory gives ~23 GB/s (a bf16 step of SmolLM2 took
26 ms), and the batch-invariant engine padded every matmul to row tiles of its
kernel classes. Here the weights are stored in ``vdpbf16ps``'s pair order (``pack``:
per block of 16 outputs and input pair, 64 bytes), and each row's outputs are one
chain of ``vdpbf16ps`` over the inputs in order, fp32, rounded once to bf16 (nearest
even). A row's bits depend on that row alone (any row count, any thread count: the
blocks of outputs are split over threads, a row's sum never is), so the engine runs
one call for any rows. With 1-2 rows a pass covers 4 blocks (3-4 rows: 2), to keep
several accumulator chains and weight streams going, and it prefetches the next
pass's weights.

Where the CPU has AMX-BF16 (the default there), a matrix whose inputs are a multiple of
32 runs on AMX tiles instead: the packed layout is already the B tiles', so they load
straight from the weights, and one ``tdpbf16ps`` covers 32 inputs of up to 16 rows (2
Intel Xeon cores, 3072 x 576, us: 1 row 106 against AVX-512's 125 and torch's 263;
16 rows 123 against 323 and 279; 64 rows 265 against 1241). Its bits differ from the
AVX-512 path's; the choice is the matrix's, the same for every call.

Where the CPU has neither but AVX2 and FMA, ``bf16_mm_avx2`` runs on the same layout in
8-lane fp32 (the weights widened with a shift or a mask; its order is in the source):
on a 2-core AMD EPYC (Zen 3) the bf16 decode step went 58.3 -> 16.8 ms and an 8-row
forward 159 -> 38.6 ms against torch's ``linear``, at ~20 GB/s (the memory's speed).

Built like the key-list kernel (``keylist_attention.compile_library``) where the CPU
has AVX-512 BF16 or AVX2 with FMA; elsewhere ``load()`` returns None and the engine keeps
torch's ``linear``. ``SPECMESH_BF16_KERNEL=avx512`` keeps AMX off, ``=avx2`` takes the
AVX2 path, ``=torch`` the kernel off. Knows nothing about models. The C source is
``csrc/bf16_matmul.c`` (with the row-pass helpers it shares with ``int4_matmul``, ``csrc/*.h``).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from .keylist_attention import c_source
from .pages import on_huge_pages

_SOURCE = c_source("bf16_matmul.c")

_lock = threading.Lock()
_state: dict = {}
# SPECMESH_BF16_KERNEL: "specmesh" (default: AMX-BF16 tiles where the CPU has them, for
# matrices whose inputs are a multiple of 32, else AVX-512 BF16; where the CPU has neither,
# AVX2), "avx512" (never AMX), "avx2" (the AVX2 path, on any CPU with AVX2 and FMA), "torch"
KERNEL_CHOICES = ("specmesh", "avx512", "avx2", "torch")
# each path of the library: what tells whether it was built for this CPU, and what it needs
# (AMX matrices whose inputs are no multiple of 32 run on the AVX-512 path, so AMX needs both)
ISAS = {"avx512": (("bf16_available",), "AVX-512 BF16 (the kernel's vdpbf16ps)"),
        "amx": (("bf16_available", "bf16_amx", "bf16_amx_enable"), "AMX-BF16"),
        "avx2": (("bf16_avx2",), "AVX2 and FMA")}


def supported(out_features: int, in_features: int) -> bool:
    """Whether ``pack`` takes a [out, in] weight (out a multiple of 16, in even)."""
    return out_features % 16 == 0 and in_features % 2 == 0 and out_features > 0 and in_features > 0


class Bf16Matmul:
    """The loaded kernel (``load()``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str = "avx512"):
        self.lib, self.path = lib, path
        self.isa = isa  # "amx", "avx512" or "avx2" (ISAS): each path has its own bits
        self.amx = isa == "amx"  # matrices whose inputs are a multiple of 32 run on AMX tiles
        P, I = ctypes.c_void_p, ctypes.c_int64
        self._avx = lib.bf16_mm_avx2 if isa == "avx2" else lib.bf16_mm
        self._amx = lib.bf16_mm_amx
        for fn in (self._avx, self._amx):
            fn.argtypes = [P, I, I, P, I, P]
            fn.restype = ctypes.c_int

    def fn(self, in_features: int):
        """The C matmul a matrix of ``in_features`` inputs runs on, ``(x, M, K, packed, N,
        y)``: AMX where enabled and K is a multiple of 32, else AVX-512 (or AVX2 where that
        is the kernel's). The matrix's alone, the same for every row count (its bits depend
        on it)."""
        return self._amx if self.amx and in_features % 32 == 0 else self._avx

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        """w [N, K] -> bf16 [N/16, K/2, 16, 2]: per block of 16 outputs and input pair, the
        16 outputs' two weights (the kernel's layout)."""
        N, K = w.shape
        if not supported(N, K):
            raise ValueError(f"bf16 pack: unsupported shape {tuple(w.shape)}")
        return on_huge_pages(w.to(torch.bfloat16).reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3))

    def mm(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 (contiguous) times the packed weight: [M, N] bf16."""
        M, K = x.shape
        nb = packed.shape[0]
        if (x.dtype != torch.bfloat16 or not x.is_contiguous() or packed.dtype != torch.bfloat16
                or packed.dim() != 4 or packed.shape[1:] != (K // 2, 16, 2) or K % 2):
            raise ValueError(f"bf16 mm: unsupported input {tuple(x.shape)} {x.dtype} for packed "
                             f"{tuple(packed.shape)}")
        y = torch.empty(M, nb * 16, dtype=torch.bfloat16)
        rc = self.fn(K)(x.data_ptr(), M, K, packed.data_ptr(), nb * 16, y.data_ptr()) if M else 0
        if rc == 2:
            raise MemoryError("bf16 mm: out of memory for the AVX2 path's fp32 rows")
        if rc:
            raise RuntimeError(f"bf16 mm: the kernel was built without {'AVX2' if self.isa == 'avx2' else 'AVX-512 BF16'}")
        return y


def load() -> Optional[Bf16Matmul]:
    """The kernel, built on first use; None where the CPU has neither AVX-512 BF16 nor
    AVX2 with FMA, there is no compiler, or ``SPECMESH_BF16_KERNEL=torch`` (``load_error()``
    says why)."""
    from .keylist_attention import cached_load, compile_library, kernel_choice, pick_variant

    def make() -> Bf16Matmul:
        choice = kernel_choice("SPECMESH_BF16_KERNEL", KERNEL_CHOICES)
        lib, path = compile_library("bf16mm", _SOURCE)
        return pick_variant(choice, lambda isa: variant(lib, path, isa), ("amx", "avx512", "avx2"))

    return cached_load(_state, _lock, make)


def variant(lib: ctypes.CDLL, path: Path, isa: str) -> Bf16Matmul:
    """One path of the built library (``ISAS``; for AMX the process's permission for the
    tile state asked once); RuntimeError where the CPU or the build lacks what it needs."""
    from .keylist_attention import require

    probes, needs = ISAS[isa]
    require(lib, probes, f"SPECMESH_BF16_KERNEL={isa}: this CPU or kernel has no {needs}")
    return Bf16Matmul(lib, path, isa)


def load_error() -> str:
    """Why ``load()`` returned None ("" when it did not, or before it ran)."""
    return _state.get("error", "")
