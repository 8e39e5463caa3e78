#!/usr/bin/env python3
"""What scoring more rows costs per weight matmul, per engine dtype, on this CPU.

Times the engine's own ``Linear`` (bf16 ``F.linear``, int8 ``_weight_int8pack_mm``,
int4 with groups of 32: ``specmesh.engine.int4_matmul`` where the CPU has AVX-512 BF16, else
``_weight_int4pack_mm_for_cpu``; ``SPECMESH_INT4_KERNEL=torch`` for torch's) on one weight shape for
1..256 input rows, best of 3 repeats of 20 calls each, all dtypes in one process.
The ratio of 8 rows to 1 row is what verifying an 8-token draft costs against a
decode step: near 1 on a memory-bound machine (where speculation pays most), near 8
on a compute-bound one.

    .venv/bin/python scripts/matmul_rows.py                    # Qwen2.5-1.5B's MLP: 1536 -> 8960
    .venv/bin/python scripts/matmul_rows.py --shape 576,1536   # SmolLM2-135M's MLP
"""

from __future__ import annotations

import argparse
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

import torch

from specmesh.engine import Linear


def best_ms(fn, calls: int = 20, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1536,8960", help="in_features,out_features")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--dtypes", default="bf16,int8,int4")
    args = ap.parse_args()
    k, n = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    mods = {d: Linear(w, None, d, 32) for d in args.dtypes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    times = {d: {} for d in mods}
    print(f"weight {k} -> {n}, torch threads {torch.get_num_threads()}")
    print("rows  " + "  ".join(f"{d:>16}" for d in mods))
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        for d, lin in mods.items():
            times[d][m] = best_ms(lambda: lin(x))
        print(f"{m:4d}  " + "  ".join(f"{times[d][m]:8.2f} ms {times[d][m] / times[d][rows[0]]:5.1f}x"
                                      for d in mods), flush=True)


if __name__ == "__main__":
    main()
