
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* every int4 matmul's group input sums xs [M, G]: each row's bf16 inputs of a group
   summed in fp32, in input order */
static void group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t G, int64_t group, float* xs) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float a = 0.0f;
            for (int64_t i = 0; i < group; i++) {
                uint32_t u = (uint32_t)x[m * K + g * group + i] << 16; float f; memcpy(&f, &u, 4);
                a += f;
            }
            xs[m * G + g] = a;
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MC 8  /* rows per pass over a block's weights */

int int4_available(void) { return 1; }

/* 16 bytes of nibble pairs -> 32 bf16 values q - 8, in the pair order dpbf16 takes. Byte j
   in dword j; d | d << 12 puts its low nibble in bits 0-3 of word 2j and its high one in
   bits 0-3 of word 2j + 1. vpermw reads 5 index bits: the table's two halves are equal, so
   the fifth bit (word 2j's: the high nibble's lowest) and the bits above need no mask. */
static inline __m512i unpack(const uint8_t* p, __m512i table) {
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
}

/* a group's 16 scales and 16 zeros (bf16, after its group * 8 bytes of nibbles) as fp32 */
static inline void scale_zero(const uint8_t* gb, int64_t group, __m512* s, __m512* z) {
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(gb + group * 8))), 16));
    *z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(gb + group * 8 + 32))), 16));
}

/* 16 fp32 sums to bf16 at y, rounded to nearest even */
static inline void store_bf16(uint16_t* y, __m512 a) {
    __m512i u = _mm512_castps_si512(a);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_storeu_si256((__m256i*)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* one output vector's group term, the same in every int4 matmul (their bits depend on
   it): acc + t_g s_g, then + z_g sum_g x */
static inline __m512 add_group(__m512 acc, __m512 t, __m512 s, __m512 z, float xsum) {
    return _mm512_fmadd_ps(z, _mm512_set1_ps(xsum), _mm512_fmadd_ps(t, s, acc));
}

/* group g's sums t [nbk * mc] (block-major) into acc, for nbk blocks of mc rows */
static inline __attribute__((always_inline)) void add_groups(const int mc, const int nbk, __m512* acc,
        const __m512* t, const uint8_t* gb0, int64_t bstride, int64_t group, const float* xs, int64_t G, int64_t g) {
    for (int b = 0; b < nbk; b++) {
        __m512 s, z;
        scale_zero(gb0 + b * bstride, group, &s, &z);
        for (int r = 0; r < mc; r++) acc[b * mc + r] = add_group(acc[b * mc + r], t[b * mc + r], s, z, xs[r * G + g]);
    }
}

/* acc [nbk * mc] to rows of y (row stride N), block b at outputs 16 b */
static inline __attribute__((always_inline)) void store_rows(const int mc, const int nbk, const __m512* acc,
                                                             uint16_t* y, int64_t N) {
    for (int b = 0; b < nbk; b++)
        for (int r = 0; r < mc; r++) store_bf16(y + r * N + 16 * b, acc[b * mc + r]);
}

/* mc rows times nbk consecutive blocks of 16 outputs: nbk * mc independent accumulator
   chains (few rows alone would wait on one dpbf16 chain's latency); each output's sum is
   the same sequence of operations whatever mc and nbk */
static inline __attribute__((always_inline)) void rows(const int mc, const int nbk, const uint16_t* x, int64_t K,
        const float* xs, int64_t G, const uint8_t* blk, int64_t bstride, int64_t gstride, int64_t group,
        __m512i table, uint16_t* y, int64_t N) {
    __m512 acc[MC];
    for (int r = 0; r < nbk * mc; r++) acc[r] = _mm512_setzero_ps();
    const int64_t pairs = group / 2;
    for (int64_t g = 0; g < G; g++) {
        __m512 t[MC];
        for (int r = 0; r < nbk * mc; r++) t[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t k = g * group + 2 * p;
            if (!(p & 3))  /* the next pass's blocks, while these are read */
                for (int b = 0; b < nbk; b++)
                    _mm_prefetch((const char*)(blk + (nbk + b) * bstride + g * gstride + 16 * p), _MM_HINT_T0);
            for (int b = 0; b < nbk; b++) {
                const __m512i w = unpack(blk + b * bstride + g * gstride + 16 * p, table);
                for (int r = 0; r < mc; r++) {
                    uint32_t xp; memcpy(&xp, x + r * K + k, 4);
                    t[b * mc + r] = _mm512_dpbf16_ps(t[b * mc + r], (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)xp));
                }
            }
        }
        add_groups(mc, nbk, acc, t, blk + g * gstride, bstride, group, xs, G, g);
    }
    store_rows(mc, nbk, acc, y, N);
}

/* Both matmuls' first step: each row's group input sums xs [M, G] (fp32, in input order),
   and the unpacking table (bf16 of i - 8, exact) */
