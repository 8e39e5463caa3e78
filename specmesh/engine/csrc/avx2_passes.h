    const int64_t nc = (M + 3) / 4;  /* balanced passes of at most 4 rows */
    const int64_t rows0 = M / nc + (M % nc != 0);
    const int64_t NBK = rows0 == 1 ? 4 : rows0 == 2 ? 2 : 1;
    const int64_t units = (nb + NBK - 1) / NBK;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t un = 0; un < units; un++) {
        const int64_t b0 = un * NBK, nbk = nb - b0 < NBK ? nb - b0 : NBK;
        for (int64_t c = 0, m0 = 0; c < nc; c++) {
            const int64_t mc = M / nc + (c < M % nc);
            switch (mc * 8 + nbk) {
                case 9: R_(1, 1); break; case 10: R_(1, 2); break; case 11: R_(1, 3); break; case 12: R_(1, 4); break;
                case 17: R_(2, 1); break; case 18: R_(2, 2); break; case 25: R_(3, 1); break; default: R_(4, 1); break;
            }
            m0 += mc;
        }
    }
