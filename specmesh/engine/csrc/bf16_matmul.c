
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

#include "row_passes.h"
#undef R_
    return 0;
}

/* AMX: the packed layout is already the B tiles' (16 input pairs x 16 outputs x 2 per
   32 inputs), so tiles load straight from the weights; one C tile per block of 16
   outputs accumulates the whole K (32 inputs a tdpbf16ps), up to 16 rows a pass; two
   blocks at a time. A C row depends on its A row only: a row's bits are its own (they
   differ from the AVX-512 path's, so a matrix uses one of the two for every call). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include "amx_preamble.h"
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

#include "avx2_common.h"
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

#include "avx2_passes.h"
#undef R_
    free(xf);
    return 0;
}
#else
int bf16_avx2(void) { return 0; }
int bf16_mm_avx2(const uint16_t* x, int64_t M, int64_t K, const uint16_t* P, int64_t N, uint16_t* y) { return 1; }
#endif