static __m512i prologue(const uint16_t* x, int64_t M, int64_t K, int64_t G, int64_t group, float* xs) {
    group_sums(x, M, K, G, group, xs);
    uint16_t tw[32];
    for (int i = 0; i < 32; i++) {
        float f = (float)((i & 15) - 8); uint32_t u; memcpy(&u, &f, 4); tw[i] = (uint16_t)(u >> 16);
    }
    __m512i table; memcpy(&table, tw, 64);
    return table;
}

/* y [M, N] bf16 = x [M, K] bf16 times the packed weight (pack()); xs: scratch [M, G] fp32 */
int int4_mm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
            float* xs, uint16_t* y) {
    const int64_t G = K / group, gstride = group * 8 + 64, nb = N / 16, bstride = G * gstride;
    const __m512i table = prologue(x, M, K, G, group, xs);
#define R_(m_, k_) rows(m_, k_, x + m0 * K, K, xs + m0 * G, G, blk, bstride, gstride, group, table, \
                        y + m0 * N + b0 * 16, N)

#include "row_passes.h"
#undef R_
    return 0;
}


/* AMX (Intel): a block's group of 32 inputs unpacked once into a B tile (16 input pairs x
   16 outputs, the dpbf16 pair order is the tile's VNNI layout) and multiplied into up to
   16 rows at once with one tdpbf16ps; the group's sum t_g (M x 16 fp32, from the tile)
   then enters acc as in the AVX-512 path. Each C row depends on its own A row only, so a
   row's bits do not depend on the others; they differ from the AVX-512 path's (the
   tile's own order of the 32 products), so one process uses one of the two. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include "amx_preamble.h"
int int4_amx(void) { return 1; }
int int4_amx_enable(void) { return amx_permission(); }

/* tdpbf16ps, as the hardware computes it (measured on an Intel Xeon with AMX-BF16,
   scripts/amx_order.py; the form of the SDM's pseudocode): per output, the even and the
   odd products of the 16 pairs in two fp32 FMA chains from zero, then dst + (even + odd),
   each step rounded to nearest even. So a tile's result can be reproduced with AVX-512
   FMAs: rows_amxe does that for few rows, where the tile's round trip through memory
   costs more than the products (a call of at most amx_few_rows rows takes this path,
   bitwise the same as the tiles). The one difference left: the tiles flush denormals
   (below 1.2e-38), these FMAs keep them; with integer weights -8..7 and normalised
   activations no sum comes near that range. x: the rows in fp32 (exact copies of the bf16
   inputs, made once a call), so each FMA takes its input as a broadcast operand from memory
   (two shuffles a pair fewer than widening the bf16 pair in registers: ~1.06x one-row
   forwards). */
static inline __attribute__((always_inline)) void rows_amxe(const int mc, const int nbk, const float* x,
        int64_t K, const float* xs, int64_t G, const uint8_t* blk, int64_t bstride, int64_t gstride,
        int64_t group, uint16_t* y, int64_t N) {
    __m512 acc[MC];
    for (int r = 0; r < nbk * mc; r++) acc[r] = _mm512_setzero_ps();
    const int64_t chunks = group / 32;
    /* q - 8 as fp32 for q = 0..15, looked up: vpermps reads an index's low 4 bits only, so a
       byte's low nibble needs no mask and its high one a shift. Per block and input pair that
       is the byte expansion, two lookups and a shift, where masks, subtractions and
       conversions took seven operations: the same values, one-row int4 forwards ~1.2x faster
       (this path is bound by its instructions, not by the memory) */
    const __m512 wtab = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    for (int64_t g = 0; g < G; g++) {
        __m512 c[MC];  /* the C tile: the group's chunks added in order */
        for (int r = 0; r < nbk * mc; r++) c[r] = _mm512_setzero_ps();
        for (int64_t ch = 0; ch < chunks; ch++) {
            __m512 ev[MC], od[MC];
            for (int r = 0; r < nbk * mc; r++) { ev[r] = _mm512_setzero_ps(); od[r] = _mm512_setzero_ps(); }
            for (int p = 0; p < 16; p++) {
                const int64_t q = ch * 16 + p, k = g * group + 2 * q;
                if (!(p & 3))  /* the next pass's blocks, while these are read */
                    for (int b = 0; b < nbk; b++)
                        _mm_prefetch((const char*)(blk + (nbk + b) * bstride + g * gstride + 16 * q), _MM_HINT_T0);
                for (int b = 0; b < nbk; b++) {
                    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + b * bstride + g * gstride + 16 * q)));
                    const __m512 we = _mm512_permutexvar_ps(d, wtab);
                    const __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), wtab);
                    for (int r = 0; r < mc; r++) {
                        const __m512 xe = _mm512_set1_ps(x[r * K + k]), xo = _mm512_set1_ps(x[r * K + k + 1]);
                        ev[b * mc + r] = _mm512_fmadd_ps(xe, we, ev[b * mc + r]);
                        od[b * mc + r] = _mm512_fmadd_ps(xo, wo, od[b * mc + r]);
                    }
                }
            }
            for (int r = 0; r < nbk * mc; r++) c[r] = _mm512_add_ps(c[r], _mm512_add_ps(ev[r], od[r]));
        }
        add_groups(mc, nbk, acc, c, blk + g * gstride, bstride, group, xs, G, g);  /* then as the tile path */
    }
    store_rows(mc, nbk, acc, y, N);
}

