/* The AMX-INT8 path of qmm.c: two or more activation rows times a tile pair's codes on
   the tile unit (tdpbssd), the way llama.cpp's AMX kernels treat K-quants.

   Each item (a Q4_K sub-block of 32 inputs, a Q6_K group of 32, a 32-form block) takes
   three steps, pipelined over the items of a tile pair (16 outputs):
   1. unpack: the pair's codes as bytes into a B tile's rows (row c holds chunk c of both
      tiles: the tile unit's VNNI order, as the tiles already store it);
   2. tiles: B loaded once, times up to 16 activation rows at a time read straight from
      the rounded rows (A: R rows of 32 or 16 bytes at the row stride), the int32 sums
      stored for the rows;
   3. sums: the sub-block scales applied as integers and, at a block's end, the fp32
      steps of the 512-bit path (qmm_vnni.h), so a row's bits are the scalar path's.
   A tile load waits for stores in flight to its bytes, and the sums come back through
   memory, so item k is unpacked AMX_LU items before its tiles run and its sums are read
   AMX_LC items after (measured on a Xeon with AMX: a B tile loaded right after its
   stores cost ~95 cycles an item, 4 items later ~30). B and C tiles alternate between
   consecutive items.

   Q4_K's codes enter the tiles as q - 8 (-8..7), so a sub-block's sum stays within 16 bits
   (32 x 8 x 127) and one vpdpwssd applies its 6-bit scale: S += (q - 8) x sc. Where the
   block ends, 8 sum_j sc_j (sum of x over sub-block j) restores sum q x exactly. Q6_K's
   groups (two sub-blocks of 16, codes 0..63) keep vpmulld.

   Every C row depends on its A row only; a group's rows past the call's come from padding
   rows of the scratch and are dropped. Needs QMM_AVX512. */

#ifdef QMM_AMX
#define AMX_LU 3   /* items between a B tile's stores and its load */
#define AMX_LC 2   /* items between a C tile's store and its sums' loads */
#define AMX_RB 8   /* B ring slots (> AMX_LU) */
#define AMX_RC 4   /* C ring slots (> AMX_LC) */
#define AMX_CROWS (QMM_RB + 16)  /* C rows a pass may store: its rows rounded up to R */

/* a thread's buffers (on its stack in qmm): B tiles' bytes and C tiles' sums by ring slot */
typedef struct {
    uint8_t bt[AMX_RB][512] __attribute__((aligned(64)));
    int32_t ct[AMX_RC][2][AMX_CROWS * 16] __attribute__((aligned(64)));
} amx_work;

/* tiles: 0, 1 B (8 x 64); 2 A (R x 32); 3, 4 C (R x 64); 5, 6 B (4 x 64); 7 A (R x 16) */
static void amx_configure(int R) {
    qtilecfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    static const uint8_t brows[8] = {8, 8, 0, 0, 0, 4, 4, 0};
    static const uint16_t colsb[8] = {64, 64, 32, 64, 64, 64, 64, 16};
    for (int i = 0; i < 8; i++) { c.colsb[i] = colsb[i]; c.rows[i] = brows[i] ? brows[i] : (uint8_t)R; }
    T_CONFIG(&c);
}

/* one tile pair's pass: its type and blocks, the rows, the accumulators */
typedef struct {
    int64_t t, nb, m0, mc;
    int R;
    const uint8_t *P0, *P1;
    const qacts* A;
    float* acc;
    amx_work* X;
    __m512i *S, *Bs;
} amx_job;

static inline int64_t amx_items(const amx_job* J) { return q_qk(J->t) == 32 ? J->nb : 8 * J->nb; }

/* step 1: item k's codes as B rows in slot k % AMX_RB */
static inline void amx_unpack(const amx_job* J, int64_t k) {
    const int64_t tb = q_tile_bytes(J->t), b = q_qk(J->t) == 32 ? k : k / 8, j = q_qk(J->t) == 32 ? 0 : k % 8;
    const uint8_t *p0 = J->P0 + b * tb, *p1 = J->P1 + b * tb;
    if (j == 0 && b + 2 < J->nb) prefetch2(p0, p1, tb);
    __m512i w[8];
    if (J->t == QT_Q4_K) {
        nibbles16(p0 + 128 * j, p1 + 128 * j, w);
        for (int c = 0; c < 8; c++) w[c] = _mm512_sub_epi8(w[c], _mm512_set1_epi8(8));
    } else if (J->t == QT_Q6_K) chunks16_q6k(p0, p1, (int)j, w);
    else chunks16_32(J->t, p0, p1, w);
    uint8_t* bt = J->X->bt[k % AMX_RB];
    for (int c = 0; c < 8; c++) _mm512_store_si512((__m512i*)(bt + 64 * c), w[c]);
}

/* step 2: item k's C for each group of R rows: K = 32 (B tile k % 2, C tile 3 + k % 2),
   or Q6_K's two halves of 16 (B rows 0-3 and 4-7) into C tiles 3 and 4 */
