
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qmm_isa.h"
#include "qmm_layout.h"

/* ---------------------------------------------------------------- activation rows

   Each row of x is rounded to int8 blocks once a call, in the form its weights' type
   takes (llama.cpp's pairing): per 32 inputs (Q4_0, Q4_1, Q5_0, Q8_0: d = max|x| / 127,
   q = round(x / d) to nearest even, the block sum of q and d * that sum) or per 256 (the
   K types: d per 256, block sums of q per 16 and per 32). A row's codes depend on that row
   alone. Scratch layout for M rows of K inputs (qmm_scratch_bytes): the 32-form's q
   [M + 16, K], d [M K/32], s [M K/32] (fp32), sum [M K/32] (int32); then the 256-form's q
   [M + 16, K], d [M K/256] (fp32), sums per 16 [M K/16] and per 32 [M K/32] (int16); then,
   64-byte aligned, the 256-form's q again in the AMX A tiles' order (a256: per group of 16
   rows and chunk of 64 inputs, the 16 rows' 64 bytes in 1 KB, filled only for calls on the
   tiles: a tile load of 1 KB in a row instead of 16 rows K apart, measured 10% less time
   at 64 and 256 rows). The 16 rows after each q are padding an AMX A tile of 16 rows may
   read past the last row (their sums are dropped). */

typedef struct {
    int64_t K;
    int8_t* q32; float* d32; float* s32; int32_t* b32;
    int8_t* q256; float* d256; int16_t* b16; int16_t* bk32; int8_t* a256;
} qacts;

static int64_t scratch_bytes(int64_t M, int64_t K) {
    return (M + 16) * K * 3 + M * (K / 32) * 12 + M * (K / 256) * 4 + M * (K / 16) * 2 + M * (K / 32) * 2 + 128;
}

int64_t qmm_scratch_bytes(int64_t M, int64_t K) { return scratch_bytes(M, K); }

static qacts acts_at(void* scratch, int64_t M, int64_t K) {
    qacts a; char* p = (char*)scratch;
    a.K = K;
    a.q32 = (int8_t*)p; p += (M + 16) * K;
    a.d32 = (float*)p; p += M * (K / 32) * 4;
    a.s32 = (float*)p; p += M * (K / 32) * 4;
    a.b32 = (int32_t*)p; p += M * (K / 32) * 4;
    a.q256 = (int8_t*)p; p += (M + 16) * K;
    a.d256 = (float*)p; p += M * (K / 256) * 4;
    a.b16 = (int16_t*)p; p += M * (K / 16) * 2;
    a.bk32 = (int16_t*)p; p += M * (K / 32) * 2;
    a.a256 = (int8_t*)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    return a;
}

static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* n values of a row, rounded as one block with the scale of amax: d, and q written */
static inline float round_block(const float* x, int n, float amax, int8_t* q) {
    const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
    return d;
}

static inline float amax_of(const float* x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) { const float a = fabsf(x[i]); amax = a > amax ? a : amax; }
    return amax;
}

#ifdef QMM_AVX2
/* the same steps on 8 lanes: max |x| (exact in any order), q = round(x id) to nearest
   even, clamped, and the codes' sums exact: bitwise round_block's */
static inline float amax_avx2(const float* x, int n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(abs, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 32 values with the scale of amax: q written, returns the codes' sums per 16 (s[0], s[1]) */
static inline void round32_avx2(const float* x, float id, int8_t* q, int32_t* s) {
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i v[4];
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[i] = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, r)));
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int h = 0; h < 2; h++) {
        const __m256i a = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
        __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4E));
        b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xB1));
        s[h] = _mm_cvtsi128_si32(b);
    }
}
#endif

