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
AVX2 path, ``=torch`` the kernel off. Knows nothing about models.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

import torch

from .int4_matmul import AMX_PREAMBLE, AVX2_COMMON, AVX2_PASSES, ROW_PASSES

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MC 8  /* accumulator chains per pass: rows x blocks */

int bf16_available(void) { return 1; }

static inline __attribute__((always_inline)) void rows(const int mc, const int nbk, const uint16_t* x, int64_t K,
        const uint16_t* blk, int64_t bstride, uint16_t* y, int64_t N) {
    __m512 t[MC];
    for (int r = 0; r < nbk * mc; r++) t[r] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t p = 0; p < pairs; p++) {
        for (int b = 0; b < nbk; b++)  /* the next pass's blocks, a line a pair */
            _mm_prefetch((const char*)(blk + (nbk + b) * bstride + 32 * p), _MM_HINT_T0);
        for (int b = 0; b < nbk; b++) {
            const __m512i w = _mm512_loadu_si512((const void*)(blk + b * bstride + 32 * p));
            for (int r = 0; r < mc; r++) {
                uint32_t xp; memcpy(&xp, x + r * K + 2 * p, 4);
                t[b * mc + r] = _mm512_dpbf16_ps(t[b * mc + r], (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)xp));
            }
        }
    }
    for (int b = 0; b < nbk; b++)
        for (int r = 0; r < mc; r++) {  /* round to nearest even */
            __m512i u = _mm512_castps_si512(t[b * mc + r]);
            u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
            _mm256_storeu_si256((__m256i*)(y + r * N + 16 * b), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        }
}

/* y [M, N] bf16 = x [M, K] bf16 times the packed weight P [N/16, K/2, 16, 2] (pack()) */
int bf16_mm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) {
    const int64_t nb = N / 16, bstride = K * 16;
#define R_(m_, k_) rows(m_, k_, x + m0 * K, K, blk, bstride, y + m0 * N + b0 * 16, N)
/*ROW_PASSES*/
#undef R_
    return 0;
}

/* AMX: the packed layout is already the B tiles' (16 input pairs x 16 outputs x 2 per
   32 inputs), so tiles load straight from the weights; one C tile per block of 16
   outputs accumulates the whole K (32 inputs a tdpbf16ps), up to 16 rows a pass; two
   blocks at a time. A C row depends on its A row only: a row's bits are its own (they
   differ from the AVX-512 path's, so a matrix uses one of the two for every call). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/*AMX_PREAMBLE*/
int bf16_amx(void) { return 1; }
int bf16_amx_enable(void) { return amx_permission(); }

int bf16_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) {
    if (K % 32) return 1;
    const int64_t nb = N / 16, bstride = K * 16, chunks = K / 32;
    const int64_t nc = (M + 15) / 16;
    for (int64_t c = 0, m0 = 0; c < nc; c++) {
        const int64_t mc = M / nc + (c < M % nc);
        _Pragma("omp parallel")
        {
            tilecfg cfg; memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            cfg.rows[0] = (uint8_t)mc; cfg.colsb[0] = 64;   /* C, block 0 */
            cfg.rows[1] = (uint8_t)mc; cfg.colsb[1] = 64;   /* C, block 1 */
            cfg.rows[2] = (uint8_t)mc; cfg.colsb[2] = 64;   /* A: mc x 32 bf16 */
            cfg.rows[3] = 16; cfg.colsb[3] = 64;            /* B, block 0 */
            cfg.rows[4] = 16; cfg.colsb[4] = 64;            /* B, block 1 */
            _tile_loadconfig(&cfg);
            __attribute__((aligned(64))) float ct[2 * 16 * 16];
            const int64_t units = (nb + 1) / 2;
            _Pragma("omp for schedule(static)")
            for (int64_t un = 0; un < units; un++) {
                const int64_t b0 = 2 * un, two = b0 + 1 < nb;
                const uint16_t* xr = x + m0 * K;
                const uint16_t* B0 = P + b0 * bstride;
                _tile_zero(0);
                if (two) _tile_zero(1);
                for (int64_t ch = 0; ch < chunks; ch++) {
                    _tile_loadd(2, xr + 32 * ch, K * 2);
                    _tile_loadd(3, B0 + 512 * ch, 64);
                    _tile_dpbf16ps(0, 2, 3);
                    if (two) {
                        _tile_loadd(4, B0 + bstride + 512 * ch, 64);
                        _tile_dpbf16ps(1, 2, 4);
                    }
                }
                _tile_stored(0, ct, 64);
                if (two) _tile_stored(1, ct + 256, 64);
                for (int64_t b = 0; b <= two; b++)
                    for (int64_t r = 0; r < mc; r++) {
                        __m512i u = _mm512_castps_si512(_mm512_load_ps(ct + 256 * b + 16 * r));
                        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
                        _mm256_storeu_si256((__m256i*)(y + (m0 + r) * N + (b0 + b) * 16),
                                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
                    }
            }
            _tile_release();
        }
        m0 += mc;
    }
    return 0;
}
#else
int bf16_amx(void) { return 0; }
int bf16_amx_enable(void) { return 0; }
int bf16_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) { return 1; }
#endif
#else
int bf16_available(void) { return 0; }
int bf16_mm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) { return 1; }
int bf16_amx(void) { return 0; }
int bf16_amx_enable(void) { return 0; }
int bf16_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) { return 1; }
#endif

