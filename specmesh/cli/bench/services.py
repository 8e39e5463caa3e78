"""The services against the engine they serve: the same prompts in process and
through ``specmesh serve`` (the SDK, and the OpenAI HTTP front), side by side.

``specmesh bench-services`` loads the target in this process (``ours_*`` systems
over a ``Runtime`` on the main thread, as ``specmesh bench`` runs them) and starts
``specmesh serve`` in a child process on free loopback ports. Every prompt runs on
every (system, path) back to back, the paths' order rotating per prompt, so
machine drift hits all alike; with ``repeats`` N each keeps its fastest of N. A
system is named once for all paths: ``ar`` is ``ours_ar`` in process and
``autoregressive`` through the services, a self drafter (``block_tree``) is
``ours_block_tree`` / ``self:block_tree``, any other drafter (``suffix``) is
``ours_suffix`` / ``external:suffix``; in process each drafts with the router's default
draft budget and budget policy, so both sides draft alike. Tokens/s is the caller's wall clock from
request to last token (the services' includes tokenizing and the wire), summed
over the prompts of a workload; greedy outputs are compared token for token.
The router's own count of wire time per round (RPC wall time minus the server's
handler time) is reported as the hop cost. Writes services.json, services.md and
services.png.

This module knows nothing about the engine's internals or about how the services
place their threads (it passes ``--cpus`` and other flags through).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from ...drafters import registry
from ...types import InvalidArgument
from .sweep import Services, _free_port

PATHS = ("in_process", "serve", "http")
DEFAULT_SYSTEMS = "ar,block_tree,suffix"
# ratio of the services to the engine in process (issue 48's targets; int4 has less room: a 5 ms step)
TARGETS = {"serve": 0.90, "http": 0.85}
TARGETS_INT4 = {"serve": 0.80, "http": 0.80}


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help="comma list: ar, a self drafter (block_tree, layerskip, ...) or an external one (suffix, "
                        "prompt_lookup, ...); a token-only external one with _overlap / _serial / _auto (draft_lm_overlap): "
                        "draft-ahead on / off in process and per request through the services")
    p.add_argument("--workloads", default="open_writing,chat_multiturn,code_edit")
    p.add_argument("--workloads-dir", default=None)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="passes; each (system, path, prompt) keeps its fastest")
    p.add_argument("--no-http", dest="http", action="store_false", help="leave out the OpenAI HTTP front")
    p.add_argument("--cpus", default="", help="`specmesh serve --cpus` (placement of the services)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="one more `specmesh serve` flag, repeatable (e.g. --serve-arg=--batch-window-ms=0)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--out", default="bench-out/services")


def systems_of(text: str) -> list[dict]:
    """``ar,block_tree,suffix`` -> the in-process name and the served strategy of each."""
    from .systems import OVERLAP_SUFFIXES  # imports torch: not at module level (`specmesh --help` stays fast)

    out = []
    for name in (x.strip() for x in str(text).split(",")):
        if not name:
            continue
        ahead, base = "", name  # <drafter>_overlap / _serial / _auto: draft-ahead on / off / auto on both paths
        for suffix, mode in OVERLAP_SUFFIXES.items():
            if name.endswith(suffix) and name[: -len(suffix)] in registry.CONTEXT_ONLY:
                ahead, name = mode, name[: -len(suffix)]
        if name == "ar":
            strategy, drafter = "autoregressive", ""
        elif name in registry.SELF:
            strategy, drafter = "self", name
        elif name in registry.EXTERNAL:
            strategy, drafter = "external", name
        else:
            raise InvalidArgument("systems", f"unknown system {name!r}: ar, {', '.join(registry.SELF)}, "
                                             f"{', '.join(registry.EXTERNAL)}")
        out.append({"name": base, "ours": f"ours_{base}", "strategy": strategy, "drafter": drafter,
                    "draft_ahead": ahead})
    if not out:
        raise InvalidArgument("systems", "is empty")
    return out


# drafters that learn across requests (suffix decoding's global tree): the SDK and HTTP paths share
# one drafter service, so the second would draft from the first's output of the same prompt while the
# in-process drafter saw it once; such systems run in process and through the SDK only
LEARNS_ACROSS_REQUESTS = ("suffix",)


def paths_of(sysd: dict, paths: list[str]) -> list[str]:
    """The paths a system runs: no HTTP for a drafter that learns across requests, nor for a
    forced draft-ahead mode (the OpenAI front takes the router's setting)."""
    skip = sysd["drafter"] in LEARNS_ACROSS_REQUESTS or bool(sysd.get("draft_ahead"))
    return [p for p in paths if not (p == "http" and skip)]


def _http_generate(url: str, prompt, sysd: dict, max_new: int, timeout: float) -> tuple[str, int, float]:
    """One non-streaming chat completion (the served model, whatever its name); (text,
    completion tokens, seconds)."""
    msgs = prompt.messages or [{"role": "user", "content": prompt.prompt}]
    body = {"messages": msgs, "max_tokens": max_new, "temperature": 0,
            "strategy": sysd["strategy"], "drafter": sysd["drafter"]}
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.loads(r.read())
    dt = time.perf_counter() - t0
    return data["choices"][0]["message"]["content"], int(data["usage"]["completion_tokens"]), dt


class _Paths:
    """One generation of a prompt on one (system, path)."""

    def __init__(self, rt, dtype: str, systems: list[dict], services: Services, max_new: int, timeout: float):
        from ...client import Client
        from .systems import make_ours

        self.rt, self.max_new, self.timeout = rt, max_new, timeout
        self.services = services
        self.client = Client(services.address, timeout=timeout)
        # the router's default draft budget and budget policy: the two sides draft alike, so the ratio is
        # what the services cost (not a different policy's drafts)
        from ...serving.settings import ServeSettings

        budget = ServeSettings.model_fields["draft_budget"].default
        self.ours = {s["name"]: make_ours(s["ours"], rt, budget, dtype, router_policy=True) for s in systems}

    def run(self, path: str, sysd: dict, prompt) -> dict:
        if path == "in_process":
            ids = self.rt.encode(prompt.prompt, prompt.messages)
            out = self.ours[sysd["name"]].run(ids, self.max_new)
            return {"tokens": list(out.tokens), "n": len(out.tokens), "s": out.seconds, "rounds": out.decode_forwards,
                    "text": self.rt.decode(out.tokens)}
        if path == "serve":
            t0 = time.perf_counter()
            r = self.client.generate(prompt.prompt, messages=prompt.messages, strategy=sysd["strategy"],
                                     drafter=sysd["drafter"], max_new_tokens=self.max_new, timeout=self.timeout,
                                     draft_ahead=sysd.get("draft_ahead", ""))
            dt = time.perf_counter() - t0
            st = r.stats
            return {"tokens": list(r.token_ids), "n": len(r.token_ids), "s": dt, "rounds": st.rounds,
                    "network_s": st.network_s, "text": r.text, "drafted": st.drafted_tokens,
                    "tau": (st.accepted_tokens + st.rounds) / st.rounds if st.rounds else None,
                    "reason": st.strategy_reason}
        text, n, dt = _http_generate(self.services.http_url, prompt, sysd, self.max_new, self.timeout)
        return {"tokens": None, "n": n, "s": dt, "text": text}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def run_bench(args) -> dict:
    from ... import workloads as wl
    from ...runtime import Runtime
    from .harness import faster, rotated

    if args.repeats < 1:
        raise InvalidArgument("repeats", f"must be at least 1, got {args.repeats}")
    if args.max_new_tokens <= 0:
        raise InvalidArgument("max_new_tokens", f"must be positive, got {args.max_new_tokens}")
    systems = systems_of(args.systems)
    names = [x.strip() for x in args.workloads.split(",") if x.strip()] or None
    loads = wl.load(names, args.prompts, Path(args.workloads_dir) if args.workloads_dir else None)
    prompts = [p for ps in loads.values() for p in ps]
    paths = [p for p in PATHS if p != "http" or args.http]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"loading {args.model} {args.dtype} in process, starting `specmesh serve` ...")
    rt = Runtime(args.model, dtype=args.dtype, n_slots=2, quiet=True)
    extra = ["--model", args.model, *(["--cpus", args.cpus] if args.cpus else []), *args.serve_arg]
    services = Services(args.dtype, 2, out / "services-serve.log", device="cpu", extra=extra,
                        http_port=_free_port() if args.http else None)
    best: dict[tuple, dict] = {}
    try:
        paths_run = _Paths(rt, args.dtype, systems, services, args.max_new_tokens, args.timeout)
        warm = wl.Prompt("warmup", "warmup", prompt="Say hello and name three colours.")
        for sysd in systems:  # warm-up: a short generation on every (system, path); a fresh router may need a retry
            for path in paths_of(sysd, paths):
                for attempt in range(3):
                    try:
                        paths_run.max_new = 16
                        paths_run.run(path, sysd, warm)
                        break
                    except Exception as e:  # noqa: BLE001
                        if attempt == 2 or "UNAVAILABLE" not in str(e).upper():
                            raise
                        time.sleep(3)
        paths_run.max_new = args.max_new_tokens
        total = args.repeats * len(prompts) * sum(len(paths_of(sd, paths)) for sd in systems)
        done = 0
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for sysd in systems:
                    for path in rotated(paths_of(sysd, paths), i + rep):
                        r = paths_run.run(path, sysd, prompt)
                        done += 1
                        key = (sysd["name"], path, prompt.id)
                        if faster(r["s"], best[key]["s"] if key in best else None):
                            best[key] = r
                        more = f"  tau {r['tau']:.2f}, {r['drafted']} drafted" if r.get("tau") else ""
                        log(f"  [{done}/{total}] {sysd['name']:12s} {path:10s} {prompt.id:22s} "
                            f"{r['n'] / r['s']:7.1f} tok/s{more}")
                        if r.get("tau") and not r["drafted"] and sysd["drafter"]:
                            log(f"      {r['reason']}")
        paths_run.client.close()
    finally:
        services.stop()
    records = []
    for sysd in systems:
        for wname, ps in loads.items():
            rec = {"system": sysd["name"], "served_as": sysd["strategy"] + (f":{sysd['drafter']}" if sysd["drafter"]
                                                                             else ""),
                   "workload": wname, "prompts": len(ps)}
            for path in paths:
                rs = [best[(sysd["name"], path, p.id)] for p in ps if (sysd["name"], path, p.id) in best]
                n, s = sum(r["n"] for r in rs), sum(r["s"] for r in rs)
                rec[f"{path}_tokens_per_s"] = round(n / s, 2) if rs and s else None
            base = [best[(sysd["name"], "in_process", p.id)] for p in ps]
            served = [best[(sysd["name"], "serve", p.id)] for p in ps]
            rec["identical"] = sum(a["tokens"] == b["tokens"] for a, b in zip(base, served))
            if "http" in paths_of(sysd, paths):
                rec["identical_http_text"] = sum(a["text"] == best[(sysd["name"], "http", p.id)]["text"]
                                                 for a, p in zip(served, ps))
            rounds = sum(r["rounds"] or 0 for r in served)
            rec["hop_us_per_round"] = round(sum(r["network_s"] for r in served) / rounds * 1e6, 1) if rounds else None
            for path in paths[1:]:
                rec[f"{path}_vs_in_process"] = _ratio(rec[f"{path}_tokens_per_s"], rec["in_process_tokens_per_s"])
            records.append(rec)
    meta = {"model": args.model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "workloads": list(loads), "prompts": args.prompts, "repeats": args.repeats, "cpus": args.cpus,
            "serve_args": args.serve_arg, "paths": paths, "targets": targets_for(args.dtype)}
    result = {"meta": meta, "records": records}
    (out / "services.json").write_text(json.dumps(result, indent=2))
    (out / "services.md").write_text(render(result))
    chart(result, out / "services.png")
    return result