/* the tiles' work, shared by one pass (at most 16 rows) and several: unpack ng groups of a
   block (from g0) into bt, prefetching a later block's weights meanwhile */
static inline void unpack_groups(const uint8_t* blk, int64_t g0, int64_t ng, int64_t gstride, int64_t bstride,
                                 int64_t chunks, __m512i table, uint16_t* bt) {
    for (int64_t i = 0; i < ng; i++) {
        const uint8_t* gb = blk + (g0 + i) * gstride;
        for (int64_t q = 0; q < 16 * chunks; q += 4)  /* the weights of a later block */
            _mm_prefetch((const char*)(gb + 2 * bstride + 16 * q), _MM_HINT_T0);
        for (int64_t q = 0; q < 16 * chunks; q++)
            _mm512_store_si512((__m512i*)(bt + 32 * (i * 16 * chunks + q)), unpack(gb + 16 * q, table));
    }
}
/* each of ng groups' sums (rows xp, from group g0) into ct, 256 floats a group: the rows
   times the unpacked B tiles, the two tile sets alternating so one group's work overlaps
   the next's */
static inline void tile_groups(const uint16_t* xp, int64_t K, int64_t g0, int64_t ng, int64_t group, int64_t chunks,
                               const uint16_t* bt, float* ct) {
    for (int64_t i = 0; i < ng; i++) {
        const uint16_t* xg = xp + (g0 + i) * group;
        const uint16_t* bg = bt + 512 * chunks * i;
#define TILE_GROUP(C_, A_, B_)                                                                    \
        _tile_zero(C_);                                                                           \
        for (int64_t ch = 0; ch < chunks; ch++) {                                                 \
            _tile_loadd(A_, xg + 32 * ch, K * 2);                                                 \
            _tile_loadd(B_, bg + 512 * ch, 64);                                                   \
            _tile_dpbf16ps(C_, A_, B_);                                                           \
        }                                                                                         \
        _tile_stored(C_, ct + 256 * i, 64);
        if (i & 1) { TILE_GROUP(3, 4, 5) } else { TILE_GROUP(0, 1, 2) }
#undef TILE_GROUP
    }
}
/* the tile configuration: two sets of C (rows x 16 fp32), A (rows x 32 bf16), B (16 pairs x
   16 outputs x 2) */
static inline void tile_config(int64_t rows) {
    tilecfg cfg; memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) {
        cfg.rows[3 * t] = (uint8_t)rows; cfg.colsb[3 * t] = 64;
        cfg.rows[3 * t + 1] = (uint8_t)rows; cfg.colsb[3 * t + 1] = 64;
        cfg.rows[3 * t + 2] = 16; cfg.colsb[3 * t + 2] = 64;
    }
    _tile_loadconfig(&cfg);
}
enum { GC = 8 };  /* groups unpacked at a time: their B tiles stay within L1 */

/* More than a tile's 16 rows (a prompt, a large tree): passes of 16 rows, each block's
   groups unpacked once for all of them (their sums wait in acc, M x 16 fp32 a thread;
   one pass at a time unpacked the whole matrix again for every 16 rows: 1.2-1.6x slower
   at 64-500 rows, measured side by side, about even at 17); the last pass reads its rows from a copy
   padded with zero rows, so its tiles have 16 rows too. A C row depends on its A row
   only, so the bits are those of any other split into passes. */
static int amx_many_rows(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                         const float* xs, uint16_t* y, __m512i table) {
    const int64_t G = K / group, gstride = group * 8 + 64, nb = N / 16, bstride = G * gstride, chunks = group / 32;
    const int64_t np = (M + 15) / 16, tail = M - 16 * (np - 1);  /* passes; rows of the last */
    uint16_t* xpad = (uint16_t*)calloc((size_t)(16 * K), sizeof(uint16_t));
    if (!xpad) return 2;
    memcpy(xpad, x + 16 * (np - 1) * K, sizeof(uint16_t) * (size_t)(tail * K));
    int failed = 0;
    _Pragma("omp parallel")
    {
        tile_config(16);
        uint16_t* bt = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 512 * GC * chunks);
        float* ct = (float*)aligned_alloc(64, sizeof(float) * 256 * GC);
        __m512* acc = (__m512*)aligned_alloc(64, sizeof(__m512) * (size_t)(16 * np));
        if (!bt || !ct || !acc) { _Pragma("omp atomic write") failed = 1; }
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < nb; b++) {
            if (!bt || !ct || !acc) continue;
            const uint8_t* blk = P + b * bstride;
            for (int64_t r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < G; g0 += GC) {
                const int64_t ng = G - g0 < GC ? G - g0 : GC;
                unpack_groups(blk, g0, ng, gstride, bstride, chunks, table, bt);
                __m512 s[GC], z[GC];
                for (int64_t i = 0; i < ng; i++) scale_zero(blk + (g0 + i) * gstride, group, &s[i], &z[i]);
                for (int64_t p = 0; p < np; p++) {
                    tile_groups(p < np - 1 ? x + 16 * p * K : xpad, K, g0, ng, group, chunks, bt, ct);
                    const int64_t rows = p < np - 1 ? 16 : tail;
                    for (int64_t r = 0; r < rows; r++) {  /* the groups in order, as in every int4 matmul */
                        __m512 a = acc[16 * p + r];
                        for (int64_t i = 0; i < ng; i++)
                            a = add_group(a, _mm512_load_ps(ct + 256 * i + 16 * r), s[i], z[i], xs[(16 * p + r) * G + g0 + i]);
                        acc[16 * p + r] = a;
                    }
                }
            }
            for (int64_t r = 0; r < M; r++) store_bf16(y + r * N + b * 16, acc[r]);
        }
        free(bt); free(ct); free(acc);
        _tile_release();
    }
    free(xpad);
    return failed ? 2 : 0;
}

