"""``specmesh uno-study``: the mask-gated adapter measured side by side, in one process.

Part 1, serving (greedy, the bench workloads' prompts, which no drafter was trained
on; systems alternate per prompt, order rotating): plain decoding, ``self:uno``
(fused: one forward a round), ``self:uno_tree``, ``self:uno_separate`` (a draft pass
+ the verify pass) and ``self:block_tree`` (the trained block drafter) where the
runtime has it. Per system: tokens/s and the ratio to plain decoding, τ (tokens
per round), target forwards per generated token (a separate draft pass counts as
one), the cost of a round (draft + verify ms) and whether the output equals plain
decoding's.

Part 2, the diffusion mode (``diffusion.Unmasking``): plain iterative unmasking vs
trajectory speculation (``self``, ``draft`` with prompt lookup as the AR drafter,
``both``, and the best-first ``tree`` of guessed states, its prior built in or fitted
on held-out prompts with ``--fit-prior``; each with the lookahead
that scores the next block's first forward after a complete guessed block unless
``--no-lookahead``): target forwards per block, steps per forward, rows per forward
(what a wider forward costs where rows are not free), tokens/s, and identity with
plain unmasking; and draft-and-refine, whose output is the target's plain
greedy decoding (identity checked against it; plain decoding costs one forward per
token, B per block).

Writes ``uno-study.json``, ``uno-study.md`` and ``uno-study.png`` to ``--out``.
Knows nothing about gRPC.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

M = "specmesh.cli.uno_study"
SERVING = ("ar", "uno", "uno_tree", "uno_separate", "block_tree")


def register(sub) -> None:
    p = sub.add_parser("uno-study", help="the mask-gated adapter's layouts and diffusion mode, side by side")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapter", default=None, help="adapter checkpoint (default: the bundled one / SPECMESH_UNO)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--workloads", default="open_writing,chat_multiturn")
    p.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--systems", default=",".join(SERVING))
    p.add_argument("--budget", type=int, default=8, help="maximum draft nodes a round (adaptive below it)")
    p.add_argument("--block", type=int, default=None, help="masks per block served (default: the drafter's)")
    p.add_argument("--max-blocks", type=int, default=None,
                   help="mask blocks a fused round carries at most (default: after every stop node)")
    p.add_argument("--diffusion-block", type=int, default=5, help="positions per diffusion block")
    p.add_argument("--per-step", type=int, default=1, help="positions unmasked per diffusion step")
    p.add_argument("--depth", type=int, default=4, help="guessed steps per speculative forward")
    p.add_argument("--tree-budget", type=int, default=64, help="guessed states per forward of the tree guesser")
    p.add_argument("--tree-depth", type=int, default=None, help="tree guesser's depth (default: the block)")
    p.add_argument("--no-lookahead", action="store_true",
                   help="do not score the next block's first forward after complete guessed blocks")
    p.add_argument("--fit-prior", type=int, default=0, metavar="N",
                   help="fit the tree guesser's prior (TreePrior.fit) on plain unmasking of N more prompts a "
                        "workload, after the measured ones (default: the built-in prior)")
    p.add_argument("--diffusion-tokens", type=int, default=64, help="new tokens per prompt in the diffusion part")
    p.add_argument("--skip-diffusion", action="store_true")
    p.add_argument("--out", default="uno-study")
    p.set_defaults(module=M, func="main")


def _serving(rt, prompts, systems, args) -> dict:
    from ..loop import AdaptiveBudget, generate_tokens

    rows = {s: {"tokens": 0, "seconds": 0.0, "rounds": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0,
                "draft_passes": 0, "identical": 0, "prompts": 0} for s in systems}
    for i, p in enumerate(prompts):
        ids = rt.encode(p.prompt, p.messages)
        order = systems[i % len(systems):] + systems[: i % len(systems)]
        outs = {}
        for s in order:
            if s == "ar":
                kw = dict(budget=0)
            else:
                kw = dict(self_draft=s, budget=AdaptiveBudget.for_drafter(s, args.budget, rt.verify_costs))
            d = rt.verifier.self_drafters.get(s)
            before = dict(d.rounds) if hasattr(d, "rounds") else None
            out, st = generate_tokens(None, rt.verifier, ids, max_new_tokens=p.budget(args.max_new_tokens),
                                      stop_ids=rt.stop_ids, **kw)
            r = rows[s]
            r["tokens"] += st.new_tokens
            r["seconds"] += st.total_s - st.prefill_s
            r["rounds"] += st.rounds
            r["accepted"] += st.accepted_tokens
            r["draft_s"] += st.draft_s
            r["verify_s"] += st.verify_s
            r["prompts"] += 1
            if before is not None:  # draft passes of their own: every round of the separate layout, and
                # the fused layout's rounds that had no block kept
                r["draft_passes"] += d.rounds["separate"] - before["separate"] + (
                    0 if d.fused else d.rounds["drafted"] - before["drafted"])
            outs[s] = out
        for s in systems:
            rows[s]["identical"] += int(outs[s] == outs["ar"])
        print(f"[{i + 1}/{len(prompts)}] {p.id}: " + ", ".join(
            f"{s} {rows[s]['tokens'] / max(rows[s]['seconds'], 1e-9):.1f} tok/s" for s in systems), file=sys.stderr)
    base = rows["ar"]["tokens"] / max(rows["ar"]["seconds"], 1e-9)
    for s, r in rows.items():
        r["tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
        r["speedup"] = r["tokens_per_s"] / base
        r["tau"] = (r["accepted"] + r["rounds"]) / r["rounds"] if r["rounds"] else 0.0
        r["forwards_per_token"] = (r["rounds"] + r["draft_passes"]) / max(r["tokens"], 1)
        r["round_ms"] = 1e3 * (r["draft_s"] + r["verify_s"]) / max(r["rounds"], 1)
        r["draft_ms_per_round"] = 1e3 * r["draft_s"] / max(r["rounds"], 1)
        r["verify_ms_per_round"] = 1e3 * r["verify_s"] / max(r["rounds"], 1)
    return rows


def _diffusion(rt, prompts, args) -> dict:
    from ..drafters.prompt_lookup import PromptLookupDrafter
    from ..types import DraftContext, SamplingParams
    from .. import workloads as wl
    from ..uno.diffusion import TreePrior, Unmasking

    pl = PromptLookupDrafter()

    def lookup(tokens, n):  # an AR drafter for the "draft" guesser: prompt lookup over the context
        return pl.propose(DraftContext("diffusion", tokens, 0, SamplingParams()), n).tokens

    dec = Unmasking(rt.engine, block=args.diffusion_block, per_step=args.per_step, slot=rt.engine.n_slots - 1,
                    lookahead=not args.no_lookahead)
    from ..loop import generate_tokens

    if args.fit_prior and args.per_step == 1:  # on prompts the measurement does not use
        n = args.prompts + args.fit_prior
        held = [p for ps in wl.load(args.workloads.split(","), n).values() for p in ps[args.prompts:n]]
        trace: list = []
        for p in held:
            dec.generate(rt.encode(p.prompt, p.messages), args.diffusion_tokens, stop_ids=rt.stop_ids, trace=trace)
        dec.prior = TreePrior.fit(trace)
        print(f"tree prior fitted on {len(held)} held-out prompts: {dec.prior}", file=sys.stderr)
    modes = [None, "self", "draft", "both"] + (["tree"] if args.per_step == 1 else [])
    rows = {str(m): {"forwards": 0, "steps": 0, "blocks": 0, "tokens": 0, "seconds": 0.0, "identical": 0,
                     "prompts": 0, "guessed": 0, "rows": 0, "lookahead": 0} for m in modes + ["refine"]}
    tree_depth = args.tree_depth or args.diffusion_block
    for i, p in enumerate(prompts):
        ids = rt.encode(p.prompt, p.messages)
        outs = {}
        for m in modes[i % len(modes):] + modes[: i % len(modes)]:
            out, st = dec.generate(ids, args.diffusion_tokens, stop_ids=rt.stop_ids, speculate=m,
                                   depth=tree_depth if m == "tree" else args.depth, budget=args.tree_budget,
                                   drafter=lookup)
            r = rows[str(m)]
            for k, v in (("forwards", st.forwards), ("steps", st.steps), ("blocks", st.blocks),
                         ("tokens", st.new_tokens), ("seconds", st.seconds), ("guessed", st.guessed_steps),
                         ("rows", st.rows), ("lookahead", st.lookahead_blocks)):
                r[k] += v
            r["prompts"] += 1
            outs[str(m)] = out
        for m in modes:
            rows[str(m)]["identical"] += int(outs[str(m)] == outs["None"])
        # draft-and-refine: lossless w.r.t. the target's plain greedy decoding
        out, st = dec.refine(ids, args.diffusion_tokens, stop_ids=rt.stop_ids)
        ar, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=args.diffusion_tokens, stop_ids=rt.stop_ids)
        r = rows["refine"]
        for k, v in (("forwards", st.forwards), ("steps", st.steps), ("blocks", st.blocks), ("tokens", st.new_tokens),
                     ("seconds", st.seconds), ("rows", st.rows)):
            r[k] += v
        r["prompts"] += 1
        r["identical"] += int(out == ar)
        print(f"[diffusion {i + 1}/{len(prompts)}] {p.id}: " + ", ".join(
            f"{m} {rows[str(m)]['forwards'] / max(rows[str(m)]['blocks'], 1):.2f} fwd/block" for m in modes),
            file=sys.stderr)
    plain = rows["None"]
    for r in rows.values():
        r["forwards_per_block"] = r["forwards"] / max(r["blocks"], 1)
        r["steps_per_forward"] = r["steps"] / max(r["forwards"], 1)
        r["rows_per_forward"] = r["rows"] / max(r["forwards"], 1)
        r["tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
        r["forward_reduction"] = plain["forwards_per_block"] / max(r["forwards_per_block"], 1e-9)
    rows["plain"] = rows.pop("None")
    return rows, dataclasses.asdict(dec.prior)


def render(res: dict) -> str:
    a = res["args"]
    lines = [f"# uno-study ({a['dtype']}, {a['device']}, {a['workloads']}, {a['prompts']} prompts each, "
             f"{a['max_new_tokens']} tokens, greedy)", "",
             f"adapter: `{res['adapter']}`; masks per served block: {res['block']}; mask blocks per fused round: "
             f"{a.get('max_blocks') or 'after every stop node'}", "",
             "| system | tok/s | vs plain | τ (tokens/round) | target forwards / token | ms / round (draft + verify) "
             "| identical to plain |", "|---|---|---|---|---|---|---|"]
    for s, r in res["serving"].items():
        lines.append(f"| {s} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                     f"{r['forwards_per_token']:.3f} | {r['round_ms']:.1f} ({r['draft_ms_per_round']:.1f} + "
                     f"{r['verify_ms_per_round']:.1f}) | {r['identical']}/{r['prompts']} |")
    if res.get("diffusion"):
        prior = f"fitted on {a['fit_prior']} held-out prompts a workload" if a.get("fit_prior") else "built in"
        lines += ["", f"## Diffusion mode (block {a['diffusion_block']}, {a['per_step']} position(s) a step, "
                  f"{a['diffusion_tokens']} tokens, depth {a['depth']}; tree: {a.get('tree_budget')} states, depth "
                  f"{a.get('tree_depth') or a['diffusion_block']}; lookahead "
                  f"{'off' if a.get('no_lookahead') else 'on'}; tree prior: {prior})", "",
                  "| decoder | target forwards / block | steps / forward | forward reduction | rows / forward "
                  "| blocks by lookahead | tok/s | identical |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, r in res["diffusion"].items():
            name = {"plain": "plain unmasking", "refine": "draft-and-refine (identical = to AR greedy; plain AR: "
                    f"{a['diffusion_block']} forwards / block)"}.get(m, f"trajectory speculation: {m}")
            lines.append(f"| {name} | {r['forwards_per_block']:.2f} | {r['steps_per_forward']:.2f} | "
                         f"{r['forward_reduction']:.2f}x | {r.get('rows_per_forward', 0):.1f} | "
                         f"{r.get('lookahead', 0)}/{r['blocks']} | {r['tokens_per_s']:.1f} | "
                         f"{r['identical']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sv = res["serving"]
    n = 2 if res.get("diffusion") else 1
    fig, axes = plt.subplots(1, n + 1, figsize=(5 * (n + 1), 3.8))
    names = list(sv)
    axes[0].bar(names, [sv[s]["speedup"] for s in names], color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("tokens/s vs plain decoding")
    axes[0].set_title("serving speed")
    axes[1].bar(names, [sv[s]["tau"] for s in names], color="tab:green")
    axes[1].set_ylabel("τ (tokens per round)")
    axes[1].set_title("tokens per round")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    if n == 2:
        df = res["diffusion"]
        axes[2].bar(list(df), [df[m]["forwards_per_block"] for m in df], color="tab:orange")
        axes[2].set_ylabel("target forwards per block")
        axes[2].set_title("diffusion mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    import os

    from .. import workloads as wl
    from ..results import write_result
    from ..runtime import Runtime

    if args.adapter:
        os.environ["SPECMESH_UNO"] = args.adapter
    rt = Runtime(args.model, dtype=args.dtype, n_slots=4, max_seq_len=2048, device=args.device, quiet=True,
                 specialist=None)
    if rt.uno is None:
        raise SystemExit("no mask-gated adapter for this model: `specmesh train-uno` or --adapter DIR")
    for name in ("uno", "uno_tree", "uno_separate"):
        if args.block:
            rt.verifier.self_drafters[name].block = args.block
        rt.verifier.self_drafters[name].max_blocks = args.max_blocks
    systems = [s for s in args.systems.split(",") if s and (s == "ar" or s in rt.verifier.self_drafters)]
    if "ar" not in systems:
        systems.insert(0, "ar")
    prompts = [p for ps in wl.load(args.workloads.split(","), args.prompts).values() for p in ps]
    res = {"args": vars(args) | {"func": None, "module": None}, "adapter": str(rt.uno_path),
           "block": rt.verifier.self_drafters["uno"].block, "serving": _serving(rt, prompts, systems, args)}
    if not args.skip_diffusion:
        res["diffusion"], res["tree_prior"] = _diffusion(rt, prompts, args)
    res["median_prompt_tokens"] = statistics.median(len(rt.encode(p.prompt, p.messages)) for p in prompts)
    write_result(args.out, "uno-study", res, render(res), plot)
    return 0
