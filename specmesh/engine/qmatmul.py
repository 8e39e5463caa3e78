"""GGUF block-quantized weights, as shipped, times int8-rounded activation rows on the
CPU: integer dot products whose cost grows slowly with the number of rows.

Why it exists: the int4 engine re-quantised a dequantised fp32 copy of the GGUF to its
own grid (the user's Q4_K_M weights passed through a second quantisation, via a 7 GB fp32
cache), and its kernels multiplied in fp32, so scoring 8 rows cost 2.3 one-row steps on
Qwen2.5-Coder-1.5B and speculation did not pay. Here the GGUF's own blocks (Q4_0, Q4_1,
Q5_0, Q8_0, Q4_K, Q6_K) are kept bit for bit, only rearranged ("tiles": 8 output rows side
by side, so one 256-bit vector holds 4 inputs of each and one integer multiply-add serves
8 outputs; ``csrc/qmm_layout.h``), and each activation row is rounded to int8 blocks the
way llama.cpp pairs the types (per 32 inputs for the 32-blocks, per 256 with sums per 16
and 32 for the K types). The codes meet the rows in integer dot products on the best
path the CPU has (``PATHS``, chosen at build time from the CPU's flags): AMX-INT8 tiles for
calls with enough rows (tile pairs of 16 outputs unpacked once into a B tile, up to 16
rows a ``tdpbssd``), AVX-512 VNNI (512-bit ``vpdpbusd`` on tile pairs), AVX-VNNI (256-bit
``vpdpbusd``), AVX2 (``vpmaddubsw`` pair sums added for a whole sub-block before one
``vpmaddwd`` applies its scale) and a scalar path; all take exactly the same steps (same
bits: tested, on every machine through the SIMDe build ``load_simde``).

The arithmetic (``csrc/qmm.c``): per row and block the integer sums are exact; the fp32
steps per block are fixed (e.g. Q4_K: ``acc = fma(S, d dx, acc); acc = fma(-Mn, dmin dx,
acc)``), so a row's result depends on that row alone, not on the other rows of the call
or on the thread that computed it: the batch-invariant engine needs that, and greedy
speculation then returns exactly this engine's plain decoding.

``QMatrix``: one matrix of segments along the outputs (a layer's q, k and v may be
Q4_K, Q4_K and Q6_K), each a GGUF tensor's raw bytes repacked once at load.
``mm(x)``: bf16 or fp32 rows in, bf16 or fp32 out. ``rows(idx)``: weight rows as values
(an embedding lookup, a screen's refinement). ``round_rows``: activations rounded as the
kernel rounds them (for tests' references).

Knows nothing about models or files: types, bytes and rows. ``SPECMESH_Q_KERNEL``
(``specmesh``: the best, or one of ``PATHS``) chooses the path; the library is built like
the other kernels (``keylist_attention.compile_library``).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .keylist_attention import c_source
from .pages import release_tail, weights_buffer

_SOURCE = c_source("qmm.c")
_FLAGS = ("-ffp-contract=off",)  # the scalar path's fp32 steps exactly as written (the vector path's order)
# every path through SIMDe: an AVX2 target whatever the CPU has (the later -march wins)
_SIMDE_FLAGS = ("-DQMM_SIMDE", "-march=x86-64-v3", "-mtune=generic", "-Wno-psabi")

_lock = threading.Lock()
_state: dict = {}

# GGML type id -> (name, inputs per block, GGUF bytes per block, our bytes per tile-block of 8 rows)
TYPES = {2: ("Q4_0", 32, 18, 144), 3: ("Q4_1", 32, 20, 160), 6: ("Q5_0", 32, 22, 176), 8: ("Q8_0", 32, 34, 272),
         12: ("Q4_K", 256, 144, 1184), 14: ("Q6_K", 256, 210, 1680)}
TYPE_IDS = {v[0]: k for k, v in TYPES.items()}
# the int8 paths, by the library's number (csrc/qmm.c); all give the same bits
PATHS = ("generic", "avx2", "avxvnni", "avx512vnni", "amx")
KERNEL_CHOICES = ("specmesh",) + PATHS


def type_id(t) -> int:
    """A type given as a GGML id, a name ("Q4_K") or a ``gguf.GGMLQuantizationType``."""
    if isinstance(t, str):
        if t.upper() not in TYPE_IDS:
            raise ValueError(f"unknown quantization type {t!r}; the q kernels take {', '.join(TYPE_IDS)}")
        return TYPE_IDS[t.upper()]
    return int(t)


def tile_bytes(t, n: int, k: int) -> int:
    """Bytes of an [n, k] tensor of type ``t`` in the kernels' tiles."""
    _, qk, _, tb = TYPES[type_id(t)]
    return n // 8 * (k // qk) * tb