/* calls of at most this many rows take rows_amxe: two rows on it were 1.07-1.45x faster
   whole forwards than on the tiles (in-process A/B, docs/int4.md); from three the tiles win */
static int amx_few_rows = 2;
int int4_amx_few_rows(int n) { int old = amx_few_rows; if (n >= 0) amx_few_rows = n; return old; }

int int4_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                float* xs, uint16_t* y) {
    const int64_t G = K / group, gstride = group * 8 + 64, nb = N / 16, bstride = G * gstride, chunks = group / 32;
    const __m512i table = prologue(x, M, K, G, group, xs);
    if (M <= amx_few_rows) {
        /* the rows in fp32 (exact), read by the FMAs as broadcast operands */
        float* xf = (float*)malloc(sizeof(float) * (size_t)(M * K));
        if (!xf) return 2;
        for (int64_t i = 0; i < M * K; i++) { uint32_t u = (uint32_t)x[i] << 16; memcpy(xf + i, &u, 4); }
#define R_(m_, k_) rows_amxe(m_, k_, xf + m0 * K, K, xs + m0 * G, G, blk, bstride, gstride, group, \
                             y + m0 * N + b0 * 16, N)

#include "row_passes.h"
#undef R_
        free(xf);
        return 0;
    }
    if (M > 16) return amx_many_rows(x, M, K, P, N, group, xs, y, table);
    int failed = 0;  /* one pass of M rows */
    _Pragma("omp parallel")
    {
        tile_config(M);
        /* per thread: the unpacked B tiles of GC groups of a block (all written before any
           is loaded) and those groups' sums */
        uint16_t* bt = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 512 * GC * chunks);
        float* ct = (float*)aligned_alloc(64, sizeof(float) * 256 * GC);
        if (!bt || !ct) { _Pragma("omp atomic write") failed = 1; }
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < nb; b++) {
            if (!bt || !ct) continue;
            const uint8_t* blk = P + b * bstride;
            __m512 acc[16];
            for (int64_t r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < G; g0 += GC) {
                const int64_t ng = G - g0 < GC ? G - g0 : GC;
                unpack_groups(blk, g0, ng, gstride, bstride, chunks, table, bt);
                tile_groups(x, K, g0, ng, group, chunks, bt, ct);
                for (int64_t i = 0; i < ng; i++) {
                    const int64_t g = g0 + i;
                    __m512 s, z;
                    scale_zero(blk + g * gstride, group, &s, &z);
                    for (int64_t r = 0; r < M; r++)
                        acc[r] = add_group(acc[r], _mm512_load_ps(ct + 256 * i + 16 * r), s, z, xs[r * G + g]);
                }
            }
            for (int64_t r = 0; r < M; r++) store_bf16(y + r * N + b * 16, acc[r]);
        }
        free(bt); free(ct);
        _tile_release();
    }
    return failed ? 2 : 0;
}
#else
int int4_amx(void) { return 0; }
int int4_amx_enable(void) { return 0; }
int int4_amx_few_rows(int n) { return 0; }
int int4_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                float* xs, uint16_t* y) { return 1; }
#endif

#else
int int4_available(void) { return 0; }
int int4_mm(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
            float* xs, uint16_t* y) { return 1; }
int int4_amx(void) { return 0; }
int int4_amx_enable(void) { return 0; }
int int4_amx_few_rows(int n) { return 0; }
int int4_mm_amx(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                float* xs, uint16_t* y) { return 1; }
#endif

/* AVX2 + FMA (x86 CPUs without AVX-512 BF16). Its own layout (``pack(isa="avx2")``), so
   that unpacking needs no shuffles: per block of 16 outputs, group and 8 inputs, two
   halves of 8 outputs, 32 bytes each, dword l holding output l's 8 nibbles (input i at
   bits 4i), then the 16 scales and 16 zeros as in the AVX-512 layout (the same size).
   Input i's weights of a half are (v & 0xF << 4i) = q 16^i, as fp32 exactly, and meet
   x 16^-i (the rows, scaled once per call; exact for |x| >= 2^-95), so each product is
   the exact x q; the last input uses v >> 28. Per row, output and group:
   t = sum x_i q_i, one fp32 FMA per input in input order, then acc = fma(t, s, acc) and
   acc = fma(z - 8 s, sum_g x, acc) (z - 8 s is exact in fp32): the same weights
   (q - 8) s + z, summed in another order than the AVX-512 matmul (other bits; one
   process uses one kernel). A row's sums never depend on the other rows or the pass
   shape, so a row's bits are its own. */
