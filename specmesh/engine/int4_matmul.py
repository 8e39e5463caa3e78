"""Group-wise int4 weight-only matmul on the CPU with bf16 activations, whose cost grows
slowly with the number of rows: a small C kernel (AVX-512 BF16) that unpacks each
block of weights once and applies it to every row of the call.

Why it exists: torch's ``_weight_int4pack_mm_for_cpu`` is as fast as the memory for one
row, but its time grows about linearly past 4 rows (measured: 3.5x the one-row time at
8 rows, 7x at 16, for SmolLM2's MLP), so verifying a draft of 8-16 tokens in int4 cost
several decode steps and speculation did not pay. Here a block of 16 output channels
and one group of inputs is unpacked to bf16 once (nibbles through a 16-entry table to
``q - 8``) and multiplied into up to 8 rows at a time with ``vdpbf16ps``. With 1-2
rows a pass takes 4 blocks (3-4 rows: 2), so it keeps several accumulator chains and
weight streams going, and prefetches the next pass's weights: a decode step went 13.6 ->
8.9 ms on an Intel Xeon (same bits: each output's sum is the same sequence of operations).
Where the CPU has AMX-BF16, ``int4_mm_amx`` (the default there; comment in the source);
it runs calls of one or two rows with AVX-512 FMAs in the tiles' own order (``rows_amxe``: same bits).
Where it has neither but AVX2 and FMA (AMD Zen 1-3, Intel before Ice Lake), ``int4_mm_avx2``
on a layout of its own (``pack`` is the chosen matmul's): 8 nibbles of one output per
dword, so input i's weights are ``v & 0xF << 4i`` converted to fp32, met by the row
scaled by ``16^-i``: no shuffles, which took a one-row call of the 1536 x 8960 matrix from
torch's 1.21 ms to 0.36 ms on a 2-core AMD EPYC (Zen 3; with the key-list attention's AVX2
loops the int4 decode step went 28.4 -> 8.4 ms, docs/int4.md). Its arithmetic is in the source's comment.

The arithmetic, per row and output: for each group g, ``t_g = sum (q_i - 8) x_i`` (bf16
products summed in fp32 pairs, in input order), then ``acc += t_g * s_g`` and
``acc += z_g * sum_g x`` (the group's input sum, fp32 in a fixed order), rounded to
bf16 at the end: the weights ``(q - 8) s + z`` of the int4 engine's quantisation
(``engine.quantize_int4``; scale and zero in bf16, as torch's kernel takes them). Every
step of a row's sum is the same whatever the other rows of the call, and a block of
outputs is computed by one thread, so a row's bits depend on that row alone (the
batch-invariant engine needs that).

Layout (``pack``): per block of 16 outputs and per group, the group's nibbles (byte j of
input pair p holds output j's inputs 2p and 2p+1) followed by the 16 scales and 16
zeros in bf16: one stream per block, the same bytes as torch's packing plus scales.

Built like the key-list kernel (``keylist_attention.compile_library``, ``-march=native``
defines ``__AVX512BF16__`` / ``__AVX2__``); where the CPU has neither AVX-512 BF16 nor
AVX2 with FMA, ``load()`` returns None and the engine keeps torch's int4 kernel.
``SPECMESH_INT4_KERNEL`` chooses (``KERNEL_CHOICES``; ``torch`` turns it off;
``avx2q8``, opt-in, rounds each row's inputs to int8 per block of 32 first, the W4A8
arithmetic llama.cpp uses on AVX2: faster from ~4 rows, less exact; with an AVX-512 VNNI
loop of the same bits where the build has it, and ``load_q8()`` for the engine's screen
head, which runs it by default). ``screen`` is the int4 engine's screen head in one call: its bf16 logits
to fp32 with each row's top k recomputed from the tied embedding table (a heap per row;
torch's ``topk`` over a 49k vocabulary costs ~0.5 ms for 8 rows here). Knows nothing
about models: weights, scales, rows and a table. The C source is ``csrc/int4_matmul.c``
(with the row-pass helpers it shares with ``bf16_matmul``, ``csrc/*.h``).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from .keylist_attention import c_source
from .pages import on_huge_pages

_SOURCE = c_source("int4_matmul.c")

_lock = threading.Lock()
_state: dict = {}
# SPECMESH_INT4_KERNEL: "specmesh" (the default: AMX-BF16 tiles where the CPU has them, else
# AVX-512 BF16, else AVX2), "amx" (AMX or nothing), "avx512" (AVX-512 BF16, never AMX),
# "avx2" (the AVX2 matmul, on any CPU that has AVX2 and FMA), "avx2q8" (opt-in: AVX2 with
# each row's inputs rounded to int8 per 32, llama.cpp's Q4 x Q8 arithmetic; 8-16 rows ~0.75x
# the fp32 AVX2 matmul's time, at a quality cost, docs/int4.md), "torch" (torch's kernel).
# AMX costs little more from 1 to 16 rows (8 rows ~0.55x AVX-512's); one or two rows, on rows_amxe,
# are as fast as AVX-512's or faster (docs/int4.md)
KERNEL_CHOICES = ("specmesh", "amx", "avx512", "avx2", "avx2q8", "torch")
# each matmul of the library: its entry point and what it needs (each has its own bits)
ISAS = {"avx512": ("int4_mm", ("int4_available",), "AVX-512 BF16"),
        "amx": ("int4_mm_amx", ("int4_amx", "int4_amx_enable"), "AMX-BF16"),
        "avx2": ("int4_mm_avx2", ("int4_avx2",), "AVX2 and FMA"),
        "avx2q8": ("int4_mm_avx2q8", ("int4_avx2",), "AVX2 and FMA")}


class Int4Matmul:
    """The loaded kernel (``load()``)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str = "avx512"):
        self.lib, self.path = lib, path
        P, I = ctypes.c_void_p, ctypes.c_int64
        self.isa = isa  # which matmul of the library ("avx512", "amx", "avx2"): each has its own bits
        self.amx = isa == "amx"
        self._mm = getattr(lib, ISAS[isa][0])
        self._mm.argtypes = [P, I, I, P, I, I, P, P]
        self._mm.restype = ctypes.c_int
        self._few = lib.int4_amx_few_rows
        self._few.argtypes, self._few.restype = [ctypes.c_int], ctypes.c_int
        self._q8v = lib.int4_q8_vnni
        self._q8v.argtypes, self._q8v.restype = [ctypes.c_int], ctypes.c_int
        self._screen = lib.screen_refine
        self._screen.argtypes = [P, I, I, P, P, P, I, I, P]
        self._screen.restype = ctypes.c_int

    def q8_vnni(self, on: int = -1) -> int:
        """Whether the int8-input matmul (``avx2q8``) runs its AVX-512 VNNI loop (the default
        where the build has it) rather than its AVX2 one (same bits; C source): sets it where
        ``on`` >= 0 (process-wide), returns the previous value (0 where there is none). For
        tests and measurements."""
        return int(self._q8v(int(on)))

    def amx_few_rows(self, n: int = -1) -> int:
        """The AMX matmul's row count up to which a call runs the tiles' arithmetic with
        AVX-512 FMAs (same bits, cheaper for one row; C source): sets it to n where n >= 0
        (process-wide), returns the previous value. For tests and measurements."""
        return int(self._few(int(n)))

    def screen(self, logits: torch.Tensor, hn: torch.Tensor, table: torch.Tensor, k: int,
               scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A screen head's output: logits bf16 [n, V] -> fp32 [n, V] with each row's k
        largest (the lower index first among equals) replaced by the exact ``hn . table[v]``
        (hn fp32 [n, H]; table bf16 [V, H], or int8 [V, H] times ``scales`` bf16 [V]; all
        contiguous; k <= 256)."""
        n, V = logits.shape
        H = hn.shape[1]
        ok = (logits.dtype == torch.bfloat16 and hn.dtype == torch.float32 and table.shape == (V, H)
              and hn.shape[0] == n and logits.is_contiguous() and hn.is_contiguous() and table.is_contiguous()
              and 1 <= k <= min(256, V))
        if scales is None:
            ok = ok and table.dtype == torch.bfloat16
        else:
            ok = ok and table.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (V,) \
                and scales.is_contiguous()
        if not ok:
            raise ValueError(f"screen: unsupported input {tuple(logits.shape)} {logits.dtype}, hn {tuple(hn.shape)}, "
                             f"table {tuple(table.shape)} {table.dtype}, k {k}")
        out = torch.empty(n, V, dtype=torch.float32)
        if n and self._screen(logits.data_ptr(), n, V, hn.data_ptr(), table.data_ptr(),
                              None if scales is None else scales.data_ptr(), H, k, out.data_ptr()):
            raise RuntimeError("screen: the kernel refused its input")
        return out

    def pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
        """q [N, K] in 0..15 (uint8), scale / zero [N, K/group] (the weight is (q - 8) *
        scale + zero, both taken in bf16) -> this matmul's layout, uint8 [N/16, K/group,
        group * 8 + 64]. N a multiple of 16, group of 32."""
        N, K = q.shape
        G = K // group
        if N % 16 or K % group or group % 32 or scale.shape != (N, G) or zero.shape != (N, G):
            raise ValueError(f"int4 pack: unsupported shape {tuple(q.shape)} group {group}")
        if self.isa in ("avx2", "avx2q8"):  # per 8 inputs, per half of 8 outputs: a dword of 8 nibbles per output
            # the dword's byte k holds inputs 2k, 2k + 1 (little-endian: input i at bits 4i), built
            # in bytes (int64 words cost 8 bytes a weight: +0.27 GB of peak memory for SmolLM2's head)
            q8 = q.to(torch.uint8).reshape(N // 16, 2, 8, G, group // 8, 4, 2)
            nib = (q8[..., 0] | (q8[..., 1] << 4)).permute(0, 3, 4, 1, 2, 5).reshape(N // 16, G, group * 8)
        else:  # per input pair: byte j holds output j's two nibbles
            q = q.to(torch.uint8).reshape(N // 16, 16, G, group // 2, 2)
            nib = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1).reshape(N // 16, G, group * 8)

        def sc(t):
            return t.to(torch.bfloat16).reshape(N // 16, 16, G).permute(0, 2, 1).contiguous().view(torch.uint8)

        return on_huge_pages(torch.cat([nib, sc(scale), sc(zero)], -1))

    def mm(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, group: int) -> torch.Tensor:
        """x [M, K] bf16 (contiguous) times the packed weight: [M, n_out] bf16."""
        M, K = x.shape
        if (x.dtype != torch.bfloat16 or not x.is_contiguous() or packed.dtype != torch.uint8
                or packed.shape != (n_out // 16, K // group, group * 8 + 64) or K % group):
            raise ValueError(f"int4 mm: unsupported input {tuple(x.shape)} {x.dtype} for packed "
                             f"{tuple(packed.shape)}")
        y = torch.empty(M, n_out, dtype=torch.bfloat16)
        xs = torch.empty(max(M, 1), K // group, dtype=torch.float32)
        rc = self._mm(x.data_ptr(), M, K, packed.data_ptr(), n_out, group, xs.data_ptr(), y.data_ptr()) if M else 0
        if rc == 2:
            raise MemoryError("int4 mm: out of memory for the " + {"avx2": "AVX2 kernel's fp32 rows",
                                                                    "avx2q8": "AVX2 kernel's int8 rows"}.get(
                                                                        self.isa, "AMX kernel's tile buffers"))
        if rc:
            raise RuntimeError(f"int4 mm: the kernel was built without {ISAS[self.isa][2]}")
        return y


def load() -> Optional[Int4Matmul]:
    """The kernel, built on first use; None where the CPU has neither AVX-512 BF16 nor
    AVX2 with FMA, there is no compiler, or ``SPECMESH_INT4_KERNEL=torch`` (``load_error()``
    says why; the engine then keeps torch's int4 kernel)."""
    from .keylist_attention import cached_load, compile_library, kernel_choice, pick_variant

    def make() -> Int4Matmul:
        choice = kernel_choice("SPECMESH_INT4_KERNEL", KERNEL_CHOICES)
        lib, path = compile_library("int4mm", _SOURCE)
        return pick_variant(choice, lambda isa: variant(lib, path, isa), ("amx", "avx512", "avx2"))

    return cached_load(_state, _lock, make)


def load_q8() -> Optional[Int4Matmul]:
    """The int8-input matmul (``avx2q8``: W4A8, its AVX-512 VNNI loop where the build has
    it) of the loaded library, for the int4 engine's screen head; None where ``load()``
    returned None or the CPU lacks AVX2 and FMA."""
    k = load()
    if k is None:
        return None
    if k.isa == "avx2q8":
        return k
    try:
        return variant(k.lib, k.path, "avx2q8")
    except RuntimeError:
        return None


def variant(lib: ctypes.CDLL, path: Path, isa: str) -> Int4Matmul:
    """One matmul of the built library (``ISAS``; for AMX the process's permission for the
    tile state asked once); RuntimeError where the CPU or the build lacks what it needs."""
    from .keylist_attention import require

    _, probes, needs = ISAS[isa]
    require(lib, probes, f"SPECMESH_INT4_KERNEL={isa}: this CPU or kernel has no {needs}")
    return Int4Matmul(lib, path, isa)


def amx_variant(lib: ctypes.CDLL, path: Path) -> Int4Matmul:
    """The AMX matmul of the built library (``variant(lib, path, "amx")``)."""
    return variant(lib, path, "amx")


def load_error() -> str:
    """Why ``load()`` returned None ("" when it did not, or before it ran)."""
    return _state.get("error", "")
