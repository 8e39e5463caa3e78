    const int64_t nc = (M + MC - 1) / MC;  /* balanced passes of at most MC rows */
    const int64_t rows0 = M / nc + (M % nc != 0);  /* the widest pass */
    const int64_t NBK = rows0 <= 2 ? 4 : rows0 <= 4 ? 2 : 1;  /* blocks per pass: nbk * rows <= MC */
    const int64_t units = (nb + NBK - 1) / NBK;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t un = 0; un < units; un++) {
        const int64_t b0 = un * NBK, nbk = nb - b0 < NBK ? nb - b0 : NBK;
        const __typeof__(P) blk = P + b0 * bstride;
        for (int64_t c = 0, m0 = 0; c < nc; c++) {
            const int64_t mc = M / nc + (c < M % nc);
            if (nbk == 4) { if (mc == 1) R_(1, 4); else R_(2, 4); }
            else if (nbk == 3) { if (mc == 1) R_(1, 3); else R_(2, 3); }
            else if (nbk == 2) {
                switch (mc) { case 1: R_(1, 2); break; case 2: R_(2, 2); break; case 3: R_(3, 2); break;
                              default: R_(4, 2); break; }
            } else {
                switch (mc) {
                    case 1: R_(1, 1); break; case 2: R_(2, 1); break; case 3: R_(3, 1); break;
                    case 4: R_(4, 1); break; case 5: R_(5, 1); break; case 6: R_(6, 1); break;
                    case 7: R_(7, 1); break; default: R_(8, 1); break;
                }
            }
            m0 += mc;
        }
    }
