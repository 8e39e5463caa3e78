/* The vpdpbusd paths of qmm.c: four unsigned weight codes times four signed activation
   bytes added into a 32-bit lane in one instruction, where AVX2 needs vpmaddubsw,
   vpaddw and vpmaddwd.

   - 256-bit (AVX-VNNI, or AVX-512 VNNI with VL), on the 8-row tiles as stored: a
     chunk vector (4 inputs of 8 outputs) times a broadcast of the row's 4 bytes.
   - 512-bit (AVX-512 VNNI), on tile pairs: the same chunk vector of two tiles side by
     side (16 outputs), so one instruction does 64 products and one broadcast feeds both.

   A sub-block's products are exact int32 sums; a type's scales multiply them as integers
   (vpmulld, vpdpwssd) and the fp32 steps per block are the scalar path's, in its order,
   so every path gives the scalar path's bits. Q8_0's signed codes: the 256-bit path moves
   their sign onto the activation (|w| times sign(w) x); the 512-bit one adds 128 to each
   code and subtracts 128 times the block's activation sum.

   Includes the 16-output helpers the AMX path shares (qmm_amx.h). Expects qmm.c's
   activation rows (qacts), layout (qmm_layout.h) and AVX2 helpers. */

#ifdef QMM_VNNI256
/* the 32-form types, 8 outputs */
static void tile_vnni_32(int64_t t, const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
    const int64_t K = A->K, tb = q_tile_bytes(t);
    const __m256i one8 = _mm256_set1_epi8(1);
    const int corr = t == QT_Q4_0 ? 8 : t == QT_Q5_0 ? 16 : 0;
    const uint8_t* T0 = T;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, T += tb) {
        qpf_whole(&pf, T0, NULL, nb, tb, b);
        __m256i w[8], wa[8];
        if (t == QT_Q8_0) for (int c = 0; c < 8; c++) { w[c] = ld(T + 32 * c); wa[c] = _mm256_abs_epi8(w[c]); }
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
            __m256i S = _mm256_setzero_si256();
            if (t == QT_Q8_0) for (int c = 0; c < 8; c++) S = DPB256(S, wa[c], _mm256_sign_epi8(bc32(x + 4 * c), w[c]));
            else for (int c = 0; c < 8; c++) S = DPB256(S, w[c], bc32(x + 4 * c));
            if (corr) S = _mm256_sub_epi32(S, _mm256_set1_epi32(corr * A->b32[bi]));
            __m256 a = _mm256_loadu_ps(acc + 8 * r);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(A->d32[bi])), a);
            if (t == QT_Q4_1) a = _mm256_fmadd_ps(m, _mm256_set1_ps(A->s32[bi]), a);
            _mm256_storeu_ps(acc + 8 * r, a);
        }
    }
}

static void tile_vnni_q4k(const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
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
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(T + 1024 + 8 * j)));
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * j;
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) s = DPB256(s, w[c], bc32(x + 4 * c));
                const __m256i p = _mm256_mullo_epi32(s, sc);
                S[r] = j ? _mm256_add_epi32(S[r], p) : p;
            }
        }
        q4k_finish8(T, A, m0, mc, b, S, acc);
    }
}

static void tile_vnni_q6k(const uint8_t* T, int64_t nb, const qacts* A, int64_t m0, int64_t mc, float* acc) {
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
            /* the pair (sc[2g], sc[2g + 1]) of each output as int16 in its 32-bit lane */
            const __m256i pr = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(T + 1536 + 16 * g)));
            const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(pr, 16), 16), s1 = _mm256_srai_epi32(pr, 16);
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * g;
                __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) { lo = DPB256(lo, w[c], bc32(x + 4 * c)); hi = DPB256(hi, w[c + 4], bc32(x + 16 + 4 * c)); }
                const __m256i p = _mm256_add_epi32(_mm256_mullo_epi32(lo, s0), _mm256_mullo_epi32(hi, s1));
                const __m256i q = _mm256_madd_epi16(pr, bc32(A->b16 + (m0 + r) * (K / 16) + 16 * b + 2 * g));
                S[r] = g ? _mm256_add_epi32(S[r], p) : p;
                Bs[r] = g ? _mm256_add_epi32(Bs[r], q) : q;
            }
        }
        q6k_finish8(T, A, m0, mc, b, S, Bs, acc);
    }
}
#endif

