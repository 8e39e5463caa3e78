"""``specmesh calibrate-layerskip``: choose the layer-skip exit layer E by measurement.

For each candidate E the target's first E layers plus its head draft inside the
verifier (``LayerSkipDrafter``); every sample prompt is decoded plainly and with
each E back to back (greedy, adaptive draft length), and the command records τ
(tokens per target forward), tokens/s and the speedup over plain decoding measured
in the same run. The best E (highest speedup) is written with all measurements to
a small JSON file (default ``$SPECMESH_CACHE/calibration/layerskip-<model>-<dtype>.json``)
that ``Runtime`` (the verifier) reads when no exit layer is configured, and that
the router's ``auto`` strategy reads to know whether ``self`` pays; reading it is
``specmesh.drafters.calibration`` (whose ``load_calibration`` and ``speedup_of`` this
module re-exports).

Knows nothing about gRPC. The measurements are only as good as the machine's
quiet: on a loaded machine, rerun it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from ...drafters.calibration import calibration_path, load_calibration, speedup_of  # noqa: F401 - re-exported

SAMPLE_PROMPTS = (
    "Rename the variable x to total and add a docstring:\n\ndef f(a):\n    x = 0\n    for v in a:\n        x += v\n"
    "    return x\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in a few sentences how a hash map works and why lookups are fast on average.",
)


def calibrate(runtime, exits: Sequence[int], prompts: Sequence[str], max_new_tokens: int = 48, budget: int = 6,
              progress=print) -> dict:
    """Measure each exit layer on ``prompts`` with ``runtime`` (a ``Runtime``)."""
    from ...drafters.model_drafters import LayerSkipDrafter
    from ...loop import AdaptiveBudget, generate_tokens

    ver = runtime.verifier
    saved = ver.self_drafters.get("layerskip")
    ids = [runtime.encode(p) for p in prompts]
    warm = ids[0][:16]
    generate_tokens(None, ver, warm, max_new_tokens=4, stop_ids=runtime.stop_ids)  # warm-up
    totals = {e: [0, 0.0, 0, 0] for e in exits}  # tokens, seconds, accepted, rounds
    ar_tokens, ar_s = 0, 0.0
    try:
        for pi, p in enumerate(ids):
            t0 = time.perf_counter()
            ref, st = generate_tokens(None, ver, p, max_new_tokens=max_new_tokens, stop_ids=runtime.stop_ids)
            ar_s += time.perf_counter() - t0
            ar_tokens += len(ref)
            for e in exits:
                ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, e)
                t0 = time.perf_counter()
                out, st = generate_tokens(None, ver, p, max_new_tokens=max_new_tokens, stop_ids=runtime.stop_ids,
                                          self_draft="layerskip", budget=AdaptiveBudget(budget))
                dt = time.perf_counter() - t0
                t = totals[e]
                t[0] += len(out)
                t[1] += dt
                t[2] += st.accepted_tokens
                t[3] += st.rounds
                if out != ref and runtime.dtype == "fp32":
                    progress(f"  note: E={e} output differs from plain decoding on prompt {pi}")
            progress(f"prompt {pi + 1}/{len(ids)} done")
    finally:
        if saved is not None:
            ver.self_drafters["layerskip"] = saved
    ar_tps = ar_tokens / ar_s if ar_s else 0.0
    results = []
    for e in exits:
        n, s, a, r = totals[e]
        tps = n / s if s else 0.0
        results.append({"exit_layer": e, "tau": (a + r) / r if r else 0.0, "tokens_per_s": tps,
                        "speedup": tps / ar_tps if ar_tps else 0.0})
    best = max(results, key=lambda r: r["speedup"])
    return {"model": str(runtime.model_dir), "dtype": runtime.dtype, "exit_layer": best["exit_layer"],
            "speedup": best["speedup"], "plain_tokens_per_s": ar_tps, "results": results, "prompts": len(ids),
            "max_new_tokens": max_new_tokens, "budget": budget, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate-layerskip",
                              help="measure tau and tokens/s per layer-skip exit layer E; write the best E")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local Hugging Face model directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--exits", default="", help="comma list of exit layers (default: about n/4, n/2, 2n/3, 4n/5)")
    p.add_argument("--prompts-file", default=None, help="text file, one prompt per line (default: built-in samples)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=6, help="maximum draft length (adaptive below it)")
    p.add_argument("--out", default=None, help="output JSON (default: the cache path the verifier reads)")
    p.set_defaults(module="specmesh.cli.bench.calibrate", func="main")


def main(args) -> int:
    from ...runtime import Runtime
    from ...types import InvalidArgument

    rt = Runtime(args.model, dtype=args.dtype, n_slots=2, max_seq_len=2048, layerskip_exit=1, quiet=True)
    n = rt.engine.n_layers
    exits = [int(x) for x in args.exits.split(",") if x.strip()] if args.exits else \
        sorted({max(1, n // 4), n // 2, (2 * n) // 3, (4 * n) // 5})
    if any(not 0 < e < n for e in exits):
        raise InvalidArgument("exits", f"exit layers must be in (0, {n})")
    prompts = SAMPLE_PROMPTS
    if args.prompts_file:
        prompts = tuple(ln.strip() for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip())
        if not prompts:
            raise InvalidArgument("prompts_file", "holds no prompts")
    rec = calibrate(rt, exits, prompts, args.max_new_tokens, args.budget)
    out = Path(args.out) if args.out else calibration_path(args.model, args.dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2))
    print(f"{'E':>4} {'tau':>6} {'tok/s':>7} {'speedup':>8}")
    for r in rec["results"]:
        print(f"{r['exit_layer']:>4} {r['tau']:>6.2f} {r['tokens_per_s']:>7.1f} {r['speedup']:>7.2f}x")
    print(f"plain decoding {rec['plain_tokens_per_s']:.1f} tok/s; chose E={rec['exit_layer']} -> {out}")
    return 0
