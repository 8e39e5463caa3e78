/* The GGUF block types the q kernels take, their files' block layout and ours.

   A GGUF tensor [N, K] is N rows of K / QK blocks (QK inputs each). We keep the same
   values, bit for bit, in "tiles": 8 consecutive rows (outputs) side by side, one
   tile-block per QK inputs, so a 256-bit vector holds 4 consecutive inputs of each of the
   8 rows (byte 4 o + e: row o, input e of the chunk) and one integer dot product serves 8
   outputs at once. A tensor is its N / 8 tiles, each tile its K / QK tile-blocks in input
   order. Layout of a tile-block, by type (o: row in the tile, c: chunk of 4 inputs):

   Q4_0 / Q4_1 / Q5_0 (QK 32, 8 chunks): 128 bytes of nibbles: vector t (0..3) of 32
     bytes holds chunk t in its low nibbles and chunk t + 4 in its high ones; Q5_0: then
     32 bytes whose byte 4 o + e holds bit 4 of chunk c's value in its bit c; then d [8]
     (fp16), Q4_1: then m [8] (fp16). Values: Q4_0 d (q - 8), Q4_1 d q + m, Q5_0 d (q - 16).
   Q8_0 (QK 32): chunk c's 32 bytes (int8) for c = 0..7, then d [8] (fp16). Value d q.
   Q4_K (QK 256, 8 sub-blocks of 32): per sub-block j the 128 bytes of its 8 chunks as
     Q4_0's; then sc [8 j + o] (u8, 6 bits), then the mins in pairs m[2p][o], m[2p + 1][o]
     at 16 p + 2 o (u8, 6 bits), then d [8] and dmin [8] (fp16). Value d sc q - dmin m.
   Q6_K (QK 256, 16 sub-blocks of 16): per group g of 32 inputs the low 4 bits of its 8
     chunks as Q4_0's nibbles (1024 bytes in all); then per group 64 bytes: vector u (0, 1)
     holds the top 2 bits of chunk 4 u + k in bits 2k..2k+1; then per group 16 bytes, the
     scale pair sc[2g][o], sc[2g + 1][o] (int8) at 2 o; then d [8] (fp16). Value
     d sc (q - 32).

   Knows nothing of activations or of how the tiles are multiplied (qmm.c). */

#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q6_K 14

/* inputs per block, GGUF bytes per block, our bytes per tile-block (8 rows); 0: not taken */
static int64_t q_qk(int64_t t) {
    switch (t) { case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q8_0: return 32;
                 case QT_Q4_K: case QT_Q6_K: return 256; default: return 0; }
}
static int64_t q_raw_bytes(int64_t t) {
    switch (t) { case QT_Q4_0: return 18; case QT_Q4_1: return 20; case QT_Q5_0: return 22; case QT_Q8_0: return 34;
                 case QT_Q4_K: return 144; case QT_Q6_K: return 210; default: return 0; }
}
static int64_t q_tile_bytes(int64_t t) {
    switch (t) { case QT_Q4_0: return 144; case QT_Q4_1: return 160; case QT_Q5_0: return 176; case QT_Q8_0: return 272;
                 case QT_Q4_K: return 1184; case QT_Q6_K: return 1680; default: return 0; }
}

