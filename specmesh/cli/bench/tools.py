"""``specmesh bench-tools``: tool calling through the OpenAI API on the Berkeley Function
Calling Leaderboard's categories, beside llama-cpp-python's server on the same GGUF.

Each system is an OpenAI-compatible server on loopback, driven with the official ``openai``
client the way BFCL's OpenAI handler drives one (the category's question as messages, its
functions as ``tools``, ``tool_choice`` left to the server: auto; greedy, not streamed):

- ``ours``: ``specmesh serve --model M --dtype D`` (or ``--ours-url`` for one already
  running; ``--strategy`` names a strategy, default the server's ``auto``);
- ``llamacpp``: llama-cpp-python's server (``python -m llama_cpp.server``, the
  ``bench-peers`` extra) on the model's GGUF, ``--chat_format chatml-function-calling``
  (its tool-calling chat format: a grammar-constrained call, or text), ``--threads``
  threads, llama.cpp's AMX / repacked weight buffers off unless ``--llamacpp-extra-bufts``
  (``llamacpp_server``), or ``--llamacpp-url``.

Per category (``bfcl.CATEGORIES``, ``--per-category`` items spread evenly over each file):
BFCL's accuracy (``bfcl.judge``: its AST checker), completion tokens per second of wall
time (prefill included, the servers' own ``usage``), and the tool-calling contract: calls
returned whose arguments break their tool's schema (``jsonschema``), and calls the reply
left in its content (the content parsed as ``specmesh.tool_parse`` parses it). Writes
tools.json (every reply) and tools.md beside each other in ``--out``.

Knows nothing about models beyond their GGUF path.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from . import bfcl

SYSTEMS = ("ours", "llamacpp")


def register(subparsers) -> None:
    import argparse

    p = subparsers.add_parser("bench-tools", help="tool calling on BFCL's categories through the OpenAI API, beside "
                              "llama-cpp-python's server on the same GGUF",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="model alias (its GGUF for llama.cpp)")
    p.add_argument("--dtype", default="int4", choices=["fp32", "bf16", "int8", "int4"], help="our verifier's dtype")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--categories", default=",".join(bfcl.CATEGORIES), help="comma list of BFCL categories")
    p.add_argument("--per-category", type=int, default=20, help="items a category, spread over its file (0: all)")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--strategy", default="", help="our strategy (default: the server's, auto)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    p.add_argument("--ours-url", default="", help="a running specmesh serve's OpenAI URL (…/v1) instead of starting one")
    p.add_argument("--llamacpp-url", default="", help="a running llama-cpp-python server's URL instead of starting one")
    p.add_argument("--llamacpp-extra-bufts", action="store_true",
                   help="llama.cpp's AMX / repacked weight buffers on (off by default: they crash on an AMX CPU here)")
    p.add_argument("--out", default="bench-out/tools")
    p.set_defaults(module="specmesh.cli.bench.tools", func="main")


def start(system: str, args, out: Path):
    """(the server or None, its /v1 URL, the model name to send)."""
    import openai

    url = args.ours_url if system == "ours" else args.llamacpp_url
    if url:
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as c:
            return None, url, c.models.list().data[0].id
    if system == "llamacpp":
        from ...models.loading import resolve_model
        from .peers import gguf_path
        from .serving import LlamaCppServer

        gguf = gguf_path(args.model, resolve_model(args.model, quiet=True))
        if gguf is None:
            raise RuntimeError(f"no GGUF found for {args.model}")
        srv = LlamaCppServer(gguf, args.threads, out / "llamacpp.log", extra=["--chat_format", "chatml-function-calling"],
                             extra_bufts=args.llamacpp_extra_bufts)
        return srv, srv.url, str(gguf)
    from .sweep import Services, _free_port

    srv = Services(args.dtype, 2, out / "ours.log", http_port=_free_port(), extra=["--model", args.model],
                   env={"SPECMESH_VERIFIER_TIMEOUT_S": "900"})
    return srv, srv.http_url, args.model


def _violations(calls: list, tools: list) -> list[str]:
    """The returned calls whose arguments break their tool's schema (or name no tool)."""
    try:
        import jsonschema
    except ImportError:  # the test extra: without it the check is skipped, and the report says so
        return ["jsonschema not installed"]
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    bad = []
    for name, args in calls:
        if name not in schemas:
            bad.append(f"{name}: not a tool")
            continue
        try:
            jsonschema.validate(json.loads(args), schemas[name])
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
            bad.append(f"{name}: {str(e).splitlines()[0][:120]}")
    return bad