#if defined(__AVX2__) && defined(__FMA__)

#include "avx2_common.h"
int int4_avx2(void) { return 1; }

/* half h's 8 scales and 8 zeros of a group (bf16, after its group * 8 bytes) as fp32 */
static inline void scale_zero8(const uint8_t* gb, int64_t group, int h, __m256* s, __m256* z) {
    *s = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(gb + group * 8 + 16 * h))), 16));
    *z = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(gb + group * 8 + 32 + 16 * h))), 16));
}

/* the mc rows x nbk blocks of 2 x 8 accumulators to bf16 outputs */
static inline __attribute__((always_inline)) void store_rows8(const int mc, const int nbk, const __m256* acc,
        uint16_t* y, int64_t N) {
    for (int b = 0; b < nbk; b++)
        for (int r = 0; r < mc; r++)
            for (int h = 0; h < 2; h++) store8_bf16(y + r * N + 16 * b + 8 * h, acc[2 * (b * mc + r) + h]);
}

/* mc rows times nbk blocks of 16 outputs: 2 * nbk * mc accumulators of 8 outputs */
static inline __attribute__((always_inline)) void rows_avx2(const int mc, const int nbk, const float* xf,
        int64_t K, const float* xs, int64_t G, const uint8_t* blk, int64_t bstride, int64_t gstride,
        int64_t group, uint16_t* y, int64_t N) {
    __m256 acc[8];
    for (int r = 0; r < 2 * nbk * mc; r++) acc[r] = _mm256_setzero_ps();
    const int64_t chunks = group / 8;
    for (int64_t g = 0; g < G; g++) {
        __m256 t[8];
        for (int r = 0; r < 2 * nbk * mc; r++) t[r] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t k = g * group + 8 * c;
            const uint8_t* cb = blk + g * gstride + 64 * c;
            for (int i = 0; i < 8; i++) {
                __m256 xb[4];
                for (int r = 0; r < mc; r++) xb[r] = _mm256_broadcast_ss(xf + r * K + k + i);
                for (int b = 0; b < nbk; b++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(cb + b * bstride + 32 * h));
                        const __m256 w = _mm256_cvtepi32_ps(i < 7 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * i)))
                                                                  : _mm256_srli_epi32(v, 28));
                        for (int r = 0; r < mc; r++) {
                            __m256* tt = t + 2 * (b * mc + r) + h;
                            *tt = _mm256_fmadd_ps(xb[r], w, *tt);
                        }
                    }
            }
        }
        for (int b = 0; b < nbk; b++) {
            const uint8_t* gb = blk + b * bstride + g * gstride;
            for (int h = 0; h < 2; h++) {
                __m256 sc, z;
                scale_zero8(gb, group, h, &sc, &z);
                const __m256 lo = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sc, z);  /* z - 8 s, exact */
                for (int r = 0; r < mc; r++) {
                    const int j = 2 * (b * mc + r) + h;
                    acc[j] = _mm256_fmadd_ps(lo, _mm256_set1_ps(xs[r * G + g]), _mm256_fmadd_ps(t[j], sc, acc[j]));
                }
            }
        }
    }
    store_rows8(mc, nbk, acc, y, N);
}

int int4_mm_avx2(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                 float* xs, uint16_t* y) {
    if (group % 8) return 1;
    const int64_t G = K / group, gstride = group * 8 + 64, nb = N / 16, bstride = G * gstride;
    float* xf = (float*)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xf) return 2;
    for (int64_t i = 0; i < M * K; i++) {  /* x 16^-(i mod 8), the last input of 8 as it is */
        uint32_t u = (uint32_t)x[i] << 16; float f; memcpy(&f, &u, 4);
        static const float sc[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
        xf[i] = f * sc[i & 7];
    }
    group_sums(x, M, K, G, group, xs);
#define R_(m_, k_) rows_avx2(m_, k_, xf + m0 * K, K, xs + m0 * G, G, P + b0 * bstride, bstride, gstride, group, \
                             y + m0 * N + b0 * 16, N)

#include "avx2_passes.h"
#undef R_
    free(xf);
    return 0;
}