#ifdef QMM_AVX512
/* ---- 16 outputs: tile-blocks P0 and P1 (two tiles of one segment) side by side. A pair
   whose second tile is missing passes P1 = P0 and ignores outputs 8..15. acc: [rows][16]. */

/* 32 bytes at a and at b; 16 bytes at a and at b; 8 bytes at a and at b */
static inline __m512i ld2(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}
static inline __m256i ld2h(const uint8_t* a, const uint8_t* b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                   _mm_loadu_si128((const __m128i*)b), 1);
}
static inline __m128i ld2q(const uint8_t* a, const uint8_t* b) {
    int64_t u, v;
    memcpy(&u, a, 8); memcpy(&v, b, 8);
    return _mm_set_epi64x(v, u);
}
static inline __m512 half16(const uint8_t* a, const uint8_t* b) { return cvt_f16_f32(ld2h(a, b)); }
static inline __m512i bc512(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

/* the chunk vectors of 32 inputs, 16 outputs, as codes: nibbles (4 x 32 bytes at p0, p1) */
static inline void nibbles16(const uint8_t* p0, const uint8_t* p1, __m512i* w) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int t = 0; t < 4; t++) {
        const __m512i v = ld2(p0 + 32 * t, p1 + 32 * t);
        w[t] = _mm512_and_si512(v, m4);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

/* a 32-form tile-block's 8 chunk vectors (Q8_0's signed codes as they are) */
static inline void chunks16_32(int64_t t, const uint8_t* P0, const uint8_t* P1, __m512i* w) {
    if (t == QT_Q8_0) { for (int c = 0; c < 8; c++) w[c] = ld2(P0 + 32 * c, P1 + 32 * c); return; }
    nibbles16(P0, P1, w);
    if (t == QT_Q5_0) {
        const __m512i h = ld2(P0 + 128, P1 + 128), one8 = _mm512_set1_epi8(1);
        for (int c = 0; c < 8; c++)
            w[c] = _mm512_or_si512(w[c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, c), one8), 4));
    }
}