def ask(client, model: str, item: bfcl.Item, max_tokens: int, extra: Optional[dict]) -> dict:
    """One item through one server: the reply, BFCL's verdict and the contract checks."""
    from ...tool_parse import parse

    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(model=model, messages=item.messages, tools=item.tools, temperature=0,
                                           max_tokens=max_tokens, **({"extra_body": extra} if extra else {}))
    except Exception as e:  # noqa: BLE001 - a refused or failed request is a wrong answer, reported as such
        return {"id": item.id, "ok": False, "failed": True, "error": f"{type(e).__name__}: {e}"[:300],
                "s": time.perf_counter() - t0,
                "tokens": 0, "calls": [], "content": None, "violations": [], "left_in_content": 0}
    s = time.perf_counter() - t0
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
    content = m.content or ""
    ok, why = bfcl.judge(item, calls, content)
    left = len(parse(content, [t["function"]["name"] for t in item.tools])[1])
    return {"id": item.id, "ok": ok, "error": why, "s": s, "tokens": r.usage.completion_tokens if r.usage else 0,
            "calls": calls, "content": content, "finish": r.choices[0].finish_reason,
            "violations": _violations(calls, item.tools), "left_in_content": left}


def summary(rows: list[dict]) -> dict:
    s = sum(r["s"] for r in rows)
    return {"n": len(rows), "accuracy": sum(r["ok"] for r in rows) / len(rows) if rows else 0.0,
            "tokens_per_s": sum(r["tokens"] for r in rows) / s if s else 0.0,
            "violations": sum(len(r["violations"]) for r in rows),
            "left_in_content": sum(r["left_in_content"] for r in rows),
            "failed": sum(bool(r.get("failed")) for r in rows)}


def run(args) -> dict:
    import openai

    from .engine_probe import cpu_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    cats = [c for c in args.categories.split(",") if c]
    bad = [s for s in systems if s not in SYSTEMS] + [c for c in cats if c not in bfcl.CATEGORIES]
    if bad:
        raise SystemExit(f"bench-tools: unknown {bad}")
    items = {c: bfcl.load(c, args.per_category) for c in cats}
    result: dict = {"meta": {"model": args.model, "dtype": args.dtype, "cpu": cpu_model(), "cpus": os.cpu_count(),
                             "date": time.strftime("%Y-%m-%d %H:%M"), "per_category": args.per_category,
                             "max_tokens": args.max_tokens, "strategy": args.strategy or "auto (server default)",
                             "systems": systems, "load_before": os.getloadavg()[0]}, "systems": {}}
    extra = {"strategy": args.strategy} if args.strategy else None
    for system in systems:
        print(f"bench-tools: starting {system}", file=sys.stderr, flush=True)
        srv, url, model = start(system, args, out)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=900)
        res: dict = {}
        try:
            for cat in cats:
                rows = [ask(client, model, it, args.max_tokens, extra if system == "ours" else None)
                        for it in items[cat]]
                res[cat] = {"summary": summary(rows), "rows": rows}
                print(f"  {system} {cat}: {res[cat]['summary']}", file=sys.stderr, flush=True)
        finally:
            client.close()
            if srv is not None:
                srv.stop()
        every = [r for c in res.values() for r in c["rows"]]
        res["overall"] = {"summary": summary(every)}
        result["systems"][system] = res
    result["meta"]["load_after"] = os.getloadavg()[0]
    (out / "tools.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "tools.md").write_text(render(result))
    return result


def render(result: dict) -> str:
    m, systems = result["meta"], list(result["systems"])
    names = {"ours": "specmesh", "llamacpp": "llama-cpp-python"}
    head = ["category", "n"] + [f"{names[s]} accuracy" for s in systems] + [f"{names[s]} tok/s" for s in systems]
    lines = [f"# bench-tools: {m['model']} (ours {m['dtype']}, strategy {m['strategy']}), BFCL v4, "
             f"{m['per_category']} items a category, greedy",
             "", f"{m['cpu']}, {m['cpus']} CPUs, {m['date']}; load average {m['load_before']:.1f} before, "
             f"{m.get('load_after', 0):.1f} after (a shared machine slows both sides alike)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cats = list(next(iter(result["systems"].values()))) if systems else []
    for cat in cats:
        sums = [result["systems"][s][cat]["summary"] for s in systems]
        lines.append(f"| {cat} | {sums[0]['n']} | " + " | ".join(f"{x['accuracy']:.2f}" for x in sums) + " | "
                     + " | ".join(f"{x['tokens_per_s']:.1f}" for x in sums) + " |")
    lines.append("")
    for s in systems:
        o = result["systems"][s]["overall"]["summary"]
        lines.append(f"- {names[s]}: returned calls that break their tool's schema: {o['violations']}; calls left "
                     f"in content: {o['left_in_content']}; failed requests: {o['failed']}")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    print(render(run(args)))
    return 0


__all__ = ["SYSTEMS", "ask", "register", "render", "run", "summary"]
