/* The AMX-INT8 path of qmm.c: many activation rows times a tile pair's codes (16
   outputs) on the tile unit (tdpbssd), up to 16 rows (R) a tile: the K-quants' A tiles
   from the rows' copy in tile order (qacts.a256), the 32-input types' straight from the
   rounded rows at their stride. Every C row depends on its A row only; a
   group's rows past the call's come from padding rows of the scratch and are dropped.
   The fp32 steps per block are the 512-bit path's (qmm_vnni.h), in the scalar path's
   order, so a row's bits are the scalar path's. Needs QMM_AVX512.

   Q4_K and Q6_K, as scaled planes. A K-quant's sub-blocks (32 inputs; Q6_K: 16) each have
   a scale per output, which the tile unit cannot apply, and applying it to each row's
   sums per sub-block (llama.cpp's AMX kernels do) costs more than the products. So each
   weight's sub-block scale is multiplied in once per block (vpmaddubsw, less 32 sc for
   Q6_K's offset: w = Q4_K's sc q, 0 <= w <= 945, or Q6_K's sc (q - 32), |w| <= 4096, fits
   16 bits) and its two bytes become two planes, w = 256 hi + lo: lo the low byte, unsigned
   (tdpbsud), hi the high one, signed (tdpbssd); one vpermt2b gathers a plane's 64 bytes
   from the even and odd inputs' products. The tiles then take a whole block, 64 inputs a
   tile product, the sums accumulating in the tile unit, and each row reads two sums a
   block: S = 256 C_hi + C_lo = sum w x, exactly the scalar path's integer total (Q4_K's
   sum sc q x; Q6_K's sum sc q x - 32 sum sc x, so no row needs its sub-blocks' sums of x:
   Q6_K 694 -> 548 ms per 1.54 G weights at 256 rows, 2 threads, the same at 16).
   (Measured on a Xeon with AMX, one thread, [8960, 1536], planes then split by shifts and
   masks: Q4_K 1.28 ms at 16 rows against 1.30 for per-sub-block sums and 1.45 on 512-bit
   VNNI, 2.56 against 3.51 at 48; Q6_K 1.62 against 2.28 and 1.79. The byte split costs 6%
   less at 16 rows than the shifts.)

   The 32-input types, as items: a block's codes unpacked into one B tile (its second half
   zero, so the tiles' shapes are the planes'), its sums read per row (one scale per
   block: the fp32 step reads them anyway).

   A tile load waits for the stores in flight to its bytes, and sums come back through
   memory, so work is pipelined over a pair's blocks (items): unpacked AMX_LU ahead of
   their tiles, their sums read AMX_LC after (a B tile loaded right after its stores cost
   ~95 cycles an item here, 4 items later ~30). */

#ifdef QMM_AMX
#define AMX_LU 3   /* items between a B tile's stores and its load */
#define AMX_LC 2   /* items between a C tile's store and its sums' loads */
#define AMX_RB 8   /* B ring slots (> AMX_LU) */
#define AMX_RC 4   /* C ring slots (> AMX_LC) */
/* rows per pass over a tile pair: a pass unpacks the pair's blocks, so the tiles take 256
   rows where the 8-row paths take 64 (a thread's stack then holds ~120 KB of a pass's sums
   and accumulators; measured on a Xeon with AMX, [8960, 1536], 2 threads, 256 rows: Q4_K
   810 -> 708 ms per 1.54 G weights against passes of 64, Q6_K 1055 -> 840; the 8-row paths
   gain nothing from longer passes) */
#define AMX_RB_ROWS 256
#define AMX_CROWS (AMX_RB_ROWS + 16)  /* C rows a pass may store: its rows rounded up to R */

/* a thread's buffers (on its stack in qmm), by ring slot: a K-quant block's two planes
   (4 B tiles of 16 x 64 each) and its two sums per row, or a 32-input block's B tile
   and its sums */
typedef struct {
    union {
        struct {
            uint8_t pb[2][2][4][1024] __attribute__((aligned(64)));
            int32_t pc[2][2][AMX_CROWS * 16] __attribute__((aligned(64)));
        };
        struct {
            uint8_t bt[AMX_RB][1024] __attribute__((aligned(64)));  /* rows 8-15 zero (amx_work_init) */
            int32_t ct[AMX_RC][AMX_CROWS * 16] __attribute__((aligned(64)));
        };
    };
} amx_work;

