"""Concurrency sweep through the gRPC services: 1, 4 and 8 concurrent streams,
plain vs speculative; total tokens/s, p50/p99 inter-token latency, TTFT and τ.

``specmesh bench-sweep --target HOST:PORT`` drives a running router;
``--serve`` starts the three services itself (``specmesh serve`` in a child
process on free loopback ports) and stops them at the end. For each
(system, streams) cell, ``streams`` threads pull requests from one queue (so
concurrency stays at ``streams`` until the queue drains) and record the arrival
time and token count of every streamed chunk. A system is ``strategy[:drafter]``
(``autoregressive``, ``external:prompt_lookup``, ``self:layerskip``, ...).

Inter-token latency: the gap between two chunks of a stream is spread evenly
over the chunk's tokens (speculative chunks carry several tokens); the raw p99
chunk gap is reported beside it. ``--repeats N`` runs N alternating passes over
the systems at each stream count; the summary (``summary``) gives each cell's
median tokens/s and its ratios to the plain pass beside it, and a verdict line
per speculative system (``TARGET``: at least 0.95x plain decoding at every
stream count). Writes sweep.json, sweep.md and sweep.png.

This module is the only part of ``specmesh.cli.bench`` that talks gRPC (through
the client SDK); it knows nothing about models.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from ...types import InvalidArgument

NOT_READY = ("specmesh bench-sweep: it needs the gRPC client SDK (specmesh.client), which is not in this "
             "checkout. Use `specmesh bench` for the in-process benchmark.")


def add_arguments(p) -> None:
    p.add_argument("--target", default="", help="router address host:port (default: --serve, or 127.0.0.1:50051)")
    p.add_argument("--serve", action="store_true", help="start the three services on free loopback ports first")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"], help="verifier dtype with --serve")
    p.add_argument("--device", default="auto", help="verifier device with --serve: auto | cpu | cuda | cuda:N")
    p.add_argument("--streams", default="1,4,8", help="comma list of concurrent stream counts")
    p.add_argument("--systems", default="autoregressive,external:prompt_lookup",
                   help="comma list of strategy[:drafter] (plain first = the speedup reference)")
    p.add_argument("--workloads", default="", help="comma list of workloads (default: all)")
    p.add_argument("--workloads-dir", default=None)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--requests", type=int, default=8, help="requests per cell (at least the stream count)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=None, help="draft tokens per round (default: router's)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the systems at each stream count, "
                   "alternating (plain, speculative, plain, ...): the summary gives each cell's median and the "
                   "ratios to the plain pass beside it (this kind of machine moves 20%% between minutes)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--out", default="bench-out", help="output directory (sweep.json, sweep.md, sweep.png)")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def parse_systems(text: str) -> list[tuple[str, str]]:
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        strategy, _, drafter = item.partition(":")
        if strategy not in ("autoregressive", "external", "self", "auto"):
            raise InvalidArgument("systems", f"unknown strategy {strategy!r} in {item!r}")
        out.append((strategy, drafter))
    if not out:
        raise InvalidArgument("systems", "is empty")
    return out


def _label(system: tuple[str, str]) -> str:
    return system[0] + (f":{system[1]}" if system[1] else "")


# ---------------------------------------------------------------- one request / one cell
def one_request(client, req: dict, system: tuple[str, str], max_new: int, budget: Optional[int],
                timeout: float) -> dict:
    """Stream one generation; chunk arrival times and token counts."""
    strategy, drafter = system
    t0 = time.perf_counter()
    s = client.stream(req.get("prompt"), messages=req.get("messages"), strategy=strategy, drafter=drafter,
                      max_new_tokens=max_new, draft_budget=budget, timeout=timeout)
    chunks: list[tuple[float, int]] = []
    seen = 0
    for _ in s:
        n = len(s.token_ids)
        if n > seen:
            chunks.append((time.perf_counter(), n - seen))
            seen = n
    res = s.result
    if res is not None and len(res.token_ids) > seen:
        chunks.append((time.perf_counter(), len(res.token_ids) - seen))
    st = res.stats if res is not None else None
    return {"t0": t0, "chunks": chunks, "tokens": sum(k for _, k in chunks), "end": time.perf_counter(),
            "tau": getattr(st, "tau", None), "rounds": getattr(st, "rounds", None)}


def run_cell(client, reqs: list[dict], system, streams: int, max_new: int, budget, timeout: float) -> dict:
    q: "queue.Queue[dict]" = queue.Queue()
    for r in reqs:
        q.put(r)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                r = q.get_nowait()
            except queue.Empty:
                return
            try:
                out = one_request(client, r, system, max_new, budget, timeout)
                with lock:
                    results.append(out)
            except Exception as e:  # noqa: BLE001 - count and report, keep the sweep going
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    itl, gaps, ttft = [], [], []
    for r in results:
        if r["chunks"]:
            ttft.append(r["chunks"][0][0] - r["t0"])
        for (ta, _), (tb, k) in zip(r["chunks"], r["chunks"][1:]):
            gaps.append(tb - ta)
            itl += [(tb - ta) / k] * k
    tokens = sum(r["tokens"] for r in results)
    taus = [r["tau"] * r["rounds"] for r in results if r["tau"] and r["rounds"]]
    rounds = sum(r["rounds"] for r in results if r["tau"] and r["rounds"])
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 2) if xs else None  # noqa: E731
    return {"system": _label(system), "streams": streams, "requests": len(results), "errors": errors,
            "new_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "chunk_gap_p99_ms": ms(gaps, 99),
            "ttft_p50_ms": ms(ttft, 50), "tau": round(sum(taus) / rounds, 3) if rounds else None}


# ---------------------------------------------------------------- services
def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def services_env(extra: Optional[dict] = None) -> dict:
    """The environment of the ``specmesh serve`` this process starts: its own plus ``extra``,
    without the OpenMP wait policy specmesh set for this process (not the user's: passed on,
    the services read PASSIVE as the user's choice and slept, plain decoding 0.55x); a policy
    the user chose (here or in ``extra``) is passed on."""
    import specmesh

    child = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return dict(child, PYTHONUNBUFFERED="1", **specmesh.user_omp_env(), **(extra or {}))


class Services:
    """``specmesh serve`` (all three) as a child process on free loopback ports."""

    def __init__(self, dtype: str, n_slots: int, log_path: Path, ready_timeout: float = 300.0, device: str = "auto",
                 extra: Sequence[str] = (), http_port: Optional[int] = None, env: Optional[dict] = None):
        """``extra``: more ``specmesh serve`` flags (``--cpus ...``, ``--model ...``); ``http_port``: serve
        the OpenAI HTTP API there (None: gRPC only); ``env``: variables added to the children's."""
        ports = {k: _free_port() for k in ("router", "drafter", "verifier")}
        self.address = f"127.0.0.1:{ports['router']}"
        self.http_url = f"http://127.0.0.1:{http_port}/v1" if http_port else None
        cmd = [sys.executable, "-m", "specmesh.cli", "serve", "--dtype", dtype, "--n-slots", str(n_slots),
               "--device", device, "--max-batch", str(max(n_slots, 1)),
               # the sweep is one client: let it hold every stream it opens (the default caps a client at 16)
               "--max-sessions-per-client", str(max(n_slots, 1)),
               # gRPC only unless asked: the OpenAI HTTP front end needs fastapi, which a bare GPU
               # machine lacks (the router died there on its import)
               *(["--http-port", str(http_port)] if http_port else ["--http", "false"]), *extra]
        cmd += [a for k, p in ports.items() for a in (f"--{k}-port", str(p))]
        self.log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=services_env(env))
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                if line.startswith("try:"):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the services did not start; see {log_path}")
        # `serve` prints its addresses before the verifier has loaded its model; the router is
        # NOT_SERVING (the OpenAI front 503) until it has: wait for that too
        from ...client import Client

        with Client(self.address, timeout=30) as c:
            while not c.ready()[0]:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the services did not become ready; see {log_path}")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------- reports
