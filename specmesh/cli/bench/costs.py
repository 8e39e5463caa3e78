"""``specmesh costs``: the speculation cost model, measured on the active device and dtype.

Measured here, in one process:

- the verifier's time to score n = 1..32 tokens (one forward over a chain after a
  committed context; the pending token + n - 1 drafts), and a batch of B sessions
  scoring 1 and 1 + k tokens each in one ragged forward;
- each drafter's time per round at budget k and per drafted token (token-level
  drafters run k steps; the block drafters one pass per round);
- the break-even τ of each drafter: a round of budget k costs ``T_d(k) + T_v(k+1)``
  and plain decoding ``T_v(1)`` per token, so speculation pays when
  τ > τ* = (T_d(k) + T_v(k+1)) / T_v(1), and the predicted speedup is S = τ / τ*;
- the PEFT-BD bound: a drafter whose round costs at least a target pass
  (c = T_d / T_v(1) >= 1) has τ* >= 1 + T_v(k+1)/T_v(1) >= 2, so S <= τ/2 —
  checked against speedups measured side by side with plain decoding on a few
  prompts (same run, alternating per prompt).

Writes costs.json, costs.md (the tables) and costs.png into ``--out``; a tqdm bar
shows progress. Numbers are wall-clock medians on a shared machine: read the
spread, not the third digit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ...results import write_result

DRAFTERS = "prompt_lookup,suffix,draft_lm,layerskip,block,block_tree"
SELF = ("layerskip", "block", "block_tree")
PROMPTS = ["Write a short story about a lighthouse keeper who receives a letter from the future.",
           "Rename the function `mean` to `average` and return the full code:\n\ndef mean(xs):\n    total = 0\n"
           "    for x in xs:\n        total += x\n    return total / len(xs)\n",
           "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Think step by step."]


def register(subparsers) -> None:
    p = subparsers.add_parser("costs", help="measure the speculation cost model (verify/draft times, break-even tau, "
                                            "the S <= tau/2 bound) for this device and dtype",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--drafters", default=DRAFTERS, help="comma list (draft_lm: a stand-in unless the target has a "
                   "paired draft model, e.g. the Qwen pair of `make setup-qwen`)")
    p.add_argument("--budget", type=int, default=6, help="draft budget k of a round")
    p.add_argument("--max-tokens", type=int, default=32, help="score 1..this many tokens")
    p.add_argument("--batch", default="1,2,4,8", help="session counts of the batched forward")
    p.add_argument("--context", type=int, default=256, help="committed context length while scoring")
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    p.add_argument("--gen-prompts", type=int, default=3, help="prompts of the measured-speedup check (0: skip)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="costs-out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(module="specmesh.cli.bench.costs", func="main")


def _median_s(fn, reps: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def verify_times(eng, context: list[int], max_tokens: int, reps: int, bar) -> dict[int, float]:
    """n -> seconds to score a chain of n tokens after ``context`` (slot 0; nothing committed)."""
    eng.reset(0)
    eng.prefill(0, context)
    toks = (context * 4)[: max_tokens]
    out = {}
    for n in range(1, max_tokens + 1):
        out[n] = _median_s(lambda: eng.score(0, toks[:n], list(range(-1, n - 1))), reps)
        bar.update(1)
    eng.reset(0)
    return out


def batch_times(eng, context: list[int], sizes: list[int], k: int, reps: int, bar) -> dict:
    """B -> {1: s, k+1: s}: B sessions scoring 1 and k + 1 tokens each in one forward."""
    out = {}
    for B in sizes:
        for s in range(B):
            eng.reset(s)
            eng.prefill(s, context)
        row = {}
        for n in (1, k + 1):
            items = [(s, (context * 4)[:n], list(range(-1, n - 1))) for s in range(B)]
            row[n] = _median_s(lambda: eng.score_batch(items), reps)
        out[B] = row
        for s in range(B):
            eng.reset(s)
        bar.update(1)
    return out


def draft_times(rt, name: str, ids: list[int], k: int, reps: int) -> float:
    """Seconds of one round of drafter ``name`` at budget k on the prompt ``ids``."""
    from ...types import DraftContext, SamplingParams, VerifyRequest

    sp = SamplingParams()
    if name in SELF:
        ver = rt.verifier
        sid = f"costs-{name}"
        res = ver.verify(VerifyRequest(sid, 0, ids, sampling=sp))
        d = ver.self_drafters[name]
        ctx = DraftContext(sid, [res.next_token], 0, sp, round_seed=1)
        try:
            return _median_s(lambda: d.propose(ctx, k), reps)
        finally:
            ver.release(sid)
    d = rt.drafter(name)
    ctx = DraftContext(f"costs-{name}", ids, len(ids), sp, round_seed=1)
    try:
        return _median_s(lambda: d.propose(ctx, k), reps)
    finally:
        d.release(ctx.session_id)


def measured_speedups(rt, names: list[str], prompts: list[list[int]], n: int, k: int, bar) -> dict:
    """name -> (τ, speedup) vs plain decoding, alternating per prompt, greedy."""
    from ...loop import generate_tokens

    plain_s, spec = 0.0, {x: [0.0, 0, 0, 0] for x in names}  # s, accepted, rounds, tokens
    toks = 0
    for ids in prompts:
        t0 = time.perf_counter()
        ref, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=n, stop_ids=rt.stop_ids)
        plain_s += time.perf_counter() - t0
        toks += len(ref)
        for name in names:
            self_draft = name if name in SELF else None
            d = None if self_draft else rt.drafter(name)
            t0 = time.perf_counter()
            out, st = generate_tokens(d, rt.verifier, ids, max_new_tokens=n, stop_ids=rt.stop_ids, budget=k,
                                      self_draft=self_draft)
            row = spec[name]
            row[0] += time.perf_counter() - t0
            row[1] += st.accepted_tokens
            row[2] += st.rounds
            row[3] += len(out)
            bar.update(1)
    res = {}
    for name, (s, acc, rounds, nt) in spec.items():
        res[name] = {"tau": (acc + rounds) / rounds if rounds else 0.0,
                     "speedup": (nt / s) / (toks / plain_s) if s and plain_s else 0.0}
    return res


def main(args) -> int:
    from ...runtime import Runtime

    k = args.budget
    names = [x.strip() for x in args.drafters.split(",") if x.strip()]
    sizes = [int(x) for x in args.batch.split(",") if x.strip()]
    rt = Runtime(args.model, dtype=args.dtype, n_slots=max(sizes + [4]), max_seq_len=1024, quiet=True,
                 device=args.device)
    names = [x for x in names if x not in SELF or x in rt.verifier.self_drafters]
    ids = rt.encode(PROMPTS[0])
    context = (ids * (args.context // len(ids) + 1))[: args.context]
    prompts = [rt.encode(p) for p in PROMPTS[: args.gen_prompts]]
    total = args.max_tokens + len(sizes) + len(names) + len(prompts) * len(names)
    from tqdm import tqdm

    with tqdm(total=total, desc="specmesh costs", disable=args.no_progress) as bar:
        tv = verify_times(rt.engine, context, args.max_tokens, args.reps, bar)
        tb = batch_times(rt.engine, context, sizes, k, args.reps, bar)
        td = {}
        for name in names:
            bar.set_postfix_str(name)
            td[name] = draft_times(rt, name, context, k, args.reps)
            bar.update(1)
        meas = measured_speedups(rt, names, prompts, args.max_new_tokens, k, bar) if prompts else {}
    t1 = tv[1]
    tvk = tv.get(k + 1) or tv[max(tv)]
    rows = []
    from ...drafters import registry

    for name in names:
        per_round = name in registry.PER_ROUND
        c = td[name] / t1  # the round's draft cost in target passes
        be = (td[name] + tvk) / t1  # break-even tau
        m = meas.get(name, {})
        tau, s = m.get("tau"), m.get("speedup")
        rows.append({"drafter": name, "draft_round_ms": td[name] * 1e3,
                     "draft_token_ms": td[name] * 1e3 / (1 if per_round else k), "cost_in_target_passes": c,
                     "break_even_tau": be, "tau": tau, "measured_speedup": s,
                     "predicted_speedup": tau / be if tau else None,
                     "bound_tau_over_2_applies": c >= 1.0,
                     "within_tau_over_2": (s <= tau / 2) if (tau and s is not None and c >= 1.0) else None})
    meta = {"model": args.model, "dtype": args.dtype, "device": str(rt.device), "budget": k,
            "context": args.context, "reps": args.reps, "max_new_tokens": args.max_new_tokens,
            "prompts": len(prompts), "torch_threads": __import__("torch").get_num_threads()}
    result = {"meta": meta, "verify_s": tv, "batch_s": tb, "drafters": rows}
    write_result(args.out, "costs", result, report(result), plot)
    return 0


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(r: dict) -> str:
    m, tv, tb, k = r["meta"], r["verify_s"], r["batch_s"], r["meta"]["budget"]
    t1 = tv[1] if 1 in tv else tv["1"]
    tvd = {int(a): b for a, b in tv.items()}
    lines = [f"# Speculation costs: {m['model']} {m['dtype']} on {m['device']} ({m['torch_threads']} threads)", "",
             f"Context {m['context']} tokens, median of {m['reps']}; budget k = {k}.", "",
             "## Verifier: time to score n tokens (one forward)", "",
             "| n | ms | x one token |", "|---|---|---|"]
    for n in sorted(tvd):
        if n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32) or n == max(tvd):
            lines.append(f"| {n} | {tvd[n] * 1e3:.1f} | {tvd[n] / t1:.2f} |")
    lines += ["", f"## Batched verify: B sessions in one forward (1 and {k + 1} tokens each)", "",
              f"| B | ms (1 token each) | per session | ms ({k + 1} tokens each) | per session |", "|---|---|---|---|---|"]
    for B, row in tb.items():
        row = {int(a): b for a, b in row.items()}
        B = int(B)
        lines.append(f"| {B} | {row[1] * 1e3:.1f} | {row[1] * 1e3 / B:.1f} | {row[k + 1] * 1e3:.1f} | "
                     f"{row[k + 1] * 1e3 / B:.1f} |")
    lines += ["", "## Drafters: cost, break-even τ and the S ≤ τ/2 bound", "",
              "τ* = (T_draft(k) + T_verify(k+1)) / T_verify(1); predicted S = τ/τ*; c = T_draft / T_verify(1). "
              "A drafter with c ≥ 1 (a target pass or more per round) cannot beat τ/2.", "",
              "| drafter | draft ms/round | ms/token | c (target passes) | break-even τ* | measured τ | "
              "predicted S | measured S | τ/2 | S ≤ τ/2 (c ≥ 1) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in r["drafters"]:
        tau = d["tau"]
        lines.append(f"| {d['drafter']} | {d['draft_round_ms']:.1f} | {d['draft_token_ms']:.2f} | "
                     f"{d['cost_in_target_passes']:.2f} | {d['break_even_tau']:.2f} | {_f(tau)} | "
                     f"{_f(d['predicted_speedup'])} | {_f(d['measured_speedup'])} | {_f(tau / 2 if tau else None)} | "
                     f"{'-' if d['within_tau_over_2'] is None else ('yes' if d['within_tau_over_2'] else 'NO')} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tv = {int(a): b for a, b in r["verify_s"].items()}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ns = sorted(tv)
    ax[0].plot(ns, [tv[n] * 1e3 for n in ns], marker="o", ms=3)
    ax[0].set(xlabel="tokens scored in one forward", ylabel="ms", title="verifier: time to score n tokens")
    for B, row in r["batch_s"].items():
        row = {int(a): b for a, b in row.items()}
        ax[0].scatter([int(B) * max(row)], [row[max(row)] * 1e3], marker="x")
        ax[0].annotate(f"B={B}", (int(B) * max(row), row[max(row)] * 1e3), fontsize=7)
    ds = r["drafters"]
    ax[1].bar([d["drafter"] for d in ds], [d["cost_in_target_passes"] for d in ds], color="tab:orange")
    ax[1].axhline(1.0, color="k", lw=0.8, ls="--", label="one target pass")
    ax[1].set(ylabel="draft cost per round / T_verify(1)", title=f"drafter cost (k = {r['meta']['budget']})")
    ax[1].tick_params(axis="x", rotation=30)
    ax[1].legend(fontsize=8)
    taus = [d["tau"] for d in ds if d["tau"]]
    hi = max(taus + [2.0]) + 0.5
    ax[2].plot([1, hi], [0.5, hi / 2], "k--", lw=0.8, label="S = τ/2 (drafter costs a target pass)")
    ax[2].plot([1, hi], [1, hi], "k:", lw=0.8, label="S = τ (free drafter, free verify)")
    ax[2].axhline(1.0, color="grey", lw=0.5)
    for d in ds:
        if d["tau"] and d["measured_speedup"] is not None:
            ax[2].scatter(d["tau"], d["measured_speedup"], label=f"{d['drafter']} (c={d['cost_in_target_passes']:.2f})")
    ax[2].set(xlabel="measured τ", ylabel="measured speedup S", title="measured S vs τ")
    ax[2].legend(fontsize=7)
    fig.suptitle(f"{r['meta']['model']} {r['meta']['dtype']} on {r['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
