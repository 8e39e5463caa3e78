#!/usr/bin/env python3
"""What one engine forward costs by the number of scored rows, on this CPU.

After a context of ``--ctx`` tokens, the engine's ``score`` of a chain of M tokens (what
verifying M drafted tokens costs; M = 1 is a decode step), median of ``--reps`` calls,
for each M of ``--rows``; then one prefill of ``--prefill`` tokens. Run it once per
kernel to compare them, alternating, e.g. the int4 matmuls:

    SPECMESH_INT4_KERNEL=avx512 .venv/bin/python scripts/forward_rows.py
    SPECMESH_INT4_KERNEL=amx .venv/bin/python scripts/forward_rows.py

Prints one line: the kernel, ms per M, the prefill's ms. Asserts nothing.

``--amx-few-rows-ab N``: instead, the AMX int4 matmul's one-row path side by side in
this process: N alternating pairs of ``--reps`` one-token forwards with one-row calls on
the tiles (``amx_few_rows(0)``) and on ``rows_amxe`` (the default; same bits), medians:

    .venv/bin/python scripts/forward_rows.py --amx-few-rows-ab 6 --reps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

from specmesh.engine import int4_matmul  # noqa: E402
from specmesh.engine import LlamaEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=500)
    ap.add_argument("--amx-few-rows-ab", type=int, default=0, metavar="N",
                    help="N alternating pairs: one-row int4 calls on the AMX tiles vs on rows_amxe")
    a = ap.parse_args()
    eng = LlamaEngine.from_pretrained(a.model, dtype=a.dtype, n_slots=2, max_seq_len=2048, quiet=True)
    vocab = eng.vocab_size
    eng.reset(0)
    eng.prefill(0, [(100 + i) % vocab for i in range(a.ctx)])

    def median_ms(m: int) -> float:
        def fwd():
            eng.score(0, list(range(m)), list(range(-1, m - 1)))

        fwd()
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fwd()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    if a.amx_few_rows_ab:
        k = int4_matmul.load() if a.dtype == "int4" else None
        if k is None or not k.amx:
            raise SystemExit("--amx-few-rows-ab needs --dtype int4 on the AMX matmul (an AMX-BF16 CPU)")
        default = k.amx_few_rows()
        res: dict = {0: [], default: []}
        try:
            for _ in range(a.amx_few_rows_ab):
                for n in (0, default):
                    k.amx_few_rows(n)
                    res[n].append(median_ms(1))
        finally:
            k.amx_few_rows(default)
        print(f"one-token forward, ms: tiles {' '.join(f'{v:.2f}' for v in res[0])}; "
              f"rows_amxe {' '.join(f'{v:.2f}' for v in res[default])}; "
              f"ratio of medians {statistics.median(res[default]) / statistics.median(res[0]):.3f}")
        return
    out = [f"{m} rows {median_ms(int(m)):.2f} ms" for m in a.rows.split(",")]
    eng.reset(1)
    t0 = time.perf_counter()
    eng.prefill(1, [(200 + i) % vocab for i in range(a.prefill)])
    pf = (time.perf_counter() - t0) * 1e3
    k = int4_matmul.load() if a.dtype == "int4" else None
    kernel = a.dtype if a.dtype != "int4" else ("int4 torch" if k is None else f"int4 {k.isa}")
    print(f"{kernel}: " + ", ".join(out) + f"; prefill {a.prefill} tokens {pf:.0f} ms")


if __name__ == "__main__":
    main()