/* AVX2 with int8 activations (W4A8, the arithmetic of llama.cpp's Q4 x Q8 dot products on
   these CPUs; ``pack(isa="avx2q8")`` is the AVX2 layout). The fp32 FMA path above is bound
   by the FMAs' throughput past a few rows (an 8-row call of SmolLM2's head costs ~5 one-row
   calls); vpmaddubsw does 32 multiplies where an FMA does 8. Per row and block of 32
   inputs a: d_a = max|x| / 127 and x_q = round(x 127 / max|x|) (nearest even; 0 where the
   block is 0), S_a = sum x_q, all exact integers below; per output and group g:
   T_a = sum (q_i - 8) x_q,i = sum q_i x_q,i - 8 S_a (vpmaddubsw pairs, exact in int16:
   |sum| <= 4 * 2 * 2 * 15 * 127 < 2^15 per lane, then vpmaddwd), t = fma(T_a, d_a, t) over
   the group's blocks in order (t = 0 first), then acc = fma(t, s, acc) and
   acc = fma(z, sum_g x, acc) with the group's exact fp32 input sum (group_sums): the weights
   (q - 8) s + z with only the scale term's inputs rounded to 8 bits. Every step is the
   row's own, so a row's bits are its own, whatever the rows and pass shape. */
#ifndef MC
#define MC 8
#endif
static inline __attribute__((always_inline)) void rows_avx2q8(const int mc, const int nbk, const int8_t* xq,
        int64_t K, const int32_t* sd, const float* xs, int64_t G, const uint8_t* blk,
        int64_t bstride, int64_t gstride, int64_t group, uint16_t* y, int64_t N) {
    const int64_t S = K / 32, subs = group / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2 * MC];
    for (int r = 0; r < 2 * nbk * mc; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < nbk; b++) {
            const uint8_t* gb = blk + b * bstride + g * gstride;
            for (int h = 0; h < 2; h++) {
                __m256 t[MC];
                for (int r = 0; r < mc; r++) t[r] = _mm256_setzero_ps();
                for (int64_t u = 0; u < subs; u++) {
                    const int64_t a = g * subs + u;
                    __m256i w[8];  /* chunk c's even inputs (0, 2, 4, 6) at 2c, odd ones at 2c + 1 */
                    for (int c = 0; c < 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(gb + 64 * (4 * u + c) + 32 * h));
                        w[2 * c] = _mm256_and_si256(v, m4);
                        w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for (int r = 0; r < mc; r++) {  /* one row at a time: its sum is one short tree */
                        const int8_t* p = xq + r * K + 32 * a;
                        __m256i m[8];
                        for (int j = 0; j < 8; j++) {
                            int32_t xw;
                            memcpy(&xw, p + 4 * j, 4);
                            m[j] = _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xw));
                        }
                        const __m256i s16 = _mm256_add_epi16(
                            _mm256_add_epi16(_mm256_add_epi16(m[0], m[1]), _mm256_add_epi16(m[2], m[3])),
                            _mm256_add_epi16(_mm256_add_epi16(m[4], m[5]), _mm256_add_epi16(m[6], m[7])));
                        const __m256i T = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones),
                                                           _mm256_load_si256((const __m256i*)(sd + 16 * (r * S + a))));
                        t[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T), _mm256_load_ps((const float*)(sd + 16 * (r * S + a) + 8)), t[r]);
                    }
                }
                __m256 sc, z;
                scale_zero8(gb, group, h, &sc, &z);
                for (int r = 0; r < mc; r++) {
                    const int j = 2 * (b * mc + r) + h;
                    acc[j] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs[r * G + g]), _mm256_fmadd_ps(t[r], sc, acc[j]));
                }
            }
        }
    store_rows8(mc, nbk, acc, y, N);
}

/* The same sums on AVX-512 VNNI, 16 outputs a vector: vpdpbusd adds four u8 x s8 products
   a lane into an int32, so a chunk of 8 inputs is two instructions where vpmaddubsw took
   four plus the adds. A chunk's dword l (v) holds output l's nibbles; v & 0x0F0F0F0F has its
   inputs 0, 2, 4, 6 in bytes 0-3 and (v >> 4) & 0x0F0F0F0F its inputs 1, 3, 5, 7, the order
   quantize_row_q8 stores the inputs in. The sums are the integers T_a of rows_avx2q8 (exact
   in any order), then the same fp32 steps in the same order on 16 lanes (add_group is
   fma(z, sum_g x, fma(t, s, acc))), rounded alike: the same bits as rows_avx2q8 (tested).
   ``int4_q8_vnni(0)`` runs rows_avx2q8 instead (tests). */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
