"""What the Qwen2.5-Coder pair gives through `specmesh serve` with its defaults (issue 62).

Starts ``specmesh serve --model qwen2.5-coder-1.5b-instruct --dtype int4`` and nothing
else (no --drafter-timeout-s: the drafter deadline follows the 0.5B's measured speed), then
sends the same prompts, alternating, as a user would and as the baselines: the router's
default (no strategy named: ``auto``, which tries the 0.5B draft LM on fresh text and keeps
it where it measures faster), plain decoding (``autoregressive``) and suffix decoding (what
``auto`` picked on this pair before: ``external:suffix``). Greedy; every system's tokens are
checked against plain decoding's. Prints each request's tok/s, τ and what auto chose, and
each system's total tokens/s over total seconds and its ratio to plain decoding measured
side by side in the same run. Needs ``make setup-qwen``. A timing script, not a test.

    .venv/bin/python scripts/pair_defaults.py [--workloads code_write,open_writing] [--prompts 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEMS = {"default (auto)": {}, "autoregressive": {"strategy": "autoregressive"},
           "external:suffix": {"strategy": "external", "drafter": "suffix"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="code_write,open_writing")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per workload (default: 2)")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default: 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    from specmesh import workloads as wl
    from specmesh.cli.bench.sweep import Services
    from specmesh.client import Client
    from startup import cpu_name

    prompts = [p for ps in wl.load(args.workloads.split(","), args.prompts).values() for p in ps]
    totals = {k: [0, 0.0] for k in SYSTEMS}
    with tempfile.TemporaryDirectory() as tmp:
        print("starting `specmesh serve --model qwen2.5-coder-1.5b-instruct --dtype int4` ...", file=sys.stderr)
        svc = Services("int4", 8, Path(tmp) / "serve.log", device="cpu",
                       extra=["--model", "qwen2.5-coder-1.5b-instruct"])
        try:
            with Client(svc.address, timeout=900) as c:
                c.generate("Say hello.", max_new_tokens=8, temperature=0, strategy="autoregressive")  # warm-up
                for rep in range(args.repeats):
                    for i, p in enumerate(prompts):
                        order = list(SYSTEMS)
                        k = (i + rep) % len(order)
                        order = order[k:] + order[:k]  # rotated: no system always runs after the same one
                        outs = {}
                        for name in order:
                            r = c.generate(p.prompt, messages=p.messages, temperature=0,
                                           max_new_tokens=p.budget(args.max_new_tokens), **SYSTEMS[name])
                            st = r.stats
                            outs[name] = r.token_ids
                            totals[name][0] += st.new_tokens
                            totals[name][1] += st.total_s
                            chose = f"{st.strategy}:{st.drafter}" if st.drafter else st.strategy
                            print(f"{p.workload:14s} {p.id:18s} {name:16s} {st.tokens_per_s:6.1f} tok/s  "
                                  f"tau {st.tau:4.2f}  {chose}", flush=True)
                        same = all(v == outs["autoregressive"] for v in outs.values())
                        print(f"{'':34s} identical to plain decoding: {'yes' if same else 'NO'}", flush=True)
        finally:
            svc.stop()
    base = totals["autoregressive"][0] / totals["autoregressive"][1]
    print(f"\n{cpu_name()}, int4, greedy, {args.max_new_tokens} tokens, {len(prompts)} prompts x {args.repeats}\n")
    for name, (n, s) in totals.items():
        print(f"{name:16s} {n / s:6.1f} tok/s  {n / s / base:5.2f}x plain decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