static inline float q_h2f(uint16_t h) {  /* IEEE half to float, exact (what F16C's vcvtph2ps gives) */
    const uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t u;
    if (e == 0) {
        if (m == 0) u = s;
        else {  /* subnormal: normalise */
            int sh = 0; uint32_t mm = m;
            while (!(mm & 1024)) { mm <<= 1; sh++; }
            u = s | ((uint32_t)(113 - sh) << 23) | ((mm & 1023) << 13);
        }
    } else if (e == 31) u = s | 0x7F800000u | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t q_rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* a nibble chunk c (0..7) of 8 chunks stored as vectors t = c % 4, low nibble for c < 4 */
static inline int q_nib(const uint8_t* v, int c, int o, int e) {
    const uint8_t b = v[32 * (c & 3) + 4 * o + e];
    return c < 4 ? (b & 15) : (b >> 4);
}

/* Q4_K's 6-bit scale and min of sub-block j from the 12 packed bytes */
static inline void q4k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* one GGUF block's integer codes q [QK] (unsigned, as the tile stores them) and its
   per-sub-block numbers; the header halves are copied as they are */
static void q_raw_codes(int64_t t, const uint8_t* b, uint8_t* q, int* sc, int* mn) {
    switch (t) {
        case QT_Q4_0: case QT_Q4_1: {
            const uint8_t* qs = b + (t == QT_Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
            break;
        }
        case QT_Q5_0: {
            const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
            const uint8_t* qs = b + 6;
            for (int j = 0; j < 16; j++) {
                q[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
                q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
            }
            break;
        }
        case QT_Q8_0: memcpy(q, b + 2, 32); break;
        case QT_Q4_K: {
            const uint8_t* qs = b + 16;
            for (int jj = 0; jj < 4; jj++)
                for (int l = 0; l < 32; l++) { q[64 * jj + l] = qs[32 * jj + l] & 15; q[64 * jj + 32 + l] = qs[32 * jj + l] >> 4; }
            for (int j = 0; j < 8; j++) q4k_scale_min(b + 4, j, sc + j, mn + j);
            break;
        }
        case QT_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            for (int n = 0; n < 2; n++, ql += 64, qh += 32)
                for (int l = 0; l < 32; l++) {
                    uint8_t* y = q + 128 * n;
                    y[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                    y[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                    y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
            break;
        }
    }
}

/* the GGUF tensor src [8 rows][K / QK blocks] into one tile's tile-blocks dst: each byte
   written once, from the 8 rows' codes of the block (unpacked first) */
static void q_repack_tile(int64_t t, const uint8_t* src, int64_t K, uint8_t* dst) {
    const int64_t qk = q_qk(t), nb = K / qk, rb = q_raw_bytes(t), tb = q_tile_bytes(t);
    uint8_t q[8][256]; int sc[8][16], mn[8][16];
    for (int64_t b = 0; b < nb; b++) {
        uint8_t* T = dst + b * tb;
        for (int o = 0; o < 8; o++) q_raw_codes(t, src + (o * nb + b) * rb, q[o], sc[o], mn[o]);
        /* the nibble vectors: per group of 32 inputs, vector v holds chunk v (low) and v + 4 (high) */
        const int groups = (int)(qk / 32), nib = t != QT_Q8_0;
        for (int g = 0; g < groups && nib; g++)
            for (int v = 0; v < 4; v++)
                for (int o = 0; o < 8; o++)
                    for (int e = 0; e < 4; e++)
                        T[128 * g + 32 * v + 4 * o + e] = (uint8_t)((q[o][32 * g + 4 * v + e] & 15)
                                                                  | ((q[o][32 * g + 16 + 4 * v + e] & 15) << 4));
        for (int o = 0; o < 8; o++) {
            const uint8_t* B = src + (o * nb + b) * rb;
            switch (t) {
                case QT_Q4_0: case QT_Q4_1: case QT_Q5_0:
                    if (t == QT_Q5_0)
                        for (int e = 0; e < 4; e++) {
                            uint8_t h = 0;
                            for (int c = 0; c < 8; c++) h |= (uint8_t)(((q[o][4 * c + e] >> 4) & 1) << c);
                            T[128 + 4 * o + e] = h;
                        }
                    memcpy(T + (t == QT_Q5_0 ? 160 : 128) + 2 * o, B, 2);                 /* d */
                    if (t == QT_Q4_1) memcpy(T + 144 + 2 * o, B + 2, 2);                  /* m */
                    break;
                case QT_Q8_0:
                    for (int c = 0; c < 8; c++) memcpy(T + 32 * c + 4 * o, q[o] + 4 * c, 4);
                    memcpy(T + 256 + 2 * o, B, 2);
                    break;
                case QT_Q4_K:
                    for (int j = 0; j < 8; j++) {
                        T[1024 + 8 * j + o] = (uint8_t)sc[o][j];
                        T[1088 + 16 * (j / 2) + 2 * o + (j & 1)] = (uint8_t)mn[o][j];
                    }
                    memcpy(T + 1152 + 2 * o, B, 2);
                    memcpy(T + 1168 + 2 * o, B + 2, 2);
                    break;
                case QT_Q6_K:
                    for (int g = 0; g < 8; g++)
                        for (int u = 0; u < 2; u++)
                            for (int e = 0; e < 4; e++) {
                                uint8_t h = 0;
                                for (int k = 0; k < 4; k++) h |= (uint8_t)(((q[o][32 * g + 4 * (4 * u + k) + e] >> 4) & 3) << (2 * k));
                                T[1024 + 64 * g + 32 * u + 4 * o + e] = h;
                            }
                    for (int s = 0; s < 16; s++) T[1536 + 16 * (s / 2) + 2 * o + (s & 1)] = (uint8_t)(int8_t)sc[o][s];
                    memcpy(T + 1664 + 2 * o, B + 208, 2);
                    break;
            }
        }
    }
}

/* row o of a tile-block: its QK values as fp32, from our layout */
static void q_tile_values(int64_t t, const uint8_t* T, int o, float* y) {
    switch (t) {
        case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: {
            const float d = q_h2f(q_rd16(T + (t == QT_Q5_0 ? 160 : 128) + 2 * o));
            const float m = t == QT_Q4_1 ? q_h2f(q_rd16(T + 144 + 2 * o)) : 0.0f;
            for (int i = 0; i < 32; i++) {
                int q = q_nib(T, i / 4, o, i % 4);
                if (t == QT_Q5_0) q |= ((T[128 + 4 * o + i % 4] >> (i / 4)) & 1) << 4;
                y[i] = t == QT_Q4_1 ? d * (float)q + m : d * (float)(q - (t == QT_Q4_0 ? 8 : 16));
            }
            break;
        }
        case QT_Q8_0: {
            const float d = q_h2f(q_rd16(T + 256 + 2 * o));
            for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)T[32 * (i / 4) + 4 * o + i % 4];
            break;
        }
        case QT_Q4_K: {
            const float d = q_h2f(q_rd16(T + 1152 + 2 * o)), dm = q_h2f(q_rd16(T + 1168 + 2 * o));
            for (int i = 0; i < 256; i++) {
                const int j = i / 32;
                const int q = q_nib(T + 128 * j, (i % 32) / 4, o, i % 4);
                const float sc = (float)T[1024 + 8 * j + o], m = (float)T[1088 + 16 * (j / 2) + 2 * o + (j & 1)];
                y[i] = d * sc * (float)q - dm * m;
            }
            break;
        }
        case QT_Q6_K: {
            const float d = q_h2f(q_rd16(T + 1664 + 2 * o));
            for (int i = 0; i < 256; i++) {
                const int g = i / 32, c = (i % 32) / 4, e = i % 4, s = i / 16;
                const int q = q_nib(T + 128 * g, c, o, e) | (((T[1024 + 64 * g + 32 * (c / 4) + 4 * o + e] >> (2 * (c % 4))) & 3) << 4);
                y[i] = d * (float)(int8_t)T[1536 + 16 * (s / 2) + 2 * o + (s & 1)] * (float)(q - 32);
            }
            break;
        }
    }
}
