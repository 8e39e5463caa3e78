
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f ld_bf16(const uint16_t* p) {
    v16h h; memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    return (v16f)u;
}
static inline v16f ld_f32(const float* p) { v16f f; memcpy(&f, p, sizeof f); return f; }
static inline float lds_bf16(const uint16_t* p, int64_t d) { uint32_t u = (uint32_t)p[d] << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float lds_f32(const float* p, int64_t d) { return p[d]; }
static inline void st_bf16(uint16_t* p, v16f f) {
    v16u u = (v16u)f;
    u += 0x7FFFu + ((u >> 16) & 1u);  /* round to nearest even (finite values) */
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}
static inline void st_f32(float* p, v16f f) { memcpy(p, &f, sizeof f); }

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* the sum of a vector's lanes, always in the same order: lanes i + (i + 8), then of those
   i + (i + 4), then i + (i + 2), then the two (halves of the vector added as halves, so
   CPUs without 16-lane registers need no lane shuffles) */
static inline float hsum(v16f a) {
    v8f lo, hi; memcpy(&lo, &a, 32); memcpy(&hi, (const char*)&a + 32, 32);
    const v8f b = lo + hi;
    v4f b0, b1; memcpy(&b0, &b, 16); memcpy(&b1, (const char*)&b + 16, 16);
    const v4f c = b0 + b1;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* e^x for x <= 0, 16 at a time (x below -87 gives e^-87): 2^(x log2 e) = 2^i 2^f, |f| <= 1/2 */
static inline v16f exp_nonpos(v16f x) {
    const v16f lo = (v16f){0} - 87.0f;
    v16i below = x < lo;
    x = (v16f)(((v16i)lo & below) | ((v16i)x & ~below));
    v16f t = x * 1.44269504088896341f;
    v16f fi = __builtin_convertvector(__builtin_convertvector(t + (v16f){0} + 12582912.0f - 12582912.0f, v16i), v16f);
    v16f f = t - fi;
    v16f p = (v16f){0} + 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    v16u bits = (v16u)((__builtin_convertvector(fi, v16i) + 127) << 23);
    return p * (v16f)bits;
}

#define HC_MAX 16   /* head dimension up to 256 */
/* the fast score loops' entry (AVX2 or AVX-512, whichever is built): FN with the head width
   a constant, 64 or 128 (hc 4 or 8); 1 for other widths (the generic loop runs instead) */
#define QK_BY_HC(NAME, T_, FN)                                                                          \
static inline int NAME##_qk(int64_t hc, const T_* kb, const int32_t* anc, int64_t c0, int64_t o0,       \
        int64_t L, int64_t g, const v16f* qf, float* s, int64_t Lp, float* mx) {                         \
    if (hc == 4) FN(kb, anc, c0, o0, L, g, 4, qf, s, Lp, mx);                                           \
    else if (hc == 8) FN(kb, anc, c0, o0, L, g, 8, qf, s, Lp, mx);                                      \
    else return 1;                                                                                      \
    return 0;                                                                                           \
}
#define KEYPOS(j) ((j) < c0 ? (int64_t)(j) : (int64_t)anc[o0 + (j) - c0])

/* CPUs with AVX2 and without AVX-512 (16-lane vectors are two registers there, and the
   generic code above moves them through memory): the score and the value loops of a
   64- or 128-wide head on 8-lane intrinsics, with the same arithmetic (each lane's
   products in the same FMA chain, the lanes reduced in hsum's order, every sum in key
   order), so the same bits as the generic loops (tested against them: ``generic_build``
   compiles this source with KEYLIST_GENERIC defined). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(KEYLIST_GENERIC)
#include <immintrin.h>
int keylist_fast8(void) { return 1; }
static inline __m256 ld8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 ld8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline float hsum8(__m256 lo, __m256 hi) {  /* hsum of the 16 lanes lo | hi */
    const __m256 b = _mm256_add_ps(lo, hi);
    const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  /* c0 + c2, c1 + c3 */
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
/* scores s[h Lp + j] and their maxima for hc (a constant) 16-lane chunks */
#define QK8(NAME, T_, LD8)                                                                              \
static inline __attribute__((always_inline)) void NAME##_qk8(const T_* kb, const int32_t* anc,          \
        int64_t c0, int64_t o0, int64_t L, int64_t g, const int64_t hc, const v16f* qf, float* s,        \
        int64_t Lp, float* mx) {                                                                         \
    const float* qq = (const float*)qf;                                                                 \
    for (int64_t j = 0; j < L; j++) {                                                                   \
        const T_* kr = kb + KEYPOS(j) * 16 * hc;                                                        \
        __m256 r[2 * hc];                                                                               \
        for (int64_t c = 0; c < 2 * hc; c++) r[c] = LD8(kr + 8 * c);                                    \
        for (int64_t h = 0; h < g; h++) {                                                               \
            const float* qh = qq + h * 16 * hc;                                                         \
            __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(qh), r[0]), hi = _mm256_mul_ps(_mm256_loadu_ps(qh + 8), r[1]); \
            for (int64_t c = 1; c < hc; c++) {                                                          \
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c), r[2 * c], lo);                       \
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16 * c + 8), r[2 * c + 1], hi);               \
            }                                                                                           \
            const float x = hsum8(lo, hi);                                                              \
            s[h * Lp + j] = x;                                                                          \
            mx[h] = x > mx[h] ? x : mx[h];                                                              \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
