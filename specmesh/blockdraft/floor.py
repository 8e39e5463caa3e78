"""Information floor of block drafting, from the target's exact conditional distributions.

Setting. A context ``c`` is followed by K slots ``x_1..x_K`` that the target
samples one after another from its exact conditionals ``p(x_k | c, x_<k)`` (its
softmax at the decoding temperature). A block drafter proposes all K slots in
one pass: what it puts at slot k may depend on the context (order 0), or on
the context and the true token at slot k-1 (order 1), but not on the sampled
tokens before. The floor at slot k is the least expected rejection at slot k
any drafter of that order can reach, when the tokens before slot k are the
target's own samples (as in the per-slot accuracy of training: "given the
earlier slots were right").

Two acceptance models, both lossless w.r.t. the target:

* **match floor** (the drafter proposes one token per slot; greedy drafts, as
  the served chain and tree drafters do, and as greedy decoding accepts them).
  A token d at slot k is the target's token with probability
  ``m_k(d) = E_{x_<k}[ p(d | c, x_<k) ]`` (the slot's marginal), so

      order 0:  F0_k = 1 - E_c[ max_d m_k(d) ]
      order 1:  F1_k = 1 - E_c[ sum_y max_d J_k(y, d) ],   J_k(y, d) = P(x_{k-1} = y, x_k = d | c)
      all:      Fa_k = 1 - E_c E_{x_<k}[ max_d p(d | c, x_<k) ]   (a drafter that sees every earlier slot:
                                                                 the floor of an autoregressive drafter)

  At slot 1 all three equal ``1 - max_d p(d | c)``, computed exactly from the
  logits. Under sampled speculative decoding a one-token draft (q one-hot at d)
  is accepted with probability ``min(1, p(d)/1) = p(d)``, so the same numbers
  are the floor of one-token drafts there too.

* **TV floor** (the drafter samples its slot-k token from a distribution q and
  the verifier runs rejection sampling). A draft from q is accepted with
  probability ``sum_x min(p(x), q(x)) = 1 - TV(p, q)``. With the earlier slots
  unseen, the best context-only q minimises

      T0_k = min_q E_{x_<k}[ TV(p(. | c, x_<k), q) ] = 1 - max_q sum_x E[ min(P_x, q_x) ],

  where ``P_x = p(x | c, x_<k)`` is a random variable (through the sampled
  prefix). The objective is separable: ``E[min(P_x, t)] = integral_0^t S_x(u) du``
  with the survival function ``S_x(u) = Pr(P_x > u)``, concave in t. Maximising
  a sum of concave functions under ``sum_x q_x = 1`` is a fractional knapsack:
  take the pieces (x, u) with the largest survival ``S_x(u)`` until their total
  length is 1, so

      T0_k = 1 - (integral of the top unit of mass of the survival functions S_x),
      q*_x = the length taken in column x (a common upper quantile level of every P_x).

  **The best q is not the marginal** ``m_k`` in general (it is when P does not
  depend on the prefix; then T0_k = 0): e.g. P = (0.9, 0.1) w.p. 0.6 and
  (0.1, 0.9) w.p. 0.4 give m = (0.58, 0.42) with expected TV 0.384, while
  q* = (0.9, 0.1) reaches 0.32 (tested). Order 1 (q may depend on x_{k-1} = y):
  the same knapsack per y with the joint weights, ``T1_k = 1 - sum_y max_q E[1{x_{k-1}=y} sum_x min(P_x, q_x)]``.
  At slot 1 the TV floor is 0 (q = p(. | c)). TV floor <= match floor always
  (a one-hot q is one choice of q).

Estimation. The per-prefix conditionals are always exact (the target's logits);
only the distribution of the earlier slots' tokens needs care:

* **Exact enumeration** while the prefix space is small: a level holds every
  prefix with non-zero probability and its exact probability; it is expanded
  while the next level has at most ``max_prefixes`` prefixes (a target with a
  small support, a top-k target, a deterministic target). Every number of such
  a slot is exact (``exact`` in the result says which slots were).
* **Monte Carlo** otherwise: R prefixes drawn i.i.d. from the target (from the
  last exactly enumerated level on), each continuing its own rollout. The
  marginal ``m_k``, the joint ``J_k`` (indicator of the sampled y times the
  exact conditional of slot k) and every per-drafter quantity (``measured``:
  ``1 - m_k(d)``, ``1 - E[sum_x min(P_x, q_x)]``) are averages of exact
  per-prefix values: **unbiased**. ``Fa_k`` is such an expectation too:
  unbiased. The floors take a maximum over the estimate (a max over drafters),
  and the expected maximum of an unbiased estimate is at least the maximum of
  its expectation (Jensen: max is convex), so the plug-in floors (``order0``,
  ``order1``, ``tv_order0``, ``tv_order1``) are **biased low** (optimistic).
  Their ``*_upper`` twins are two-fold cross-fitted: the drafter (token, or q)
  is chosen on one half of the prefixes and its rejection measured on the
  other half (and vice versa, averaged); that is an unbiased estimate of the
  rejection of a real drafter, hence **biased high**. In expectation the true
  floor lies in [plug-in, upper]; where a slot is exact both are equal.
  Order 1 under Monte Carlo groups prefixes by their sampled y: with a large
  vocabulary most groups hold one prefix and the order-1 plug-in tends to the
  ``Fa_k`` (full-conditioning) floor, while the cross-fit falls back to the
  order-0 choice for a y unseen in the choosing half; the bracket is then wide
  (it says so; enumerate with a top-k target to close it).

The old estimator counted R sampled rollouts per context and took empirical
maxima; with few samples per context those are huge (a target uniform over 100
tokens, true floor 0.99, came out at 0.05 for order 1 with 16 rollouts). Here
the conditionals are exact and that target gives 0.99 at every slot.

Knows nothing about gRPC; a target is anything with ``vocab_size`` and
``next_probs(context, prefixes) -> [n, V]`` (``EngineTarget`` for the engine
behind a verifier, ``FunctionTarget`` for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

DTYPE = torch.float64


class Target(Protocol):
    vocab_size: int

    def next_probs(self, context: Sequence[int], prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """[len(prefixes), V]: the exact distribution p(. | context + prefix) the target samples from."""


class FunctionTarget:
    """A target given by ``fn(tokens) -> probabilities over V`` (for tests and studies)."""

    def __init__(self, fn: Callable[[tuple], Sequence[float]], vocab_size: int):
        self.fn, self.vocab_size = fn, vocab_size

    def next_probs(self, context, prefixes) -> torch.Tensor:
        rows = [torch.as_tensor(self.fn(tuple(context) + tuple(p)), dtype=DTYPE) for p in prefixes]
        out = torch.stack(rows)
        return out / out.sum(-1, keepdim=True)


def target_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T), optionally top-k
    renormalised; T = 0 is greedy (one-hot at the argmax)."""
    logits = logits.to(DTYPE)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(DTYPE)
    z = logits / temperature
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, -1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.softmax(z, -1)