TARGET = 0.95  # speculation against plain decoding at every stream count (issue 48)


def summary(cells: list[dict]) -> list[dict]:
    """Per (system, streams): the median tokens/s over the passes and the ratios to the
    plain system's (the first system's) tokens/s in the same pass, with their median."""
    plain = cells[0]["system"] if cells else ""
    base = {(c["streams"], c.get("repeat", 0)): c["tokens_per_s"] for c in cells if c["system"] == plain}
    out: dict = {}
    for c in cells:
        row = out.setdefault((c["system"], c["streams"]), {"system": c["system"], "streams": c["streams"],
                                                            "tokens_per_s": [], "ratios": []})
        row["tokens_per_s"].append(c["tokens_per_s"])
        b = base.get((c["streams"], c.get("repeat", 0)))
        if b:
            row["ratios"].append(round(c["tokens_per_s"] / b, 3))
    for row in out.values():
        row["median_tokens_per_s"] = round(statistics.median(row["tokens_per_s"]), 2)
        row["median_ratio"] = round(statistics.median(row["ratios"]), 3) if row["ratios"] else None
    return list(out.values())


def verdicts(rows: list[dict]) -> list[str]:
    """One line per speculative system: its lowest median ratio to plain decoding over the
    stream counts against ``TARGET``."""
    plain = rows[0]["system"] if rows else ""
    lines = []
    for name in dict.fromkeys(r["system"] for r in rows if r["system"] != plain):
        rs = [r for r in rows if r["system"] == name and r["median_ratio"] is not None]
        if not rs:
            continue
        worst = min(rs, key=lambda r: r["median_ratio"])
        ok = "ok" if worst["median_ratio"] >= TARGET else "BELOW TARGET"
        lines.append(f"- {name}: lowest median {worst['median_ratio']:.2f}x of {plain} (at {worst['streams']} "
                     f"streams; target >= {TARGET:.2f}x at every stream count): {ok}")
    return lines


