"""Offline study of the block drafter's draft trees on held-out bench prompts (``specmesh tree-study``).

1. **Held-out sequences**: the target's greedy answers (plain decoding through the
   loop) to the prompts of the chosen bench workloads, which no drafter was trained
   on; cached as JSON lines per model, dtype and length.
2. **Target pass**: per sequence, one forward for the drafter's features and the
   target's entropy at every position.
3. **Drafts**: at every response position (the anchor: the pending token of a
   round), the served drafting step (``FoldedDrafter.draft``, one context cache
   carried along the sequence, bf16 as served): the top-``width`` candidates of
   each slot with their probabilities. The target's own next tokens say which
   nodes greedy verification accepts.
4. **Scorers**: prefix-blind ``Calibration`` vs path-conditioned
   ``PathCalibration``, cross-fitted (two folds by prompt: each fold's trees are
   scored by the calibration fitted on the other fold); for each node budget, τ
   (1 + the accepted length of greedy verification) per workload and scorer.
5. **Entropy-switched budgets** (after EntMTP): τ per (budget, entropy bin) of the
   signal the serving loop has before it drafts — the target's entropy where it
   predicted the pending token (``VerifyResult.entropy`` of the previous round);
   with a cost model (a draft costs ``c`` forwards; verifying n nodes costs the
   measured forward time of n + 1 scored tokens over that of one — on a CPU the
   matmul tiles make it a step function, so a linear ``beta`` per token misleads),
   the budget a bin should get maximises τ / cost(n) (n = 0: no draft, τ = 1,
   cost 1); the switched schedule's tokens per unit cost against every fixed
   budget, cross-fitted the same way.

Writes a JSON of every figure, a table and a PNG. Knows nothing about gRPC.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from .tree import Calibration, PathCalibration, best_first_tree

BUDGETS = (1, 2, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class Anchor:
    """One drafting round at a held-out position."""

    workload: str
    fold: int  # 0 / 1: which half of the prompts (cross-fitting)
    cands: list[list[tuple[int, float]]]  # per slot: (token, drafter prob), descending
    truth: list[int]  # the target's next tokens after the anchor (at most the block's slots)
    entropy: float  # the target's entropy (nats) where it predicted the anchor token


@dataclass
class StudyData:
    anchors: list[Anchor] = field(default_factory=list)
    draft_ms: float = 0.0  # mean served draft time per anchor


# ------------------------------------------------------------------ pure parts
def accepted_length(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> int:
    """Nodes greedy verification accepts: the deepest path of the tree that is a prefix of ``truth``."""
    node, depth = -1, 0
    while depth < len(truth):
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def path_samples(a: Anchor) -> list[tuple[int, float, bool, int]]:
    """(slot, prob, accepted given parent accepted, path class) for every candidate whose
    parent path is the target's own: the samples both scorers are fitted on."""
    out = []
    cls = 0
    for k, truth in enumerate(a.truth):
        hit = None
        for r, (t, p) in enumerate(a.cands[k]):
            out.append((k, p, t == truth, cls + (r > 0)))
            if t == truth:
                hit = r
        if hit is None:
            break  # deeper slots: the parent is not in the tree
        cls += hit > 0
    return out


def fit_scorers(anchors: Sequence[Anchor], n_slots: int) -> tuple[Calibration, PathCalibration]:
    s = [x for a in anchors for x in path_samples(a)]
    return Calibration.fit(s, n_slots), PathCalibration.fit(s, n_slots)


def tree_tau(a: Anchor, budget: int, scorer) -> int:
    """τ of one round: 1 + the nodes accepted of the best-first tree of ``budget`` nodes."""
    if budget <= 0:
        return 1
    t = best_first_tree(a.cands, budget, scorer)
    return 1 + accepted_length(t.tokens, t.parents, a.truth)


def entropy_edges(anchors: Sequence[Anchor], bins: int) -> list[float]:
    """Quantile edges of the entropy signal (``bins`` bins, interior edges only)."""
    xs = sorted(a.entropy for a in anchors)
    return [xs[min(len(xs) - 1, int(len(xs) * i / bins))] for i in range(1, bins)] if xs else []


def entropy_bin(edges: Sequence[float], h: float) -> int:
    return sum(h >= e for e in edges)