static int q8_vnni = 1;
int int4_q8_vnni(int on) { int old = q8_vnni; if (on >= 0) q8_vnni = on; return old; }
static inline __attribute__((always_inline)) void rows_q8_vnni(const int mc, const int nbk, const int8_t* xq,
        int64_t K, const int32_t* sd, const float* xs, int64_t G, const uint8_t* blk,
        int64_t bstride, int64_t gstride, int64_t group, uint16_t* y, int64_t N) {
    const int64_t S = K / 32, subs = group / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MC];
    for (int r = 0; r < nbk * mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < nbk; b++) {
            const uint8_t* gb = blk + b * bstride + g * gstride;
            if (b == 0)  /* the next pass's blocks, while these are read */
                for (int i = 0; i < nbk; i++)
                    for (int64_t o = 0; o < gstride; o += 64)
                        _mm_prefetch((const char*)(gb + (nbk + i) * bstride + o), _MM_HINT_T0);
            __m512 t[MC];
            for (int r = 0; r < mc; r++) t[r] = _mm512_setzero_ps();
            for (int64_t u = 0; u < subs; u++) {
                const int64_t a = g * subs + u;
                __m512i w[8];  /* chunk c's even inputs at 2c, its odd ones at 2c + 1 */
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512((const void*)(gb + 64 * (4 * u + c)));
                    w[2 * c] = _mm512_and_si512(v, m4);
                    w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
                for (int r = 0; r < mc; r++) {
                    const int8_t* p = xq + r * K + 32 * a;
                    __m512i T0 = _mm512_setzero_si512(), T1 = _mm512_setzero_si512();
                    for (int c = 0; c < 4; c++) {
                        int32_t e, o;
                        memcpy(&e, p + 8 * c, 4);
                        memcpy(&o, p + 8 * c + 4, 4);
                        T0 = _mm512_dpbusd_epi32(T0, w[2 * c], _mm512_set1_epi32(e));
                        T1 = _mm512_dpbusd_epi32(T1, w[2 * c + 1], _mm512_set1_epi32(o));
                    }
                    const int32_t* q = sd + 16 * (r * S + a);  /* 8 S, then d */
                    float d;
                    memcpy(&d, q + 8, 4);
                    const __m512i T = _mm512_sub_epi32(_mm512_add_epi32(T0, T1), _mm512_set1_epi32(q[0]));
                    t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(T), _mm512_set1_ps(d), t[r]);
                }
            }
            __m512 sc, z;
            scale_zero(gb, group, &sc, &z);
            for (int r = 0; r < mc; r++) acc[b * mc + r] = add_group(acc[b * mc + r], t[r], sc, z, xs[r * G + g]);
        }
    store_rows(mc, nbk, acc, y, N);
}
#else
int int4_q8_vnni(int on) { return 0; }
#endif

/* a row's bf16 inputs [K] to int8 in blocks of 32 (each 8 stored as inputs 0, 2, 4, 6, 1, 3,
   5, 7: the order rows_avx2q8 broadcasts them in), the blocks' scales d and sums S */
static void quantize_row_q8(const uint16_t* x, int64_t K, int8_t* q, int32_t* sd) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t a = 0; a < K / 32; a++) {
        __m256 f[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            f[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(x + 32 * a + 8 * j))), 16));
            m = _mm256_max_ps(m, _mm256_and_ps(f[j], nosign));
        }
        float mx[8], amax = 0.0f;
        _mm256_storeu_ps(mx, m);
        for (int i = 0; i < 8; i++) amax = mx[i] > amax ? mx[i] : amax;
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float d = amax / 127.0f;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], _mm256_set1_ps(id)));  /* nearest even */
            sum = _mm256_add_epi32(sum, v);
            const __m256i w = _mm256_permutevar8x32_epi32(v, perm);
            const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(w, w), _mm256_packs_epi32(w, w));
            const int32_t l = _mm_cvtsi128_si32(_mm256_castsi256_si128(b8)),
                          u = _mm_cvtsi128_si32(_mm256_extracti128_si256(b8, 1));
            memcpy(q + 32 * a + 8 * j, &l, 4);
            memcpy(q + 32 * a + 8 * j + 4, &u, 4);
        }
        int32_t ss[8], tot = 0;
        _mm256_storeu_si256((__m256i*)ss, sum);
        for (int i = 0; i < 8; i++) tot += ss[i];
        _mm256_store_si256((__m256i*)(sd + 16 * a), _mm256_set1_epi32(8 * tot));  /* 8 S, then d, 8 lanes each */
        _mm256_store_ps((float*)(sd + 16 * a + 8), _mm256_set1_ps(d));
    }
}

int int4_mm_avx2q8(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                   float* xs, uint16_t* y) {
    if (group % 32) return 1;
    const int64_t G = K / group, gstride = group * 8 + 64, nb = N / 16, bstride = G * gstride, S = K / 32;
    const size_t rows = (size_t)(M > 0 ? M : 1);
    /* per row: its blocks' (8 S, d) as two vectors of 8 lanes, then its int8 inputs */
    char* buf = (char*)aligned_alloc(32, rows * (size_t)S * 64 + rows * (size_t)K + 32);
    if (!buf) return 2;
    int32_t* sd = (int32_t*)buf;
    int8_t* xq = (int8_t*)(buf + rows * (size_t)S * 64);
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * K, K, xq + m * K, sd + m * S * 16);
    group_sums(x, M, K, G, group, xs);
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (q8_vnni) {
#define R_(m_, k_) rows_q8_vnni(m_, k_, xq + m0 * K, K, sd + m0 * S * 16, xs + m0 * G, G, blk, bstride, gstride, \
                                group, y + m0 * N + b0 * 16, N)

#include "row_passes.h"
#undef R_
        free(buf);
        return 0;
    }