/* tiles: 0, 1 B (16 x 64: the planes hi, lo); 2, 7 A (R x 64: two groups of rows); 3, 4
   and 5, 6 C (R x 64: hi, lo of each group). A 32-input block is a B tile whose rows 8-15
   are zero: its A tile reads 64 bytes, the 32 past the block times zero. */
static void amx_configure(int R) {
    qtilecfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) { c.colsb[i] = 64; c.rows[i] = i < 2 ? 16 : (uint8_t)R; }
    T_CONFIG(&c);
}

/* the 256-form's rows in the A tiles' order (qacts.a256): group g of 16 rows, chunk c of 64
   inputs at (g K / 64 + c) KB; the last group's rows past M are the padding rows */
static void amx_a_tiles(const qacts* A, int64_t M) {
    const int64_t K = A->K, ch = K / 64;
    _Pragma("omp parallel for schedule(static) if(M > 16)")
    for (int64_t gc = 0; gc < (M + 15) / 16 * ch; gc++) {
        const int8_t* src = A->q256 + (gc / ch) * 16 * K + (gc % ch) * 64;
        for (int i = 0; i < 16; i++) memcpy(A->a256 + gc * 1024 + 64 * i, src + i * K, 64);
    }
}

/* the items' B tiles' zero rows, once a call */
static void amx_work_init(amx_work* X) {
    for (int s = 0; s < AMX_RB; s++) memset(X->bt[s] + 512, 0, 512);
}

/* one tile pair's pass: its type and blocks, the rows, the accumulators */
typedef struct {
    int64_t t, nb, m0, mc;
    int R;
    const uint8_t *P0, *P1;
    const qacts* A;
    float* acc;
    amx_work* X;
    __m512i* S;
    qpf* pf;  /* the stream ahead of the block being unpacked, asked through the iteration */
} amx_job;

/* ---- Q4_K and Q6_K: planes */

/* vpshufb controls giving, in a 64-byte row of 16 outputs x 4 inputs, each output's scale
   at its even (parity 0) or odd (parity 1) inputs and 0 at the others, for vpmaddubsw; the
   scales come from a vector whose 128-bit lane L holds those of outputs 4 L .. 4 L + 3:
   [0] Q4_K (output o at byte o), [1 + h] Q6_K's sub-block 2 g + h (byte 2 (o mod 8) + h of
   the tile's scale pairs). planes_sel: vpermt2b controls taking byte h (0 low, 1 high) of
   the even inputs' 16-bit products (lane i: input 2 i) and of the odd ones' into the row's
   byte order. Filled once, at load. */
static int8_t planes_ctl[3][2][64] __attribute__((aligned(64)));
static int8_t planes_sel[2][64] __attribute__((aligned(64)));

__attribute__((constructor)) static void planes_ctl_init(void) {
    for (int v = 0; v < 3; v++)
        for (int odd = 0; odd < 2; odd++)
            for (int L = 0; L < 4; L++)
                for (int i = 0; i < 4; i++)
                    for (int e = 0; e < 4; e++) {
                        const int o = 4 * L + i, idx = v == 0 ? o : 2 * (o % 8) + (v - 1);
                        planes_ctl[v][odd][16 * L + 4 * i + e] = (int8_t)((e & 1) == odd ? idx : 0x80);
                    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 32; i++) { planes_sel[h][2 * i] = (int8_t)(2 * i + h); planes_sel[h][2 * i + 1] = (int8_t)(64 + 2 * i + h); }
}

static inline __m512i scale_bytes(__m512i src, int v, int odd) {
    return _mm512_shuffle_epi8(src, _mm512_load_si512((const __m512i*)planes_ctl[v][odd]));
}

/* a chunk row of codes times its scales (se: even inputs', so: odd inputs'), less the
   offsets ce, co (the same scales times the type's offset: Q6_K's 32, Q4_K none), as the
   planes' bytes: w = 256 hi + lo (sl, sh: planes_sel) */
static inline void split_planes(__m512i q, __m512i se, __m512i so, __m512i ce, __m512i co, __m512i sl, __m512i sh,
                                uint8_t* hi, uint8_t* lo) {
    const __m512i pe = _mm512_sub_epi16(_mm512_maddubs_epi16(q, se), ce);  /* inputs 0, 2 */
    const __m512i po = _mm512_sub_epi16(_mm512_maddubs_epi16(q, so), co);  /* inputs 1, 3 */
    _mm512_store_si512((__m512i*)lo, _mm512_permutex2var_epi8(pe, sl, po));
    _mm512_store_si512((__m512i*)hi, _mm512_permutex2var_epi8(pe, sh, po));
}

