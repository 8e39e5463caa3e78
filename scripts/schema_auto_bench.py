"""A fixed-key JSON schema through a running ``specmesh serve``: ``auto`` against plain decoding.

Issue 67's case: a schema of 8 fixed keys, each a yes/no enum, asked through the OpenAI
API with the official client (greedy, ``response_format`` json_schema). For each prompt
the two strategies alternate for ``--repeats`` rounds (``strategy: autoregressive``, and
none named: the server's default ``auto``), each keeping its best tokens/s (completion
tokens / wall seconds of the request, prefill included); the outputs must be equal, and
``auto``'s stats say which drafter it picked and why (under a grammar: prompt lookup, whose
chains get the grammar's forced tokens free).

    specmesh serve --model qwen2.5-coder-1.5b-instruct --dtype int4 &
    python scripts/schema_auto_bench.py --base-url http://127.0.0.1:8000/v1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time

KEYS = ["has_garden", "has_garage", "pets_allowed", "furnished", "near_school", "has_balcony", "has_elevator",
        "parking_included"]
SCHEMA = {"type": "object", "properties": {k: {"enum": ["yes", "no"]} for k in KEYS}, "required": KEYS,
          "additionalProperties": False}
PROMPTS = ["Describe a small city apartment as a JSON record of yes/no features.",
           "A family house in the suburbs: give its features as JSON (yes or no each)."]


def one(client, model: str, prompt: str, strategy: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "features", "schema": SCHEMA}},
        extra_body={"strategy": strategy} if strategy else None)
    s = time.perf_counter() - t0
    sm = r.model_extra["specmesh"]
    return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens, "s": s,
            "tok_s": r.usage.completion_tokens / s, "tau": sm.get("tau"), "strategy": sm.get("strategy"),
            "drafter": sm.get("drafter"), "reason": sm.get("strategy_reason"), "forced": sm.get("forced_tokens")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    rows = []
    for prompt in PROMPTS:
        best: dict = {}
        for _ in range(args.repeats):
            for name, strategy in (("autoregressive", "autoregressive"), ("auto", "")):
                r = one(client, model, prompt, strategy, args.max_tokens)
                if name not in best or r["tok_s"] > best[name]["tok_s"]:
                    best[name] = r
        ar, au = best["autoregressive"], best["auto"]
        same = ar["text"] == au["text"]
        rows.append({"prompt": prompt, "autoregressive": ar, "auto": au, "identical": same,
                     "speedup": au["tok_s"] / ar["tok_s"]})
        print(f"{prompt[:48]!r}: auto {au['tok_s']:.1f} tok/s (tau {au['tau']:.2f}, {au['strategy']}:{au['drafter']}, "
              f"{au['forced']} forced) / autoregressive {ar['tok_s']:.1f} = {au['tok_s'] / ar['tok_s']:.2f}x; "
              f"outputs identical: {same}; {au['tokens']} tokens", flush=True)
        print(f"  auto's reason: {au['reason']}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"model": model, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
