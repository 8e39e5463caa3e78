"""Issue 68's seed check on a real ``specmesh serve`` (SmolLM2 by default, strategy ``auto``):
5 seeded sampled chat requests (temperature 0.8), each repeated ``--repeats`` times with
``n`` 1 and 4, the prefix cache cold (a fresh ``cache_salt``) and warm in turn, while
``--background`` other streams decode beside them (``specmesh.cli.bench.seeds``).
Passes when every repeat gives the same answers and choice 0 of n = 4 is the n = 1 answer.

    PYTHONPATH=. .venv/bin/python scripts/seed_repeats.py                 # 20 repeats, 8 streams
    PYTHONPATH=. .venv/bin/python scripts/seed_repeats.py --repeats 3 --background 2

Writes ``--out``/seeds.json; exit status 1 when an answer differed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--background", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default="bench-out/seeds")
    args = ap.parse_args()

    import openai

    from specmesh.cli.bench.seeds import repeat_seeded
    from specmesh.cli.bench.sweep import Services, _free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    srv = Services(args.dtype, 16, out / "serve.log", http_port=_free_port(),
                   extra=["--model", args.model, "--max-sessions-per-client", "64"])
    client = openai.OpenAI(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=900)
    try:
        res = repeat_seeded(client, args.model, repeats=args.repeats, background=args.background,
                            max_tokens=args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        client.close()
        srv.stop()
    res["seconds"] = round(time.time() - t0)
    (out / "seeds.json").write_text(json.dumps(res, indent=1))
    for i, p in res["prompts"].items():
        print(f"prompt {i}: distinct answers n=1 {p['distinct_n1']}, n=4 {p['distinct_n_choices']}; choice 0 == n=1: "
              f"{p['choice0_equals_n1']}; auto picked {p['picked']}")
    print(f"background: {res['background_requests']} requests, {len(res['background_errors'])} errors; "
          f"all identical: {res['all_identical']} ({res['seconds']} s)")
    return 0 if res["all_identical"] and not res["background_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
