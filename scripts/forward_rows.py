#!/usr/bin/env python3
"""What one engine forward costs by the number of scored rows, on this CPU.

After a context of ``--ctx`` tokens, the engine's ``score`` of a chain of M tokens (what
verifying M drafted tokens costs; M = 1 is a decode step), median of ``--reps`` calls,
for each M of ``--rows``; then one prefill of ``--prefill`` tokens. Run it once per
kernel to compare them, alternating, e.g. the int4 matmuls:

    SPECMESH_INT4_KERNEL=avx512 .venv/bin/python scripts/forward_rows.py
    SPECMESH_INT4_KERNEL=amx .venv/bin/python scripts/forward_rows.py

Prints one line: the kernel, ms per M, the prefill's ms. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.own_machine_threads()

from specmesh import int4_matmul  # noqa: E402
from specmesh.engine import LlamaEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=500)
    a = ap.parse_args()
    eng = LlamaEngine.from_pretrained(a.model, dtype=a.dtype, n_slots=2, max_seq_len=2048, quiet=True)
    vocab = eng.vocab_size
    eng.reset(0)
    eng.prefill(0, [(100 + i) % vocab for i in range(a.ctx)])
    out = []
    for m in (int(r) for r in a.rows.split(",")):
        def fwd():
            eng.score(0, list(range(m)), list(range(-1, m - 1)))

        fwd()
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fwd()
            ts.append(time.perf_counter() - t0)
        out.append(f"{m} rows {statistics.median(ts) * 1e3:.2f} ms")
    eng.reset(1)
    t0 = time.perf_counter()
    eng.prefill(1, [(200 + i) % vocab for i in range(a.prefill)])
    pf = (time.perf_counter() - t0) * 1e3
    k = int4_matmul.load() if a.dtype == "int4" else None
    kernel = a.dtype if a.dtype != "int4" else ("int4 torch" if k is None else "int4 amx" if k.amx else "int4 avx512")
    print(f"{kernel}: " + ", ".join(out) + f"; prefill {a.prefill} tokens {pf:.0f} ms")


if __name__ == "__main__":
    main()
