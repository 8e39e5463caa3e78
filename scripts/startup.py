"""Start-up time of the ``specmesh`` command: what a user waits for beyond the work (issue 62).

Side by side in one run, each command ``--runs`` times (median, and the fastest):

- ``python -c pass``: the interpreter alone, the floor every command pays;
- ``specmesh --help``, ``specmesh serve --help`` and an argument error
  (``specmesh serve --no-such-flag``), none of which should load torch or grpc;
- ``specmesh generate PROMPT --json`` against a ``specmesh serve`` started here (the
  default model, free ports): the process's wall time less the generation's own
  (its stats' ``total_s``) is what the command adds; and the same request from a warm
  SDK client in this process, for reference (its wall time less the same stat: the
  hop and the client's own work).

Prints a table and two verdicts: ``--help`` and the argument error under 0.5 s, and
``generate`` adding under 0.5 s to the generation. A timing script, not a test (no test
depends on timing): run it on a quiet machine and say which CPU the figures are from.

    .venv/bin/python scripts/startup.py [--runs 5] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECMESH = [sys.executable, "-m", "specmesh.cli"]
PROMPT = "Name three colours."
LIMIT_S = 0.5


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return time.perf_counter() - t0, r


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="times each command runs (default: 5)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens of each generation (default: 32)")
    ap.add_argument("--no-generate", action="store_true", help="only the commands that need no services")
    args = ap.parse_args()
    env = dict(os.environ)
    rows: dict[str, list[float]] = {}
    checks = {"python -c pass": [sys.executable, "-c", "pass"], "specmesh --help": SPECMESH + ["--help"],
              "specmesh serve --help": SPECMESH + ["serve", "--help"],
              "specmesh serve --no-such-flag": SPECMESH + ["serve", "--no-such-flag"]}
    for _ in range(args.runs):  # interleaved, so a burst of a neighbour's load hits them alike
        for name, cmd in checks.items():
            s, r = timed(cmd, env)
            if r.returncode not in (0, 2):
                print(r.stderr, file=sys.stderr)
                return 1
            rows.setdefault(name, []).append(s)
    if not args.no_generate:
        sys.path.insert(0, str(ROOT))
        from specmesh.cli.bench.sweep import Services
        from specmesh.client import Client

        with tempfile.TemporaryDirectory() as tmp:
            print("starting `specmesh serve` (the default model) ...", file=sys.stderr, flush=True)
            svc = Services("bf16", 2, Path(tmp) / "serve.log", device="cpu")
            try:
                gen = SPECMESH + ["generate", PROMPT, "--address", svc.address, "--json", "--temperature", "0",
                                  "--max-new-tokens", str(args.max_new_tokens)]
                with Client(svc.address, timeout=300) as c:
                    c.generate(PROMPT, max_new_tokens=args.max_new_tokens, temperature=0)  # warm-up
                    for _ in range(args.runs):
                        s, r = timed(gen, env)
                        if r.returncode:
                            print(r.stderr, file=sys.stderr)
                            return 1
                        total = json.loads(r.stdout)["total_s"]
                        rows.setdefault("specmesh generate: wall", []).append(s)
                        rows.setdefault("specmesh generate: the generation (total_s)", []).append(total)
                        rows.setdefault("specmesh generate: added", []).append(s - total)
                        t0 = time.perf_counter()
                        res = c.generate(PROMPT, max_new_tokens=args.max_new_tokens, temperature=0)
                        rows.setdefault("SDK in process (warm): added", []).append(
                            time.perf_counter() - t0 - res.stats.total_s)
            finally:
                svc.stop()
    print(f"\n{cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {args.runs} runs each\n")
    print(f"| {'command':48s} | median s | fastest s |")
    print(f"|{'-' * 50}|----------|-----------|")
    for name, xs in rows.items():
        print(f"| {name:48s} | {statistics.median(xs):8.3f} | {min(xs):9.3f} |")
    fast = max(statistics.median(rows[k]) for k in ("specmesh --help", "specmesh serve --no-such-flag"))
    print(f"\n--help and an argument error: {fast:.3f} s (median, the slower of the two): "
          f"{'OK' if fast < LIMIT_S else 'OVER'} (< {LIMIT_S} s)")
    if "specmesh generate: added" in rows:
        added = statistics.median(rows["specmesh generate: added"])
        print(f"`specmesh generate` adds {added:.3f} s to the generation (median): "
              f"{'OK' if added < LIMIT_S else 'OVER'} (< {LIMIT_S} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