/* row r of x (fp32 or bf16) into the forms asked for (need: bit 0 the 32-form, bit 1 the 256-form) */
static void quantize_row(const void* x, int64_t xtype, int64_t r, const qacts* A, int64_t need, int avx2) {
    const int64_t K = A->K;
    float buf[256];
    for (int64_t k0 = 0; k0 < K; k0 += 256) {
        const int64_t n = K - k0 < 256 ? K - k0 : 256;
        if (xtype) {
            const uint16_t* xr = (const uint16_t*)x + r * K + k0;
            for (int64_t i = 0; i < n; i++) { uint32_t u = (uint32_t)xr[i] << 16; memcpy(buf + i, &u, 4); }
        } else memcpy(buf, (const float*)x + r * K + k0, sizeof(float) * (size_t)n);
        int32_t s[16];
        if (need & 1)
            for (int64_t b = 0; b < n / 32; b++) {
                const int64_t bi = r * (K / 32) + k0 / 32 + b;
                int8_t* q = A->q32 + r * K + k0 + 32 * b;
                float d;
#ifdef QMM_AVX2
                if (avx2) {
                    const float amax = amax_avx2(buf + 32 * b, 32);
                    d = amax / 127.0f;
                    round32_avx2(buf + 32 * b, amax > 0.0f ? 1.0f / d : 0.0f, q, s);
                    s[0] += s[1];
                } else
#endif
                {
                    d = round_block(buf + 32 * b, 32, amax_of(buf + 32 * b, 32), q);
                    s[0] = 0;
                    for (int i = 0; i < 32; i++) s[0] += q[i];
                }
                A->d32[bi] = d; A->b32[bi] = s[0]; A->s32[bi] = d * (float)s[0];
            }
        if ((need & 2) && n == 256) {
            int8_t* q = A->q256 + r * K + k0;
            float d;
#ifdef QMM_AVX2
            if (avx2) {
                const float amax = amax_avx2(buf, 256);
                d = amax / 127.0f;
                const float id = amax > 0.0f ? 1.0f / d : 0.0f;
                for (int j = 0; j < 8; j++) round32_avx2(buf + 32 * j, id, q + 32 * j, s + 2 * j);
            } else
#endif
            {
                d = round_block(buf, 256, amax_of(buf, 256), q);
                for (int j = 0; j < 16; j++) {
                    s[j] = 0;
                    for (int i = 0; i < 16; i++) s[j] += q[16 * j + i];
                }
            }
            A->d256[r * (K / 256) + k0 / 256] = d;
            for (int j = 0; j < 16; j++) A->b16[r * (K / 16) + k0 / 16 + j] = (int16_t)s[j];
            for (int j = 0; j < 8; j++) A->bk32[r * (K / 32) + k0 / 32 + j] = (int16_t)(s[2 * j] + s[2 * j + 1]);
        }
    }
}

/* ---------------------------------------------------------------- one tile, every row

   tile_*(T, nb, A, m0, mc, acc): the tile's nb tile-blocks (8 outputs) times rows m0 ..
   m0 + mc - 1; acc [mc][8] fp32, zero on entry, gets each row's 8 dot products. Per row
   and tile-block the integer sums are exact (the codes are small enough that no
   intermediate overflows, whatever the order), then fp32 steps in a fixed order:

   Q4_0  acc = fma(float(S - 8 B), d dx, acc)          S = sum q x, B = sum x (codes)
   Q5_0  acc = fma(float(S - 16 B), d dx, acc)
   Q4_1  acc = fma(float(S), d dx, acc); acc = fma(m, dx B, acc)
   Q8_0  acc = fma(float(S), d dx, acc)
   Q4_K  acc = fma(float(sum_j sc_j S_j), d dx, acc); acc = fma(-float(sum_j m_j B_j), dmin dx, acc)
   Q6_K  acc = fma(float(sum_s sc_s S_s - 32 sum_s sc_s B_s), d dx, acc)

   The scalar path and the AVX2 path take exactly these steps, so their bits are equal;
   a row's bits depend on its own codes alone (not on mc, m0 or the thread). */

