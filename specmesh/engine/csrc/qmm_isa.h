/* Which int8 paths this build of qmm.c has, and the few operations they share.

   Native build (-march=native): each path is compiled where the compiler targets its ISA
   (the CPU's CPUID flags, through -march=native): QMM_AVX2 (AVX2 + FMA + F16C),
   QMM_VNNI256 (AVX-VNNI, or AVX-512 VNNI with VL: vpdpbusd on 256-bit vectors),
   QMM_AVX512 (AVX-512 F/BW/VL + VNNI: vpdpbusd on 512-bit vectors), QMM_AMX (AMX-INT8
   tiles, with AVX-512 and VBMI's vpermt2b for the steps around them; every AMX CPU has
   both).

   SIMDe build (-DQMM_SIMDE, compiled for x86-64-v3): every path is compiled whatever the
   CPU has; the AVX-512 and VNNI intrinsics come from SIMDe's portable implementations
   (Debian's libsimde-dev), and the AMX tile instructions from the plain-C stand-in below.
   Tests run that build bitwise against the scalar path on machines without the ISA, so
   the same kernel text is checked everywhere.

   Knows nothing of block types or layouts (qmm_layout.h) or of the kernels (qmm.c). */

#if defined(QMM_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/fma.h>
#include <simde/x86/f16c.h>
#define QMM_AVX2 1
#define QMM_VNNI256 1
#define QMM_AVX512 1
#define QMM_AMX 1
#define QMM_AMX_EMU 1
#else
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QMM_AVX2 1
#endif
#if defined(QMM_AVX2) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define QMM_VNNI256 1
#endif
#if defined(QMM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QMM_AVX512 1
#endif
#if defined(QMM_AVX512) && defined(__AVX512VBMI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QMM_AMX 1
#endif
#endif

#ifdef QMM_VNNI256
/* 8 lanes of 4 u8 x s8 products added into acc (vpdpbusd): the VEX form where the CPU has
   AVX-VNNI and no AVX-512 VL, the EVEX form otherwise (same result) */
#if defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(QMM_SIMDE)
#define DPB256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define DPB256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#endif

#ifdef QMM_AVX512
/* the 512-bit conversions SIMDe 0.7 lacks, from two 256-bit halves there */
#ifdef QMM_SIMDE
static inline __m512i cat256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512 cvt_i32_f32(__m512i v) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm512_castsi512_si256(v)), hi = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(v, 1));
    return _mm512_castsi512_ps(cat256(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m512 cvt_f16_f32(__m256i h) {
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    return _mm512_castsi512_ps(cat256(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m512i cvt_u8_i32(__m128i v) {
    return cat256(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
static inline __m512i cvt_i8_i32(__m128i v) {
    return cat256(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
static inline __m512i cvt_u8_i16(__m256i v) {
    return cat256(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)));
}
static inline __m512i sra32(__m512i v, int n) {
    return cat256(_mm256_srai_epi32(_mm512_castsi512_si256(v), n), _mm256_srai_epi32(_mm512_extracti64x4_epi64(v, 1), n));
}
#else
#define cvt_i32_f32(v) _mm512_cvtepi32_ps(v)
#define cvt_f16_f32(h) _mm512_cvtph_ps(h)
#define cvt_u8_i32(v) _mm512_cvtepu8_epi32(v)
#define cvt_i8_i32(v) _mm512_cvtepi8_epi32(v)
#define cvt_u8_i16(v) _mm512_cvtepu8_epi16(v)
#define sra32(v, n) _mm512_srai_epi32(v, n)
#endif
#endif

#ifdef QMM_AMX
/* the tile configuration (64 bytes: palette 1, then each tile's bytes per row and rows) */
typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } qtilecfg;
#ifdef QMM_AMX_EMU
/* The stand-in: eight tiles of up to 16 rows x 64 bytes per thread, the configuration's
   shapes, and the five instructions the kernel uses, as the architecture defines them
   (tileloadd / tilestored: `rows` rows of `colsb` bytes at a stride, the rest of the tile
   zero; tilezero; tdpbssd: C[m][n] += sum over k < colsb(A) of A[m][k] * B[k / 4][4 n +
   k % 4], signed bytes, int32 sums; tdpbsud: the same with B's bytes unsigned). */
typedef struct { int rows, colsb; uint8_t d[16][64]; } emu_tile;
static _Thread_local emu_tile emu_t[8];
static void emu_config(const qtilecfg* c) {
    for (int i = 0; i < 8; i++) { emu_t[i].rows = c->rows[i]; emu_t[i].colsb = c->colsb[i]; memset(emu_t[i].d, 0, 1024); }
}
static void emu_load(int t, const void* p, int64_t stride) {
    emu_tile* T = &emu_t[t];
    memset(T->d, 0, 1024);
    for (int r = 0; r < T->rows; r++) memcpy(T->d[r], (const uint8_t*)p + r * stride, (size_t)T->colsb);
}
static void emu_store(int t, void* p, int64_t stride) {
    const emu_tile* T = &emu_t[t];
    for (int r = 0; r < T->rows; r++) memcpy((uint8_t*)p + r * stride, T->d[r], (size_t)T->colsb);
}
static void emu_dp(int c, int a, int b, int b_unsigned) {
    emu_tile *C = &emu_t[c], *A = &emu_t[a], *B = &emu_t[b];
    for (int m = 0; m < C->rows; m++)
        for (int n = 0; n < C->colsb / 4; n++) {
            int32_t s;
            memcpy(&s, C->d[m] + 4 * n, 4);
            for (int k = 0; k < A->colsb; k++) {
                const uint8_t w = B->d[k / 4][4 * n + k % 4];
                s += (int8_t)A->d[m][k] * (b_unsigned ? (int32_t)w : (int32_t)(int8_t)w);
            }
            memcpy(C->d[m] + 4 * n, &s, 4);
        }
}
#define T_CONFIG(cfg) emu_config(cfg)
#define T_RELEASE() ((void)0)
#define T_LOAD(t, p, s) emu_load(t, p, s)
#define T_STORE(t, p, s) emu_store(t, p, s)
#define T_ZERO(t) memset(emu_t[t].d, 0, 1024)
#define T_DP(c, a, b) emu_dp(c, a, b, 0)
#define T_DPSU(c, a, b) emu_dp(c, a, b, 1)
static int amx_permission(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>
#define T_CONFIG(cfg) _tile_loadconfig(cfg)
#define T_RELEASE() _tile_release()
#define T_LOAD(t, p, s) _tile_loadd(t, p, s)
#define T_STORE(t, p, s) _tile_stored(t, p, s)
#define T_ZERO(t) _tile_zero(t)
#define T_DP(c, a, b) _tile_dpbssd(c, a, b)
#define T_DPSU(c, a, b) _tile_dpbsud(c, a, b)
/* Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) */
static int amx_permission(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
#endif
#endif