/* AVX2 + FMA (x86 CPUs without AVX-512 BF16), on the same packed layout: half a block's
   pair (8 outputs x 2 weights, 32 bytes) gives the even inputs' weights as v << 16 and
   the odd ones' as v & 0xFFFF0000, in fp32 exactly. Per row and output, one fp32 chain
   over the input pairs in order: t = fma(x_odd, w_odd, t), then t = fma(x_even, w_even, t)
   (vdpbf16ps's order in Intel's pseudocode; bf16 products are exact in fp32, so each step
   rounds once), rounded once to bf16. A row's bits are its own. (Whether they equal the
   AVX-512 path's is not checked: no machine here had both.) The rows are converted to
   fp32 once per call. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdlib.h>
/*AVX2_COMMON*/
int bf16_avx2(void) { return 1; }

static inline __attribute__((always_inline)) void rows_avx2(const int mc, const int nbk, const float* xf, int64_t K,
        const uint16_t* blk, int64_t bstride, uint16_t* y, int64_t N) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 t[8];
    for (int r = 0; r < 2 * nbk * mc; r++) t[r] = _mm256_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t p = 0; p < pairs; p++) {
        for (int b = 0; b < nbk; b++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + b * bstride + 32 * p + 16 * h));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
                for (int r = 0; r < mc; r++) {
                    __m256* tt = t + 2 * (b * mc + r) + h;
                    *tt = _mm256_fmadd_ps(_mm256_broadcast_ss(xf + r * K + 2 * p), we,
                                          _mm256_fmadd_ps(_mm256_broadcast_ss(xf + r * K + 2 * p + 1), wo, *tt));
                }
            }
    }
    for (int b = 0; b < nbk; b++)
        for (int r = 0; r < mc; r++)
            for (int h = 0; h < 2; h++) store8_bf16(y + r * N + 16 * b + 8 * h, t[2 * (b * mc + r) + h]);
}

int bf16_mm_avx2(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) {
    const int64_t nb = N / 16, bstride = K * 16;
    float* xf = (float*)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xf) return 2;
    for (int64_t i = 0; i < M * K; i++) { uint32_t u = (uint32_t)x[i] << 16; memcpy(xf + i, &u, 4); }
#define R_(m_, k_) rows_avx2(m_, k_, xf + m0 * K, K, P + b0 * bstride, bstride, y + m0 * N + b0 * 16, N)
/*AVX2_PASSES*/
#undef R_
    free(xf);
    return 0;
}
#else
int bf16_avx2(void) { return 0; }
int bf16_mm_avx2(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) { return 1; }
#endif
""".replace("/*ROW_PASSES*/", ROW_PASSES).replace("/*AMX_PREAMBLE*/", AMX_PREAMBLE) \
    .replace("/*AVX2_COMMON*/", AVX2_COMMON).replace("/*AVX2_PASSES*/", AVX2_PASSES)

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
        return w.to(torch.bfloat16).reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()

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
