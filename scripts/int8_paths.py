#!/usr/bin/env python3
"""What a forward of a GGUF model costs by scored rows on each int8 path this CPU has.

The GGUF's blocks (``--dtype int4``) run on ``csrc/qmm.c``'s paths (amx, avx512vnni,
avxvnni, avx2, generic: ``qmatmul.PATHS``); this forces each path the CPU has in turn
(``qmatmul.load().use_path``: every path gives the same bits, only the time differs) and,
after ``--ctx`` tokens of context, times ``score`` of M tokens for each M of ``--rows``,
the paths alternating, best of ``--reps``; then a prefill of ``--prefill`` tokens per
path. Prints a line a path: ms per M and the ratios of 8 and 16 rows to one. Asserts
nothing; run it with nothing else on the machine.

    .venv/bin/python scripts/int8_paths.py                                # the Qwen 1.5B (make setup-qwen)
    .venv/bin/python scripts/int8_paths.py --model smollm2-135m-instruct --paths avx2,avx512vnni
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--paths", default="", help="comma list (default: every path this CPU has but generic)")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import specmesh

    specmesh.spin_threads()
    import torch

    from specmesh.engine import LlamaEngine
    from specmesh.engine import qmatmul as qm

    torch.set_num_threads(a.threads)
    k = qm.load()
    paths = [p for p in a.paths.split(",") if p] or [p for p in k.paths() if p != "generic"]
    rows = [int(m) for m in a.rows.split(",")]
    eng = LlamaEngine.from_pretrained(a.model, dtype="int4", n_slots=2, max_seq_len=max(2048, a.ctx + 64), quiet=True)
    V = eng.vocab_size
    eng.reset(0)
    eng.prefill(0, [(100 + i) % V for i in range(a.ctx)])
    best: dict = {p: {} for p in paths}
    for _ in range(a.reps):
        for p in paths:
            k.use_path(p)
            for m in rows:
                t0 = time.perf_counter()
                eng.score(0, [(7 * i + 11) % V for i in range(m)], list(range(-1, m - 1)))
                dt = (time.perf_counter() - t0) * 1e3
                best[p][m] = min(dt, best[p].get(m, dt))
    from specmesh.cli.bench.engine_probe import cpu_model

    print(f"{cpu_model()}; paths here: {', '.join(k.paths())}; {a.model}, {a.threads} threads, {a.ctx} tokens "
          f"of context, best of {a.reps}")
    for p in paths:
        k.use_path(p)
        pre = [(13 * i + 5) % V for i in range(a.prefill)]
        ts = []
        for _ in range(2):
            eng.reset(1)
            t0 = time.perf_counter()
            eng.prefill(1, pre)
            ts.append(time.perf_counter() - t0)
        b = best[p]
        ratios = " ".join(f"{m}/1 {b[m] / b[1]:.2f}x" for m in rows if m > 1 and 1 in b and m in (8, 16))
        print(f"{p:11s} " + " ".join(f"{m}: {b[m]:6.1f} ms" for m in rows) +
              f"  {ratios}  prefill {a.prefill / min(ts):.0f} tok/s")


if __name__ == "__main__":
    main()