static inline void amx_tiles(const amx_job* J, int64_t k) {
    const int64_t K = J->A->K, R = J->R;
    const uint8_t* bt = J->X->bt[k % AMX_RB];
    int32_t *c0 = J->X->ct[k % AMX_RC][0], *c1 = J->X->ct[k % AMX_RC][1];
    const int8_t* x = q_qk(J->t) == 32 ? J->A->q32 + J->m0 * K + 32 * k
                                       : J->A->q256 + J->m0 * K + 256 * (k / 8) + 32 * (k % 8);
    if (J->t == QT_Q6_K) {
        T_LOAD(5, bt, 64);
        T_LOAD(6, bt + 256, 64);
        for (int64_t g = 0; g * R < J->mc; g++) {
            const int8_t* xg = x + g * R * K;
            T_LOAD(7, xg, K); T_ZERO(3); T_DP(3, 7, 5); T_STORE(3, c0 + g * R * 16, 64);
            T_LOAD(7, xg + 16, K); T_ZERO(4); T_DP(4, 7, 6); T_STORE(4, c1 + g * R * 16, 64);
        }
    } else if (k & 1) {
        T_LOAD(1, bt, 64);
        for (int64_t g = 0; g * R < J->mc; g++) { T_LOAD(2, x + g * R * K, K); T_ZERO(4); T_DP(4, 2, 1); T_STORE(4, c0 + g * R * 16, 64); }
    } else {
        T_LOAD(0, bt, 64);
        for (int64_t g = 0; g * R < J->mc; g++) { T_LOAD(2, x + g * R * K, K); T_ZERO(3); T_DP(3, 2, 0); T_STORE(3, c0 + g * R * 16, 64); }
    }
}

/* Q4_K's scale pairs (sc[2p], sc[2p + 1]) of each output as int16 in its lane */
static inline __m512i q4k_scale_pairs(const uint8_t* p0, const uint8_t* p1, int p) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(p0 + 1024 + 16 * p)), b = _mm_loadu_si128((const __m128i*)(p1 + 1024 + 16 * p));
    return cvt_u8_i16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, _mm_srli_si128(a, 8))),
                                              _mm_unpacklo_epi8(b, _mm_srli_si128(b, 8)), 1));
}

/* step 3: item k's sums into the rows' accumulators; a block's last item finishes it */
static inline void amx_sums(const amx_job* J, int64_t k) {
    const int64_t K = J->A->K, mc = J->mc, m0 = J->m0;
    const int32_t *c0 = J->X->ct[k % AMX_RC][0], *c1 = J->X->ct[k % AMX_RC][1];
    __m512i *S = J->S, *Bs = J->Bs;
    if (q_qk(J->t) == 32) {
        const int64_t t = J->t, tb = q_tile_bytes(t), off = offset_32(t);
        const uint8_t *p0 = J->P0 + k * tb, *p1 = J->P1 + k * tb;
        const __m512 d = half16(p0 + dpos_32(t), p1 + dpos_32(t));
        const __m512 m = t == QT_Q4_1 ? half16(p0 + 144, p1 + 144) : _mm512_setzero_ps();
        for (int64_t r = 0; r < mc; r++) {
            const int64_t bi = (m0 + r) * (K / 32) + k;
            __m512i s = _mm512_load_si512((const __m512i*)(c0 + 16 * r));
            if (off) s = _mm512_sub_epi32(s, _mm512_set1_epi32((int32_t)off * J->A->b32[bi]));
            finish16_32(t, s, d, m, J->A, bi, J->acc + 16 * r);
        }
        return;
    }
    const int64_t b = k / 8, j = k % 8, tb = q_tile_bytes(J->t);
    const uint8_t *p0 = J->P0 + b * tb, *p1 = J->P1 + b * tb;
    if (J->t == QT_Q4_K) {
        const __m512i sc = cvt_u8_i32(ld2q(p0 + 1024 + 8 * j, p1 + 1024 + 8 * j));
        for (int64_t r = 0; r < mc; r++)
            S[r] = _mm512_dpwssd_epi32(j ? S[r] : _mm512_setzero_si512(), _mm512_load_si512((const __m512i*)(c0 + 16 * r)), sc);
        if (j < 7) return;
        __m512i sp[4];
        for (int p = 0; p < 4; p++) sp[p] = q4k_scale_pairs(p0, p1, p);
        for (int64_t r = 0; r < mc; r++) {  /* + 8 sum_j sc_j (sum of x over sub-block j): sum of q x */
            const int16_t* bs = J->A->bk32 + (m0 + r) * (K / 32) + 8 * b;
            __m512i e = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) e = _mm512_dpwssd_epi32(e, sp[p], bc512(bs + 2 * p));
            S[r] = _mm512_add_epi32(S[r], _mm512_slli_epi32(e, 3));
        }
        finish16_q4k(p0, p1, b, J->A, m0, mc, S, J->acc);
        return;
    }
    __m512i pr, s0, s1;
    scales16_q6k(p0, p1, (int)j, &pr, &s0, &s1);
    for (int64_t r = 0; r < mc; r++) {
        const __m512i p = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512((const __m512i*)(c0 + 16 * r)), s0),
                                           _mm512_mullo_epi32(_mm512_load_si512((const __m512i*)(c1 + 16 * r)), s1));
        const __m512i q = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pr,
                                              bc512(J->A->b16 + (m0 + r) * (K / 16) + 16 * b + 2 * j));
        S[r] = j ? _mm512_add_epi32(S[r], p) : p;
        Bs[r] = j ? _mm512_add_epi32(Bs[r], q) : q;
    }
    if (j == 7) finish16_q6k(p0, p1, b, J->A, m0, mc, S, Bs, J->acc);
}

/* rows m0 .. m0 + mc of a tile pair's pass on the tiles (R rows per A tile) */
static void pair_amx(int64_t t, const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0,
                     int64_t mc, float* acc, int R, amx_work* X) {
    __m512i S[QMM_RB], Bs[QMM_RB];
    const amx_job J = {t, nb, m0, mc, R, P0, P1, A, acc, X, S, Bs};
    const int64_t n = amx_items(&J);
    for (int64_t k = 0; k < n + AMX_LU + AMX_LC; k++) {
        if (k < n) amx_unpack(&J, k);
        if (k >= AMX_LU && k - AMX_LU < n) amx_tiles(&J, k - AMX_LU);
        if (k >= AMX_LU + AMX_LC) amx_sums(&J, k - AMX_LU - AMX_LC);
    }
}
#endif