def linear_cost(c: float, beta: float):
    """cost(n) of a round with n drafted nodes, in forwards: 1 + c + beta n (1 without a draft)."""
    return lambda n: 1 + c + beta * n if n else 1.0


def best_budget(taus: dict[int, float], cost) -> int:
    """The budget maximising τ / cost(n) (0: no draft, τ 1 at cost 1)."""
    best, best_n = 1.0, 0
    for n, t in sorted(taus.items()):
        r = t / cost(n)
        if r > best + 1e-12:
            best, best_n = r, n
    return best_n


# ------------------------------------------------------------------ evaluation
def evaluate(data: StudyData, budgets: Sequence[int] = BUDGETS, c: float = 0.2, beta: float = 0.015,
             bins: int = 4, verify_cost: Optional[dict[int, float]] = None) -> dict:
    """Every figure of the study, cross-fitted over the two folds (see the module docstring).
    ``verify_cost[n]``: the forward time of n + 1 scored tokens over that of one (measured,
    ``forward_costs``); without it, 1 + beta n."""
    cost = (lambda n: c + verify_cost[n] if n else 1.0) if verify_cost else linear_cost(c, beta)
    anchors = data.anchors
    n_slots = max(len(a.cands) for a in anchors)
    folds = [[a for a in anchors if a.fold == f] for f in (0, 1)]
    scorers = [fit_scorers(folds[1 - f], n_slots) for f in (0, 1)]  # fold f is scored by the other's fit
    workloads = sorted({a.workload for a in anchors})
    taus: dict[str, dict[str, dict[int, list[int]]]] = {s: {w: {n: [] for n in budgets} for w in workloads}
                                                         for s in ("blind", "path")}
    edges = [entropy_edges(folds[1 - f], bins) for f in (0, 1)]  # fold f's bins: edges from the other fold
    per_anchor: list[tuple[int, int, dict[int, int]]] = []  # (fold, bin, {n: tau}) with the path scorer
    for f in (0, 1):
        blind, path = scorers[f]
        for a in folds[f]:
            got = {}
            for n in budgets:
                taus["blind"][a.workload][n].append(tree_tau(a, n, blind))
                got[n] = tree_tau(a, n, path)
                taus["path"][a.workload][n].append(got[n])
            b = entropy_bin(edges[f], a.entropy)
            per_anchor.append((f, b, got))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    table = {s: {w: {n: mean(v) for n, v in d.items()} for w, d in ws.items()} for s, ws in taus.items()}
    for s in table:
        table[s]["all"] = {n: mean([t for w in workloads for t in taus[s][w][n]]) for n in budgets}
    # the schedule: per bin, the budget chosen on the other fold's τ(n | bin), applied to this fold
    sched_cost = {"switched": [0.0, 0.0], **{n: [0.0, 0.0] for n in budgets}}  # [tokens, cost]
    chosen: dict[int, list[int]] = {}
    for f in (0, 1):
        other = [(b, got) for ff, b, got in per_anchor if ff != f]
        tau_bin = {b: {n: mean([got[n] for bb, got in other if bb == b]) for n in budgets} for b in range(bins)}
        pick = {b: best_budget({n: t for n, t in tau_bin[b].items() if not math.isnan(t)}, cost)
                for b in range(bins)}
        chosen[f] = [pick[b] for b in range(bins)]
        for ff, b, got in per_anchor:
            if ff != f:
                continue
            n = pick[b]
            sched_cost["switched"][0] += got[n] if n else 1
            sched_cost["switched"][1] += cost(n)
            for m in budgets:
                sched_cost[m][0] += got[m]
                sched_cost[m][1] += cost(m)
    per_cost = {str(k): v[0] / v[1] for k, v in sched_cost.items()}
    full = [(b, got) for _, b, got in per_anchor]
    return {
        "anchors": len(anchors), "n_slots": n_slots, "budgets": list(budgets), "workloads": workloads,
        "tau": {s: {w: {str(n): t for n, t in d.items()} for w, d in ws.items()} for s, ws in table.items()},
        "cost_model": {"c": c, "beta": None if verify_cost else beta, "draft_ms": data.draft_ms,
                       "round_cost": {str(n): cost(n) for n in (0, *budgets)}},
        "entropy_bins": bins, "entropy_edges": edges,
        "tau_by_entropy_bin": {str(b): {str(n): mean([got[n] for bb, got in full if bb == b]) for n in budgets}
                               for b in range(bins)},
        "schedule_budgets_per_fold": chosen,
        "tokens_per_cost": per_cost,
        "path_class_acceptance": _class_rates(anchors),
    }