def render(cells: list[dict], meta: dict) -> str:
    L = ["# specmesh concurrency sweep (gRPC)", "",
         f"router {meta['target']}, max_new_tokens {meta['max_new_tokens']}, {meta['requests']} requests per cell "
         f"(at least one per stream), prompts from {', '.join(meta['workloads'])}. ITL = gap between streamed "
         "chunks spread over the chunk's tokens; chunk gap p99 is the raw gap.", "",
         "| system | streams | requests | new tokens | wall s | total tok/s | vs plain | ITL p50 ms | ITL p99 ms "
         "| chunk gap p99 ms | TTFT p50 ms | τ | errors |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(c["streams"], c.get("repeat", 0)): c["tokens_per_s"] for c in cells
             if c["system"] == cells[0]["system"]}
    f = lambda v: "–" if v is None else f"{v}"  # noqa: E731
    for c in cells:
        base = plain.get((c["streams"], c.get("repeat", 0)))
        vs = f"{c['tokens_per_s'] / base:.2f}x" if base else "–"
        L.append(f"| {c['system']} | {c['streams']} | {c['requests']} | {c['new_tokens']} | {c['wall_s']} | "
                 f"{c['tokens_per_s']} | {vs} | {f(c['itl_p50_ms'])} | {f(c['itl_p99_ms'])} | "
                 f"{f(c['chunk_gap_p99_ms'])} | {f(c['ttft_p50_ms'])} | {f(c['tau'])} | {len(c['errors'])} |")
    rows = summary(cells)
    passes = max((c.get("repeat", 0) for c in cells), default=0) + 1
    L += ["", f"Summary: median of {passes} alternating pass(es); ratios to {cells[0]['system'] if cells else '–'} "
          "in the same pass.", "",
          "| system | streams | median tok/s | median vs plain | ratios |", "|---|---|---|---|---|"]
    for r in rows:
        m = "–" if r["median_ratio"] is None else f"{r['median_ratio']:.2f}x"
        L.append(f"| {r['system']} | {r['streams']} | {r['median_tokens_per_s']} | {m} | "
                 f"{' / '.join(f'{x:.2f}' for x in r['ratios'])} |")
    L += [""] + verdicts(rows)
    errs = sorted({e for c in cells for e in c["errors"]})
    if errs:
        L += ["", "Errors:"] + [f"- {e}" for e in errs[:10]]
    return "\n".join(L) + "\n"