/* acc[h hc + c] = sum_j s[h Lp + j] v_j[chunk c], l[h] = sum_j s[h Lp + j]: a chunk and at    \
   most four heads at a time (gh a constant), so their sums stay in registers */                       \
static inline __attribute__((always_inline)) void NAME##_pv8h(const T_* vc, const int32_t* anc,         \
        int64_t c0, int64_t o0, int64_t L, int64_t hd, const int gh, const float* s0, int64_t Lp,       \
        v16f* out, int64_t hc) {                                                                         \
    __m256 a[8];                                                                                        \
    for (int i = 0; i < 2 * gh; i++) a[i] = _mm256_setzero_ps();                                        \
    for (int64_t j = 0; j < L; j++) {                                                                   \
        const T_* vr = vc + KEYPOS(j) * hd;                                                             \
        const __m256 r0 = LD8(vr), r1 = LD8(vr + 8);                                                    \
        for (int i = 0; i < gh; i++) {                                                                  \
            const __m256 w = _mm256_broadcast_ss(s0 + i * Lp + j);                                      \
            a[2 * i] = _mm256_fmadd_ps(w, r0, a[2 * i]);                                                \
            a[2 * i + 1] = _mm256_fmadd_ps(w, r1, a[2 * i + 1]);                                        \
        }                                                                                               \
    }                                                                                                   \
    for (int i = 0; i < gh; i++) {                                                                      \
        float* d = (float*)(out + i * hc);                                                              \
        _mm256_storeu_ps(d, a[2 * i]); _mm256_storeu_ps(d + 8, a[2 * i + 1]);                           \
    }                                                                                                   \
}                                                                                                       \
static inline int NAME##_pv8(int64_t hc, const T_* vb, const int32_t* anc, int64_t c0, int64_t o0,      \
        int64_t L, int64_t g, const float* s, int64_t Lp, float* l, v16f* acc) {                         \
    for (int64_t j = 0; j < L; j++)                                                                     \
        for (int64_t h = 0; h < g; h++) l[h] += s[h * Lp + j];                                          \
    for (int64_t c = 0; c < hc; c++)                                                                    \
        for (int64_t h0 = 0; h0 < g; h0 += 4) {                                                         \
            const T_* vc = vb + 16 * c;                                                                 \
            const float* s0 = s + h0 * Lp;                                                              \
            v16f* out = acc + h0 * hc + c;                                                              \
            switch (g - h0 < 4 ? g - h0 : 4) {                                                          \
                case 1: NAME##_pv8h(vc, anc, c0, o0, L, 16 * hc, 1, s0, Lp, out, hc); break;            \
                case 2: NAME##_pv8h(vc, anc, c0, o0, L, 16 * hc, 2, s0, Lp, out, hc); break;            \
                case 3: NAME##_pv8h(vc, anc, c0, o0, L, 16 * hc, 3, s0, Lp, out, hc); break;            \
                default: NAME##_pv8h(vc, anc, c0, o0, L, 16 * hc, 4, s0, Lp, out, hc); break;           \
            }                                                                                           \
        }                                                                                               \
    return 0;                                                                                           \
}                                                                                                       \
QK_BY_HC(NAME, T_, NAME##_qk8)
/* 0 where the fast loop ran (so the generic one is skipped), else 1 */
#define FAST8_QK(NAME, ...) NAME##_qk(__VA_ARGS__)
#define FAST8_PV(NAME, ...) NAME##_pv8(__VA_ARGS__)
#else
int keylist_fast8(void) { return 0; }
#define QK8(NAME, T_, LD8)
#define FAST8_QK(NAME, ...) 1
#define FAST8_PV(NAME, ...) 1
#endif

/* CPUs with AVX-512: the score and value loops of a 64- or 128-wide head with the head
   dimension a constant (the query heads and the sums in registers, not in stack arrays
   of a run-time size), still the generic code's arithmetic, so the same bits (tested
   against ``generic_build``):
   - scores: 16 keys at a time, converted to fp32 once for all the query heads; each
     key's 16 lane sums made in the same FMA chain as the generic loop, then the 16 keys'
     lanes reduced together (red16: the pairs hsum adds, in its order, for 16 vectors
     at once; the lanes shuffled, never a sum reordered), the maxima lane-wise (max is
     exact: the same maximum);
   - values: every key's value row converted once for up to 16 sums (four 64-wide heads or
     two 128-wide ones, each chunk its own register), every sum in key order, the weights'
     sums l beside them. */
#if defined(__AVX512F__) && !defined(KEYLIST_GENERIC)
#include <immintrin.h>
int keylist_fast16(void) { return 1; }
/* a + b c in one rounding: the generic loop's contraction, spelled out (left to GCC, the
   unrolled q0 k0 + q1 k1 may fuse either product) */
static inline v16f fma16(v16f b, v16f c, v16f a) { return (v16f)_mm512_fmadd_ps((__m512)b, (__m512)c, (__m512)a); }
/* ld_bf16 in one widening load (GCC splits the generic conversion in two halves) */
static inline v16f ld16_bf16(const uint16_t* p) {
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
static inline v16f ld16_f32(const float* p) { return (v16f)_mm512_loadu_ps(p); }
static inline v16f sh_add(v16f a, v16f b, v16i lo, v16i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
/* lane j of the result = hsum(a[j]), j < 16, bit for bit */
static inline __attribute__((always_inline)) v16f red16(const v16f* a) {
    /* lanes i + (i + 8): two vectors' halves side by side */
    const v16i L1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i H1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    /* then i + (i + 4): four keys' quarters, one per 128-bit block */
    const v16i L2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i H2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    /* then c0 + c2 and c1 + c3 within each block */
    const v16i L3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i H3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    /* then the two: block k holds keys 4k .. 4k + 3 in order */
    const v16i L4 = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
    const v16i H4 = {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31};
    v16f u[4];  /* u[m], block k: the four lanes c of key m + 4k */
    for (int m = 0; m < 4; m++)
        u[m] = sh_add(sh_add(a[m], a[m + 4], L1, H1), sh_add(a[m + 8], a[m + 12], L1, H1), L2, H2);
    return sh_add(sh_add(u[0], u[1], L3, H3), sh_add(u[2], u[3], L3, H3), L4, H4);
}
#define QK16(NAME, T_, LD)                                                                              \
static inline __attribute__((always_inline)) void NAME##_qk16(const T_* kb, const int32_t* anc,         \
        int64_t c0, int64_t o0, int64_t L, int64_t g, const int64_t hc, const v16f* qf, float* s,        \
        int64_t Lp, float* mx) {                                                                         \
    /* lane i of mv[h]: the maximum of the scores of keys i, i + 16, ...; max is exact, so their   \
       maximum is the keys' maximum (only a tie of 0 and -0 may keep the other sign, which no      \
       exp(s - max) tells apart) */                                                                     \
    const v16i iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                           \
    v16f mv[g];                                                                                         \
    for (int64_t h = 0; h < g; h++) mv[h] = (v16f){0} + mx[h];                                          \
    for (int64_t j0 = 0; j0 < L; j0 += 16) {                                                            \
        const int n = L - j0 < 16 ? (int)(L - j0) : 16;                                                 \
        v16f kf[16 * hc];                                                                               \
        for (int64_t i = 0; i < n; i++) {                                                               \
            const T_* kr = kb + KEYPOS(j0 + i) * 16 * hc;                                               \
            for (int64_t c = 0; c < hc; c++) kf[i * hc + c] = LD(kr + 16 * c);                          \
        }                                                                                               \
        for (int64_t i = n * hc; i < 16 * hc; i++) kf[i] = (v16f){0};  /* past the keys: scores unused */ \
        for (int64_t h = 0; h < g; h++) {                                                               \
            const v16f* qh = qf + h * hc;                                                               \
            v16f a[16];                                                                                 \
            for (int64_t i = 0; i < 16; i++) {                                                          \
                v16f x = qh[0] * kf[i * hc];                                                            \
                for (int64_t c = 1; c < hc; c++) x = fma16(qh[c], kf[i * hc + c], x);                   \
                a[i] = x;                                                                               \
            }                                                                                           \
            const v16f r = red16(a);                                                                    \
            memcpy(s + h * Lp + j0, &r, sizeof r);                                                      \
            const v16i up = (r > mv[h]) & (iota < n);                                                   \
            mv[h] = (v16f)(((v16i)r & up) | ((v16i)mv[h] & ~up));                                       \
        }                                                                                               \
    }                                                                                                   \
    for (int64_t h = 0; h < g; h++)                                                                     \
        for (int i = 0; i < 16; i++) mx[h] = mv[h][i] > mx[h] ? mv[h][i] : mx[h];                       \
}                                                                                                       \
/* acc[h hc + c] = sum_j s[h Lp + j] v_j[chunk c] and l[h] = sum_j s[h Lp + j] for gh heads    \
   (gh hc <= 16, both constants): every sum its own register, advanced once a key */               \
static inline __attribute__((always_inline)) void NAME##_pv16h(const T_* vb, const int32_t* anc,        \
        int64_t c0, int64_t o0, int64_t L, const int64_t hc, const int gh, const float* s0, int64_t Lp, \
        v16f* out, float* l) {                                                                           \
    v16f a[16];                                                                                         \
    float ls[4];                                                                                        \
    for (int i = 0; i < gh; i++) {                                                                      \
        ls[i] = l[i];                                                                                   \
        for (int64_t c = 0; c < hc; c++) a[i * hc + c] = (v16f){0};                                     \
    }                                                                                                   \
    for (int64_t j = 0; j < L; j++) {                                                                   \
        const T_* vr = vb + KEYPOS(j) * 16 * hc;                                                        \
        v16f r[8];                                                                                      \
        for (int64_t c = 0; c < hc; c++) r[c] = LD(vr + 16 * c);                                        \
        for (int i = 0; i < gh; i++) {                                                                  \
            const float w = s0[i * Lp + j];                                                             \
            const v16f wv = (v16f)_mm512_set1_ps(w);                                                    \
            ls[i] += w;                                                                                 \
            for (int64_t c = 0; c < hc; c++) a[i * hc + c] = fma16(wv, r[c], a[i * hc + c]);            \
        }                                                                                               \
    }                                                                                                   \
    for (int i = 0; i < gh; i++) {                                                                      \
        l[i] = ls[i];                                                                                   \
        for (int64_t c = 0; c < hc; c++) out[i * hc + c] = a[i * hc + c];                               \
    }                                                                                                   \
}                                                                                                       \
static inline int NAME##_pv16(int64_t hc, const T_* vb, const int32_t* anc, int64_t c0, int64_t o0,     \
        int64_t L, int64_t g, const float* s, int64_t Lp, float* l, v16f* acc) {                         \
    for (int64_t h0 = 0; h0 < g; h0 += 16 / hc) {                                                       \
        const int64_t gh = g - h0 < 16 / hc ? g - h0 : 16 / hc;                                         \
        const float* s0 = s + h0 * Lp;                                                                  \
        if (hc == 4 && gh == 4) NAME##_pv16h(vb, anc, c0, o0, L, 4, 4, s0, Lp, acc + h0 * 4, l + h0);   \
        else if (hc == 4 && gh == 3) NAME##_pv16h(vb, anc, c0, o0, L, 4, 3, s0, Lp, acc + h0 * 4, l + h0); \
        else if (hc == 4 && gh == 2) NAME##_pv16h(vb, anc, c0, o0, L, 4, 2, s0, Lp, acc + h0 * 4, l + h0); \
        else if (hc == 4) NAME##_pv16h(vb, anc, c0, o0, L, 4, 1, s0, Lp, acc + h0 * 4, l + h0);         \
        else if (hc == 8 && gh == 2) NAME##_pv16h(vb, anc, c0, o0, L, 8, 2, s0, Lp, acc + h0 * 8, l + h0); \
        else if (hc == 8) NAME##_pv16h(vb, anc, c0, o0, L, 8, 1, s0, Lp, acc + h0 * 8, l + h0);         \
        else return 1;                                                                                  \
    }                                                                                                   \
    return 0;                                                                                           \
}                                                                                                       \
QK_BY_HC(NAME, T_, NAME##_qk16)
#define FAST16_QK(NAME, ...) NAME##_qk(__VA_ARGS__)
#define FAST16_PV(NAME, ...) NAME##_pv16(__VA_ARGS__)
#else
int keylist_fast16(void) { return 0; }
#define QK16(NAME, T_, LD)
#define FAST16_QK(NAME, ...) 1
#define FAST16_PV(NAME, ...) 1
#endif

/* One (row, KV head): its g query heads qf (scaled, fp32) against the L keys it names
   (the first c0 positions, then anc[o0 ...]); o: g rows of hd outputs. 1 if out of memory. */
#define CORE(NAME, T_, LD, ST)                                                                          \
static int NAME(const T_* kb, const T_* vb, const int32_t* anc, int64_t c0, int64_t o0, int64_t L,      \
                int64_t g, int64_t hd, const v16f* qf, T_* o) {                                         \
    const int64_t hc = hd / 16;                                                                         \
    if (L <= 0) { memset(o, 0, sizeof(T_) * g * hd); return 0; }                                       \
    const int64_t Lp = (L + 15) & ~(int64_t)15;                                                         \
    float* s = (float*)aligned_alloc(64, sizeof(float) * (size_t)(g * Lp));                            \
    if (!s) return 1;                                                                                   \
    float mx[g], l[g];                                                                                  \
    v16f acc[g * hc], row[HC_MAX];                                                                      \
    for (int64_t h = 0; h < g; h++) {                                                                   \
        mx[h] = -3.0e38f; l[h] = 0.0f;                                                                  \
        for (int64_t c = 0; c < hc; c++) acc[h * hc + c] = (v16f){0};                                   \
    }                                                                                                   \
    if (FAST8_QK(NAME, hc, kb, anc, c0, o0, L, g, qf, s, Lp, mx)                                        \
        && FAST16_QK(NAME, hc, kb, anc, c0, o0, L, g, qf, s, Lp, mx))                                   \
    for (int64_t j = 0; j < L; j++) {                                                                   \
        const T_* kr = kb + KEYPOS(j) * hd;                                                             \
        for (int64_t c = 0; c < hc; c++) row[c] = LD(kr + 16 * c);                                      \
        for (int64_t h = 0; h < g; h++) {                                                               \
            v16f a = qf[h * hc] * row[0];                                                               \
            for (int64_t c = 1; c < hc; c++) a += qf[h * hc + c] * row[c];                              \
            const float x = hsum(a);                                                                    \
            s[h * Lp + j] = x;                                                                          \
            mx[h] = x > mx[h] ? x : mx[h];                                                              \
        }                                                                                               \
    }                                                                                                   \
    for (int64_t h = 0; h < g; h++) {                                                                   \
        float* sh = s + h * Lp;                                                                         \
        for (int64_t j = L; j < Lp; j++) sh[j] = mx[h];                                                 \
        for (int64_t j = 0; j < Lp; j += 16) {                                                          \
            v16f x; memcpy(&x, sh + j, sizeof x);                                                       \
            x = exp_nonpos(x - mx[h]);                                                                  \
            memcpy(sh + j, &x, sizeof x);                                                               \
        }                                                                                               \
    }                                                                                                   \
    if (FAST8_PV(NAME, hc, vb, anc, c0, o0, L, g, s, Lp, l, acc)                                        \
        && FAST16_PV(NAME, hc, vb, anc, c0, o0, L, g, s, Lp, l, acc))                                   \
    for (int64_t j = 0; j < L; j++) {                                                                   \
        const T_* vr = vb + KEYPOS(j) * hd;                                                             \
        for (int64_t c = 0; c < hc; c++) row[c] = LD(vr + 16 * c);                                      \
        for (int64_t h = 0; h < g; h++) {                                                               \
            const float w = s[h * Lp + j];                                                              \
            l[h] += w;                                                                                  \
            for (int64_t c = 0; c < hc; c++) acc[h * hc + c] += w * row[c];                             \
        }                                                                                               \
    }                                                                                                   \
    for (int64_t h = 0; h < g; h++) {                                                                   \
        const float r = 1.0f / l[h];                                                                    \
        for (int64_t c = 0; c < hc; c++) ST(o + h * hd + 16 * c, acc[h * hc + c] * r);                  \
    }                                                                                                   \
    free(s);                                                                                            \
    return 0;                                                                                           \
}

/* Rotate-half RoPE of one head x at the position whose tables are c, s (sin signed):
   x * c + swap_halves(x) * s, times scale, as 16-lane chunks. */
#define ROPE(NAME, T_, LDS)                                                                             \
static inline void NAME(const T_* x, const T_* c, const T_* s, int64_t hd, float scale, v16f* out) {    \
    float r[16 * HC_MAX];                                                                               \
    const int64_t half = hd / 2;                                                                        \
    for (int64_t d = 0; d < half; d++) r[d] = (LDS(x, d) * LDS(c, d) + LDS(x, d + half) * LDS(s, d)) * scale; \
    for (int64_t d = half; d < hd; d++) r[d] = (LDS(x, d) * LDS(c, d) + LDS(x, d - half) * LDS(s, d)) * scale; \
    memcpy(out, r, sizeof(float) * hd);                                                                 \
}

/* Attention alone: q [N, nq, hd] rows (strides q_row, q_head), one layer's cache k, v
   [slots, nk, T, hd]; per row its slot and keys; out [N, nq, hd]. */
#define ATTEND(NAME, T_, LD, CORE_)                                                                     \
int NAME(const T_* q, int64_t q_row, int64_t q_head, const T_* k, const T_* v, int64_t nk, int64_t T,   \
         const int32_t* slot, const int32_t* ctx, const int32_t* off, const int32_t* cnt,              \
         const int32_t* anc, T_* out, int64_t N, int64_t nq, int64_t hd, float scale) {                \
    const int64_t g = nq / nk, hc = hd / 16;                                                            \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel for schedule(static)")                                                        \
    for (int64_t task = 0; task < N * nk; task++) {                                                    \
        const int64_t n = task / nk, kh = task % nk;                                                    \
        v16f qf[g * hc];                                                                                \
        for (int64_t h = 0; h < g; h++)                                                                 \
            for (int64_t c = 0; c < hc; c++)                                                            \
                qf[h * hc + c] = LD(q + n * q_row + (kh * g + h) * q_head + 16 * c) * scale;            \
        const int64_t base = ((int64_t)slot[n] * nk + kh) * T * hd;                                     \
        if (CORE_(k + base, v + base, anc, ctx[n], off[n], (int64_t)ctx[n] + cnt[n], g, hd, qf,         \
                  out + (n * nq + kh * g) * hd)) {                                                      \
            _Pragma("omp atomic write") failed = 1;                                                     \
        }                                                                                               \
    }                                                                                                   \
    return failed;                                                                                      \
}

/* One attention layer from the qkv projection on: RoPE on q and k, k and v written to
   the cache where each row's go, then every row attends to the keys it names. */
typedef struct {
    int64_t N, nq, nk, hd, T, qkv_row;
    const void *cos, *sin;                       /* [positions, hd] tables in the cache dtype, sin signed */
    const int32_t *rope_pos, *wslot, *wpos;      /* per row: RoPE position; cache slot (< 0: none), position */
    const int32_t *slot, *ctx, *off, *cnt, *anc; /* per row: the keys it attends to */
    float scale;
} layer_plan;

#define LAYER(NAME, T_, LD, ST, ROPE_, CORE_)                                                           \
int NAME(const layer_plan* P, const T_* qkv, T_* k, T_* v, T_* out) {                                  \
    const int64_t N = P->N, nq = P->nq, nk = P->nk, hd = P->hd, T = P->T, hc = hd / 16, g = nq / nk;   \
    const T_* cs = (const T_*)P->cos; const T_* sn = (const T_*)P->sin;                                \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel for schedule(static)")                                                        \
    for (int64_t task = 0; task < N * nk; task++) {                                                    \
        const int64_t n = task / nk, kh = task % nk;                                                    \
        if (P->wslot[n] < 0) continue;                                                                  \
        const T_* x = qkv + n * P->qkv_row + (nq + kh) * hd;                                            \
        const int64_t at = (((int64_t)P->wslot[n] * nk + kh) * T + P->wpos[n]) * hd;                   \
        v16f kr[HC_MAX];                                                                                \
        ROPE_(x, cs + (int64_t)P->rope_pos[n] * hd, sn + (int64_t)P->rope_pos[n] * hd, hd, 1.0f, kr);   \
        for (int64_t c = 0; c < hc; c++) ST(k + at + 16 * c, kr[c]);                                    \
        memcpy(v + at, x + nk * hd, sizeof(T_) * hd);                                                   \
    }                                                                                                   \
    _Pragma("omp parallel for schedule(static)")                                                        \
    for (int64_t task = 0; task < N * nk; task++) {                                                    \
        const int64_t n = task / nk, kh = task % nk;                                                    \
        v16f qf[g * hc];                                                                                \
        for (int64_t h = 0; h < g; h++)                                                                 \
            ROPE_(qkv + n * P->qkv_row + (kh * g + h) * hd, cs + (int64_t)P->rope_pos[n] * hd,          \
                  sn + (int64_t)P->rope_pos[n] * hd, hd, P->scale, qf + h * hc);                        \
        const int64_t base = ((int64_t)P->slot[n] * nk + kh) * T * hd;                                  \
        if (CORE_(k + base, v + base, P->anc, P->ctx[n], P->off[n], (int64_t)P->ctx[n] + P->cnt[n], g,  \
                  hd, qf, out + (n * nq + kh * g) * hd)) {                                              \
            _Pragma("omp atomic write") failed = 1;                                                     \
        }                                                                                               \
    }                                                                                                   \
    return failed;                                                                                      \
}

QK8(core_bf16, uint16_t, ld8_bf16)
QK8(core_f32, float, ld8_f32)
QK16(core_bf16, uint16_t, ld16_bf16)
QK16(core_f32, float, ld16_f32)
CORE(core_bf16, uint16_t, ld_bf16, st_bf16)
CORE(core_f32, float, ld_f32, st_f32)
ROPE(rope_bf16, uint16_t, lds_bf16)
ROPE(rope_f32, float, lds_f32)
ATTEND(keylist_attend_bf16, uint16_t, ld_bf16, core_bf16)
ATTEND(keylist_attend_f32, float, ld_f32, core_f32)
LAYER(keylist_layer_bf16, uint16_t, ld_bf16, st_bf16, rope_bf16, core_bf16)
LAYER(keylist_layer_f32, float, ld_f32, st_f32, rope_f32, core_f32)

/* The residual add and RMSNorm of fp32 rows x [N, H] (in place) with fp32 weights w:
   x += d (bf16 rows, added in fp32; d NULL: nothing to add), then y = bf16(x / rms(x) * w),
   the mean of squares summed in 16 lanes and reduced in a fixed order (H a multiple of 16). */
void add_rmsnorm_bf16(float* x, const uint16_t* d, const float* w, uint16_t* y, int64_t N, int64_t H, float eps) {
    _Pragma("omp parallel for schedule(static) if(N * H >= 65536)")
    for (int64_t n = 0; n < N; n++) {
        float* xr = x + n * H;
        v16f a = (v16f){0};
        for (int64_t c = 0; c < H; c += 16) {
            v16f v = ld_f32(xr + c);
            if (d) { v += ld_bf16(d + n * H + c); st_f32(xr + c, v); }
            a += v * v;
        }
        const float r = 1.0f / __builtin_sqrtf(hsum(a) / (float)H + eps);
        for (int64_t c = 0; c < H; c += 16) st_bf16(y + n * H + c, ld_f32(xr + c) * r * ld_f32(w + c));
    }
}

/* The SwiGLU product of bf16 rows gu [N, 2I] = [g | u]: m = bf16(silu(g) * u) in fp32,
   silu(g) = g * sigmoid(g) with e = e^-|g| (I a multiple of 16). */
void silu_mul_bf16(const uint16_t* gu, uint16_t* m, int64_t N, int64_t I) {
    _Pragma("omp parallel for schedule(static) if(N * I >= 65536)")
    for (int64_t n = 0; n < N; n++) {
        const uint16_t* g = gu + n * 2 * I;
        for (int64_t c = 0; c < I; c += 16) {
            const v16f x = ld_bf16(g + c), u = ld_bf16(g + I + c);
            const v16i neg = x < 0;
            const v16f ax = (v16f)((v16i)x & ~(v16i)((v16u){0} + 0x80000000u));
            const v16f e = exp_nonpos((v16f){0} - ax);
            const v16f num = (v16f)(((v16i)e & neg) | ((v16i)((v16f){0} + 1.0f) & ~neg));
            st_bf16(m + n * I + c, x * (num / (1.0f + e)) * u);
        }
    }
}
