"""``specmesh bench-serving``: serving workloads through the OpenAI API, as users meet them.

Each system is an OpenAI-compatible server on loopback, driven with the official
``openai`` client (streamed chat completions, greedy):

- ``ours``: ``specmesh serve`` with its defaults (prefix cache on, chunked prefill);
- ``ours_nocache``: ``specmesh serve --prefix-cache false --prefill-chunk 0`` (the
  verifier before issue 59: every prompt prefilled whole, in one forward);
- ``llamacpp``: llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) on the
  same GGUF, ``--n_ctx 4096 --n_threads <cpus>`` (the ``bench-peers`` extra; it keeps its
  slot's KV for the common prefix of consecutive requests).

Workloads (``--workloads``):

- ``chat``: one conversation of ``--turns`` turns, each the history plus a ~120-token user
  message, ``--max-new-tokens`` a turn: TTFT and end to end per turn, on every system
  (``turns.png``); target: mean TTFT of turns 6-10 within 1.5x that of turns 1-2;
- ``shared``: ``--users`` users at once with one ~1,000-token system prompt and a short
  question each: TTFT p50/p99 with the cache on and off (target: on <= 1/3 of off);
- ``interference``: 8 streams decoding (plain decoding, so a gap is one token) while
  ~2,000-token prompts arrive: the streams' inter-token gaps p50/p99 (target: p99 <= 2x
  p50 with chunked prefill), against the server without chunking;
- ``sweep``: Poisson arrivals at ``--rates`` requests/s, prompts of mixed lengths up to
  ~2,000 tokens: TTFT, inter-token gap and end to end at p50/p99 and goodput (requests/s
  meeting ``--slo-ttft`` and ``--slo-tpot``), as ``vllm bench serve`` reports them
  (``sweep.png``).

Writes serving.json and serving.md beside the charts. Ratios are measured side by side in
one run on one machine; the machine it ran on is in the report. Knows nothing about
models beyond their tokenizer (prompt lengths) and GGUF path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from ...workloads import load as load_prompts
from .sweep import Services, _free_port, percentile

SYSTEMS = ("ours", "ours_nocache", "llamacpp")
WORKLOADS = ("chat", "shared", "interference", "sweep")


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"], help="our verifier's dtype")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rates", default="0.25,0.5,1.0", help="Poisson arrival rates of the sweep, requests/s")
    p.add_argument("--requests", type=int, default=12, help="requests per sweep rate")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="goodput: TTFT at most this many seconds")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="goodput: seconds per output token after the first")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (our services use every CPU)")
    p.add_argument("--soak", type=int, default=0, help="in process: this many distinct conversations through a "
                   "small prefix cache and none, outputs compared, RSS sampled (0: no soak)")
    p.add_argument("--soak-mib", type=float, default=64.0, help="the soak's cache budget in MiB")
    p.add_argument("--soak-serve", type=int, default=0, help="this many honest two-turn conversations through "
                   "specmesh serve with a fuzzing client beside them: errors, seeded outputs against a quiet run, "
                   "the services' RSS (cli/bench/soak.py; 0: none)")
    p.add_argument("--soak-seeded", type=int, default=20, help="of those, sampled with a seed and run quiet first")
    p.add_argument("--soak-concurrency", type=int, default=4, help="conversations at a time in --soak-serve")
    p.add_argument("--soak-tokens", type=int, default=16, help="tokens a reply in --soak-serve")
    p.add_argument("--soak-fuzz", action=argparse.BooleanOptionalAction, default=True,
                   help="the fuzzing client beside --soak-serve (schemathesis and Hypothesis: the test extra)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out/serving")


# ---------------------------------------------------------------- texts of given token lengths
class Texts:
    """Text pieces of about n tokens each, cut from the bundled workloads' prompts."""

    def __init__(self, model: str, seed: int):
        from ...models.loading import load_tokenizer, resolve_model

        self.tok = load_tokenizer(resolve_model(model, quiet=True))
        parts = []
        for prompts in load_prompts().values():
            for p in prompts:
                parts += [p.prompt] if p.prompt else [m["content"] for m in p.messages if m.get("content")]
        words = " ".join(parts).split()
        self.words, self.rng = words, random.Random(seed)

    def piece(self, n: int) -> str:
        """About ``n`` tokens of text (whole words from a random place)."""
        i = self.rng.randrange(len(self.words))
        out, count = [], 0
        while count < n:
            w = self.words[i % len(self.words)]
            out.append(w)
            count += len(self.tok.encode(" " + w, add_special_tokens=False))
            i += 1
        return " ".join(out)