/* block b's planes into slot s: B tile t covers inputs 64 t .. 64 t + 63 (rows: chunks) */
static void planes_unpack(const amx_job* J, int64_t b, int s) {
    const int64_t tb = q_tile_bytes(J->t);
    const uint8_t *p0 = J->P0 + b * tb, *p1 = J->P1 + b * tb;
    uint8_t (*pb)[4][1024] = J->X->pb[s];
    const __m512i sl = _mm512_load_si512((const __m512i*)planes_sel[0]), sh = _mm512_load_si512((const __m512i*)planes_sel[1]);
    const __m512i zero = _mm512_setzero_si512(), c32 = _mm512_set1_epi8(32);
    __m512i w[8];
    if (J->t == QT_Q4_K) {
        for (int j = 0; j < 8; j++) {  /* the 16 outputs' scales of sub-block j in every lane */
            qpf_step(J->pf, J->pf->q);
            const __m512i src = _mm512_broadcast_i32x4(ld2q(p0 + 1024 + 8 * j, p1 + 1024 + 8 * j));
            const __m512i se = scale_bytes(src, 0, 0), so = scale_bytes(src, 0, 1);
            nibbles16(p0 + 128 * j, p1 + 128 * j, w);
            for (int c = 0; c < 8; c++) {
                const int row = 8 * (j & 1) + c;
                split_planes(w[c], se, so, zero, zero, sl, sh, pb[0][j / 2] + 64 * row, pb[1][j / 2] + 64 * row);
            }
        }
        return;
    }
    for (int g = 0; g < 8; g++) {  /* the scale pairs (sc[2g][o], sc[2g + 1][o]): tile 0's in lanes 0-1, 1's in 2-3 */
        qpf_step(J->pf, J->pf->q);
        const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p0 + 1536 + 16 * g)));
        const __m256i c1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(p1 + 1536 + 16 * g)));
        const __m512i src = _mm512_inserti64x4(_mm512_castsi256_si512(a), c1, 1);
        chunks16_q6k(p0, p1, g, w);
        for (int h = 0; h < 2; h++) {  /* chunks 4 h .. 4 h + 3: sub-block 2 g + h */
            const __m512i se = scale_bytes(src, 1 + h, 0), so = scale_bytes(src, 1 + h, 1);
            const __m512i ce = _mm512_maddubs_epi16(c32, se), co = _mm512_maddubs_epi16(c32, so);  /* 32 sc */
            for (int c = 4 * h; c < 4 * h + 4; c++) {
                const int row = 8 * (g & 1) + c;
                split_planes(w[c], se, so, ce, co, sl, sh, pb[0][g / 2] + 64 * row, pb[1][g / 2] + 64 * row);
            }
        }
    }
}

/* block b's two sums per row of the pass into slot s, the block's 4 B tiles per plane
   accumulated in the tile unit; two groups of rows share each B tile's load */
static void planes_tiles(const amx_job* J, int64_t b, int s) {
    const int64_t K = J->A->K, R = J->R;
    uint8_t (*pb)[4][1024] = J->X->pb[s];
    int32_t *hi = J->X->pc[s][0], *lo = J->X->pc[s][1];
    const int8_t* x = J->A->a256 + ((J->m0 / 16) * (K / 64) + 4 * b) * 1024;  /* group 0's chunk 0 of block b */
    for (int64_t g = 0; g * R < J->mc; g += 2) {
        const int two = (g + 1) * R < J->mc;
        T_ZERO(3); T_ZERO(4);
        if (two) { T_ZERO(5); T_ZERO(6); }
        for (int t = 0; t < 4; t++) {
            qpf_step(J->pf, J->pf->q);
            T_LOAD(0, pb[0][t], 64); T_LOAD(1, pb[1][t], 64);
            T_LOAD(2, x + (g * K / 64 + t) * 1024, 64); T_DP(3, 2, 0); T_DPSU(4, 2, 1);
            if (two) { T_LOAD(7, x + ((g + 1) * K / 64 + t) * 1024, 64); T_DP(5, 7, 0); T_DPSU(6, 7, 1); }
        }
        T_STORE(3, hi + g * R * 16, 64); T_STORE(4, lo + g * R * 16, 64);
        if (two) { T_STORE(5, hi + (g + 1) * R * 16, 64); T_STORE(6, lo + (g + 1) * R * 16, 64); }
    }
}

