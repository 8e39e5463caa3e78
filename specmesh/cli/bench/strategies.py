"""``specmesh bench-strategies``: workloads x strategies through the real services.

Starts the verifier (the target, fp32 by default so greedy identity is exact),
the drafter and the router in this process on loopback ports, then sends every
workload prompt (``bench/workloads/*.jsonl``, or built-in prompts when there are
none) once per strategy — the order of strategies rotates per prompt so machine
drift hits them alike — and prints tokens/s and the ratio to plain decoding
measured side by side, per workload. Reasoning prompts run in reasoning mode for
every strategy (the same full-CoT procedure), where ``ssr`` joins the columns
and the answer phase is reported separately.

Proactive: for each multi-turn conversation (up to its last assistant turn) it
calls ``Anticipate(wait)``; the first predicted user turn is the *covered*
follow-up, the workload's real next turn the uncovered one. Each follow-up runs
without anticipation (plain decoding) and as ``proactive`` (its cache and warm
KV); TTFT and tokens/s of both are printed, the real turn first, and the report
gives the mean ratio of each (``proactive_ratio``): the covered one says what a
correct anticipation buys, the real one what a user's actual follow-up gets.

Verdict lines: ``auto`` within 10% of the best fixed strategy on every workload
and never below 0.95x plain; ``proactive`` on covered follow-ups >= 2x plain
tokens/s (the real-turn ratio is printed beside it, without a target); ``ssr``
>= 1.5x plain on the answer phase. Ratios on a loaded machine
are noisy: the numbers are what this run measured, nothing is adjusted.

Knows nothing about the strategies' internals: it only talks to the router
through the client SDK.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Optional

from ..stack import LocalStack

FIXED = ("autoregressive", "external:prompt_lookup", "external:suffix", "external:adaptive_lookup",
         "external:draft_lm", "self:layerskip")
BUILTIN = {
    "code_edit": [{"id": "b1", "prompt": "Add a docstring to this function and return the whole function:\n\n"
                   "```python\ndef area(w, h):\n    if w < 0 or h < 0:\n        raise ValueError('negative')\n"
                   "    return w * h\n```"}],
    "code_write": [{"id": "b2", "prompt": "Write a Python function that reverses the words of a sentence."}],
    "chat_multiturn": [{"id": "b3", "messages": [
        {"role": "user", "content": "Give me three tips for learning to cook."},
        {"role": "assistant", "content": "1. Start with simple recipes.\n2. Learn basic knife skills.\n"
                                         "3. Taste as you cook."},
        {"role": "user", "content": "Can you explain the second tip in more detail?"}]}],
    "reasoning": [{"id": "b4", "prompt": "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? "
                   "Think step by step."}],
}


def load_workloads(names: Optional[list[str]], per: int, directory: Optional[str]) -> dict[str, list[dict]]:
    try:
        from ... import workloads as wl

        loaded = wl.load(names, per, Path(directory) if directory else None)
        return {k: [{"id": p.id, "prompt": p.prompt, "messages": p.messages} for p in v] for k, v in loaded.items()}
    except Exception as e:  # noqa: BLE001 - the workloads module or files are missing: built-in prompts
        print(f"(workloads unavailable: {e}; using built-in prompts)")
        return {k: v[:per] for k, v in BUILTIN.items() if not names or k in names}


class Services(LocalStack):
    """Verifier, drafter and router servers in this process (loopback, free ports) over
    one Runtime: ``specmesh.cli.stack.LocalStack`` with the target's verifier."""

    def __init__(self, model: str, dtype: str, slots: int, max_seq_len: int, device: str = "cpu"):
        from ...runtime import Runtime
        from ...serving.settings import load_settings
        from ...threads import model_thread

        self.thread = model_thread()  # the model loads and runs on one thread, as in `specmesh serve`
        self.rt = self.thread.run(Runtime, model, dtype=dtype, n_slots=slots, max_seq_len=max_seq_len, quiet=True,
                                  device=device)
        base = dict(model=model, dtype=dtype, n_slots=slots, max_seq_len=max_seq_len, max_new_tokens=1024,
                    workers=16, drain_s=0.0, max_sessions_per_client=64, device=device)
        if "metrics" in _fields():
            base["metrics"] = False  # no /metrics HTTP port for an in-process benchmark
        super().__init__([self.rt.verifier], self.rt, self.rt.vocab_size, settings=partial(load_settings, **base),
                         thread=self.thread)

    def tie_gap(self, kw: dict, ref: list[int], other: list[int]) -> Optional[float]:
        """|logit(ref[i]) - logit(other[i])| of the target at the first position where
        two outputs of the same request differ (a near-tie flips under different
        forward shapes), computed with one plain forward; None when one is a prefix."""
        from specmesh.router.core import GenerateSpec

        i = next((j for j, (x, y) in enumerate(zip(ref, other)) if x != y), None)
        if i is None:
            return None
        spec = GenerateSpec(prompt=kw.get("prompt") or "", messages=kw.get("messages"), strategy="autoregressive",
                            max_new_tokens=kw.get("max_new_tokens"), reasoning=kw.get("reasoning", False),
                            thinking_budget=kw.get("thinking_budget"))
        ids = self.router.plan(spec).ids + list(ref[:i])
        return self.thread.run(self._tie_gap, ids, ref[i], other[i])

    def _tie_gap(self, ids: list[int], a: int, b: int) -> float:
        v = self.rt.verifier
        with v.lock:
            slot = v.pool.allocate("bench-tie-check")
            try:
                self.rt.engine.reset(slot)
                logits = self.rt.engine.prefill(slot, ids)
            finally:
                v.release("bench-tie-check")
        return abs(float(logits[a]) - float(logits[b]))