static void tile_scalar(int64_t t, const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
    const int64_t K = A->K, tb = q_tile_bytes(t), qk = q_qk(t);
    for (int64_t b = 0; b < nb; b++, T += tb)
        for (int64_t r = 0; r < mc; r++) {
            const int64_t row = m0 + r;
            for (int o = 0; o < 8; o++) {
                float* a = acc + 8 * r + o;
                if (qk == 32) {
                    const int8_t* x = A->q32 + row * K + 32 * b;
                    const int64_t bi = row * (K / 32) + b;
                    const float dx = A->d32[bi];
                    int32_t S = 0;
                    for (int i = 0; i < 32; i++) {
                        int q;
                        if (t == QT_Q8_0) q = (int8_t)T[32 * (i / 4) + 4 * o + i % 4];
                        else {
                            q = q_nib(T, i / 4, o, i % 4);
                            if (t == QT_Q5_0) q |= ((T[128 + 4 * o + i % 4] >> (i / 4)) & 1) << 4;
                        }
                        S += q * x[i];
                    }
                    const int32_t B = A->b32[bi];
                    switch (t) {
                        case QT_Q4_0: *a = fmaf((float)(S - 8 * B), q_h2f(q_rd16(T + 128 + 2 * o)) * dx, *a); break;
                        case QT_Q5_0: *a = fmaf((float)(S - 16 * B), q_h2f(q_rd16(T + 160 + 2 * o)) * dx, *a); break;
                        case QT_Q4_1:
                            *a = fmaf((float)S, q_h2f(q_rd16(T + 128 + 2 * o)) * dx, *a);
                            *a = fmaf(q_h2f(q_rd16(T + 144 + 2 * o)), A->s32[bi], *a);
                            break;
                        default: *a = fmaf((float)S, q_h2f(q_rd16(T + 256 + 2 * o)) * dx, *a); break;
                    }
                } else {
                    const int8_t* x = A->q256 + row * K + 256 * b;
                    const float dx = A->d256[row * (K / 256) + b];
                    if (t == QT_Q4_K) {
                        int32_t S = 0, Mn = 0;
                        for (int j = 0; j < 8; j++) {
                            int32_t s = 0;
                            for (int i = 0; i < 32; i++) s += q_nib(T + 128 * j, i / 4, o, i % 4) * x[32 * j + i];
                            S += (int32_t)T[1024 + 8 * j + o] * s;
                            Mn += (int32_t)T[1088 + 16 * (j / 2) + 2 * o + (j & 1)] * A->bk32[row * (K / 32) + 8 * b + j];
                        }
                        *a = fmaf((float)S, q_h2f(q_rd16(T + 1152 + 2 * o)) * dx, *a);
                        *a = fmaf(-(float)Mn, q_h2f(q_rd16(T + 1168 + 2 * o)) * dx, *a);
                    } else {
                        int32_t S = 0, Bs = 0;
                        for (int s = 0; s < 16; s++) {
                            const int g = s / 2;
                            int32_t v = 0;
                            for (int i = 16 * (s & 1); i < 16 * (s & 1) + 16; i++) {
                                const int c = i / 4, e = i % 4;
                                const int q = q_nib(T + 128 * g, c, o, e)
                                    | (((T[1024 + 64 * g + 32 * (c / 4) + 4 * o + e] >> (2 * (c % 4))) & 3) << 4);
                                v += q * x[32 * g + i];
                            }
                            const int32_t sc = (int8_t)T[1536 + 16 * g + 2 * o + (s & 1)];
                            S += sc * v;
                            Bs += sc * A->b16[row * (K / 16) + 16 * b + s];
                        }
                        *a = fmaf((float)(S - 32 * Bs), q_h2f(q_rd16(T + 1664 + 2 * o)) * dx, *a);
                    }
                }
            }
        }
}

#ifdef QMM_AVX2
#define QMM_RB 64  /* rows per pass over a tile (the scratch of one pass lives on the stack) */

/* ---- the weights' stream, asked ahead a few lines at a time

   A thread's units (tiles, or tile pairs) follow each other in memory (a segment's tiles are
   contiguous and a thread takes consecutive units), so a call reads its weights as one
   stream, a pair's two tiles as two. The kernels ask for the lines of the block QPF_FAR or
   QPF_NEAR bytes ahead (at least one block), on into the units after a unit's last block,
   a few lines at a time spread over a block's work (qpf_step where the work is). Asked all
   at once, a Q4_K pair's 37 lines hold more misses than a core has line fill buffers (16
   on recent Intel cores): the prefetches past them wait in the pipeline, the core stalls
   instead of computing while lines arrive, and the next unit's first blocks, never asked
   for, arrive on demand. (Measured on a Xeon with AMX, Qwen2.5-Coder-1.5B Q4_K_M, 2
   threads: one row 66.5 -> 43.5 ms, 8 rows 116.9 -> 73.2, 16 rows 141.3 -> 96.5.) The
   K-quants' blocks are asked into L2 (prefetcht1) 8 KB ahead (QPF_FAR): the requests leave the line fill
   buffers to the loads sooner and the stream stays further ahead of the work (C benchmark
   on the same Xeon, 2 threads, [8960, 1536], medians of 6 runs alternating against L1 and
   3 KB: Q4_K one row 43.0 -> 39.9 ms per 1.54 G weights, 8 rows 57.8 -> 54.5, 16 rows
   79.5 -> 71.5; Q6_K 16 rows 107.1 -> 94.6); the 32-input types' small blocks into L1 3 KB
   ahead (QPF_NEAR: the 0.5B draft model's Q5_0 / Q8_0 matrices ran 5-15% slower the far
   way). */
#define QPF_NEAR 3072
#define QPF_FAR 8192

typedef struct { const uint8_t *a, *b; int64_t n, left, q; int far; } qpf;

/* the unit whose first tile-blocks are P0 and P1 (P1 NULL: one tile), nb blocks of tb
   bytes: block k's stream ahead (far: QPF_FAR into L2, else QPF_NEAR into L1), its lines
   to be asked in `parts` steps */
static inline void qpf_at(qpf* f, const uint8_t* P0, const uint8_t* P1, int64_t nb, int64_t tb, int64_t k, int parts,
                          int far) {
    const int64_t j = k + ((far ? QPF_FAR : QPF_NEAR) + tb - 1) / tb;
    f->far = far;
    /* block j % nb of the unit j / nb ahead: a unit starts where the one before ends (a
       pair's two tiles one after the other), so a tile's stream is contiguous and a pair's
       two streams step two tiles a unit */
    if (P1) {
        const int64_t at = (j / nb) * 2 * nb * tb + (j % nb) * tb;
        f->a = P0 + at; f->b = P1 + at;
    } else { f->a = P0 + j * tb; f->b = NULL; }
    f->n = (tb + 63) / 64;
    f->left = P1 ? 2 * f->n : f->n;
    f->q = (f->left + parts - 1) / parts;
}