def schedule_from(anchors: Sequence[Anchor], scorer, budgets: Sequence[int] = BUDGETS, bins: int = 4):
    """The ``loop.TreeSchedule`` served with the drafter: entropy bin edges (quantiles) and
    τ per node budget in each bin, with ``scorer``'s trees, over ``anchors``."""
    from ..loop import TreeSchedule

    edges = entropy_edges(anchors, bins)
    sums = [{n: 0.0 for n in budgets} for _ in range(bins)]
    counts = [0] * bins
    for a in anchors:
        b = entropy_bin(edges, a.entropy)
        counts[b] += 1
        for n in budgets:
            sums[b][n] += tree_tau(a, n, scorer)
    return TreeSchedule(edges, [{n: v / counts[b] for n, v in sums[b].items()} if counts[b] else {}
                                for b in range(bins)])


def _class_rates(anchors: Sequence[Anchor]) -> dict:
    """Acceptance given parent accepted, per path class, against the mean drafter probability
    of the same nodes: what the prefix-blind marginal claims vs what verification gives."""
    acc: dict[int, list[float]] = {}
    for a in anchors:
        for k, p, ok, cls in path_samples(a):
            s = acc.setdefault(min(cls, 2), [0.0, 0.0, 0.0])
            s[0] += ok
            s[1] += p
            s[2] += 1
    return {str(c): {"accepted": s[0] / s[2], "mean_prob": s[1] / s[2], "nodes": int(s[2])}
            for c, s in sorted(acc.items())}


def workload_table(res: dict) -> str:
    """Markdown: τ per workload and budget, prefix-blind vs path-conditioned."""
    bud = res["budgets"]
    lines = ["| workload | scorer | " + " | ".join(f"n={n}" for n in bud) + " |",
             "|---|---|" + "---|" * len(bud)]
    for w in res["workloads"] + ["all"]:
        for s in ("blind", "path"):
            row = res["tau"][s][w]
            lines.append(f"| {w} | {s} | " + " | ".join(f"{row[str(n)]:.3f}" for n in bud) + " |")
    return "\n".join(lines)


