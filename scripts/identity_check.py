"""Greedy identity and cost of the batch-invariant engine on the real model.

For each dtype, one ``Runtime``; its engine is switched between the batch-invariant
forward (``on``) and the ragged one (``off``, what the engine did before) with
``LlamaEngine.set_batch_invariant``. Two parts:

1. Identity: for bench prompts, greedy plain decoding vs greedy speculative decoding
   with each drafter (external ``prompt_lookup``; in-verifier ``block`` /
   ``block_tree``), in each mode: how many generations are token-identical to plain
   decoding of the same mode (and where the first difference is).
2. Cost: plain-decoding and block_tree tokens/s with invariance on and off, measured
   alternately in this process (order flipped every repetition; other processes share
   the cores, so medians of several repetitions are reported).

    .venv/bin/python scripts/identity_check.py                      # bf16 + int8, the defaults below
    .venv/bin/python scripts/identity_check.py --dtypes bf16 --prompts 1 --speed-reps 5
    .venv/bin/python scripts/identity_check.py --skip-identity --speed-reps 7   # the cost part only

Prints two tables; ``--json PATH`` also writes the raw results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specmesh  # noqa: E402 - before torch: this script has the machine to itself

specmesh.spin_threads()

from specmesh import workloads as wl  # noqa: E402
from specmesh.drafters import registry  # noqa: E402
from specmesh.loop import AdaptiveBudget, VerifyCosts, generate_tokens  # noqa: E402
from specmesh.runtime import Runtime  # noqa: E402

SELF = registry.SELF  # in-verifier drafters (block, block_tree, layerskip, uno, ...)


def encode(rt: Runtime, p) -> list[int]:
    return rt.encode(p.prompt) if p.messages is None else rt.encode(messages=p.messages)


def generate(rt: Runtime, name, ids, max_new: int, costs: VerifyCosts):
    """(new tokens, seconds, stats) of one greedy generation; name None = plain decoding."""
    t0 = time.perf_counter()
    if name is None:
        out, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=max_new, stop_ids=rt.stop_ids)
    elif name in SELF:
        out, st = generate_tokens(None, rt.verifier, ids, self_draft=name, max_new_tokens=max_new,
                                  budget=AdaptiveBudget.for_drafter(name, 8, costs=costs), stop_ids=rt.stop_ids)
    else:
        out, st = generate_tokens(rt.drafter(name), rt.verifier, ids, max_new_tokens=max_new,
                                  budget=AdaptiveBudget.for_drafter(name, 8, costs=costs), stop_ids=rt.stop_ids)
    return out, time.perf_counter() - t0, st


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bf16,int8")
    ap.add_argument("--drafters", default="prompt_lookup,block,block_tree")
    ap.add_argument("--workloads", default="open_writing,code_edit,chat_multiturn,summarize_quotes")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per workload for the identity part")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--modes", default="on,off", help="identity part: on (batch-invariant) and/or off (ragged)")
    ap.add_argument("--skip-identity", action="store_true")
    ap.add_argument("--speed-reps", type=int, default=3, help="0: no cost part")
    ap.add_argument("--speed-workloads", default="open_writing")
    ap.add_argument("--speed-prompts", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    dtypes = [d for d in a.dtypes.split(",") if d]
    drafters = [d for d in a.drafters.split(",") if d]
    modes = [m for m in a.modes.split(",") if m]
    prompts = [p for ps in wl.load(a.workloads.split(","), a.prompts).values() for p in ps]
    sprompts = [p for ps in wl.load(a.speed_workloads.split(","), a.speed_prompts).values() for p in ps]
    results: dict = {"identity": {}, "speed": {}, "tau": {}, "args": vars(a)}

    for dtype in dtypes:
        rt = Runtime(a.model, dtype=dtype, n_slots=4, max_seq_len=2048, quiet=True)
        eng = rt.engine
        costs = {m: VerifyCosts() for m in ("on", "off")}
        ids = {p.id: encode(rt, p) for p in prompts + sprompts}
        print(f"# {dtype}: row_tiles={eng.row_tiles} attn_tiles={eng.attn_tiles} key_block={eng.key_block}",
              flush=True)

        if not a.skip_identity:
            for mode in modes:
                eng.set_batch_invariant(mode == "on")
                for p in prompts:
                    plain = generate(rt, None, ids[p.id], p.budget(a.max_new_tokens), costs[mode])[0]
                    for name in drafters:
                        out = generate(rt, name, ids[p.id], p.budget(a.max_new_tokens), costs[mode])[0]
                        same = out == plain
                        diff = None if same else first_diff(out, plain)
                        rec = results["identity"].setdefault(f"{dtype}/{mode}/{name}", [])
                        rec.append({"prompt": p.id, "identical": same, "first_diff": diff, "len": len(plain)})
                        verdict = "identical" if same else f"DIFFERS at token {diff}"
                        print(f"  {dtype} {mode:3s} {name:14s} {p.id:22s} {verdict}", flush=True)

        if a.speed_reps > 0:
            for rep in range(a.speed_reps):
                order = ("on", "off") if rep % 2 == 0 else ("off", "on")
                for mode in order:
                    eng.set_batch_invariant(mode == "on")
                    for sysname, name in (("plain", None), ("block_tree", "block_tree")):
                        toks = secs = 0.0
                        for p in sprompts:
                            out, s, st = generate(rt, name, ids[p.id], p.budget(a.max_new_tokens), costs[mode])
                            toks, secs = toks + len(out), secs + s
                            if name is not None:
                                results["tau"].setdefault(f"{dtype}/{mode}", []).append(st.tau)
                        results["speed"].setdefault(f"{dtype}/{mode}/{sysname}", []).append(toks / secs)
                print(f"  speed rep {rep + 1}/{a.speed_reps}: " + "  ".join(
                    f"{k.split('/', 1)[1]}={v[-1]:.1f}" for k, v in results["speed"].items() if k.startswith(dtype)),
                    flush=True)
        eng.set_batch_invariant(eng.dtype_name != "fp32")

    if results["identity"]:
        print("\nidentity: speculative generations token-identical to plain decoding (same dtype, same mode)")
        print(f"{'dtype':6s} {'mode':5s} " + " ".join(f"{d:>14s}" for d in drafters) + f" {'all':>10s}")
        for dtype in dtypes:
            for mode in modes:
                cells, n_same, n_all = [], 0, 0
                for d in drafters:
                    rec = results["identity"].get(f"{dtype}/{mode}/{d}", [])
                    s = sum(r["identical"] for r in rec)
                    cells.append(f"{s}/{len(rec)}")
                    n_same, n_all = n_same + s, n_all + len(rec)
                print(f"{dtype:6s} {mode:5s} " + " ".join(f"{c:>14s}" for c in cells) + f" {n_same}/{n_all}".rjust(11))
    if results["speed"]:
        print("\ncost: tokens/s, median of repetitions (on = batch-invariant, off = ragged)")
        print(f"{'dtype':6s} {'system':11s} {'on':>8s} {'off':>8s} {'on/off':>7s}  reps on | off")
        for dtype in dtypes:
            for sysname in ("plain", "block_tree"):
                on = results["speed"].get(f"{dtype}/on/{sysname}", [])
                off = results["speed"].get(f"{dtype}/off/{sysname}", [])
                if on and off:
                    mon, moff = statistics.median(on), statistics.median(off)
                    print(f"{dtype:6s} {sysname:11s} {mon:8.1f} {moff:8.1f} {mon / moff:7.2f}  "
                          + " ".join(f"{x:.1f}" for x in on) + " | " + " ".join(f"{x:.1f}" for x in off))
            on_p, on_t = results["speed"].get(f"{dtype}/on/plain"), results["speed"].get(f"{dtype}/on/block_tree")
            off_p, off_t = results["speed"].get(f"{dtype}/off/plain"), results["speed"].get(f"{dtype}/off/block_tree")
            if on_p and on_t and off_p and off_t:
                med, tau = statistics.median, results["tau"]
                print(f"{dtype:6s} block_tree speedup over plain: on {med(on_t) / med(on_p):.2f}x"
                      f"  off {med(off_t) / med(off_p):.2f}x;  block_tree tau: on "
                      f"{statistics.mean(tau[dtype + '/on']):.2f}  off {statistics.mean(tau[dtype + '/off']):.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