def supported(t, out_features: int, in_features: int) -> bool:
    """Whether the kernels take a [out, in] tensor of GGML type ``t``."""
    tid = type_id(t)
    return tid in TYPES and out_features % 8 == 0 and in_features % TYPES[tid][1] == 0


class _Seg(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("n", ctypes.c_int64), ("off", ctypes.c_int64)]


class _Mat(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("K", ctypes.c_int64), ("nseg", ctypes.c_int64),
                ("seg", ctypes.POINTER(_Seg))]


class QKernel:
    """The loaded library (``load()``, or ``load_simde()``: every path through SIMDe)."""

    def __init__(self, lib: ctypes.CDLL, path, isa: int, build: str = "native"):
        self.lib, self.path, self.build = lib, path, build
        P, I = ctypes.c_void_p, ctypes.c_int64
        for name, args in (("qmm", [P, I, I, P, I, P, P]), ("qrepack", [I, P, I, I, P]),
                           ("qrows", [I, P, I, P, I, I, P]), ("qround", [P, I, I, I, P, P])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.qmm_scratch_bytes.argtypes, lib.qmm_scratch_bytes.restype = [I, I], I
        for name in ("qmm_path", "qmm_has", "qmm_amx_min_rows"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        lib.qmm_path(isa)
        self.mm_addr = ctypes.cast(lib.qmm_bf16, ctypes.c_void_p).value  # the layer stack's entry point

    @property
    def isa(self) -> str:
        """The path in use (one of ``PATHS``)."""
        return PATHS[self.lib.qmm_path(-2)]

    def paths(self) -> list[str]:
        """The paths this build runs here (for AMX: the OS also granted the tile state)."""
        return [p for i, p in enumerate(PATHS) if self.lib.qmm_has(i)]

    def use_path(self, isa: Optional[str] = None) -> str:
        """The path in use; sets it first where ``isa`` is given (process-wide; for tests and
        measurements: every path gives the same bits)."""
        if isa is not None:
            if isa not in PATHS or self.lib.qmm_path(PATHS.index(isa)) < 0:
                raise RuntimeError(f"this build of the q kernels has no {isa} path here (it has "
                                   f"{', '.join(self.paths())})")
        return self.isa

    def force_amx_rows(self, n: Optional[int]) -> None:
        """On the AMX path, run every type on the tiles from ``n`` rows (for tests and
        measurements; every path gives the same bits); None: the measured rows (11; AVX-512
        VNNI below)."""
        self.lib.qmm_amx_min_rows(-1 if n is None else max(1, int(n)))

    def describe(self) -> str:
        """The path in use, as reports name it."""
        p = self.isa
        if p == "amx":
            p = "amx (tiles from 11 rows; avx512vnni below)"
        return p + (" via SIMDe" if self.build == "simde" else "")

    def scratch(self, M: int, K: int) -> torch.Tensor:
        return torch.empty(int(self.lib.qmm_scratch_bytes(M, K)), dtype=torch.uint8)

    def repack(self, t, raw, n: int, k: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A GGUF tensor's bytes (a uint8 tensor or numpy array, e.g. a view of the mapped
        file: rows of blocks, [n, k / QK * block bytes] or flat) -> tiles (into ``out``,
        a uint8 tensor of ``tile_bytes(t, n, k)``, where given)."""
        tid = type_id(t)
        name, qk, rb, tb = TYPES[tid]
        if isinstance(raw, torch.Tensor):
            raw = raw.contiguous().view(torch.uint8)
            size, ptr = raw.numel(), raw.data_ptr()
        else:
            import numpy as np

            raw = np.ascontiguousarray(raw).reshape(-1)
            size, ptr = raw.nbytes, raw.ctypes.data
        if size != n * (k // qk) * rb or not supported(tid, n, k):
            raise ValueError(f"{name} tensor [{n}, {k}]: {size} bytes, expected {n * (k // qk) * rb} "
                             f"(rows a multiple of 8, inputs of {qk})")
        out = torch.empty(tile_bytes(tid, n, k), dtype=torch.uint8) if out is None else out
        if self.lib.qrepack(tid, ptr, n, k, out.data_ptr()):
            raise ValueError(f"q repack refused a {name} tensor [{n}, {k}]")
        return out


def load() -> Optional[QKernel]:
    """The kernel, built on first use; None where there is no compiler (``load_error()``)."""
    from .keylist_attention import cached_load, compile_library, kernel_choice

    def make() -> QKernel:
        choice = kernel_choice("SPECMESH_Q_KERNEL", KERNEL_CHOICES)
        lib, path = compile_library("qmm", _SOURCE, _FLAGS)
        k = QKernel(lib, path, -1)
        if choice != "specmesh":
            if choice not in k.paths():
                raise RuntimeError(f"SPECMESH_Q_KERNEL={choice}: this CPU or build has no {choice} path "
                                   f"(it has {', '.join(k.paths())})")
            k.use_path(choice)
        return k

    return cached_load(_state, _lock, make)


_simde_state: dict = {}
SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"


def load_simde() -> Optional[QKernel]:
    """The same source built for x86-64-v3 with SIMDe's portable AVX-512 / VNNI intrinsics
    and a plain-C stand-in of the AMX tile instructions (``csrc/qmm_isa.h``): every path
    runs on any x86-64 CPU with AVX2, for tests of the paths the CPU lacks. None where
    SIMDe's headers (Debian's ``libsimde-dev``) or the compiler are missing
    (``load_simde_error()``)."""
    import os
    import platform

    from .keylist_attention import cached_load, compile_library

    def make() -> QKernel:
        if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists(SIMDE_HEADER):
            raise RuntimeError(f"no SIMDe headers ({SIMDE_HEADER}; Debian package libsimde-dev) "
                               "or not an x86-64 machine")
        lib, path = compile_library("qmm-simde", _SOURCE, _FLAGS + _SIMDE_FLAGS)
        return QKernel(lib, path, 0, build="simde")

    return cached_load(_simde_state, _lock, make)


def load_simde_error() -> str:
    return _simde_state.get("error", "")


def load_error() -> str:
    return _state.get("error", "")


def require() -> QKernel:
    k = load()
    if k is None:
        raise RuntimeError(f"the q kernels are not available here: {load_error()}")
    return k


@dataclass
class Part:
    """One GGUF tensor's rows: its type, shape [n, k] and raw bytes (a uint8 tensor, or a
    numpy array such as a view of the mapped file)."""

    type: int
    n: int
    k: int
    raw: object


REPACK_CHUNK = 32 << 20  # source bytes a repack step reads from a mapped file


def _repack_part(k: QKernel, p: Part, data: torch.Tensor, off: int) -> None:
    """``p``'s tiles into ``data`` at ``off``. A part that is a view of a mapped file is
    repacked ``REPACK_CHUNK`` bytes of rows at a time, each step's source pages dropped
    from this process once read (the file stays in the page cache): the load's peak
    memory is the tiles plus one step, not the tiles plus the file's pages read so far
    (for a large head, both of its copies at once)."""
    mm = getattr(p.raw, "_mmap", None)
    if mm is None or getattr(p.raw, "mode", None) != "r" or p.n <= 8:  # (dropped pages of a copy-on-write
        # mapping would lose what was written to them; a read-only one reads them back from the file)
        k.repack(p.type, p.raw, p.n, p.k, data[off: off + tile_bytes(p.type, p.n, p.k)])
        return
    import mmap

    import numpy as np

    rows = np.asarray(p.raw).reshape(p.n, -1)
    step = max(8, REPACK_CHUNK // max(1, rows.shape[1]) // 8 * 8)
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data  # where the mapping starts
    page = mmap.PAGESIZE
    for r0 in range(0, p.n, step):
        r1 = min(p.n, r0 + step)
        src = rows[r0:r1]
        a, b = tile_bytes(p.type, r0, p.k), tile_bytes(p.type, r1, p.k)
        k.repack(p.type, src, r1 - r0, p.k, data[off + a: off + b])
        lo = (src.ctypes.data - base) // page * page
        hi = min(len(mm), -(-(src.ctypes.data - base + src.nbytes) // page) * page)
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class QMatrix:
    """A weight [N, K] of GGUF blocks, one segment per part along the outputs (``Part``s of the
    same K), repacked into the kernel's tiles once."""

    def __init__(self, parts: Sequence[Part], kernel: Optional[QKernel] = None):
        k = kernel or require()
        if not parts or any(p.k != parts[0].k for p in parts):
            raise ValueError("QMatrix: parts must share their input size")
        self.kernel = k
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        self.types = [type_id(p.type) for p in parts]
        self.seg_rows = [p.n for p in parts]
        for p in parts:
            if type_id(p.type) not in TYPES:
                raise ValueError(f"the q kernels take {', '.join(TYPE_IDS)}, not GGML type {p.type}")
        sizes = [tile_bytes(p.type, p.n, p.k) for p in parts]
        self.offsets = [sum(sizes[:i]) for i in range(len(parts))]
        self.data = weights_buffer(sum(sizes))
        for p, off in zip(parts, self.offsets):  # each part repacked into its place
            _repack_part(k, p, self.data, off)
        self._bind()

    def rows_view(self, ranges: Sequence[tuple[int, int]]) -> "QMatrix":
        """A weight of this one's output rows in ``ranges`` ([start, end) pairs, ascending,
        each a multiple of 8 within one segment), sharing its bytes: ``mm`` gives those rows'
        outputs, concatenated."""
        v = object.__new__(QMatrix)
        v.kernel, v.in_features, v.data = self.kernel, self.in_features, self.data
        v.types, v.seg_rows, v.offsets = [], [], []
        base = 0
        bounds = [(sum(self.seg_rows[:i]), t, n, off) for i, (t, n, off) in
                  enumerate(zip(self.types, self.seg_rows, self.offsets))]
        for a, b in ranges:
            if a % 8 or b % 8 or not 0 <= a < b <= self.out_features or a < base:
                raise ValueError(f"rows_view: [{a}, {b}) must be ascending multiples of 8 within "
                                 f"{self.out_features} rows")
            seg = next((x for x in bounds if x[0] <= a and b <= x[0] + x[2]), None)
            if seg is None:
                raise ValueError(f"rows_view: [{a}, {b}) crosses a segment boundary")
            start, t, _, off = seg
            v.types.append(t)
            v.seg_rows.append(b - a)
            v.offsets.append(off + tile_bytes(t, a - start, self.in_features))
            base = b
        v.out_features = sum(v.seg_rows)
        v._bind()
        return v

    def compact(self, reuse: bool = False) -> "QMatrix":
        """This weight (a ``rows_view`` or the whole) in a buffer of its own: its segments'
        bytes side by side, so the weight it views can be freed. ``reuse``: moved to the
        front of the buffer it shares and the pages past them released (no second copy
        while both exist); the weight it views is garbage after that."""
        c = object.__new__(QMatrix)
        c.kernel, c.in_features, c.out_features = self.kernel, self.in_features, self.out_features
        c.types, c.seg_rows = list(self.types), list(self.seg_rows)
        sizes = [tile_bytes(t, n, self.in_features) for t, n in zip(self.types, self.seg_rows)]
        c.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        dst = self.data if reuse else weights_buffer(sum(sizes))
        for off, size, src in zip(c.offsets, sizes, self.offsets):  # off <= src: forwards
            if reuse and off == src:
                continue
            seg = self.data[src: src + size]
            dst[off: off + size].copy_(seg.clone() if reuse and src < off + size else seg)
        c.data = release_tail(dst, sum(sizes)) if reuse else dst
        c._bind()
        return c

    def _bind(self) -> None:
        self._segs = (_Seg * len(self.types))(*[_Seg(t, n, o) for t, n, o in zip(self.types, self.seg_rows,
                                                                                    self.offsets)])
        self.struct = _Mat(self.data.data_ptr(), self.in_features, len(self.types), self._segs)
        self.addr = ctypes.addressof(self.struct)

    @property
    def type_names(self) -> list[str]:
        return [TYPES[t][0] for t in self.types]

    def nbytes(self) -> int:
        return self.data.numel()

    def mm(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] bf16 or fp32 times the weight: [M, N] of ``out_dtype`` (bf16 or fp32)."""
        M, K = x.shape
        if K != self.in_features or x.dtype not in (torch.bfloat16, torch.float32) or \
                out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"q mm: unsupported input {tuple(x.shape)} {x.dtype} -> {out_dtype} for a "
                             f"[{self.out_features}, {self.in_features}] weight")
        x = x.contiguous()
        y = torch.empty(M, self.out_features, dtype=out_dtype)
        if M:
            s = self.kernel.scratch(M, K)
            if self.kernel.lib.qmm(x.data_ptr(), int(x.dtype == torch.bfloat16), M, self.addr,
                                   int(out_dtype == torch.bfloat16), s.data_ptr(), y.data_ptr()):
                raise ValueError(f"q mm refused the weight ({self.type_names})")
        return y

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Weight rows ``idx`` [...] as values [..., K] (fp32 or bf16)."""
        flat = idx.reshape(-1).to(torch.int64).contiguous()
        K = self.in_features
        out = torch.empty(flat.numel(), K, dtype=dtype)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row index out of range for {self.out_features} rows")
        base = 0
        for t, n, off in zip(self.types, self.seg_rows, self.offsets):
            sel = ((flat >= base) & (flat < base + n)).nonzero().reshape(-1)
            if sel.numel():
                loc = (flat[sel] - base).contiguous()
                part = torch.empty(sel.numel(), K, dtype=dtype)
                if self.kernel.lib.qrows(t, self.data.data_ptr() + off, K, loc.data_ptr(), loc.numel(),
                                         int(dtype == torch.bfloat16), part.data_ptr()):
                    raise ValueError("q rows refused the weight")
                out[sel] = part if len(self.types) > 1 else part
            base += n
        return out.reshape(*idx.shape, K)


def round_rows(x: torch.Tensor, form: str, kernel: Optional[QKernel] = None) -> torch.Tensor:
    """x [M, K] fp32 rounded to int8 blocks as the kernels round activations and back to
    values: ``form`` "32" (the 32-block types') or "256" (the K types')."""
    k = kernel or require()
    x = x.float().contiguous()
    M, K = x.shape
    out = torch.empty_like(x)
    s = k.scratch(M, K)
    if k.lib.qround(x.data_ptr(), M, K, {"32": 1, "256": 2}[form], s.data_ptr(), out.data_ptr()):
        raise ValueError(f"round_rows: K {K} is not a multiple of the {form}-input block")
    return out