/* Q6_K's group g: its 8 chunk vectors, codes 0..63 */
static inline void chunks16_q6k(const uint8_t* P0, const uint8_t* P1, int g, __m512i* w) {
    const __m512i m30 = _mm512_set1_epi8(0x30);
    nibbles16(P0 + 128 * g, P1 + 128 * g, w);
    for (int u = 0; u < 2; u++) {
        const __m512i h = ld2(P0 + 1024 + 64 * g + 32 * u, P1 + 1024 + 64 * g + 32 * u);
        w[4 * u + 0] = _mm512_or_si512(w[4 * u + 0], _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
        w[4 * u + 1] = _mm512_or_si512(w[4 * u + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
        w[4 * u + 2] = _mm512_or_si512(w[4 * u + 2], _mm512_and_si512(h, m30));
        w[4 * u + 3] = _mm512_or_si512(w[4 * u + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
    }
}

/* Q6_K group g's scale pairs: (sc[2g], sc[2g + 1]) of each output as int16 in its lane
   (pr), and each alone as int32 (s0, s1) */
static inline void scales16_q6k(const uint8_t* P0, const uint8_t* P1, int g, __m512i* pr, __m512i* s0, __m512i* s1) {
    *pr = _mm512_cvtepi8_epi16(ld2h(P0 + 1536 + 16 * g, P1 + 1536 + 16 * g));
    *s0 = sra32(_mm512_slli_epi32(*pr, 16), 16);
    *s1 = sra32(*pr, 16);
}

/* the fp32 steps of a 32-form block for one row (the scalar path's): S the exact sum
   after the type's offset */
static inline void finish16_32(int64_t t, __m512i S, __m512 d, __m512 m, const qacts* A, int64_t bi, float* acc) {
    __m512 a = _mm512_loadu_ps(acc);
    a = _mm512_fmadd_ps(cvt_i32_f32(S), _mm512_mul_ps(d, _mm512_set1_ps(A->d32[bi])), a);
    if (t == QT_Q4_1) a = _mm512_fmadd_ps(m, _mm512_set1_ps(A->s32[bi]), a);
    _mm512_storeu_ps(acc, a);
}

/* Q4_K block b after its sub-blocks: the mins' sum per row, then the two fp32 steps */
static void finish16_q4k(const uint8_t* P0, const uint8_t* P1, int64_t b, const qacts* A, int64_t m0, int64_t mc,
                         const __m512i* S, float* acc) {
    const int64_t K = A->K;
    const __m512 d = half16(P0 + 1152, P1 + 1152), dmin = half16(P0 + 1168, P1 + 1168);
    __m512i mp[4];
    for (int p = 0; p < 4; p++) mp[p] = cvt_u8_i16(ld2h(P0 + 1088 + 16 * p, P1 + 1088 + 16 * p));
    for (int64_t r = 0; r < mc; r++) {
        const int16_t* bs = A->bk32 + (m0 + r) * (K / 32) + 8 * b;
        __m512i mn = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) mn = _mm512_dpwssd_epi32(mn, mp[p], bc512(bs + 2 * p));
        const __m512 dx = _mm512_set1_ps(A->d256[(m0 + r) * (K / 256) + b]);
        __m512 a = _mm512_loadu_ps(acc + 16 * r);
        a = _mm512_fmadd_ps(cvt_i32_f32(S[r]), _mm512_mul_ps(d, dx), a);
        a = _mm512_fnmadd_ps(cvt_i32_f32(mn), _mm512_mul_ps(dmin, dx), a);
        _mm512_storeu_ps(acc + 16 * r, a);
    }
}

/* Q6_K block b after its groups: S - 32 Bs (Bs NULL: S is that already), one fp32 step */
static void finish16_q6k(const uint8_t* P0, const uint8_t* P1, int64_t b, const qacts* A, int64_t m0, int64_t mc,
                         const __m512i* S, const __m512i* Bs, float* acc) {
    const int64_t K = A->K;
    const __m512 d = half16(P0 + 1664, P1 + 1664);
    for (int64_t r = 0; r < mc; r++) {
        const __m512 dx = _mm512_set1_ps(A->d256[(m0 + r) * (K / 256) + b]);
        const __m512i tot = Bs ? _mm512_sub_epi32(S[r], _mm512_slli_epi32(Bs[r], 5)) : S[r];
        __m512 a = _mm512_loadu_ps(acc + 16 * r);
        a = _mm512_fmadd_ps(cvt_i32_f32(tot), _mm512_mul_ps(d, dx), a);
        _mm512_storeu_ps(acc + 16 * r, a);
    }
}

static inline int64_t offset_32(int64_t t) { return t == QT_Q4_0 ? 8 : t == QT_Q5_0 ? 16 : 0; }
static inline int64_t dpos_32(int64_t t) { return t == QT_Q5_0 ? 160 : t == QT_Q8_0 ? 256 : 128; }

static void pair512_32(int64_t t, const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0,
                       int64_t mc, float* acc) {
    const int64_t K = A->K, tb = q_tile_bytes(t);
    /* Q8_0: codes + 128 as unsigned, 128 times the activations' sum taken off */
    const int64_t off = t == QT_Q8_0 ? 128 : offset_32(t);
    const uint8_t *Q0 = P0, *Q1 = P1;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, P0 += tb, P1 += tb) {
        qpf_whole(&pf, Q0, Q1, nb, tb, b);
        __m512i w[8];
        chunks16_32(t, P0, P1, w);
        if (t == QT_Q8_0) for (int c = 0; c < 8; c++) w[c] = _mm512_xor_si512(w[c], _mm512_set1_epi8((char)0x80));
        const __m512 d = half16(P0 + dpos_32(t), P1 + dpos_32(t));
        const __m512 m = t == QT_Q4_1 ? half16(P0 + 144, P1 + 144) : _mm512_setzero_ps();
        for (int64_t r = 0; r < mc; r++) {
            const int64_t bi = (m0 + r) * (K / 32) + b;
            const int8_t* x = A->q32 + (m0 + r) * K + 32 * b;
            __m512i S = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) S = _mm512_dpbusd_epi32(S, w[c], bc512(x + 4 * c));
            if (off) S = _mm512_sub_epi32(S, _mm512_set1_epi32((int32_t)off * A->b32[bi]));
            finish16_32(t, S, d, m, A, bi, acc + 16 * r);
        }
    }
}

static void pair512_q4k(const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0, int64_t mc,
                        float* acc) {
    const int64_t K = A->K;
    __m512i S[QMM_RB];
    const uint8_t *Q0 = P0, *Q1 = P1;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, P0 += 1184, P1 += 1184) {
        qpf_begin(&pf, Q0, Q1, nb, 1184, b, 8);
        for (int j = 0; j < 8; j++) {
            __m512i w[8];
            qpf_step(&pf, pf.q);
            nibbles16(P0 + 128 * j, P1 + 128 * j, w);
            const __m512i sc = cvt_u8_i32(ld2q(P0 + 1024 + 8 * j, P1 + 1024 + 8 * j));
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * j;
                __m512i s = _mm512_setzero_si512();
                for (int c = 0; c < 8; c++) s = _mm512_dpbusd_epi32(s, w[c], bc512(x + 4 * c));
                const __m512i p = _mm512_mullo_epi32(s, sc);
                S[r] = j ? _mm512_add_epi32(S[r], p) : p;
            }
        }
        finish16_q4k(P0, P1, b, A, m0, mc, S, acc);
    }
}