/* block b's sums: S = 256 C_hi + C_lo per row, then the block's fp32 steps */
static void planes_sums(const amx_job* J, int64_t b, int s) {
    const int64_t tb = q_tile_bytes(J->t), m0 = J->m0, mc = J->mc;
    const uint8_t *p0 = J->P0 + b * tb, *p1 = J->P1 + b * tb;
    qpf_step(J->pf, J->pf->left);
    for (int64_t r = 0; r < mc; r++)
        J->S[r] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const __m512i*)(J->X->pc[s][0] + 16 * r)), 8),
                                   _mm512_load_si512((const __m512i*)(J->X->pc[s][1] + 16 * r)));
    if (J->t == QT_Q4_K) finish16_q4k(p0, p1, b, J->A, m0, mc, J->S, J->acc);
    else finish16_q6k(p0, p1, b, J->A, m0, mc, J->S, NULL, J->acc);  /* the planes hold sc (q - 32): S is the total */
}

/* ---- the 32-input types: items (blocks) */

/* step 1: block k's codes as B rows in slot k % AMX_RB */
static inline void item_unpack(const amx_job* J, int64_t k) {
    const int64_t tb = q_tile_bytes(J->t);
    const uint8_t *p0 = J->P0 + k * tb, *p1 = J->P1 + k * tb;
    qpf_whole(J->pf, J->P0, J->P1, J->nb, tb, k);
    __m512i w[8];
    chunks16_32(J->t, p0, p1, w);
    uint8_t* bt = J->X->bt[k % AMX_RB];
    for (int c = 0; c < 8; c++) _mm512_store_si512((__m512i*)(bt + 64 * c), w[c]);
}

/* step 2: block k's sums for each group of R rows */
static inline void item_tiles(const amx_job* J, int64_t k) {
    const int64_t K = J->A->K, R = J->R;
    int32_t* c = J->X->ct[k % AMX_RC];
    const int8_t* x = J->A->q32 + J->m0 * K + 32 * k;
    T_LOAD(0, J->X->bt[k % AMX_RB], 64);
    for (int64_t g = 0; g * R < J->mc; g++) { T_LOAD(2, x + g * R * K, K); T_ZERO(3); T_DP(3, 2, 0); T_STORE(3, c + g * R * 16, 64); }
}

/* step 3: block k's fp32 step per row */
static inline void item_sums(const amx_job* J, int64_t k) {
    const int64_t K = J->A->K, t = J->t, tb = q_tile_bytes(t), off = offset_32(t);
    const int32_t* c = J->X->ct[k % AMX_RC];
    const uint8_t *p0 = J->P0 + k * tb, *p1 = J->P1 + k * tb;
    const __m512 d = half16(p0 + dpos_32(t), p1 + dpos_32(t));
    const __m512 m = t == QT_Q4_1 ? half16(p0 + 144, p1 + 144) : _mm512_setzero_ps();
    for (int64_t r = 0; r < J->mc; r++) {
        const int64_t bi = (J->m0 + r) * (K / 32) + k;
        __m512i s = _mm512_load_si512((const __m512i*)(c + 16 * r));
        if (off) s = _mm512_sub_epi32(s, _mm512_set1_epi32((int32_t)off * J->A->b32[bi]));
        finish16_32(t, s, d, m, J->A, bi, J->acc + 16 * r);
    }
}

/* rows m0 .. m0 + mc of a tile pair's pass on the tiles (R rows per A tile) */
static void pair_amx(int64_t t, const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0,
                     int64_t mc, float* acc, int R, amx_work* X) {
    __m512i S[AMX_RB_ROWS];
    qpf pf;
    const amx_job J = {t, nb, m0, mc, R, P0, P1, A, acc, X, S, &pf};
    if (q_qk(t) == 256) {  /* a block unpacked a block ahead of its tiles, its sums read a block after */
        for (int64_t k = 0; k < nb + 2; k++) {
            qpf_begin(&pf, P0, P1, nb, q_tile_bytes(t), k, 16);  /* half in the unpack, a quarter in the tiles */
            if (k < nb) planes_unpack(&J, k, (int)(k & 1));
            if (k >= 1 && k - 1 < nb) planes_tiles(&J, k - 1, (int)((k - 1) & 1));
            if (k >= 2) planes_sums(&J, k - 2, (int)(k & 1));
        }
        return;
    }
    for (int64_t k = 0; k < nb + AMX_LU + AMX_LC; k++) {
        if (k < nb) item_unpack(&J, k);
        if (k >= AMX_LU && k - AMX_LU < nb) item_tiles(&J, k - AMX_LU);
        if (k >= AMX_LU + AMX_LC) item_sums(&J, k - AMX_LU - AMX_LC);
    }
}
#endif