# ---------------------------------------------------------------- servers
class LlamaCppServer:
    """llama-cpp-python's OpenAI server on the GGUF, in a child process."""

    def __init__(self, gguf: Path, threads: int, log_path: Path, ctx: int = 4096, timeout: float = 300.0,
                 extra: Sequence[str] = (), extra_bufts: bool = True):
        """``extra``: more server flags (``--chat_format chatml-function-calling``); ``extra_bufts``
        False: llama.cpp's AMX / repacked weight buffers off (``llamacpp_server``)."""
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = open(log_path, "w", encoding="utf-8")
        module = "llama_cpp.server" if extra_bufts else "specmesh.cli.bench.llamacpp_server"
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--model", str(gguf), "--n_ctx",
                                      str(ctx), "--n_threads", str(threads), "--host", "127.0.0.1", "--port",
                                      str(port), *extra], stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while not _up(self.url):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"llama-cpp-python's server did not start; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _up(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(system: str, args, out: Path, extra: Sequence[str] = (), env: Optional[dict] = None):
    """(the server, its /v1 URL, the model name to send); ``extra``: more ``specmesh serve`` flags,
    ``env``: more variables for it."""
    if system == "llamacpp":
        from ...models.loading import resolve_model
        from .peers import gguf_path

        gguf = gguf_path(args.model, resolve_model(args.model, quiet=True))
        if gguf is None:
            raise RuntimeError(f"no GGUF found for {args.model}")
        srv = LlamaCppServer(gguf, args.threads, out / "llamacpp.log")
        return srv, srv.url, str(gguf)
    # one client sends every user's requests: let it hold them all at once (the default caps a client at 8 here)
    flags = ["--model", args.model, "--max-prompt-tokens", "2000", "--max-new-tokens-limit", "1024",
             "--max-sessions-per-client", str(max(16, 2 * args.users)), *extra]
    if system == "ours_nocache":
        flags += ["--prefix-cache", "false", "--prefill-chunk", "0"]
    # a loaded machine may take minutes over a burst of long prompts: no router deadline cuts a request short
    srv = Services(args.dtype, 8, out / f"{system}.log", http_port=_free_port(), extra=flags,
                   env=dict({"SPECMESH_VERIFIER_TIMEOUT_S": "900"}, **(env or {})))
    return srv, srv.http_url, args.model