static void pair512_q6k(const uint8_t* P0, const uint8_t* P1, int64_t nb, const qacts* A, int64_t m0, int64_t mc,
                        float* acc) {
    const int64_t K = A->K;
    __m512i S[QMM_RB], Bs[QMM_RB];
    const uint8_t *Q0 = P0, *Q1 = P1;
    qpf pf;
    for (int64_t b = 0; b < nb; b++, P0 += 1680, P1 += 1680) {
        qpf_begin(&pf, Q0, Q1, nb, 1680, b, 8);
        for (int g = 0; g < 8; g++) {
            __m512i w[8], pr, s0, s1;
            qpf_step(&pf, pf.q);
            chunks16_q6k(P0, P1, g, w);
            scales16_q6k(P0, P1, g, &pr, &s0, &s1);
            for (int64_t r = 0; r < mc; r++) {
                const int8_t* x = A->q256 + (m0 + r) * K + 256 * b + 32 * g;
                __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    lo = _mm512_dpbusd_epi32(lo, w[c], bc512(x + 4 * c));
                    hi = _mm512_dpbusd_epi32(hi, w[c + 4], bc512(x + 16 + 4 * c));
                }
                const __m512i p = _mm512_add_epi32(_mm512_mullo_epi32(lo, s0), _mm512_mullo_epi32(hi, s1));
                const __m512i q = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pr,
                                                      bc512(A->b16 + (m0 + r) * (K / 16) + 16 * b + 2 * g));
                S[r] = g ? _mm512_add_epi32(S[r], p) : p;
                Bs[r] = g ? _mm512_add_epi32(Bs[r], q) : q;
            }
        }
        finish16_q6k(P0, P1, b, A, m0, mc, S, Bs, acc);
    }
}
#endif