/* a K-quant's block k: its stream asked far ahead, in `parts` steps */
static inline void qpf_begin(qpf* f, const uint8_t* P0, const uint8_t* P1, int64_t nb, int64_t tb, int64_t k, int parts) {
    qpf_at(f, P0, P1, nb, tb, k, parts, 1);
}

/* the next n lines of the block begun (none past its end) */
static inline void qpf_step(qpf* f, int64_t n) {
    for (; n > 0 && f->left > 0; n--, f->left--) {
        const int64_t l = (f->b ? 2 * f->n : f->n) - f->left;
        const char* p = (const char*)(l < f->n ? f->a + 64 * l : f->b + 64 * (l - f->n));
        if (f->far) _mm_prefetch(p, _MM_HINT_T1);
        else _mm_prefetch(p, _MM_HINT_T0);
    }
}

/* block k's stream ahead asked at once (a 32-input block's few lines: nothing to spread) */
static inline void qpf_whole(qpf* f, const uint8_t* P0, const uint8_t* P1, int64_t nb, int64_t tb, int64_t k) {
    qpf_at(f, P0, P1, nb, tb, k, 1, 0);
    qpf_step(f, f->q);
}

static inline __m256i bc32(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
/* 8 u8 scales -> each in both 16-bit halves of its output's 32-bit lane (madd multiplies a pair by it) */
static inline __m256i sc_pairs(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

/* the four 32-byte nibble vectors at p as 8 chunk vectors of codes 0..15 */
static inline void nibbles8(const uint8_t* p, __m256i* w) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int t = 0; t < 4; t++) {
        const __m256i v = ld(p + 32 * t);
        w[t] = _mm256_and_si256(v, m4);
        w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

/* the 32-form types: 8 chunks per tile-block */
static void tile_avx2_32(int64_t t, const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
    const int64_t K = A->K, tb = q_tile_bytes(t);
    const __m256i ones = _mm256_set1_epi16(1), one8 = _mm256_set1_epi8(1);
    const uint8_t* T0 = T;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, T += tb) {
        qpf_whole(&pf, T0, NULL, nb, tb, b);
        __m256i w[8];
        if (t == QT_Q8_0) for (int c = 0; c < 8; c++) w[c] = ld(T + 32 * c);
        else {
            nibbles8(T, w);
            if (t == QT_Q5_0) {
                const __m256i h = ld(T + 128);
                for (int c = 0; c < 8; c++)
                    w[c] = _mm256_or_si256(w[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, c), one8), 4));
            }
        }
        const __m256 d = half8(T + (t == QT_Q5_0 ? 160 : t == QT_Q8_0 ? 256 : 128));
        const __m256 m = t == QT_Q4_1 ? half8(T + 144) : _mm256_setzero_ps();
        for (int64_t r = 0; r < mc; r++) {
            const int64_t row = m0 + r, bi = row * (K / 32) + b;
            const int8_t* x = A->q32 + row * K + 32 * b;
            __m256i S;
            if (t == QT_Q8_0) {
                S = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(bc32(x + 4 * c), w[c]));
                    S = _mm256_add_epi32(S, _mm256_madd_epi16(p, ones));
                }
            } else if (t == QT_Q5_0) {  /* codes < 32: four chunks' pair sums fit 16 bits */
                __m256i s0 = _mm256_maddubs_epi16(w[0], bc32(x)), s1 = _mm256_maddubs_epi16(w[4], bc32(x + 16));
                for (int c = 1; c < 4; c++) {
                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[c], bc32(x + 4 * c)));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[c + 4], bc32(x + 16 + 4 * c)));
                }
                S = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
            } else {  /* codes < 16: eight chunks' pair sums fit 16 bits */
                __m256i s = _mm256_maddubs_epi16(w[0], bc32(x));
                for (int c = 1; c < 8; c++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], bc32(x + 4 * c)));
                S = _mm256_madd_epi16(s, ones);
            }
            if (t == QT_Q4_0) S = _mm256_sub_epi32(S, _mm256_set1_epi32(8 * A->b32[bi]));
            else if (t == QT_Q5_0) S = _mm256_sub_epi32(S, _mm256_set1_epi32(16 * A->b32[bi]));
            __m256 a = _mm256_loadu_ps(acc + 8 * r);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(A->d32[bi])), a);
            if (t == QT_Q4_1) a = _mm256_fmadd_ps(m, _mm256_set1_ps(A->s32[bi]), a);
            _mm256_storeu_ps(acc + 8 * r, a);
        }
    }
}