# ---------------------------------------------------------------- one streamed request
def stream(client, model: str, messages: list[dict], max_new: int, extra: Optional[dict] = None) -> dict:
    """One streamed greedy chat completion: TTFT, chunk times, end to end, text, usage."""
    t0 = time.perf_counter()
    kw = {"extra_body": extra} if extra else {}
    s = client.chat.completions.create(model=model, messages=messages, max_tokens=max_new, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, **kw)
    times, text, usage = [], [], None
    for ch in s:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter() - t0)
            text.append(ch.choices[0].delta.content)
    e2e = time.perf_counter() - t0
    cached = None
    if usage is not None and getattr(usage, "prompt_tokens_details", None) is not None:
        cached = usage.prompt_tokens_details.cached_tokens
    return {"ttft": times[0] if times else e2e, "e2e": e2e, "gaps": [b - a for a, b in zip(times, times[1:])],
            "text": "".join(text), "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None, "cached_tokens": cached}


# ---------------------------------------------------------------- workloads
def run_chat(client, model: str, texts: Texts, turns: int, max_new: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": texts.piece(120) + "\nWhat does this say?"})
        r = stream(client, model, msgs, max_new)
        msgs.append({"role": "assistant", "content": r["text"]})
        out.append(dict(r, turn=t + 1, gaps=None))
    return out


def run_concurrent(client, model: str, jobs: list[tuple[float, list[dict], int, Optional[dict]]]) -> list[dict]:
    """Requests started at given offsets (seconds), each in a thread; results in job order."""
    res: list = [None] * len(jobs)
    t0 = time.perf_counter()

    def one(i, at, msgs, n, extra):
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        try:
            res[i] = dict(stream(client, model, msgs, n, extra), start=at)
        except Exception as e:  # noqa: BLE001 - reported per request
            res[i] = {"error": f"{type(e).__name__}: {e}", "start": at}

    threads = [threading.Thread(target=one, args=(i, *j)) for i, j in enumerate(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return res


def run_shared(client, model: str, texts: Texts, users: int, max_new: int, seed: int) -> list[dict]:
    system = "You are the support assistant of a shop. Policies:\n" + texts.piece(1000)
    rng = random.Random(seed)
    jobs = [(0.05 * k, [{"role": "system", "content": system},
                        {"role": "user", "content": texts.piece(rng.randrange(15, 40))}], max_new, None)
            for k in range(users)]
    return run_concurrent(client, model, jobs)


def run_interference(client, model: str, texts: Texts, is_ours: bool) -> list[dict]:
    plain = {"strategy": "autoregressive"} if is_ours else None
    jobs = [(0.1 * k, [{"role": "user", "content": texts.piece(60)}], 160, plain) for k in range(8)]
    jobs += [(4.0 + 3.0 * k, [{"role": "user", "content": texts.piece(1900)}], 8, plain) for k in range(2)]
    res = run_concurrent(client, model, jobs)
    for r in res[:8]:
        r["stream"] = True
    return res


def _rss() -> int:
    """This process's resident set, bytes (Linux)."""
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    return 0


def run_soak(args, texts: Texts) -> dict:
    """``--soak`` distinct two-turn conversations in process, through a verifier whose prefix
    cache has ``--soak-mib`` (evicting all along) and one without a cache: every output
    compared, this process's RSS sampled as it goes (its growth must stay within the
    budget plus a fixed margin)."""
    from ...loop import generate_tokens
    from ...runtime import Runtime

    on = Runtime(args.model, dtype=args.dtype, n_slots=4, max_seq_len=2048, quiet=True, block_drafter=False,
                 specialist=None, uno=False)
    on.verifier.configure_prefix_cache(True, int(args.soak_mib * (1 << 20)))
    off_verifier = type(on.verifier)(on.engine, prefix_cache=False)  # the same weights and slots, no cache
    rss0, rss, diffs, t0 = _rss(), [], 0, time.perf_counter()
    for k in range(args.soak):
        msgs = [{"role": "system", "content": f"Conversation {k}. " + texts.piece(80)},
                {"role": "user", "content": texts.piece(60)}]
        for turn in range(2):
            ids = on.encode(messages=msgs)
            a, _ = generate_tokens(None, on.verifier, ids, max_new_tokens=8, stop_ids=on.stop_ids)
            b, _ = generate_tokens(None, off_verifier, ids, max_new_tokens=8, stop_ids=on.stop_ids)
            diffs += a != b
            msgs += [{"role": "assistant", "content": on.decode(a)}, {"role": "user", "content": texts.piece(40)}]
        if k % 25 == 24 or k == args.soak - 1:
            rss.append((k + 1, _rss() - rss0))
            print(f"  soak {k + 1}: rss +{rss[-1][1] / 2 ** 20:.0f} MiB, evictions "
                  f"{on.verifier.info()['prefix_cache_evictions']}, outputs changed {diffs}", file=sys.stderr,
                  flush=True)
    info = on.verifier.info()
    return {"conversations": args.soak, "budget_mib": args.soak_mib, "outputs_changed": diffs,
            "rss_growth_mib": [(k, r / 2 ** 20) for k, r in rss], "evictions": info["prefix_cache_evictions"],
            "hits": info["prefix_cache_hits"], "queries": info["prefix_cache_queries"],
            "cache_bytes_mib": info["prefix_cache_bytes"] / 2 ** 20, "seconds": time.perf_counter() - t0}


def run_sweep(client, model: str, texts: Texts, rates: list[float], n: int, max_new: int, seed: int) -> list[dict]:
    out = []
    for rate in rates:
        rng = random.Random(seed + int(rate * 1000))
        at, jobs = 0.0, []
        for _ in range(n):
            at += rng.expovariate(rate)
            jobs.append((at, [{"role": "user", "content": texts.piece(rng.choice([100, 300, 600, 1000, 1900]))}],
                         max_new, None))
        t0 = time.perf_counter()
        res = run_concurrent(client, model, jobs)
        out.append({"rate": rate, "wall": time.perf_counter() - t0, "requests": res})
    return out


# ---------------------------------------------------------------- summaries
def pct(xs, q):
    return percentile(list(xs), q) if xs else None


def latency_summary(res: list[dict], slo_ttft: float, slo_tpot: float, wall: Optional[float] = None) -> dict:
    ok = [r for r in res if "error" not in r]
    gaps = [g for r in ok for g in (r.get("gaps") or [])]
    tpot = [(r["e2e"] - r["ttft"]) / max(1, (r["completion_tokens"] or 1) - 1) for r in ok]
    good = sum(1 for r, t in zip(ok, tpot) if r["ttft"] <= slo_ttft and t <= slo_tpot)
    d = {"requests": len(res), "errors": len(res) - len(ok),
         "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
         "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99), "e2e_p50": pct([r["e2e"] for r in ok], 50),
         "e2e_p99": pct([r["e2e"] for r in ok], 99), "good": good}
    if wall:
        d["goodput"] = good / wall
        d["throughput"] = len(ok) / wall
    return d


def chat_summary(turns: list[dict]) -> dict:
    ttft = [t["ttft"] for t in turns]
    early, late = ttft[:2], ttft[5:10]
    d = {"ttft_turns_1_2": statistics.mean(early), "ttft_last": ttft[-1], "e2e_last": turns[-1]["e2e"],
         "e2e_sum": sum(t["e2e"] for t in turns)}
    if late:
        d["ttft_turns_6_10"] = statistics.mean(late)
        d["late_over_early"] = d["ttft_turns_6_10"] / d["ttft_turns_1_2"]
    return d


def chart_turns(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, d in result.get("chat", {}).items():
        turns = d["turns"]
        a.plot([t["turn"] for t in turns], [t["ttft"] for t in turns], marker="o", label=name)
        b.plot([t["turn"] for t in turns], [t["e2e"] for t in turns], marker="o", label=name)
    a.set(xlabel="turn", ylabel="time to first token (s)", title="multi-turn chat: TTFT per turn")
    b.set(xlabel="turn", ylabel="end to end (s)", title="multi-turn chat: end to end per turn")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_sweep(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, rows in result.get("sweep", {}).items():
        rates = [r["rate"] for r in rows]
        for ax, key in zip(axes, ("ttft", "itl", "e2e")):
            ax.plot(rates, [r["summary"][f"{key}_p50"] or 0 for r in rows], marker="o", label=f"{name} p50")
            ax.plot(rates, [r["summary"][f"{key}_p99"] or 0 for r in rows], marker="x", ls="--", label=f"{name} p99")
            ax.set(xlabel="arrival rate (requests/s)", ylabel=f"{key} (s)", title=key.upper())
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x, unit="s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}" if unit else f"{x:.2f}"


def render(result: dict) -> str:
    m = result["meta"]
    lines = [f"# bench-serving ({m['model']}, our dtype {m['dtype']})", "",
             f"Machine: {m['cpu']}, {m['cpus']} CPUs; {m['date']}. Streamed greedy chat completions through each "
             "server's OpenAI API (official `openai` client). ours = `specmesh serve` defaults (prefix cache, "
             "chunked prefill); ours_nocache = `--prefix-cache false --prefill-chunk 0`; llamacpp = "
             "llama-cpp-python's server on the same GGUF.", ""]
    if "chat" in result:
        lines += ["## Multi-turn chat", "", "| system | TTFT turns 1-2 | TTFT turns 6-10 | ratio | last TTFT | "
                  "last e2e | sum of e2e |", "|---|---|---|---|---|---|---|"]
        for name, d in result["chat"].items():
            s = d["summary"]
            lines.append(f"| {name} | {_f(s['ttft_turns_1_2'])} | {_f(s.get('ttft_turns_6_10'))} | "
                         f"{_f(s.get('late_over_early'), '')}x | {_f(s['ttft_last'])} | {_f(s['e2e_last'])} | "
                         f"{_f(s['e2e_sum'])} |")
        lines += ["", "![TTFT per turn](turns.png)", ""]
    if "shared" in result:
        lines += ["## Shared system prompt", "", "| system | TTFT p50 | TTFT p99 | e2e p50 | cached tokens (median) |",
                  "|---|---|---|---|---|"]
        for name, d in result["shared"].items():
            s = d["summary"]
            lines.append(f"| {name} | {_f(s['ttft_p50'])} | {_f(s['ttft_p99'])} | {_f(s['e2e_p50'])} | "
                         f"{d.get('cached_median', '-')} |")
        lines.append("")
    if "interference" in result:
        lines += ["## Streams while long prompts arrive", "", "| system | stream gap p50 | p99 | p99/p50 | "
                  "long prompts' TTFT |", "|---|---|---|---|---|"]
        for name, d in result["interference"].items():
            lines.append(f"| {name} | {_f(d['itl_p50'])} | {_f(d['itl_p99'])} | {_f(d['ratio'], '')}x | "
                         f"{', '.join(_f(x) for x in d['long_ttft'])} |")
        lines.append("")
    if "sweep" in result:
        lines += ["## Poisson arrivals", "", "| system | rate | TTFT p50 / p99 | gap p50 / p99 | e2e p50 / p99 | "
                  "goodput (req/s) | errors |", "|---|---|---|---|---|---|---|"]
        for name, rows in result["sweep"].items():
            for r in rows:
                s = r["summary"]
                lines.append(f"| {name} | {r['rate']} | {_f(s['ttft_p50'])} / {_f(s['ttft_p99'])} | "
                             f"{_f(s['itl_p50'])} / {_f(s['itl_p99'])} | {_f(s['e2e_p50'])} / {_f(s['e2e_p99'])} | "
                             f"{_f(s.get('goodput'), '')} | {s['errors']} |")
        lines += ["", f"Goodput: requests/s with TTFT <= {m['slo_ttft']} s and time per output token <= "
                  f"{m['slo_tpot']} s.", "", "![sweep](sweep.png)", ""]
    if "soak" in result:
        so = result["soak"]
        lines += ["## Soak", "", f"{so['conversations']} distinct two-turn conversations in process through a "
                  f"{so['budget_mib']:.0f} MiB prefix cache and none: {so['outputs_changed']} outputs changed, "
                  f"{so['evictions']} blocks evicted, {so['hits']} of {so['queries']} prompt tokens cached; the "
                  f"process's RSS grew {', '.join(f'{r:.0f} MiB after {k}' for k, r in so['rss_growth_mib'])}.", ""]
    if "soak_serve" in result:
        so = result["soak_serve"]
        lines += ["## Soak through serve, a fuzzing client beside it", "",
                  f"{so['conversations']} two-turn conversations ({so['tokens']} tokens a reply, {so['concurrency']} "
                  f"at a time) through the OpenAI front, a {so['budget_mib']:.0f} MiB prefix cache: "
                  f"{so['error_count']} errors; {so['seeded']} seeded conversations against a quiet run: "
                  f"{len(so['seeded_changed'])} changed; the services' RSS "
                  f"{', '.join(f'{r:.0f} MiB after {k}' for k, r in so['rss_mib'])}; fuzzing: "
                  f"{json.dumps(so['fuzz']['cases'])}, {so['fuzz']['failed']} failed.", ""]
    lines += [f"- {v}" for v in result.get("verdicts", [])]
    return "\n".join(lines) + "\n"


def verdicts(result: dict) -> list[str]:
    out = []
    chat = result.get("chat", {})
    if "ours" in chat and "late_over_early" in chat["ours"]["summary"]:
        r = chat["ours"]["summary"]["late_over_early"]
        out.append(f"chat: our mean TTFT of turns 6-10 is {r:.2f}x that of turns 1-2 (target <= 1.5): "
                   f"{'MET' if r <= 1.5 else 'NOT MET'}")
    if "ours" in chat and "llamacpp" in chat:
        a, b = chat["ours"]["summary"]["e2e_sum"], chat["llamacpp"]["summary"]["e2e_sum"]
        out.append(f"chat: summed end to end ours {a:.2f} s, llama-cpp-python {b:.2f} s: {b / a:.2f}x")
    sh = result.get("shared", {})
    if "ours" in sh and "ours_nocache" in sh:
        a, b = sh["ours"]["summary"]["ttft_p50"], sh["ours_nocache"]["summary"]["ttft_p50"]
        out.append(f"shared system prompt: TTFT p50 {a:.3f} s with the cache, {b:.3f} s without: {a / b:.2f} "
                   f"(target <= 0.33): {'MET' if a / b <= 1 / 3 else 'NOT MET'}")
    so = result.get("soak")
    if so:
        grow = max(r for _, r in so["rss_growth_mib"])
        out.append(f"soak: {so['outputs_changed']} of {2 * so['conversations']} outputs changed by the cache and its "
                   f"{so['evictions']} evictions; RSS grew at most {grow:.0f} MiB over a {so['budget_mib']:.0f} MiB "
                   "budget")
    if result.get("soak_serve"):
        from .soak import verdict

        out.append(verdict(result["soak_serve"]))
    it = result.get("interference", {})
    if "ours" in it:
        r = it["ours"]["ratio"]
        out.append(f"streams while 2,000-token prompts arrive: gap p99 / p50 = {r:.2f} with chunked prefill "
                   f"(target <= 2): {'MET' if r <= 2 else 'NOT MET'}")
    return out


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [s for s in systems if s not in SYSTEMS] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"bench-serving: unknown {bad}")
    import os

    import openai

    from .engine_probe import cpu_model

    cpu = cpu_model()
    result: dict = {"meta": {"model": args.model, "dtype": args.dtype, "cpu": cpu, "cpus": os.cpu_count(),
                             "date": time.strftime("%Y-%m-%d %H:%M"), "slo_ttft": args.slo_ttft,
                             "slo_tpot": args.slo_tpot, "systems": systems, "workloads": workloads}}
    rates = [float(x) for x in args.rates.split(",") if x]
    for system in systems:
        texts = Texts(args.model, args.seed)  # the same texts on every system
        print(f"bench-serving: starting {system}", file=sys.stderr, flush=True)
        srv, url, model = start(system, args, out)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        try:
            if "chat" in workloads:
                turns = run_chat(client, model, texts, args.turns, args.max_new_tokens)
                result.setdefault("chat", {})[system] = {"turns": turns, "summary": chat_summary(turns)}
                print(f"  chat: {chat_summary(turns)}", file=sys.stderr, flush=True)
            if "shared" in workloads and system != "llamacpp":
                res = run_shared(client, model, texts, args.users, args.max_new_tokens, args.seed)
                cached = [r["cached_tokens"] for r in res if r.get("cached_tokens") is not None]
                result.setdefault("shared", {})[system] = {
                    "requests": res, "summary": latency_summary(res, args.slo_ttft, args.slo_tpot),
                    "cached_median": statistics.median(cached) if cached else None}
                print(f"  shared: {result['shared'][system]['summary']}", file=sys.stderr, flush=True)
            if "interference" in workloads and system != "llamacpp":
                res = run_interference(client, model, texts, system.startswith("ours"))
                gaps = [g for r in res if r.get("stream") for g in (r.get("gaps") or [])]
                p50, p99 = pct(gaps, 50), pct(gaps, 99)
                result.setdefault("interference", {})[system] = {
                    "itl_p50": p50, "itl_p99": p99, "ratio": (p99 / p50) if p50 else None,
                    "long_ttft": [r.get("ttft") for r in res[8:]], "errors": sum("error" in r for r in res)}
                print(f"  interference: {result['interference'][system]}", file=sys.stderr, flush=True)
            if "sweep" in workloads:
                rows = run_sweep(client, model, texts, rates, args.requests, args.max_new_tokens, args.seed)
                for r in rows:
                    r["summary"] = latency_summary(r["requests"], args.slo_ttft, args.slo_tpot, r["wall"])
                    print(f"  sweep {r['rate']}/s: {r['summary']}", file=sys.stderr, flush=True)
                result.setdefault("sweep", {})[system] = rows
        finally:
            client.close()
            srv.stop()
    if args.soak:
        print(f"bench-serving: soak of {args.soak} conversations", file=sys.stderr, flush=True)
        result["soak"] = run_soak(args, Texts(args.model, args.seed + 1))
    if args.soak_serve:
        from .soak import run_soak_served

        print(f"bench-serving: soak of {args.soak_serve} conversations through serve", file=sys.stderr, flush=True)
        result["soak_serve"] = run_soak_served(args, Texts(args.model, args.seed + 2), start, out)
    result["verdicts"] = verdicts(result)
    (out / "serving.json").write_text(json.dumps(result, indent=1, default=str))
    if "chat" in result:
        chart_turns(result, out / "turns.png")
    if "sweep" in result:
        chart_sweep(result, out / "sweep.png")
    (out / "serving.md").write_text(render(result))
    return result


def main(args) -> int:
    result = run(args)
    print(render(result))
    return 0
