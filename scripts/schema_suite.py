"""The JSON-schema suite of structured outputs, through the services, for every strategy.

For every schema of ``tests/data/json_schemas.json`` (61 schemas: objects, arrays, enums,
nesting, numbers with bounds, strings with patterns and formats, optional fields,
anyOf / oneOf / allOf, $ref, const, prefixItems, multipleOf) and every strategy that takes a
grammar (the router's list: plain decoding, each external drafter the drafter service
hosts, self with its default and layer-skip drafters, auto; ssr is a reasoning strategy
and refuses grammars, proactive needs a conversation's anticipation cache: both left out),
greedy and sampled (seeded), the schema's prompt is sent as a chat with the schema as its
structured output (``Client.generate(json_schema=...)``) to a router + drafter service +
verifier service in this process, on loopback (``specmesh.cli.bench.strategies.Services``:
what ``specmesh serve`` runs, in one process). Every output is validated with the
``jsonschema`` package (Draft 2020-12 with that draft's format checks, RFC 3339 time and
date-time added), and greedy outputs are compared with plain decoding's (lossless: they
must be identical).

Prints a table (valid / total per strategy and mode, outputs cut at ``--max-tokens``, valid
of the completed ones, greedy outputs identical to plain decoding, forced tokens) and
writes every output with its verdict to ``--out`` (JSON). An output cut by the token limit
counts as invalid (it is not JSON); the grammar cannot make a model close what it keeps
extending (digits of a number, a free object's keys). ``--recheck RESULT`` validates a
saved result again (and generates its errored rows again). Exit status 0 when every
completed output is valid. Run under the CPU lock (~40 min for 1220 generations on 2
shared cores): ``flock -s /tmp/specmesh-cpu.lock .venv/bin/python scripts/schema_suite.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "data" / "json_schemas.json"
SYSTEM = "You answer with JSON only."
# RFC 3339 full-time (JSON Schema's "time") and date-time; jsonschema checks them only with the
# rfc3339-validator package installed, so they are checked here
TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))$")
# left out of the default list: ssr (reasoning: refuses grammars) and proactive (drafts from a
# conversation's anticipation cache, which a one-shot request has not got)
SKIP = ("ssr", "proactive")


def load_suite(path: Path = SUITE) -> list[dict]:
    """The suite's entries: name, features, prompt, schema."""
    return json.loads(Path(path).read_text())["schemas"]


def _time(s) -> bool:
    m = TIME.match(s) if isinstance(s, str) else None
    if m is None:
        return False
    h, mi, sec, oh, om = (int(x) if x else 0 for x in (m[1], m[2], m[3], m[6], m[7]))
    return h <= 23 and mi <= 59 and sec <= 60 and oh <= 23 and om <= 59


def _date_time(s) -> bool:
    if not isinstance(s, str) or len(s) < 11 or s[10] not in "Tt":
        return False
    try:
        date.fromisoformat(s[:10])
    except ValueError:
        return False
    return _time(s[11:])


def validator(schema: dict):
    """A Draft 2020-12 validator of ``schema`` checking formats (that draft's checks, plus RFC 3339
    time and date-time)."""
    import jsonschema

    fc = jsonschema.FormatChecker(())
    fc.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    fc.checks("date-time")(_date_time)
    fc.checks("time")(_time)
    return jsonschema.Draft202012Validator(schema, format_checker=fc)


def check_output(text: str, schema: dict) -> tuple[bool, str]:
    """(whether ``text`` is JSON that holds ``schema``, why not)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return False, f"not JSON: {e}"
    errors = sorted(validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        return False, f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}"
    return True, ""


def strategy_cases(client, only=None) -> list[tuple[str, str]]:
    """(strategy, drafter) for the strategies the router lists that take a grammar: each
    external drafter it lists, self's default drafter and layer-skip, the others once."""
    cases = []
    for s in client.list_strategies().strategies:
        if s.name in SKIP:
            continue
        if s.name == "external":
            cases += [("external", d) for d in s.drafters if d != "cache"]
        elif s.name == "self":
            cases += [("self", "")] + ([("self", "layerskip")] if "layerskip" in s.drafters else [])
        else:
            cases.append((s.name, ""))
    if only:
        want = [tuple((x + ":").split(":")[:2]) for x in only]
        cases = [c for c in cases if c in want or (c[0], "") in [(w[0], "") for w in want if not w[1]]]
    return cases


def label(case: tuple[str, str]) -> str:
    return case[0] + (f":{case[1]}" if case[1] else "")


def generate(client, entry: dict, case: tuple[str, str], mode: str, max_tokens: int, seed: int) -> dict:
    """One generation of the suite, validated: a row of the result."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": entry["prompt"]}]
    kw = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0, seed=seed)
    row = dict(schema=entry["name"], strategy=label(case), mode=mode)
    t0 = time.perf_counter()
    try:
        r = client.generate(messages=messages, json_schema=entry["schema"], strategy=case[0], drafter=case[1],
                            max_new_tokens=max_tokens, **kw)
    except Exception as e:  # noqa: BLE001 - a refusal is a result of the suite too
        return dict(row, valid=False, why=f"refused: {e}", text="", finish="error", tokens=0, forced=0, actual="")
    ok, why = check_output(r.text, entry["schema"])
    return dict(row, valid=ok, why=why, text=r.text, finish=r.finish_reason, tokens=len(r.token_ids),
                forced=r.stats.forced_tokens, actual=f"{r.stats.strategy}:{r.stats.drafter}",
                seconds=round(time.perf_counter() - t0, 3))


def run(client, suite, cases, modes, max_tokens: int, seed: int, progress) -> list[dict]:
    rows = []
    for entry in suite:
        for mode in modes:
            for case in cases:
                rows.append(generate(client, entry, case, mode, max_tokens, seed))
                progress()
    return compare(rows)


def compare(rows: list[dict]) -> list[dict]:
    """Mark each greedy row with whether it is plain decoding's output of the same schema."""
    plain = {(x["schema"]): x["text"] for x in rows if x["mode"] == "greedy" and x["strategy"] == "autoregressive"}
    for x in rows:
        if x["mode"] == "greedy" and x["schema"] in plain:
            x["same_as_plain"] = x["text"] == plain[x["schema"]]
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """One line per (strategy, mode): valid, total, cut at the token limit, greedy equal to plain, forced tokens."""
    out = {}
    for x in rows:
        s = out.setdefault((x["strategy"], x["mode"]), dict(strategy=x["strategy"], mode=x["mode"], valid=0, total=0,
                                                           cut=0, same=0, forced=0, tokens=0))
        s["total"] += 1
        s["valid"] += bool(x["valid"])
        s["cut"] += x["finish"] == "length"
        s["same"] += bool(x.get("same_as_plain"))
        s["forced"] += x["forced"]
        s["tokens"] += x["tokens"]
    return list(out.values())