/* The steps the 8-output Q4_K / Q6_K tiles of the AVX2 and AVX-VNNI paths share. Q4_K, after
   block b's sums S[r]: subtract the mins (each sub-block's min times its sum of x) and add
   both, scaled, into acc. Q6_K: the 6-bit codes of group g (its nibbles and two high bits);
   after block b's sums, S - 32 B (the codes' offset) scaled into acc. */
static inline void q4k_finish8(const uint8_t* T, const qacts* A, int64_t m0, int64_t mc, int64_t b,
                               const __m256i* S, float* acc) {
    const int64_t K = A->K;
    const __m256 d = half8(T + 1152), dmin = half8(T + 1168);
    __m256i mp[4];
    for (int p = 0; p < 4; p++) mp[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(T + 1088 + 16 * p)));
    for (int64_t r = 0; r < mc; r++) {
        const int16_t* bs = A->bk32 + (m0 + r) * (K / 32) + 8 * b;
        __m256i mn = _mm256_madd_epi16(mp[0], bc32(bs));
        for (int p = 1; p < 4; p++) mn = _mm256_add_epi32(mn, _mm256_madd_epi16(mp[p], bc32(bs + 2 * p)));
        const __m256 dx = _mm256_set1_ps(A->d256[(m0 + r) * (K / 256) + b]);
        __m256 a = _mm256_loadu_ps(acc + 8 * r);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[r]), _mm256_mul_ps(d, dx), a);
        a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mn), _mm256_mul_ps(dmin, dx), a);
        _mm256_storeu_ps(acc + 8 * r, a);
    }
}

static inline void q6k_codes8(const uint8_t* T, int g, __m256i* w) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    nibbles8(T + 128 * g, w);
    for (int u = 0; u < 2; u++) {
        const __m256i h = ld(T + 1024 + 64 * g + 32 * u);
        w[4 * u + 0] = _mm256_or_si256(w[4 * u + 0], _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
        w[4 * u + 1] = _mm256_or_si256(w[4 * u + 1], _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
        w[4 * u + 2] = _mm256_or_si256(w[4 * u + 2], _mm256_and_si256(h, m30));
        w[4 * u + 3] = _mm256_or_si256(w[4 * u + 3], _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
    }
}

static inline void q6k_finish8(const uint8_t* T, const qacts* A, int64_t m0, int64_t mc, int64_t b,
                               const __m256i* S, const __m256i* Bs, float* acc) {
    const int64_t K = A->K;
    const __m256 d = half8(T + 1664);
    for (int64_t r = 0; r < mc; r++) {
        const __m256 dx = _mm256_set1_ps(A->d256[(m0 + r) * (K / 256) + b]);
        const __m256i tot = _mm256_sub_epi32(S[r], _mm256_slli_epi32(Bs[r], 5));
        __m256 a = _mm256_loadu_ps(acc + 8 * r);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d, dx), a);
        _mm256_storeu_ps(acc + 8 * r, a);
    }
}

static void tile_avx2_q4k(const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
    const int64_t K = A->K;
    __m256i S[QMM_RB];
    const uint8_t* T0 = T;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, T += 1184) {
        qpf_begin(&pf, T0, NULL, nb, 1184, b, 8);
        for (int j = 0; j < 8; j++) {
            __m256i w[8];
            qpf_step(&pf, pf.q);
            nibbles8(T + 128 * j, w);
            const __m256i sc = sc_pairs(T + 1024 + 8 * j);
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * j;
                __m256i s = _mm256_maddubs_epi16(w[0], bc32(x));
                for (int c = 1; c < 8; c++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], bc32(x + 4 * c)));
                const __m256i p = _mm256_madd_epi16(s, sc);
                S[r] = j ? _mm256_add_epi32(S[r], p) : p;
            }
        }
        q4k_finish8(T, A, m0, mc, b, S, acc);
    }
}