def chart(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    med = {(r["system"], r["streams"]): r["median_tokens_per_s"] for r in summary(cells)}
    for sysname in dict.fromkeys(c["system"] for c in cells):
        cs = [c for c in cells if c["system"] == sysname and c.get("repeat", 0) == 0]  # latency: the first pass
        x = [c["streams"] for c in cs]
        a.plot(x, [med[(sysname, n)] for n in x], marker="o", label=sysname)
        b.plot(x, [c["itl_p50_ms"] or 0 for c in cs], marker="o", label=f"{sysname} p50")
        b.plot(x, [c["itl_p99_ms"] or 0 for c in cs], marker="x", ls="--", label=f"{sysname} p99")
    a.set(xlabel="concurrent streams", ylabel="total tokens / s (median of the passes)", title="throughput")
    b.set(xlabel="concurrent streams", ylabel="ms", title="inter-token latency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- entry
def run_sweep(args) -> dict:
    from ...client import Client
    from ... import workloads as wl

    streams = [int(x) for x in str(args.streams).split(",") if x.strip()]
    if not streams or any(n <= 0 for n in streams):
        raise InvalidArgument("streams", f"must be positive integers, got {args.streams!r}")
    systems = parse_systems(args.systems)
    repeats = int(getattr(args, "repeats", 1))
    if repeats < 1:
        raise InvalidArgument("repeats", f"must be >= 1, got {repeats}")
    names = [x.strip() for x in args.workloads.split(",") if x.strip()] or None
    loads = wl.load(names, args.prompts, Path(args.workloads_dir) if args.workloads_dir else None)
    pool = [{"prompt": p.prompt, "messages": p.messages} for ps in loads.values() for p in ps]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    services = (Services(args.dtype, max(streams), out / "sweep-serve.log", device=getattr(args, "device", "auto"))
                if args.serve else None)
    target = services.address if services else (args.target or "127.0.0.1:50051")
    cells: list[dict] = []
    try:
        client = Client(target, timeout=args.timeout)
        for system in systems:  # warm-up: one short request per system (a fresh router may need a retry)
            for attempt in range(3):
                try:
                    one_request(client, pool[0], system, 8, args.budget, args.timeout)
                    break
                except Exception as e:  # noqa: BLE001
                    if attempt == 2 or "UNAVAILABLE" not in str(e).upper():
                        raise
                    time.sleep(3)
        for n in streams:
            reqs = [pool[i % len(pool)] for i in range(max(args.requests, n))]
            for rep in range(repeats):  # plain and speculative back to back at each concurrency, alternating
                for system in systems:
                    cell = run_cell(client, reqs, system, n, args.max_new_tokens, args.budget, args.timeout)
                    cell["repeat"] = rep
                    print(f"  {cell['system']:28s} streams {n}" + (f" pass {rep + 1}/{repeats}" if repeats > 1
                                                                   else "") +
                          f": {cell['tokens_per_s']:7.1f} tok/s, ITL p50 {cell['itl_p50_ms']} ms p99 "
                          f"{cell['itl_p99_ms']} ms, errors {len(cell['errors'])}", file=sys.stderr, flush=True)
                    cells.append(cell)
        client.close()
    finally:
        if services:
            services.stop()
    meta = {"target": target, "served_here": bool(services), "dtype": args.dtype if services else None,
            "max_new_tokens": args.max_new_tokens, "requests": args.requests, "workloads": list(loads),
            "streams": streams, "systems": [_label(s) for s in systems], "repeats": repeats}
    rows = summary(cells)
    for line in verdicts(rows):
        print(line, file=sys.stderr)
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "cells": cells, "summary": rows}, indent=2))
    (out / "sweep.md").write_text(render(cells, meta))
    chart(cells, out / "sweep.png")
    return {"meta": meta, "cells": cells}


def main(args) -> int:
    import importlib.util

    if importlib.util.find_spec("specmesh.client") is None:
        print(NOT_READY, file=sys.stderr)
        return 2
    run_sweep(args)
    print(f"wrote {args.out}/sweep.json, sweep.md, sweep.png")
    return 0