def targets_for(dtype: str) -> dict:
    return dict(TARGETS_INT4 if dtype == "int4" else TARGETS)


def verdicts(result: dict) -> list[str]:
    """One line per (system, path): the services' ratio over all workloads against its target."""
    lines = []
    meta, recs = result["meta"], result["records"]
    for name in dict.fromkeys(r["system"] for r in recs):
        rs = [r for r in recs if r["system"] == name]
        for path in meta["paths"][1:]:
            # tokens/s over all prompts: the harmonic combination of the workloads' rates, weighted by prompts
            ratios = [r[f"{path}_vs_in_process"] for r in rs if r[f"{path}_vs_in_process"]]
            if not ratios:
                continue
            lo, target = min(ratios), meta["targets"][path]
            ok = "ok" if lo >= target else "BELOW TARGET"
            lines.append(f"{name} through {path}: {lo:.2f}x-{max(ratios):.2f}x of in process "
                         f"(target >= {target:.2f}x): {ok}")
    return lines


def render(result: dict) -> str:
    meta, recs = result["meta"], result["records"]
    paths = meta["paths"]
    serve_args = " " + " ".join(meta["serve_args"]) if meta["serve_args"] else ""
    L = ["# The services against the engine in process", "",
         f"{meta['model']} {meta['dtype']}, greedy, {meta['max_new_tokens']} new tokens, {meta['prompts']} prompts "
         f"per workload, fastest of {meta['repeats']} pass(es); `specmesh serve` placement: "
         f"{meta['cpus'] or 'default (every CPU shared)'}{serve_args}."
         " Tokens/s: the caller's wall clock, request to last token. Hop: the router's wire time per round "
         "(RPC wall time minus the server's handler time).", "",
         "| system | served as | workload | " + " | ".join(f"{p} tok/s" for p in paths) + " | "
         + " | ".join(f"{p} / in process" for p in paths[1:]) + " | identical (serve) | hop µs/round |",
         "|" + "---|" * (4 + 2 * len(paths))]
    f = lambda v: "–" if v is None else f"{v}"  # noqa: E731
    x = lambda v: "–" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in recs:
        L.append(f"| {r['system']} | {r['served_as']} | {r['workload']} | "
                 + " | ".join(f(r[f'{p}_tokens_per_s']) for p in paths) + " | "
                 + " | ".join(x(r[f'{p}_vs_in_process']) for p in paths[1:])
                 + f" | {r['identical']}/{r['prompts']} | {f(r['hop_us_per_round'])} |")
    L += ["", *[f"- {v}" for v in verdicts(result)]]
    return "\n".join(L) + "\n"


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs, paths = result["records"], result["meta"]["paths"][1:]
    labels = [f"{r['system']}\n{r['workload']}" for r in recs]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(recs)), 4))
    w = 0.8 / max(1, len(paths))
    for j, p in enumerate(paths):
        ax.bar([i + j * w for i in range(len(recs))], [r[f"{p}_vs_in_process"] or 0 for r in recs], w,
               label=f"through {p}")
    for p, t in result["meta"]["targets"].items():
        if p in paths:
            ax.axhline(t, ls="--", lw=0.8, color="grey")
    ax.axhline(1.0, lw=0.8, color="black")
    ax.set_xticks([i + w * (len(paths) - 1) / 2 for i in range(len(recs))], labels, fontsize=7)
    ax.set_ylabel("tokens/s, services / in process")
    ax.set_title(f"{result['meta']['model']} {result['meta']['dtype']}: the services against the engine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    result = run_bench(args)
    print(render(result))
    print(f"wrote {args.out}/services.json, services.md, services.png")
    return 0
