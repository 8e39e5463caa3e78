"""Information floor of block drafting, from target rollouts.

A block drafter predicts slot k (the k-th token after the anchor) from the
context alone, without seeing the sampled tokens at slots < k. From R sampled
rollouts of the target per context, the least expected rejection any drafter
with a given conditioning can reach at slot k is:

- order 0 (context only):      1 - E_ctx[ max_x P(x_k = x | ctx) ]
- order 1 (also slot k-1):     1 - E_ctx[ sum_y P(x_{k-1} = y | ctx) max_x P(x_k = x | ctx, y) ]

estimated with empirical frequencies over the rollouts. A drafter's measured
rejection at slot k (1 - P(its prediction equals the rollout token)) minus the
floor of its conditioning order is its model gap: what training can still win.

Knows nothing about models; it consumes token arrays.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Optional, Sequence


def floors(rollouts: Sequence[Sequence[Sequence[int]]]) -> dict:
    """rollouts[c][r][k]: token at slot k of rollout r of context c.
    Returns {"order0": [K floats], "order1": [K floats]} (order1[0] == order0[0])."""
    K = min(len(r) for ctx in rollouts for r in ctx)
    o0, o1 = [0.0] * K, [0.0] * K
    for ctx in rollouts:
        R = len(ctx)
        for k in range(K):
            c = Counter(r[k] for r in ctx)
            o0[k] += 1 - max(c.values()) / R
            if k == 0:
                o1[k] += 1 - max(c.values()) / R
                continue
            by_prev: dict[int, Counter] = defaultdict(Counter)
            for r in ctx:
                by_prev[r[k - 1]][r[k]] += 1
            hit = sum(max(cnt.values()) for cnt in by_prev.values()) / R
            o1[k] += 1 - hit
    n = len(rollouts)
    return {"order0": [x / n for x in o0], "order1": [x / n for x in o1]}


def measured_rejection(rollouts, predictions: Sequence[Sequence[int]]) -> list[float]:
    """predictions[c][k]: the drafter's (context-only) token for slot k of context c."""
    K = min(len(p) for p in predictions)
    rej = [0.0] * K
    for ctx, pred in zip(rollouts, predictions):
        for k in range(K):
            rej[k] += sum(r[k] != pred[k] for r in ctx) / len(ctx)
    return [x / len(predictions) for x in rej]


def model_gap(rejection: list[float], floor: list[float]) -> list[float]:
    return [m - f for m, f in zip(rejection, floor)]


def sample_rollouts(verifier, contexts: list[list[int]], n_rollouts: int, length: int, temperature: float = 1.0,
                    seed: int = 0, progress=None) -> list[list[list[int]]]:
    """R sampled continuations of ``length`` tokens per context from the target, batched
    over sessions with verify_batch (each rollout its own session and seed)."""
    from ..loop import round_seed
    from ..types import SamplingParams, TokenTree, VerifyRequest

    out: list[list[list[int]]] = []
    width = verifier.engine.n_slots
    for ci, ctx in enumerate(contexts):
        rolls: list[list[int]] = []
        for r0 in range(0, n_rollouts, width):
            group = list(range(r0, min(n_rollouts, r0 + width)))
            seqs = {f"floor-{ci}-{r}": [] for r in group}
            kv = {sid: 0 for sid in seqs}
            for _ in range(length):
                reqs = []
                for j, sid in enumerate(seqs):
                    toks = ctx + seqs[sid]
                    sp = SamplingParams(temperature=temperature, seed=seed + 1000 * ci + group[j])
                    reqs.append(VerifyRequest(sid, kv[sid], toks[kv[sid]:], TokenTree(), sp,
                                              round_seed(sp.seed, len(toks))))
                for req, res in zip(reqs, verifier.verify_batch(reqs)):
                    if isinstance(res, Exception):
                        raise res
                    kv[req.session_id] = len(ctx) + len(seqs[req.session_id])
                    seqs[req.session_id].append(res.next_token)
            for sid in seqs:
                verifier.release(sid)
            rolls += list(seqs.values())
        out.append(rolls)
        if progress is not None:
            progress(1)
    return out


def plot_floor(result: dict, path, title: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(result["order0"])
    xs = list(range(1, K + 1))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, result["order0"], "o-", label="floor, order 0 (context only)")
    ax.plot(xs, result["order1"], "s-", label="floor, order 1 (+ previous slot)")
    if "measured" in result:
        ax.plot(xs, result["measured"], "^-", label="drafter measured rejection")
    ax.set_xlabel("slot k after the anchor")
    ax.set_ylabel("expected rejection")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(title or "information floor per slot")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