class EngineTarget:
    """Exact conditionals from the engine behind an ``EngineVerifier``: the context
    (minus its last token) is prefilled once into a verifier session, then each
    call scores the prefixes as one token tree (a trie rooted at the context's last
    token) without committing anything."""

    def __init__(self, verifier, temperature: float = 1.0, top_k: int = 0, max_nodes: int = 512,
                 session_id: str = "floor-target"):
        self.verifier, self.engine = verifier, verifier.engine
        self.vocab_size = self.engine.vocab_size
        self.temperature, self.top_k, self.max_nodes, self.sid = temperature, top_k, max_nodes, session_id
        self._ctx: Optional[tuple] = None

    def _slot(self, context: Sequence[int]) -> int:
        ctx = tuple(context)
        if len(ctx) < 2:
            raise ValueError("a context needs at least 2 tokens")
        if ctx != self._ctx:
            self.verifier.prefill(self.sid, list(ctx[:-1]))
            self._ctx = ctx
        return self.verifier.slot_of(self.sid)

    def next_probs(self, context, prefixes) -> torch.Tensor:
        slot = self._slot(context)
        out: list[torch.Tensor] = []
        tokens, parents, rows, index = [int(context[-1])], [-1], [], {}
        for p in prefixes:
            if len(tokens) + len(p) > self.max_nodes and rows:
                out.append(self.engine.score(slot, tokens, parents, rows=rows).logits)
                tokens, parents, rows, index = [int(context[-1])], [-1], [], {}
            node = 0
            for t in p:
                key = (node, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
            rows.append(node)
        if rows:
            out.append(self.engine.score(slot, tokens, parents, rows=rows).logits)
        return target_probs(torch.cat(out), self.temperature, self.top_k)

    def close(self) -> None:
        if self._ctx is not None:
            self.verifier.release(self.sid)
            self._ctx = None


# ---------------------------------------------------------------- per-slot quantities

def best_q(P: torch.Tensor, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    """max over distributions q of sum_r w_r sum_x min(P[r, x], q_x), and the q reaching it.

    The fractional knapsack of the module docstring: column x's survival function
    S_x(u) = sum_r w_r 1{P[r, x] > u} is a step function; its pieces [P_(j+1), P_(j)]
    (values sorted descending) have height = the weight of the j largest values.
    Taking the highest pieces first until their total length is 1 is optimal
    (each objective term is concave in q_x) and fills each column from u = 0 up."""
    P, w = P.to(DTYPE), w.to(DTYPE)
    if P.shape[0] == 1:  # one distribution: q = P accepts everything
        return float(w.sum()), P[0].clone()
    cols = (P > 0).any(0).nonzero().squeeze(-1)
    Pc = P[:, cols]
    vals, order = Pc.sort(0, descending=True)
    heights = w[order].cumsum(0)
    lengths = vals - torch.cat([vals[1:], torch.zeros_like(vals[:1])])
    col = torch.arange(len(cols)).repeat(P.shape[0])
    h, L = heights.flatten(), lengths.flatten()
    keep = L > 0
    h, L, col = h[keep], L[keep], col[keep]
    o = torch.argsort(h, descending=True, stable=True)
    h, L, col = h[o], L[o], col[o]
    before = L.cumsum(0) - L
    take = torch.clamp(1.0 - before, min=0.0)
    take = torch.minimum(take, L)
    q = torch.zeros(P.shape[1], dtype=DTYPE)
    q.index_add_(0, cols[col], take)
    return float((h * take).sum()), q


def tv_value(P: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    """sum_r w_r sum_x min(P[r, x], q_x): acceptance probability of drafting from q."""
    return float((w.to(DTYPE)[:, None] * torch.minimum(P.to(DTYPE), q.to(DTYPE)[None])).sum())


def _groups(y: Sequence[int]) -> dict:
    g: dict = {}
    for i, t in enumerate(y):
        g.setdefault(t, []).append(i)
    return g


def _match1(P, w, y) -> float:
    return sum(float((w[idx] @ P[idx]).max()) for idx in _groups(y).values())


def _tv1(P, w, y) -> float:
    total = 0.0
    for idx in _groups(y).values():
        wi = w[idx]
        s = float(wi.sum())
        if s > 0:
            total += s * best_q(P[idx], wi / s)[0]
    return total


def _crossfit(P, w, y) -> dict:
    """Acceptance of drafters chosen on one half of the prefixes, measured on the
    other (both directions averaged): unbiased for real drafters, so 1 - it is an
    upward-biased floor estimate."""
    n = P.shape[0]
    halves = (torch.arange(0, n, 2), torch.arange(1, n, 2))
    acc = {"order0": 0.0, "order1": 0.0, "tv_order0": 0.0, "tv_order1": 0.0}
    for a, b in (halves, halves[::-1]):
        wa, wb = w[a] / w[a].sum(), w[b] / w[b].sum()
        Pa, Pb = P[a], P[b]
        d0 = int((wa @ Pa).argmax())
        q0 = best_q(Pa, wa)[1]
        acc["order0"] += float(wb @ Pb[:, d0])
        acc["tv_order0"] += tv_value(Pb, wb, q0)
        ya, yb = [y[int(i)] for i in a], [y[int(i)] for i in b]
        choice, qs = {}, {}
        for t, idx in _groups(ya).items():
            choice[t] = int((wa[idx] @ Pa[idx]).argmax())
            qs[t] = best_q(Pa[idx], wa[idx] / wa[idx].sum())[1]
        for j, t in enumerate(yb):
            acc["order1"] += float(wb[j] * Pb[j, choice.get(t, d0)])
            acc["tv_order1"] += tv_value(Pb[j:j + 1], wb[j:j + 1], qs.get(t, q0))
    return {k: v / 2 for k, v in acc.items()}


def slot_floors(P: torch.Tensor, w: torch.Tensor, y: Optional[Sequence[int]], exact: bool) -> dict:
    """Floors of one slot of one context from its prefixes' exact conditionals ``P``
    [n, V], their weights ``w`` (sum 1: exact probabilities, or 1/R for samples) and
    the previous slot's token ``y`` of each prefix (None at slot 1)."""
    P, w = P.to(DTYPE), w.to(DTYPE)
    m = w @ P
    out = {"order0": 1 - float(m.max()), "order_all": 1 - float(w @ P.max(-1).values),
           "tv_order0": 1 - best_q(P, w)[0]}
    if y is None:
        out["order1"], out["tv_order1"] = out["order0"], out["tv_order0"]
    else:
        out["order1"], out["tv_order1"] = 1 - _match1(P, w, y), 1 - _tv1(P, w, y)
    if exact or P.shape[0] < 2:
        for k in ("order0", "order1", "tv_order0", "tv_order1"):
            out[k + "_upper"] = out[k]
    else:
        for k, v in _crossfit(P, w, y if y is not None else [0] * P.shape[0]).items():
            out[k + "_upper"] = 1 - v
    return {k: min(1.0, max(0.0, v)) for k, v in out.items()}  # rounding only


# ---------------------------------------------------------------- levels of prefixes

@dataclass
class Level:
    prefixes: list[tuple]
    weights: torch.Tensor  # [n], sums to 1
    exact: bool


def _next_level(level: Level, P: torch.Tensor, rollouts: int, max_prefixes: int, gen: torch.Generator) -> Level:
    if level.exact:
        nz = (P > 0).nonzero()
        if len(nz) <= max_prefixes:  # enumerate every continuation with its exact probability
            w = level.weights[nz[:, 0]] * P[nz[:, 0], nz[:, 1]]
            return Level([level.prefixes[i] + (int(x),) for i, x in nz.tolist()], w / w.sum(), True)
        parents = torch.multinomial(level.weights, rollouts, replacement=True, generator=gen).tolist()
    else:  # each rollout continues its own prefix
        parents = list(range(len(level.prefixes)))
    xs = [int(torch.multinomial(P[i], 1, generator=gen)) for i in parents]
    n = len(parents)
    return Level([level.prefixes[i] + (x,) for i, x in zip(parents, xs)], torch.full((n,), 1.0 / n, dtype=DTYPE),
                 False)


FLOOR_KEYS = ("order0", "order1", "order_all", "tv_order0", "tv_order1", "order0_upper", "order1_upper",
              "tv_order0_upper", "tv_order1_upper")


def floors(target: Target, contexts: Sequence[Sequence[int]], slots: int, rollouts: int = 64, seed: int = 0,
           max_prefixes: int = 256, drafts: Optional[Sequence[Sequence[torch.Tensor]]] = None,
           progress: Optional[Callable[[int], None]] = None) -> dict:
    """Per-slot floors (see the module docstring), averaged over ``contexts``.

    ``drafts[c][k]``: a drafter's distribution over the target vocabulary at slot
    k+1 of context c (its argmax is its one-token draft); with it the result also
    has ``measured`` (1 - E[m_k(argmax q)]) and ``measured_tv`` (1 - E[sum_x
    min(P_x, q_x)]), unbiased, and the model gaps to the order-0 floors.
    Returns lists of length ``slots`` under FLOOR_KEYS, ``exact`` (the fraction
    of contexts whose slot was computed by exact enumeration) and the settings."""
    if rollouts < 2:
        raise ValueError("rollouts must be >= 2 (the cross-fitted bounds need two halves)")
    acc = {k: [0.0] * slots for k in FLOOR_KEYS}
    exact = [0.0] * slots
    meas, meas_tv = [0.0] * slots, [0.0] * slots
    for ci, ctx in enumerate(contexts):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + ci)
        level = Level([()], torch.ones(1, dtype=DTYPE), True)
        for k in range(slots):
            P = target.next_probs(ctx, level.prefixes).to(DTYPE)
            y = [p[-1] for p in level.prefixes] if k else None
            f = slot_floors(P, level.weights, y, level.exact)
            for key in FLOOR_KEYS:
                acc[key][k] += f[key]
            exact[k] += level.exact
            if drafts is not None:
                q = drafts[ci][k].to(DTYPE)
                meas[k] += 1 - float(level.weights @ P[:, int(q.argmax())])
                meas_tv[k] += 1 - tv_value(P, level.weights, q)
            if k + 1 < slots:
                level = _next_level(level, P, rollouts, max_prefixes, gen)
        if progress is not None:
            progress(1)
    n = max(1, len(contexts))
    res = {key: [v / n for v in acc[key]] for key in FLOOR_KEYS}
    res.update(exact=[e / n for e in exact], slots=slots, contexts=len(contexts), rollouts=rollouts,
               max_prefixes=max_prefixes)
    if drafts is not None:
        res["measured"] = [v / n for v in meas]
        res["measured_tv"] = [v / n for v in meas_tv]
        res["gap_order0"] = model_gap(res["measured"], res["order0"])
        res["gap_tv_order0"] = model_gap(res["measured_tv"], res["tv_order0"])
    return res


def model_gap(rejection: list[float], floor: list[float]) -> list[float]:
    return [m - f for m, f in zip(rejection, floor)]


def plot_floor(result: dict, path, title: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(result["order0"])
    xs = list(range(1, K + 1))
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    for key, style, label in (("order0", "o-", "one-token drafts, order 0 (context only)"),
                              ("order1", "s-", "one-token drafts, order 1 (+ previous slot)"),
                              ("tv_order0", "o--", "sampled drafts (TV), order 0"),
                              ("tv_order1", "s--", "sampled drafts (TV), order 1")):
        line, = ax.plot(xs, result[key], style, label=label)
        up = result.get(key + "_upper")
        if up is not None and any(abs(a - b) > 1e-12 for a, b in zip(up, result[key])):
            ax.fill_between(xs, result[key], up, color=line.get_color(), alpha=0.15)
    if "order_all" in result:
        ax.plot(xs, result["order_all"], ":", color="gray", label="one-token drafts seeing every earlier slot")
    if "measured" in result:
        ax.plot(xs, result["measured"], "^-", label="drafter measured (one-token)")
    if "measured_tv" in result:
        ax.plot(xs, result["measured_tv"], "v--", label="drafter measured (sampled, TV)")
    ax.set_xlabel("slot k after the anchor")
    ax.set_ylabel("expected rejection")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(title or "information floor per slot (bands: Monte Carlo bracket)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
