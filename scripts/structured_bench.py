"""Structured outputs and predicted outputs: speed against plain decoding, same run.

In process (the one loop over the served engine's verifier: ``Runtime``), greedy,
SmolLM2-135M-Instruct (``--model`` another, e.g. qwen2.5-coder-1.5b-instruct with
``--dtype int4``), each pair alternating for ``--repeats`` rounds, each side keeping
its best tokens/s:
- constrained speculation (jump-forward + prompt lookup) / constrained plain decoding, on
  JSON with many fixed keys and enums (target: >= 1.3x);
- constrained plain / unconstrained plain decoding (the mask's cost; target >= 0.9x);
- predicted outputs on code edits (the edited code as the prediction) / plain decoding
  (target: >= 2x), with the accepted / rejected prediction tokens.
Outputs are checked equal between the sides of each pair (greedy). Run under the CPU
lock: ``flock -s /tmp/specmesh-cpu.lock .venv/bin/python scripts/structured_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import time

from specmesh.drafters import PromptLookupDrafter
from specmesh.drafters.prediction import PredictionDrafter
from specmesh.loop import BudgetPolicy, generate_tokens
from specmesh.runtime import Runtime
from specmesh.types import GenerationStats, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "employee_id": {"type": "integer"}, "full_name": {"type": "string", "maxLength": 24},
    "department": {"enum": ["engineering", "marketing", "sales", "finance", "human resources"]},
    "seniority_level": {"enum": ["junior", "intermediate", "senior", "principal"]},
    "employment_status": {"enum": ["full_time", "part_time", "contractor"]},
    "office_location": {"enum": ["new_york", "london", "singapore", "remote"]},
    "is_manager": {"type": "boolean"}, "years_of_experience": {"type": "integer"},
    "primary_programming_language": {"enum": ["python", "javascript", "go", "rust", "java"]}},
    "required": ["employee_id", "full_name", "department", "seniority_level", "employment_status", "office_location",
                 "is_manager", "years_of_experience", "primary_programming_language"],
    "additionalProperties": False}
JSON_PROMPTS = ["Describe a fictional software engineer as a JSON record.",
                "Give me a JSON record of an employee who works in sales in London."]
CODE = '''def total(xs):
    s = 0
    for x in xs:
        s = s + x
    return s


def mean(xs):
    return total(xs) / len(xs)
'''
LONG = CODE + '''

def variance(xs):
    m = mean(xs)
    return total([(x - m) ** 2 for x in xs]) / len(xs)


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def normalize(xs):
    lo, hi = min(xs), max(xs)
    return [(x - lo) / (hi - lo) for x in xs]
'''
# as code-editing tools ask (OpenAI's predicted-outputs guide: "Respond only with code, and with no markdown
# formatting"); the prediction is the code with the edit made
ONLY = " Respond only with the whole code, with no explanation and no markdown formatting.\n\n"
EDITS = [("Rename the variable s to acc in this code." + ONLY + CODE,
          CODE.replace("s = 0", "acc = 0").replace("s = s + x", "acc = acc + x").replace("return s\n", "return acc\n")),
         ('Add the one-line docstring """The mean of xs.""" to mean in this code.' + ONLY + CODE,
          CODE.replace("def mean(xs):\n", 'def mean(xs):\n    """The mean of xs."""\n')),
         ("Rename the function total to sum_of in this code, and its calls." + ONLY + LONG,
          LONG.replace("total(", "sum_of("))]


def timed(rt, ids, drafter, sampling, n, jump_forward=True, budget=8):
    st = GenerationStats()
    t0 = time.perf_counter()
    out, _ = generate_tokens(drafter, rt.verifier, ids, sampling=sampling, max_new_tokens=n, stop_ids=rt.stop_ids,
                             budget=BudgetPolicy(budget), jump_forward=jump_forward, stats=st)
    dt = time.perf_counter() - t0
    return out, len(out) / dt, st


def pair(name, a, b, repeats):
    best = [0.0, 0.0]
    outs = [None, None]
    extra = {}
    for _ in range(repeats):
        for k, f in enumerate((a, b)):
            out, tps, st = f()
            best[k] = max(best[k], tps)
            outs[k] = out
            extra[k] = st
    print(f"{name}: {best[0]:.1f} / {best[1]:.1f} tok/s = {best[0] / best[1]:.2f}x "
          f"(tokens {len(outs[0])} / {len(outs[1])}, same output: {outs[0] == outs[1]})")
    return best[0] / best[1], outs, extra


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="code edits' token limit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only-code", action="store_true")
    args = ap.parse_args()
    rt = Runtime(args.model, dtype=args.dtype, n_slots=2, max_seq_len=1024, quiet=True,
                 block_drafter=False, uno=False)
    cons = SamplingParams(grammar_kind="json_schema", grammar=json.dumps(SCHEMA))
    print(f"{args.model} {args.dtype}, greedy, best of {args.repeats} alternating")
    for p in JSON_PROMPTS if not args.only_code else []:
        ids = rt.encode(messages=[{"role": "user", "content": p}])
        _, outs, st = pair("  json: constrained speculation / constrained plain",
                           lambda: timed(rt, ids, PromptLookupDrafter(), cons, 160),
                           lambda: timed(rt, ids, None, cons, 160, jump_forward=False), args.repeats)
        print(f"    forced tokens {st[0].forced_tokens}, target forwards {st[0].target_forwards} / "
              f"{st[1].target_forwards}; {rt.decode(outs[0])}")
        pair("  json: constrained plain / unconstrained plain",
             lambda: timed(rt, ids, None, cons, 160, jump_forward=False),
             lambda: timed(rt, ids, None, SamplingParams(), 160), args.repeats)
    for prompt, prediction in EDITS:
        ids = rt.encode(messages=[{"role": "user", "content": prompt}])
        pred = rt.codec.tokenizer.encode(prediction, add_special_tokens=False)
        holder = {}

        def predicted():
            holder["d"] = d = PredictionDrafter(pred)
            return timed(rt, ids, d, SamplingParams(), args.max_new_tokens, budget=32)

        _, outs, _ = pair("  code edit: prediction / plain", predicted,
                          lambda: timed(rt, ids, None, SamplingParams(), args.max_new_tokens), args.repeats)
        print(f"    accepted {holder['d'].accepted} / rejected {holder['d'].rejected} prediction tokens; "
              f"output: {rt.decode(outs[0])!r}")


if __name__ == "__main__":
    main()
