#!/usr/bin/env python3
"""How one AMX ``tdpbf16ps`` sums its products: the tile's result against candidate
orders, on random bf16 tiles (one row of A, 16 outputs), in C on this CPU.

Why: the int4 engine's AMX matmul runs one-row calls with AVX-512 FMAs
(``int4_matmul``'s ``rows_amxe``), which must give the tiles' bits; this is the
measurement that says which order that is. For n pairs (1..16) and a zero or random
initial C it counts, over 4000 trials x 16 outputs, the outputs where each candidate
differs from the tile:

- ``seq even-odd`` / ``seq odd-even``: one FMA chain over the 2n products, from C;
- ``exact``: the exact sum of the products (in double) plus C, rounded once;
- ``pair sums``: each pair's exact sum rounded, summed in order, then plus C;
- ``tree``: the rounded pair sums in a pairwise tree, then plus C;
- ``two chains``: the even and the odd products in two FMA chains from zero, then
  C + (even + odd), each step rounded to nearest even (what ``rows_amxe`` does).

Deterministic (fixed seed); prints a table; asserts nothing. Needs AMX-BF16 (Linux).

    .venv/bin/python scripts/amx_order.py
"""

from __future__ import annotations

import ctypes

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
/*AMX_PREAMBLE*/
static float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float rnd(unsigned* s) { *s = *s * 1103515245u + 12345u; return ((*s >> 8) & 0xFFFF) / 32768.0f - 1.0f; }
static float tree(const float* v, int n) {
    if (n == 1) return v[0];
    float t[16];
    for (int i = 0; i < n / 2; i++) t[i] = v[2 * i] + v[2 * i + 1];
    return tree(t, n / 2);
}
/* out[6]: mismatches of the six candidates; returns the outputs compared (0: no AMX) */
long amx_order(int np, int cinit, long* out) {
    if (!amx_permission()) return 0;
    tilecfg cfg; memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 1; cfg.colsb[0] = 64; cfg.rows[1] = 1; cfg.colsb[1] = 64; cfg.rows[2] = 16; cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
    unsigned seed = 12345u + 7u * np + cinit;
    long tot = 0;
    for (int i = 0; i < 6; i++) out[i] = 0;
    for (int trial = 0; trial < 4000; trial++) {
        uint16_t A[32] = {0}, B[512] = {0};
        float C[16], R[16];
        for (int k = 0; k < 2 * np; k++) A[k] = tobf(rnd(&seed));
        for (int k = 0; k < np; k++) for (int j = 0; j < 32; j++) B[k * 32 + j] = tobf(rnd(&seed));
        for (int n = 0; n < 16; n++) C[n] = cinit ? rnd(&seed) : 0.0f;
        _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, R, 64);
        for (int n = 0; n < 16; n++) {
            float s_eo = C[n], s_oe = C[n], ev = 0.0f, od = 0.0f, r[16] = {0}, ps = 0.0f;
            double ex = 0.0;
            for (int k = 0; k < np; k++) {
                const float a0 = bf(A[2 * k]), a1 = bf(A[2 * k + 1]), b0 = bf(B[k * 32 + 2 * n]), b1 = bf(B[k * 32 + 2 * n + 1]);
                s_eo = fmaf(a1, b1, fmaf(a0, b0, s_eo));
                s_oe = fmaf(a0, b0, fmaf(a1, b1, s_oe));
                ev = fmaf(a0, b0, ev);
                od = fmaf(a1, b1, od);
                const double p = (double)a0 * b0 + (double)a1 * b1;
                ex += p;
                r[k] = (float)p;
                ps = k ? ps + r[k] : r[k];
            }
            int np2 = 1;
            while (np2 < np) np2 *= 2;
            const float cand[6] = {s_eo, s_oe, (float)(ex + C[n]), C[n] + ps, C[n] + tree(r, np2), C[n] + (ev + od)};
            for (int i = 0; i < 6; i++) out[i] += memcmp(&cand[i], &R[n], 4) != 0;
            tot++;
        }
    }
    _tile_release();
    return tot;
}
#else
long amx_order(int np, int cinit, long* out) { return 0; }
#endif
"""

NAMES = ("seq even-odd", "seq odd-even", "exact", "pair sums", "tree", "two chains")


def main() -> None:
    from specmesh.engine.keylist_attention import c_source, compile_library

    lib, _ = compile_library("amxorder", _SOURCE.replace("/*AMX_PREAMBLE*/", c_source("amx_preamble.h")))
    lib.amx_order.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_long)]
    lib.amx_order.restype = ctypes.c_long
    print("| pairs | initial C | outputs | " + " | ".join(NAMES) + " |")
    print("|---:|---|---:|" + "---:|" * len(NAMES))
    for np_ in (1, 2, 4, 16):
        for cinit in (0, 1):
            out = (ctypes.c_long * 6)()
            tot = lib.amx_order(np_, cinit, out)
            if not tot:
                raise SystemExit("this CPU or build has no AMX-BF16")
            print(f"| {np_} | {'random' if cinit else 'zero'} | {tot} | " + " | ".join(str(v) for v in out) + " |")


if __name__ == "__main__":
    main()