#endif
#define R_(m_, k_) rows_avx2q8(m_, k_, xq + m0 * K, K, sd + m0 * S * 16, xs + m0 * G, G, blk, bstride, gstride, \
                               group, y + m0 * N + b0 * 16, N)

#include "row_passes.h"
#undef R_
    free(buf);
    return 0;
}
#else
int int4_avx2(void) { return 0; }
int int4_mm_avx2(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                 float* xs, uint16_t* y) { return 1; }
int int4_mm_avx2q8(const uint16_t* x, int64_t M, int64_t K, const uint8_t* P, int64_t N, int64_t group,
                   float* xs, uint16_t* y) { return 1; }
int int4_q8_vnni(int on) { return 0; }
#endif

/* The screen head's logits: lg bf16 [n, V] (the int4 head's) -> out fp32 [n, V], each row's
   k largest (ties: the lower index) recomputed exactly as hn . table[v] (fp32 hidden [n, H]),
   summed in input order: table bf16 [V, H] (the tied embedding; scales NULL), or int8 [V, H]
   times its row's bf16 scale (an untied head's int8 copy). k <= 256. */
int screen_refine(const uint16_t* lg, int64_t n, int64_t V, const float* hn, const void* table,
                  const uint16_t* scales, int64_t H, int64_t k, float* out) {
    if (k < 1 || k > 256 || k > V) return 1;
    _Pragma("omp parallel for schedule(static) if(n >= 2)")
    for (int64_t r = 0; r < n; r++) {
        float* o = out + r * V;
        const uint16_t* l = lg + r * V;
        for (int64_t v = 0; v < V; v++) { uint32_t u = (uint32_t)l[v] << 16; memcpy(o + v, &u, 4); }
        /* a min-heap of (value, index) ordered by value, then the higher index first (so
           among equal values the lower indices stay); v only grows, so a new entry
           enters iff its value beats the root's */
#define LESS(av, ai, bv, bi) ((av) < (bv) || ((av) == (bv) && (ai) > (bi)))
        float hv[256]; int32_t hi[256];
        int64_t m = 0;
        for (int64_t v = 0; v < V; v++) {
            const float f = o[v];
            if (m == k && !(f > hv[0])) {
                /* the heap is full: skip 16 values at a time while none beats its root (the
                   same entries enter, in the same order, as one at a time) */
                while (v + 16 < V) {
                    int any = 0;
                    for (int i = 1; i <= 16; i++) any |= o[v + i] > hv[0];
                    if (any) break;
                    v += 16;
                }
                continue;
            }
            int64_t i;
            if (m < k) {  /* sift up */
                i = m++;
                while (i > 0) {
                    const int64_t p = (i - 1) / 2;
                    if (!LESS(f, v, hv[p], hi[p])) break;
                    hv[i] = hv[p]; hi[i] = hi[p]; i = p;
                }
            } else {  /* replace the root, sift down */
                i = 0;
                for (;;) {
                    int64_t c = 2 * i + 1;
                    if (c >= k) break;
                    if (c + 1 < k && LESS(hv[c + 1], hi[c + 1], hv[c], hi[c])) c++;
                    if (!LESS(hv[c], hi[c], f, v)) break;
                    hv[i] = hv[c]; hi[i] = hi[c]; i = c;
                }
            }
            hv[i] = f; hi[i] = (int32_t)v;
        }
#undef LESS
        /* the m dot products, eight at a time: each its own sum in input order (one chain
           a product would wait on its previous add's latency), one fused multiply-add a
           step (fmaf: the compiler's contraction of a += x * y is not guaranteed; on an AMD
           EPYC build it was not, and the sums differed from the FMA chain by an ulp or two) */
        const float* h = hn + r * H;
        for (int64_t j0 = 0; j0 < m; j0 += 8) {
            const int nj = m - j0 < 8 ? (int)(m - j0) : 8;
            float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (scales) {
                const int8_t* t[8];
                for (int q = 0; q < 8; q++) t[q] = (const int8_t*)table + (int64_t)hi[j0 + (q < nj ? q : 0)] * H;
                for (int64_t d = 0; d < H; d++)
                    for (int q = 0; q < 8; q++) a[q] = fmaf(h[d], (float)t[q][d], a[q]);
                for (int q = 0; q < nj; q++) {
                    uint32_t u = (uint32_t)scales[hi[j0 + q]] << 16; float sc; memcpy(&sc, &u, 4);
                    o[hi[j0 + q]] = a[q] * sc;
                }
            } else {
                const uint16_t* t[8];
                for (int q = 0; q < 8; q++) t[q] = (const uint16_t*)table + (int64_t)hi[j0 + (q < nj ? q : 0)] * H;
                for (int64_t d = 0; d < H; d++)
                    for (int q = 0; q < 8; q++) {
                        uint32_t u = (uint32_t)t[q][d] << 16; float w; memcpy(&w, &u, 4); a[q] = fmaf(h[d], w, a[q]);
                    }
                for (int q = 0; q < nj; q++) o[hi[j0 + q]] = a[q];
            }
        }
    }
    return 0;
}