def schedule_table(res: dict) -> str:
    bud = res["budgets"]
    lines = ["| entropy bin (edges of fold 0 / fold 1) | " + " | ".join(f"n={n}" for n in bud) + " |",
             "|---|" + "---|" * len(bud)]
    e0, e1 = ([0.0] + e + [float("inf")] for e in res["entropy_edges"])
    for b in range(res["entropy_bins"]):
        row = res["tau_by_entropy_bin"][str(b)]
        lines.append(f"| {b}: [{e0[b]:.2f}, {e0[b + 1]:.2f}) / [{e1[b]:.2f}, {e1[b + 1]:.2f}) nats | "
                     + " | ".join(f"{row[str(n)]:.3f}" for n in bud) + " |")
    pc = res["tokens_per_cost"]
    best_fixed = max(bud, key=lambda n: pc[str(n)])
    rc = res["cost_model"]["round_cost"]
    lines += ["", "round cost in forwards (draft + verify of n nodes): "
              + ", ".join(f"n={n}: {rc[str(n)]:.2f}" for n in bud),
              "", f"tokens per unit cost: "
              f"entropy-switched {pc['switched']:.3f} (budgets per bin, fold 0/1: "
              f"{res['schedule_budgets_per_fold'][0]} / {res['schedule_budgets_per_fold'][1]}); best fixed budget "
              f"n={best_fixed}: {pc[str(best_fixed)]:.3f}; n=8: {pc.get('8', float('nan')):.3f}"]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bud = res["budgets"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for w in res["workloads"] + ["all"]:
        for s, ls in (("blind", "--"), ("path", "-")):
            axes[0].plot(bud, [res["tau"][s][w][str(n)] for n in bud], ls, marker="o", ms=3,
                         label=f"{w} ({s})" if w == "all" or s == "path" else None)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tree nodes")
    axes[0].set_ylabel("τ (tokens per round)")
    axes[0].set_title("prefix-blind (--) vs path-conditioned (-) trees")
    axes[0].legend(fontsize=7)
    for b in range(res["entropy_bins"]):
        row = res["tau_by_entropy_bin"][str(b)]
        axes[1].plot(bud, [row[str(n)] for n in bud], marker="o", ms=3, label=f"entropy bin {b}")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("tree nodes")
    axes[1].set_title("τ by the target's entropy at the pending token")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ data (model-dependent)
def heldout_sequences(rt, prompts: Sequence, max_new_tokens: int, cache: Path) -> list[dict]:
    """The target's greedy answers (plain decoding) to ``prompts`` (bench workload prompts:
    ``id``, ``workload``, ``prompt`` / ``messages``, ``budget(n)``), cached by prompt id."""
    from ..loop import generate_tokens

    cache.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            done[r["id"]] = r
    todo = [p for p in prompts if p.id not in done]
    for p in tqdm(todo, desc="held-out answers (plain decoding)", file=sys.stderr, disable=not todo):
        ids = rt.encode(p.prompt, p.messages)
        out, _ = generate_tokens(None, rt.verifier, ids, max_new_tokens=p.budget(max_new_tokens),
                                 stop_ids=rt.stop_ids, budget=0)
        done[p.id] = {"id": p.id, "workload": p.workload, "prompt_ids": ids, "response_ids": out}
        with cache.open("a") as fh:
            fh.write(json.dumps(done[p.id]) + "\n")
    return [done[p.id] for p in prompts]


@torch.inference_mode()
def collect(rt, drafter, records: Sequence[dict], width: int) -> StudyData:
    """Steps 2-3 of the module docstring over ``records`` (``drafter``: a BlockSelfDrafter)."""
    eng = rt.engine
    layers = list(drafter.model.cfg.feature_layers)
    keep = drafter.model.keep_ids
    K = drafter.model.cfg.block - 1
    data = StudyData()
    draft_s, n_drafts = 0.0, 0
    for r in tqdm(records, desc="target pass + drafts", file=sys.stderr):
        toks = r["prompt_ids"] + r["response_ids"]
        eng.reset(0)
        try:
            out = eng.score(0, toks, list(range(-1, len(toks) - 1)), hidden_layers=layers)
        finally:
            eng.reset(0)
        lp = torch.log_softmax(out.logits.float(), -1)
        ent = -(lp.exp() * lp).sum(-1)  # [T]: entropy of the prediction of token t + 1
        feats = torch.cat([out.hidden[i] for i in layers], -1).to(torch.bfloat16)
        cache = drafter.folded.new_cache()
        fold = int(r["id"].rsplit("_", 1)[-1]) % 2 if r["id"].rsplit("_", 1)[-1].isdigit() else hash(r["id"]) % 2
        for a in range(len(r["prompt_ids"]), len(toks) - 1):
            t0 = time.perf_counter()
            lg = drafter.folded.draft(cache, toks[a], a, lambda x, y: feats[x:y])
            draft_s += time.perf_counter() - t0
            n_drafts += 1
            top = torch.topk(torch.softmax(lg.float(), -1), width, -1)
            cands = [list(zip(keep[i].tolist(), p.tolist())) for i, p in zip(top.indices, top.values)]
            data.anchors.append(Anchor(r["workload"], fold, cands, toks[a + 1: a + 1 + K], float(ent[a - 1])))
    data.draft_ms = 1000 * draft_s / max(1, n_drafts)
    return data


def forward_costs(rt, budgets: Sequence[int] = BUDGETS, ctx_len: int = 320, reps: int = 5) -> dict:
    """Median target forward time (ms) scoring n + 1 chain tokens after ``ctx_len`` committed
    ones, for n = 0 and every budget; ``verify_cost[n]`` = that time over the 1-token one."""
    eng = rt.engine
    rng = random.Random(0)
    eng.reset(0)
    eng.prefill(0, [rng.randrange(100, 20000) for _ in range(ctx_len)])
    ms = {}
    try:
        for n in (0, *budgets):
            xs = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                eng.score(0, [rng.randrange(100, 20000) for _ in range(n + 1)], list(range(-1, n)))
                xs.append(time.perf_counter() - t0)
            ms[n] = 1000 * sorted(xs[1:])[len(xs[1:]) // 2]
    finally:
        eng.reset(0)
    return {"forward_ms": ms, "verify_cost": {n: ms[n] / ms[0] for n in budgets}}