static void tile_avx2_q6k(const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
    const int64_t K = A->K;
    __m256i S[QMM_RB], Bs[QMM_RB];
    const uint8_t* T0 = T;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, T += 1680) {
        qpf_begin(&pf, T0, NULL, nb, 1680, b, 8);
        for (int g = 0; g < 8; g++) {
            __m256i w[8];
            qpf_step(&pf, pf.q);
            q6k_codes8(T, g, w);
            const __m256i pr = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(T + 1536 + 16 * g)));
            const __m256i s0 = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pr, 0xA0), 0xA0);
            const __m256i s1 = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pr, 0xF5), 0xF5);
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * g;
                /* codes < 64: two chunks' pair sums fit 16 bits */
                const __m256i a0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bc32(x)), _mm256_maddubs_epi16(w[1], bc32(x + 4)));
                const __m256i a1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bc32(x + 8)), _mm256_maddubs_epi16(w[3], bc32(x + 12)));
                const __m256i a2 = _mm256_add_epi16(_mm256_maddubs_epi16(w[4], bc32(x + 16)), _mm256_maddubs_epi16(w[5], bc32(x + 20)));
                const __m256i a3 = _mm256_add_epi16(_mm256_maddubs_epi16(w[6], bc32(x + 24)), _mm256_maddubs_epi16(w[7], bc32(x + 28)));
                const __m256i p = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a0, s0), _mm256_madd_epi16(a1, s0)),
                                                   _mm256_add_epi32(_mm256_madd_epi16(a2, s1), _mm256_madd_epi16(a3, s1)));
                const __m256i q = _mm256_madd_epi16(pr, bc32(A->b16 + (m0 + r) * (K / 16) + 16 * b + 2 * g));
                S[r] = g ? _mm256_add_epi32(S[r], p) : p;
                Bs[r] = g ? _mm256_add_epi32(Bs[r], q) : q;
            }
        }
        q6k_finish8(T, A, m0, mc, b, S, Bs, acc);
    }
}
#else
#define QMM_RB 64
#endif

#include "qmm_vnni.h"
#include "qmm_amx.h"

#ifdef QMM_AMX
#define ACC_ROWS AMX_RB_ROWS  /* the most rows a pass takes */
#else
#define ACC_ROWS QMM_RB
#endif

/* ---------------------------------------------------------------- matrices

   A matrix is segments of rows, each of one type, concatenated along the outputs (a
   layer's q, k and v in one call). base + off: the segment's tiles. */

typedef struct { int64_t type, n, off; } qseg;
typedef struct { const uint8_t* base; int64_t K, nseg; const qseg* seg; } qmat;

/* The paths, all giving the same bits: 0 scalar, 1 AVX2, 2 AVX-VNNI (256-bit vpdpbusd on
   the 8-row tiles), 3 AVX-512 VNNI (512-bit on tile pairs), 4 AMX (tile pairs on the tile
   unit where a call has enough rows for the type, the AVX-512 VNNI path otherwise). */
enum { P_SCALAR, P_AVX2, P_VNNI256, P_AVX512, P_AMX, P_COUNT };
static int qmm_isa = -1;  /* -1: the best this build has */

/* Rows from which the AMX path runs every type on the tiles, the AVX-512 VNNI path below
   (measured on a Xeon with AMX-INT8, Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, a forward of M
   rows, the weights' stream asked ahead (qpf): every type from 9 rows against the 512-bit
   path alone, 10 rows 76.1 / 75.2 ms, 12 rows 80.1 / 88.0, 14 rows 85.4 / 96.9; from 6
   rows, 8 rows cost 73.5 against 67.1). qmm_amx_min_rows overrides it. */
static int amx_rows_forced = 0;
static int amx_min_rows(void) { return amx_rows_forced ? amx_rows_forced : 11; }

static int amx_usable(void) {
#ifdef QMM_AMX
    static int ok = -1;  /* the process's permission for the tile state, asked once */
    if (ok < 0) ok = amx_permission();
    return ok;
#else
    return 0;
#endif
}

/* whether this build (and, for AMX, the OS) has path `isa` */
int qmm_has(int isa) {
    switch (isa) {
        case P_SCALAR: return 1;
#ifdef QMM_AVX2
        case P_AVX2: return 1;
#endif
#ifdef QMM_VNNI256
        case P_VNNI256: return 1;
#endif
#ifdef QMM_AVX512
        case P_AVX512: return 1;
#endif
        case P_AMX: return amx_usable();
        default: return 0;
    }
}

/* sets the path (0..4, -1 the best this build has) where `isa` >= -1; returns the one in
   use (-1: `isa` is not in this build) */
int qmm_path(int isa) {
    if (isa >= 0 && !qmm_has(isa)) return -1;
    if (isa >= -1) qmm_isa = isa;
    if (qmm_isa >= 0) return qmm_isa;
    for (int p = P_COUNT - 1; p > 0; p--) if (qmm_has(p)) return p;
    return P_SCALAR;
}

/* n >= 1: every type runs on the tiles from n rows (the AMX path; for tests and
   measurements); n == -1: the measured rows again; returns the override in force before
   (0: none) */
int qmm_amx_min_rows(int n) {
    const int old = amx_rows_forced;
    if (n >= 1 || n == -1) amx_rows_forced = n < 0 ? 0 : n;
    return old;
}

static int64_t mat_need(const qmat* W) {
    int64_t need = 0;
    for (int64_t s = 0; s < W->nseg; s++) need |= q_qk(W->seg[s].type) == 32 ? 1 : 2;
    return need;
}

