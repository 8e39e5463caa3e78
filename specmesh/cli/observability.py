"""``specmesh trace show|list`` and ``specmesh stats``.

- ``specmesh trace list FILE``: the requests in a JSON-lines trace file.
- ``specmesh trace show FILE [--request ID] [--out PNG]``: one request's rounds
  as a table and a timeline PNG (draft / network / verify / other per round).
  ``ID`` is a trace id, the request span id or the session id of the final
  message (``GenerateFinal.session_id``), or a unique prefix; default: the last
  request in the file.
- ``specmesh stats [SOURCE ...] [--url URL] [--block B] [--png PATH | --out-dir DIR]``:
  the acceptance histogram per strategy (or bench system), τ, the ceiling bin and
  the preflight verdict, printed, and drawn only when asked (``--png``; ``--out``
  is its old name). SOURCE: stats JSON (``specmesh
  generate --json``), a bench ``results.json``, a trace file, or a saved
  ``/metrics`` scrape; ``--url`` scrapes a running router's ``/metrics``.

This module parses arguments and prints; the work is in ``specmesh.observability``'s
``stats``, ``traces`` and ``plots``.
"""

from __future__ import annotations

import json
import os
import sys


def register(sub) -> None:
    t = sub.add_parser("trace", help="read a JSON-lines trace file (SPECMESH_TRACE_FILE)")
    tsub = t.add_subparsers(dest="trace_cmd", required=True)
    s = tsub.add_parser("show", help="one request's rounds as a table and a timeline PNG")
    s.add_argument("file")
    s.add_argument("--request", default=None, help="trace id, span id or session id (or a prefix); default: last")
    s.add_argument("--out", default=None, help="PNG path (default: trace-<trace id prefix>.png)")
    s.set_defaults(module="specmesh.cli.observability", func="trace_show")
    ls = tsub.add_parser("list", help="the requests in a trace file")
    ls.add_argument("file")
    ls.set_defaults(module="specmesh.cli.observability", func="trace_list")

    p = sub.add_parser("stats", help="acceptance histogram, ceiling bin and block-size verdict")
    p.add_argument("sources", nargs="*", help="stats JSON, bench results.json, trace file or saved /metrics")
    p.add_argument("--url", action="append", default=[], help="scrape a router's /metrics (repeatable)")
    p.add_argument("--block", type=int, default=None, help="block size - 1 (longest draft); default: the longest seen")
    p.add_argument("--threshold", type=float, default=0.10, help="ceiling fraction above which the block binds")
    p.add_argument("--merge", action="store_true", help="one histogram over all groups")
    p.add_argument("--png", "--out", dest="png", default=None, metavar="PATH",
                   help="also draw the histograms into this PNG (default: no PNG)")
    p.add_argument("--out-dir", default=None, metavar="DIR", help="also draw them into DIR/acceptance.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(module="specmesh.cli.observability", func="stats_main")


# ---------------------------------------------------------------- trace

def _load_requests(path: str):
    from ..observability.jsonl import read_spans
    from ..observability.traces import requests

    return requests(read_spans(path))


def trace_list(args) -> int:
    reqs = _load_requests(args.file)
    print(f"{'trace id':32s}  {'session id':32s}  {'strategy':24s} rounds tokens    tau   ms")
    for r in reqs:
        a = r.attrs
        ms = ((r.span.get("end_ns") or 0) - (r.span.get("start_ns") or 0)) / 1e6
        lab = r.label + (" LOSSY" if a.get("specmesh.lossy") else "")
        print(f"{r.trace_id:32s}  {r.session_id:32s}  {lab:24s} {len(r.rounds):6d} "
              f"{a.get('gen_ai.usage.output_tokens', 0):6d} {float(a.get('specmesh.tau', 0.0)):6.2f} {ms:6.0f}")
    return 0


def trace_show(args) -> int:
    from ..observability.plots import timeline_png
    from ..observability.traces import find, phases

    req = find(_load_requests(args.file), args.request)
    a = req.attrs
    print(f"request {req.span['span_id']} trace {req.trace_id} session {req.session_id}")
    print(f"strategy {req.label}, model {a.get('gen_ai.request.model', '')}, "
          f"{a.get('gen_ai.usage.input_tokens', '?')} prompt tokens, {a.get('gen_ai.usage.output_tokens', '?')} new, "
          f"tau {float(a.get('specmesh.tau', 0.0)):.2f}, finish {a.get('gen_ai.response.finish_reasons', ['?'])}"
          + (f", LOSSY acceptance ({a.get('specmesh.acceptance', '?')})" if a.get("specmesh.lossy") else ""))
    print(f"{'round':>5} {'drafted':>7} {'accepted':>8} {'draft ms':>9} {'network ms':>10} {'verify ms':>9} "
          f"{'other ms':>8} {'wall ms':>8} {'batch':>5}")
    tot = {k: 0.0 for k in ("draft", "network", "verify", "other")}
    for r in req.rounds:
        ph = phases(r)
        for k in tot:
            tot[k] += ph[k]
        name = "pre" if r.a("prefill", False) else str(r.index)
        print(f"{name:>5} {int(r.a('drafted')):7d} {int(r.a('accepted')):8d} {ph['draft']:9.1f} "
              f"{ph['network']:10.1f} {ph['verify']:9.1f} {ph['other']:8.1f} {float(r.a('wall_ms', 0.0)):8.1f} "
              f"{int(r.a('batch_size', 1)):5d}")
    print(f"{'sum':>5} {'':7} {'':8} {tot['draft']:9.1f} {tot['network']:10.1f} {tot['verify']:9.1f} "
          f"{tot['other']:8.1f}")
    out = args.out or f"trace-{req.trace_id[:12]}.png"
    print(f"wrote {timeline_png(req, out)}")
    return 0


# ---------------------------------------------------------------- stats

def _bars(hist: list[int], block: int) -> list[str]:
    total = sum(hist) or 1
    top = max(hist) if hist else 1
    lines = []
    for a, n in enumerate(hist):
        mark = "  <- ceiling bin" if a == block and block > 0 else ""
        lines.append(f"  {a:3d} {n:7d} {n / total:7.1%} {'#' * int(round(40 * n / top)) if top else ''}{mark}")
    return lines


def stats_main(args) -> int:
    from ..observability import stats as st

    sources = list(args.sources) + list(args.url)
    if not sources:
        print("specmesh stats: give a stats/bench JSON, a trace file, a saved scrape or --url", file=sys.stderr)
        return 2
    accs = []
    for src in sources:
        accs += st.load(src)
    if not accs:
        print("specmesh stats: no acceptance histograms found in " + ", ".join(sources), file=sys.stderr)
        return 1
    if args.merge and len(accs) > 1:
        accs = [st.merge(accs)]
    accs = [st.with_block(a, args.block) for a in accs]
    if args.json:
        print(json.dumps([{"label": a.label, "source": a.source, "hist": a.hist, "rounds": a.rounds, "tau": a.tau,
                           "block": a.block, "ceiling_rounds": a.ceiling_count,
                           "ceiling_fraction": a.ceiling_fraction,
                           "ceiling_exact": a.exact_ceiling, "binds": a.binds(args.threshold),
                           "verdict": a.verdict(args.threshold)} for a in accs], indent=2))
    else:
        for a in accs:
            how = "per round, against each request's draft budget" if a.exact_ceiling else f"top bin a={a.block}"
            of = "drafted rounds" if a.drafted_rounds else "rounds"
            print(f"{a.label}  [{a.source}]  requests {a.requests}, rounds {a.rounds}, tau {a.tau:.2f}, "
                  f"block B={a.block}")
            print("    a  rounds   share")
            print("\n".join(_bars(a.hist + [0] * max(0, a.block + 1 - len(a.hist)), a.block)))
            d = a.drafted_rounds if a.drafted_rounds else a.rounds
            print(f"  ceiling bin a={a.block}: {a.ceiling_count} of {d} {of} ({a.ceiling_fraction:.1%}; {how})")
            print(f"  verdict: {a.verdict(args.threshold)}")
            print()
    pngs = [p for p in (args.png, args.out_dir and os.path.join(args.out_dir, "acceptance.png")) if p]
    for png in pngs:  # only where asked: nothing lands in the current directory unasked
        from ..observability.plots import acceptance_png

        if os.path.dirname(png):
            os.makedirs(os.path.dirname(png), exist_ok=True)
        path = acceptance_png(accs, png, args.threshold)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