def _fields() -> set:
    from ...serving.settings import ServeSettings

    return set(ServeSettings.model_fields)


def _split(system: str) -> tuple[str, str]:
    s, _, d = system.partition(":")
    return s, d


def _request(rec: dict) -> dict:
    return {"prompt": rec["prompt"]} if rec.get("prompt") else {"messages": rec["messages"]}


def run_matrix(client, work: dict, systems: list[str], max_new: int, think_new: int, budget: int,
               progress, forget=lambda: None, tie_gap=None) -> dict:
    """workload -> system -> {tokens, seconds, answer_tokens, answer_s, identical, n, tau_sum, reasons}."""
    out: dict = {}
    for wname, recs in work.items():
        reasoning = wname == "reasoning"
        cols = list(systems) + (["ssr"] if reasoning else [])
        agg = {c: {"tokens": 0, "seconds": 0.0, "answer_tokens": 0, "answer_s": 0.0, "identical": 0, "n": 0,
                   "tau": 0.0, "reasons": [], "tie_gaps": [], "network_s": 0.0, "draft_s": 0.0, "rounds": 0}
               for c in cols}
        for pi, rec in enumerate(recs):
            order = cols[pi % len(cols):] + cols[: pi % len(cols)]
            results = {}
            for system in order:
                strategy, drafter = _split(system)
                kw = dict(_request(rec), strategy=strategy, drafter=drafter, draft_budget=budget,
                          max_new_tokens=think_new if reasoning else max_new)
                if reasoning:
                    kw.update(reasoning=True, thinking_budget=think_new * 3 // 4)
                forget()  # suffix trees must not draft from this prompt's earlier runs
                results[system] = r = client.generate(**kw)
                a = agg[system]
                a["tokens"] += r.stats.new_tokens
                a["seconds"] += r.stats.total_s
                a["answer_tokens"] += r.stats.answer_tokens
                a["answer_s"] += r.stats.answer_s
                a["tau"] += r.stats.tau
                a["network_s"] += r.stats.network_s
                a["draft_s"] += r.stats.draft_s
                a["rounds"] += r.stats.rounds
                a["n"] += 1
                if system == "auto":
                    a["reasons"].append(f"{r.stats.strategy}:{r.stats.drafter} ({r.stats.strategy_reason})")
            ref = results["autoregressive"].token_ids
            for system, r in results.items():
                agg[system]["identical"] += r.token_ids == ref
                if r.token_ids != ref and tie_gap is not None:
                    kw = dict(_request(rec), max_new_tokens=think_new if reasoning else max_new)
                    if reasoning:
                        kw.update(reasoning=True, thinking_budget=think_new * 3 // 4)
                    g = tie_gap(kw, ref, r.token_ids)
                    if g is not None:
                        agg[system]["tie_gaps"].append(g)
            progress(f"  {wname} {pi + 1}/{len(recs)} done")
        out[wname] = agg
    return out


def run_proactive(client, convs: list[dict], max_new: int, next_turns: int, progress) -> list[dict]:
    rows = []
    for i, rec in enumerate(convs):
        msgs = rec.get("messages") or []
        if len(msgs) < 3 or msgs[-1]["role"] != "user":
            continue
        history, real = msgs[:-1], msgs[-1]["content"]
        conv = f"bench-{rec['id']}-{time.time_ns()}"
        t0 = time.perf_counter()
        a = client.anticipate(conv, history, next_turns=next_turns, wait=True, timeout=900)
        t_ant = time.perf_counter() - t0
        covered = a.predicted_turns[0] if a.predicted_turns else "Please continue."
        row = {"id": rec["id"], "anticipation_s": t_ant, "anticipation_tokens": a.tokens, "covered_turn": covered}
        for kind, turn in (("covered", covered), ("real", real)):
            m = history + [{"role": "user", "content": turn}]
            pro = client.generate(messages=m, strategy="proactive", conversation_id=conv, max_new_tokens=max_new)
            plain = client.generate(messages=m, strategy="autoregressive", max_new_tokens=max_new)
            row[kind] = {"plain_tps": plain.stats.tokens_per_s, "plain_ttft": plain.stats.ttft_s,
                         "pro_tps": pro.stats.tokens_per_s, "pro_ttft": pro.stats.ttft_s,
                         "cache_hit": pro.stats.cache_hit, "cache_accepted": pro.stats.cache_accepted_tokens,
                         "new_tokens": pro.stats.new_tokens, "warm": pro.stats.warm_prefix_tokens,
                         "tau": pro.stats.tau, "identical": pro.token_ids == plain.token_ids}
        rows.append(row)
        progress(f"  proactive {i + 1}/{len(convs)} done")
    return rows


def proactive_ratio(pro: list[dict], kind: str) -> float:
    """Mean proactive tokens/s over mean plain tokens/s of the follow-ups of ``kind``:
    ``real`` (the workload's own next user turn) or ``covered`` (the first turn the
    anticipation predicted, so its reply is already in the cache)."""
    tp = sum(r[kind]["pro_tps"] for r in pro) / len(pro)
    tpl = sum(r[kind]["plain_tps"] for r in pro) / len(pro)
    return tp / tpl if tpl else 0.0


def _tps(a: dict) -> float:
    return a["tokens"] / a["seconds"] if a["seconds"] else 0.0


def render(matrix: dict, pro: list[dict], meta: dict) -> str:
    lines = [f"# bench-strategies  ({meta['model']}, {meta['dtype']}, max_new_tokens={meta['max_new']}, "
             f"reasoning max_new_tokens={meta['think_new']}, budget={meta['budget']}, {meta['prompts']} prompt(s) "
             "per workload; tokens/s and x plain decoding, measured side by side)", ""]
    table, verdict_auto = _table(matrix)
    lines += table
    lines += _reasoning_and_proactive(matrix, pro)
    ext, verdict_ext = _external_vs_self(matrix)
    lines += ext
    lines += ["", "verdicts:"]
    for wname, e, o, ratio in verdict_ext:
        lines.append(f"  [{'PASS' if ratio >= 0.9 else 'FAIL'}] {e} on {wname}: {ratio:.2f}x {o} (needs >= 0.90)")
    for wname, ok, vs_best, vs_ar, best in verdict_auto:
        lines.append(f"  [{'PASS' if ok else 'FAIL'}] auto on {wname}: {vs_best:.2f}x the best fixed ({best}), "
                     f"{vs_ar:.2f}x plain (needs >= 0.90 and >= 0.95)")
    if pro:
        real, covered = proactive_ratio(pro, "real"), proactive_ratio(pro, "covered")
        lines.append(f"  [info] proactive on real next turns (the workload's own next user turn): "
                     f"{real:.2f}x plain tokens/s (no target; what a user's actual follow-up gets)")
        lines.append(f"  [{'PASS' if covered >= 2 else 'FAIL'}] proactive on covered follow-ups (the model's own "
                     f"predicted next turn, which the anticipation pre-answered): {covered:.2f}x plain tokens/s "
                     "(needs >= 2)")
    if "reasoning" in matrix and "ssr" in matrix["reasoning"]:
        agg = matrix["reasoning"]
        pa = agg["autoregressive"]
        sa = agg["ssr"]
        r = ((sa["answer_tokens"] / sa["answer_s"]) / (pa["answer_tokens"] / pa["answer_s"])
             if sa["answer_s"] and pa["answer_s"] and pa["answer_tokens"] else 0.0)
        lines.append(f"  [{'PASS' if r >= 1.5 else 'FAIL'}] ssr answer phase: {r:.2f}x plain (needs >= 1.5)")
    return "\n".join(lines)


def _table(matrix: dict) -> tuple[list[str], list]:
    """The workloads x systems table (tokens/s, x plain), the '!' note, auto's reasons;
    and auto's verdict rows."""
    systems = sorted({s for agg in matrix.values() for s in agg}, key=lambda s: (s == "auto", s == "ssr",
                                                                                  FIXED.index(s) if s in FIXED else 9))
    w = max(14, max(len(s) for s in systems) + 1)
    lines = [f"{'workload':<17}" + "".join(f"{s:>{w}}" for s in systems)]
    verdict_auto = []
    for wname, agg in matrix.items():
        ar = _tps(agg["autoregressive"])
        cells = []
        for s in systems:
            if s not in agg:
                cells.append(f"{'-':>{w}}")
                continue
            t = _tps(agg[s])
            mark = "" if agg[s]["identical"] == agg[s]["n"] else "!"
            cells.append(f"{f'{t:.1f} {t / ar:.2f}x{mark}':>{w}}" if ar else f"{t:>{w}.1f}")
        lines.append(f"{wname:<17}" + "".join(cells))
        fixed = {s: _tps(agg[s]) for s in agg if s != "auto"}
        best = max(fixed, key=fixed.get)
        if "auto" in agg:
            a = _tps(agg["auto"])
            ok = a >= 0.9 * fixed[best] and a >= 0.95 * ar
            verdict_auto.append((wname, ok, a / fixed[best] if fixed[best] else 0.0, a / ar if ar else 0.0, best))
    gaps = [(w, s, g) for w, agg in matrix.items() for s in agg for g in agg[s].get("tie_gaps", [])]
    lines += ["", "('!' = some output differed from plain decoding" + (
        "; target logit gap between the two tokens where they part: " +
        ", ".join(f"{w}/{s} {g:.1e}" for w, s, g in gaps) + ")" if gaps else ")"), "", "auto chose:"]
    for wname, agg in matrix.items():
        if "auto" in agg:
            lines.append(f"  {wname}: " + "; ".join(sorted(set(agg["auto"]["reasons"]))))
    return lines, verdict_auto


def _reasoning_and_proactive(matrix: dict, pro: list[dict]) -> list[str]:
    lines = []
    if "reasoning" in matrix:
        agg = matrix["reasoning"]
        lines += ["", "reasoning, answer phase only (tokens after the end of thinking / seconds from there):"]
        for s in ("autoregressive", "ssr", "auto"):
            if s in agg and agg[s]["answer_s"]:
                lines.append(f"  {s:<16} {agg[s]['answer_tokens'] / agg[s]['answer_s']:6.1f} tok/s "
                             f"({agg[s]['answer_tokens']} tokens)")
    if pro:
        lines += ["", "proactive: next turn with vs without anticipation (TTFT s, tokens/s); real = the "
                  "workload's own next user turn, covered = the model's predicted one (its reply pre-generated); "
                  f"mean: real {proactive_ratio(pro, 'real'):.2f}x, covered {proactive_ratio(pro, 'covered'):.2f}x"]
        for r in pro:
            for kind in ("real", "covered"):
                x = r[kind]
                lines.append(f"  {r['id']} {kind:<7} plain ttft {x['plain_ttft']:.2f} {x['plain_tps']:5.1f} tok/s | "
                             f"proactive ttft {x['pro_ttft']:.2f} {x['pro_tps']:5.1f} tok/s "
                             f"({x['pro_tps'] / x['plain_tps'] if x['plain_tps'] else 0:.2f}x, tau {x['tau']:.2f}, "
                             f"cache hit {x['cache_hit']}, {x['cache_accepted']} cached tokens accepted, "
                             f"warm prefix {x['warm']}, identical {x['identical']})")
            lines.append(f"    anticipation took {r['anticipation_s']:.1f} s idle ({r['anticipation_tokens']} tokens); "
                         f"covered turn: {r['covered_turn']!r}")
    return lines


def _external_vs_self(matrix: dict) -> tuple[list[str], list]:
    """The block drafter on the drafter service vs in the verifier, per workload and pooled."""
    pairs = [(f"external:{d}", f"self:{d}") for d in ("block_tree", "block")]
    pairs = [(e, o) for e, o in pairs if any(e in agg and o in agg for agg in matrix.values())]
    lines, verdict_ext = [], []
    if not pairs:
        return lines, verdict_ext
    lines += ["", "the block drafter on the drafter service (features over the wire) vs in the verifier "
              "(tokens/s ratio; per round: draft ms incl. its RPC, network ms = RPC wall - server time):"]
    for e, o in pairs:
        for wname, agg in matrix.items():
            if e in agg and o in agg:
                ratio = _tps(agg[e]) / _tps(agg[o]) if _tps(agg[o]) else 0.0
                per = {k: (1e3 * agg[k]["draft_s"] / max(1, agg[k]["rounds"]),
                           1e3 * agg[k]["network_s"] / max(1, agg[k]["rounds"])) for k in (e, o)}
                lines.append(f"  {wname:<16} {e} / {o}: {ratio:.2f}x  (draft {per[e][0]:.1f} vs {per[o][0]:.1f} "
                             f"ms/round, network {per[e][1]:.1f} vs {per[o][1]:.1f} ms/round)")
                verdict_ext.append((wname, e, o, ratio))
        both = [agg for agg in matrix.values() if e in agg and o in agg]
        if len(both) > 1:  # every workload's tokens over every workload's seconds
            te = sum(a[e]["tokens"] for a in both) / max(1e-9, sum(a[e]["seconds"] for a in both))
            to = sum(a[o]["tokens"] for a in both) / max(1e-9, sum(a[o]["seconds"] for a in both))
            lines.append(f"  {'all':<16} {e} / {o}: {te / to if to else 0.0:.2f}x")
    return lines, verdict_ext


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-strategies", help="workloads x router strategies through the services")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--workloads", default="", help="comma list (default: all in --workloads-dir)")
    p.add_argument("--workloads-dir", default=None)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--systems", default=",".join(FIXED) + ",auto",
                   help="strategy[:drafter] list (autoregressive is always run; external:draft_lm is a stand-in "
                        "unless the target has a paired draft model, e.g. the Qwen pair of `make setup-qwen`)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reasoning-max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=8, help="draft budget per round")
    p.add_argument("--proactive", type=int, default=2, help="conversations for the proactive follow-up test (0: off)")
    p.add_argument("--next-turns", type=int, default=2, help="predicted next turns per anticipation")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--device", default="cpu", help="verifier and drafter service: cpu | cuda | cuda:N | auto")
    p.add_argument("--out", default=None, help="also write the table and raw numbers here (.md and .json)")
    p.set_defaults(module="specmesh.cli.bench.strategies", func="main")


def main(args) -> int:
    from ...client import Client

    t_start = time.perf_counter()
    names = [x.strip() for x in args.workloads.split(",") if x.strip()] or None
    work = load_workloads(names, args.prompts, args.workloads_dir)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "autoregressive" not in systems:
        systems.insert(0, "autoregressive")
    svc = Services(args.model, args.dtype, args.slots, 2048, device=getattr(args, "device", "cpu"))
    try:
        with Client(svc.address, timeout=900, client_id="bench") as c:
            c.generate("Say hello.", strategy="autoregressive", max_new_tokens=4)  # warm-up
            matrix = run_matrix(c, {k: v for k, v in work.items()}, systems, args.max_new_tokens,
                                args.reasoning_max_new_tokens, args.budget, print,
                                forget=lambda: svc.host.reset(["suffix", "cache"]), tie_gap=svc.tie_gap)
            convs = work.get("chat_multiturn") or []
            pro = run_proactive(c, convs[: args.proactive], args.max_new_tokens, args.next_turns, print) \
                if args.proactive > 0 else []
    finally:
        svc.close()
    meta = {"model": args.model, "dtype": args.dtype, "max_new": args.max_new_tokens,
            "think_new": args.reasoning_max_new_tokens, "budget": args.budget, "prompts": args.prompts}
    text = render(matrix, pro, meta)
    print(text)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "matrix": matrix, "proactive": pro}, indent=2))
    return 0