static int mat_check(const qmat* W) {
    for (int64_t s = 0; s < W->nseg; s++) {
        const int64_t t = W->seg[s].type, qk = q_qk(t);
        if (!qk || W->K % qk || W->seg[s].n % 8) return 1;
    }
    return 0;
}

/* one tile (8 outputs) on the 8-row paths */
static void run_tile(int64_t t, const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc, int path) {
#ifdef QMM_VNNI256
    if (path == P_VNNI256) {
        if (t == QT_Q4_K) tile_vnni_q4k(T, nb, A, m0, mc, acc);
        else if (t == QT_Q6_K) tile_vnni_q6k(T, nb, A, m0, mc, acc);
        else tile_vnni_32(t, T, nb, A, m0, mc, acc);
        return;
    }
#endif
#ifdef QMM_AVX2
    if (path >= P_AVX2) {
        if (t == QT_Q4_K) tile_avx2_q4k(T, nb, A, m0, mc, acc);
        else if (t == QT_Q6_K) tile_avx2_q6k(T, nb, A, m0, mc, acc);
        else tile_avx2_32(t, T, nb, A, m0, mc, acc);
        return;
    }
#endif
    (void)path;
    tile_scalar(t, T, nb, A, m0, mc, acc);
}

/* one tile pair (16 outputs; P1 == P0 where the segment's last tile has no partner) on
   the 512-bit paths; R: rows per A tile where the tiles run, 0 where they do not */
static void run_pair(int64_t t, const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0,
                     int64_t mc, float* acc, int R, void* work) {
#ifdef QMM_AMX
    if (R) {
        pair_amx(t, P0, P1, nb, A, m0, mc, acc, R, (amx_work*)work);
        return;
    }
#else
    (void)work;
#endif
#ifdef QMM_AVX512
    if (t == QT_Q4_K) pair512_q4k(P0, P1, nb, A, m0, mc, acc);
    else if (t == QT_Q6_K) pair512_q6k(P0, P1, nb, A, m0, mc, acc);
    else pair512_32(t, P0, P1, nb, A, m0, mc, acc);
#else
    (void)t; (void)P0; (void)P1; (void)nb; (void)A; (void)m0; (void)mc; (void)acc; (void)R; (void)work;
#endif
}

static inline uint16_t f2bf(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* rows m0 .. m0 + mc of acc [mc][w] into y's outputs n0 .. n0 + n */
static inline void put_rows(const float* acc, int64_t w, int64_t n, int64_t m0, int64_t mc, int64_t n0, int64_t N,
                            int64_t ytype, void* y) {
    for (int64_t r = 0; r < mc; r++)
        for (int64_t o = 0; o < n; o++) {
            const int64_t at = (m0 + r) * N + n0 + o;
            if (ytype) ((uint16_t*)y)[at] = f2bf(acc[w * r + o]);
            else ((float*)y)[at] = acc[w * r + o];
        }
}

/* the work unit u (a tile, or a tile pair where `pairs`) of W: its segment's type, its
   first tile-block, the second's (the same where none), its first output and width */
static void unit_at(const qmat* W, int64_t u, int pairs, int64_t* type, const uint8_t** P0, const uint8_t** P1,
                    int64_t* n0, int64_t* n) {
    int64_t s = 0, first = 0;
    for (;; s++) {
        const int64_t tiles = W->seg[s].n / 8, units = pairs ? (tiles + 1) / 2 : tiles;
        if (u < units) break;
        u -= units; first += W->seg[s].n;
    }
    const int64_t t = W->seg[s].type, tiles = W->seg[s].n / 8, nb = W->K / q_qk(t), tile = pairs ? 2 * u : u;
    *type = t;
    *P0 = W->base + W->seg[s].off + tile * nb * q_tile_bytes(t);
    *P1 = pairs && tile + 1 < tiles ? *P0 + nb * q_tile_bytes(t) : *P0;
    *n0 = first + 8 * tile;
    *n = pairs && tile + 1 < tiles ? 16 : 8;
}

/* y [M, N] (ytype 0 fp32, 1 bf16) = x [M, K] (xtype 0 fp32, 1 bf16) times W's rows;
   scratch: qmm_scratch_bytes(M, K). 0: done; 1: a type or shape W cannot take. */
int qmm(const void* x, int64_t xtype, int64_t M, const qmat* W, int64_t ytype, void* scratch, void* y) {
    if (mat_check(W)) return 1;
    const int64_t K = W->K, need = mat_need(W);
    int64_t N = 0, units = 0;
    const int path = qmm_path(-2), pairs = path >= P_AVX512;
    for (int64_t s = 0; s < W->nseg; s++) {
        N += W->seg[s].n;
        units += pairs ? (W->seg[s].n / 8 + 1) / 2 : W->seg[s].n / 8;
    }
    const qacts A = acts_at(scratch, M, K);
    const int R = path == P_AMX && M >= amx_min_rows() ? (int)(M < 16 ? M : 16) : 0;  /* rows per A tile; 0: no tiles */
    _Pragma("omp parallel for schedule(static) if(M > 1)")
    for (int64_t r = 0; r < M; r++) quantize_row(x, xtype, r, &A, need, path >= P_AVX2);
#ifdef QMM_AMX
    if (R && (need & 2)) amx_a_tiles(&A, M);
#endif
    /* rows per pass over a unit: the tiles take more (each pass unpacks the unit's blocks) */
    const int64_t rb = R ? ACC_ROWS : QMM_RB;
    _Pragma("omp parallel")
    {
        void* work = NULL;
#ifdef QMM_AMX
        amx_work X;  /* this thread's tile buffers */
        if (R) { amx_configure(R); amx_work_init(&X); work = &X; }
#endif
        _Pragma("omp for schedule(static)")
        for (int64_t u = 0; u < units; u++) {
            int64_t type, n0, n;
            const uint8_t *P0, *P1;
            unit_at(W, u, pairs, &type, &P0, &P1, &n0, &n);
            const int64_t nb = K / q_qk(type), w = pairs ? 16 : 8;
            float acc[ACC_ROWS * 16] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += rb) {
                const int64_t mc = M - m0 < rb ? M - m0 : rb;
                memset(acc, 0, sizeof(float) * (size_t)(w * mc));
                if (pairs) run_pair(type, P0, P1, nb, &A, m0, mc, acc, R, work);
                else run_tile(type, P0, nb, &A, m0, mc, acc, path);
                put_rows(acc, w, n, m0, mc, n0, N, ytype, y);
            }
        }
#ifdef QMM_AMX
        if (R) T_RELEASE();
#endif
    }
    return 0;
}

