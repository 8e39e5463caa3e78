#!/usr/bin/env python3
"""Which exact dtype is fastest here: plain decoding and ``self:block_tree`` in fp32,
bf16 and int8 (each with the engine's default numerics: batch-invariant in bf16/int8
on CPU), side by side in one process, systems alternating per prompt. Prints
tokens/s per system (median over prompts), ratios to fp32 plain decoding, and
whether each speculative output equals its own dtype's plain decoding.

    .venv/bin/python scripts/dtype_compare.py --workloads open_writing,chat_multiturn --prompts 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import statistics
import time

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

from specmesh.workloads import load
from specmesh.loop import AdaptiveBudget, generate_tokens
from specmesh.runtime import Runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--workloads", default="open_writing,chat_multiturn")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    rts = {d: Runtime("smollm2-135m-instruct", dtype=d, n_slots=2, max_seq_len=1024, quiet=True)
           for d in a.dtypes.split(",")}
    prompts = [p for ps in load(a.workloads.split(","), a.prompts).values() for p in ps]
    speed: dict[str, list[float]] = {}
    same: dict[str, list[bool]] = {}
    for d, rt in rts.items():  # warm-up
        generate_tokens(None, rt.verifier, rt.encode("hi"), max_new_tokens=4, stop_ids=rt.stop_ids)
    for i, p in enumerate(prompts):
        for d, rt in rts.items():
            ids = rt.encode(p.prompt, p.messages)
            t0 = time.perf_counter()
            plain, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=a.max_new_tokens,
                                        stop_ids=rt.stop_ids)
            speed.setdefault(f"{d} plain", []).append(len(plain) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            out, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=a.max_new_tokens,
                                      stop_ids=rt.stop_ids, self_draft="block_tree",
                                      budget=AdaptiveBudget.for_drafter("block_tree", 8, costs=rt.verify_costs))
            speed.setdefault(f"{d} block_tree", []).append(len(out) / (time.perf_counter() - t0))
            same.setdefault(d, []).append(out == plain)
        print(f"prompt {i + 1}/{len(prompts)} {p.id}", flush=True)
    base = statistics.median(speed[f"{next(iter(rts))} plain"])
    print(f"\n{'system':<18}{'tok/s':>8}{'vs first plain':>16}")
    for k, v in speed.items():
        m = statistics.median(v)
        print(f"{k:<18}{m:>8.1f}{m / base:>15.2f}x")
    for d, v in same.items():
        print(f"{d}: block_tree identical to plain decoding {sum(v)}/{len(v)}")


if __name__ == "__main__":
    main()
