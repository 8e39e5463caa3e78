"""The long fuzzing runs of issue 68: both doors of a real ``specmesh serve`` (SmolLM2 by
default; its OpenAI front and its router), thousands of cases each, from a fixed seed.

- the HTTP door: schemathesis cases generated from the front's ``/openapi.json``, for each
  of ``/v1/chat/completions`` and ``/v1/completions``, ``--cases`` an endpoint (half
  positive: what the schema allows, half negative: what it does not);
- the gRPC door: ``--cases`` Hypothesis cases of ``GenerateRequest`` (raw stubs: what the
  SDK would refuse before sending reaches the router too);

each judged by ``specmesh.cli.bench.fuzz`` (a success, or a refusal naming its field), and
then the services checked still serving (health, a greedy request through each door) and
their processes alive. Generation is capped (``--max-new-tokens-limit 16``) so that a case
costs a fraction of a second; refusals cost milliseconds.

    PYTHONPATH=. .venv/bin/python scripts/fuzz.py                       # 2,000 cases a door, seed 68
    PYTHONPATH=. .venv/bin/python scripts/fuzz.py --cases 200 --doors grpc
    PYTHONPATH=. .venv/bin/python scripts/fuzz.py --tiny --cases 4000    # CI's stack (tests/services/test_fuzz.py)

``--tiny``: the stack of the CI test instead (router, drafter and verifier services in this
process, a tiny random model over ``CharCodec``, grammars served): every code path but the
real tokenizer's, fast enough for many thousands of cases.

Writes ``--out``/fuzz.json (outcomes, failures with what was sent) and prints a summary;
exit status 1 when a case failed or a service stopped serving.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


class TinyStack:
    """The CI test's stack in this process (``tests/services/test_fuzz.py``), with the face of
    ``Services``: ``address``, ``http_url``, ``proc.poll()``, ``stop()``."""

    def __init__(self):
        import functools

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support
        from specmesh.cli.stack import LocalStack
        from specmesh.drafters import PromptLookupDrafter, SuffixDrafter
        from specmesh.serving.openai_http import start_http
        from tests.support import TRACED_SETTINGS, CharCodec, V, settings, tiny_grammar_verifier

        kw = dict(TRACED_SETTINGS, model="tiny-test-model", max_seq_len=512, max_prompt_tokens=400, max_new_tokens=16)
        self.stack = LocalStack([lambda: tiny_grammar_verifier(max_seq_len=512)], CharCodec(), V,
                                settings=functools.partial(settings, kw),
                                drafters={"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter})
        self.http = start_http(self.stack.rs, self.stack.address, port=0)
        self.address, self.http_url = self.stack.address, self.http.url
        self.proc = type("Alive", (), {"poll": staticmethod(lambda: None)})

    def stop(self) -> None:
        self.http.stop()
        self.stack.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cases", type=int, default=2000, help="cases an HTTP endpoint (half each mode), and gRPC cases")
    ap.add_argument("--seed", type=int, default=68)
    ap.add_argument("--doors", default="http,grpc")
    ap.add_argument("--out", default="bench-out/fuzz")
    ap.add_argument("--tiny", action="store_true", help="the CI test's in-process tiny stack, not specmesh serve")
    args = ap.parse_args()

    from specmesh.cli.bench import fuzz
    from specmesh.cli.bench.sweep import Services, _free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # generation capped (a case costs a fraction of a second); refusals cost milliseconds
    extra = ["--model", args.model, "--max-new-tokens-limit", "8", "--max-prompt-tokens", "1500",
             "--max-sessions-per-client", "64"]
    t0 = time.time()
    srv = TinyStack() if args.tiny else Services(args.dtype, 8, out / "serve.log", http_port=_free_port(), extra=extra,
                                                 env={"SPECMESH_DEFAULT_MAX_NEW_TOKENS": "4"})
    base = srv.http_url.removesuffix("/v1")
    report: dict = {"model": "tiny (CharCodec)" if args.tiny else args.model, "dtype": args.dtype, "seed": args.seed,
                    "cases": args.cases}
    try:
        doors = args.doors.split(",")
        if "http" in doors:
            t = time.time()
            tally = fuzz.fuzz_http(base, args.cases // 2, args.seed)
            report["http"] = dict(tally.to_dict(), seconds=round(time.time() - t))
            print(f"http: {report['http']['cases']} failed {tally.failed} in {report['http']['seconds']} s",
                  file=sys.stderr, flush=True)
        if "grpc" in doors:
            t = time.time()
            tally = fuzz.fuzz_grpc(srv.address, args.cases, args.seed)
            report["grpc"] = dict(tally.to_dict(), seconds=round(time.time() - t))
            print(f"grpc: {report['grpc']['cases']} failed {tally.failed} in {report['grpc']['seconds']} s",
                  file=sys.stderr, flush=True)
        report["not_serving"] = fuzz.still_serving(base, srv.address)
        report["serve_exited"] = srv.proc.poll()
    finally:
        srv.stop()
    report["seconds"] = round(time.time() - t0)
    (out / "fuzz.json").write_text(json.dumps(report, indent=1, default=str))
    failed = sum(report.get(d, {}).get("failed", 0) for d in ("http", "grpc"))
    for d in ("http", "grpc"):
        if d in report:
            print(f"{d}: cases {report[d]['cases']}, failed {report[d]['failed']}; outcomes {report[d]['outcomes']}")
            for f in report[d]["failures"][:5]:
                print(f"  {f['problem']}\n    sent: {f['sent'][:300]}")
    print(f"still serving: {not report['not_serving']} {report['not_serving']}; serve exited: {report['serve_exited']}")
    return 1 if failed or report["not_serving"] or report["serve_exited"] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