/* the layer stack's matmul (layer_stack.c's mm4_fn): bf16 rows in and out; W a qmat */
int qmm_bf16(const uint16_t* x, int64_t M, int64_t K, const void* W, int64_t N, int64_t unused, float* scratch,
             uint16_t* y) {
    (void)unused; (void)N;
    if (((const qmat*)W)->K != K) return 1;
    return qmm(x, 1, M, (const qmat*)W, 1, scratch, y);
}

/* ---------------------------------------------------------------- packing and values */

/* GGUF rows src [N][K / QK blocks] of type t -> tiles dst (q_tile_bytes(t) * N / 8 * K / QK
   bytes). 0: done; 1: a type or shape it cannot take. */
int qrepack(int64_t t, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t qk = q_qk(t);
    if (!qk || K % qk || N % 8) return 1;
    const int64_t nb = K / qk;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < N / 8; i++)
        q_repack_tile(t, src + i * 8 * nb * q_raw_bytes(t), K, dst + i * nb * q_tile_bytes(t));
    return 0;
}

/* rows idx [n] of a tiled tensor (type t, K inputs) as fp32 or bf16 (otype 0 / 1) into out [n, K] */
int qrows(int64_t t, const uint8_t* tiles, int64_t K, const int64_t* idx, int64_t n, int64_t otype, void* out) {
    const int64_t qk = q_qk(t);
    if (!qk || K % qk) return 1;
    const int64_t nb = K / qk, tb = q_tile_bytes(t);
    _Pragma("omp parallel for schedule(static) if(n > 4)")
    for (int64_t i = 0; i < n; i++) {
        const uint8_t* T = tiles + (idx[i] / 8) * nb * tb;
        float v[256];
        for (int64_t b = 0; b < nb; b++) {
            q_tile_values(t, T + b * tb, (int)(idx[i] % 8), v);
            for (int64_t e = 0; e < qk; e++) {
                if (otype) ((uint16_t*)out)[i * K + b * qk + e] = f2bf(v[e]);
                else ((float*)out)[i * K + b * qk + e] = v[e];
            }
        }
    }
    return 0;
}

/* x [M, K] (fp32) rounded as the kernels round it and back: out [M, K] = d q (form 1: per
   32, 2: per 256) */
int qround(const float* x, int64_t M, int64_t K, int64_t form, void* scratch, float* out) {
    if ((form == 1 && K % 32) || (form == 2 && K % 256) || (form != 1 && form != 2)) return 1;
    const qacts A = acts_at(scratch, M, K);
    for (int64_t r = 0; r < M; r++) {
        quantize_row(x, 0, r, &A, form, qmm_path(-2) >= P_AVX2);
        for (int64_t k = 0; k < K; k++)
            out[r * K + k] = form == 1 ? A.d32[r * (K / 32) + k / 32] * (float)A.q32[r * K + k]
                                       : A.d256[r * (K / 256) + k / 256] * (float)A.q256[r * K + k];
    }
    return 0;
}