def services(model: str, dtype: str):
    from specmesh.cli.bench.strategies import Services

    print(f"loading {model} {dtype} behind a router, a drafter service and a verifier service ...", file=sys.stderr)
    return Services(model, dtype, slots=2, max_seq_len=1024)


def recheck(path: Path, suite: list[dict]) -> dict:
    """A saved result validated again with this validator; rows that ended in an error
    (a deadline, a lost peer) generated again."""
    from specmesh import Client

    res = json.loads(path.read_text())
    by_name = {e["name"]: e for e in suite}
    for x in res["rows"]:
        if x["finish"] != "error":
            x["valid"], x["why"] = check_output(x["text"], by_name[x["schema"]]["schema"])
    errors = [k for k, x in enumerate(res["rows"]) if x["finish"] == "error"]
    if errors:
        stack = services(res["model"], res["dtype"])
        try:
            with Client(stack.address, timeout=600) as c:
                for k in errors:
                    x = res["rows"][k]
                    case = tuple((x["strategy"] + ":").split(":")[:2])
                    res["rows"][k] = generate(c, by_name[x["schema"]], case, x["mode"], res["max_tokens"],
                                              res["seed"])
                    print(f"generated again: {x['schema']} {x['strategy']} {x['mode']} (was: {x['why']})",
                          file=sys.stderr)
        finally:
            stack.close()
    compare(res["rows"])
    return res


def report(res: dict, out: Path) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = res["rows"]
    lines = summary(rows)
    t = Table(title=f"JSON-schema suite: {res['schemas']} schemas, {res['model']} {res['dtype']} through the services "
                    f"(max {res['max_tokens']} tokens; sampled: temperature 1, seed {res['seed']})")
    for col in ("strategy", "mode", "valid", "valid %", "cut at limit", "valid of completed", "greedy = plain",
                "forced / tokens"):
        t.add_column(col)
    for s in lines:
        done = s["total"] - s["cut"]
        t.add_row(s["strategy"], s["mode"], f"{s['valid']}/{s['total']}", f"{100 * s['valid'] / s['total']:.1f}",
                  str(s["cut"]), f"{s['valid']}/{done}", f"{s['same']}/{s['total']}" if s["mode"] == "greedy" else "-",
                  f"{s['forced']}/{s['tokens']}")
    Console(width=160).print(t)
    valid, total = sum(s["valid"] for s in lines), sum(s["total"] for s in lines)
    cut = sum(s["cut"] for s in lines)
    for x in [x for x in rows if not x["valid"]][:30]:
        print(f"  invalid: {x['schema']} {x['strategy']} {x['mode']} ({x['finish']}): {x['why']} :: {x['text'][:100]!r}")
    print(f"valid {valid}/{total} = {100 * valid / max(1, total):.1f}%; {cut} cut at the token limit; valid of the "
          f"completed outputs {valid}/{total - cut} = {100 * valid / max(1, total - cut):.1f}%")
    res.update(valid=valid, total=total, cut=cut, summary=lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, ensure_ascii=False))
    print(f"wrote {out}")
    return 0 if valid == total - cut else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--suite", default=str(SUITE))
    ap.add_argument("--schemas", nargs="*", help="only these schema names")
    ap.add_argument("--strategies", nargs="*", help="only these, as strategy or strategy:drafter")
    ap.add_argument("--modes", nargs="*", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="bench-out/schema_suite.json")
    ap.add_argument("--recheck", metavar="RESULT", help="validate a saved result (--out of an earlier run) again and "
                    "generate its rows that ended in an error again; writes --out")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from specmesh import Client

    suite = load_suite(Path(args.suite))
    if args.recheck:
        return report(recheck(Path(args.recheck), suite), Path(args.out))
    if args.schemas:
        suite = [e for e in suite if e["name"] in set(args.schemas)]
    stack = services(args.model, args.dtype)
    try:
        with Client(stack.address, timeout=600) as c:
            cases = strategy_cases(c, args.strategies)
            print(f"{len(suite)} schemas x {len(cases)} strategies ({', '.join(map(label, cases))}) x "
                  f"{' + '.join(args.modes)}", file=sys.stderr)
            t0 = time.perf_counter()
            with tqdm(total=len(suite) * len(cases) * len(args.modes), unit="gen") as bar:
                rows = run(c, suite, cases, args.modes, args.max_tokens, args.seed, lambda: bar.update(1))
            wall = time.perf_counter() - t0
    finally:
        stack.close()
    res = dict(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, seed=args.seed, schemas=len(suite),
               strategies=[label(c) for c in cases], modes=args.modes, wall_s=round(wall, 1), rows=rows)
    return report(res, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
