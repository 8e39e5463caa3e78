"""The target's diffusion mode (block-wise iterative unmasking through the gated adapter)
and speculation over its unmasking trajectory.

**The decoder** (``Unmasking``, greedy, deterministic). Text grows in blocks of B
positions. A block's state is which positions are filled; every forward scores the
pending token (the last finalised one) and the block's positions L..L+B-2, each
row predicting the next position's token (the adapter's row convention). A row
holds its position's token if filled, else the MASK vector; rows at or after the
first unfilled position are gated (adapter on: their context holds a mask), rows
before it are the plain target. One *step* fills the ``per_step`` unfilled
positions with the highest top probability (ties: leftmost) with their argmax
tokens; a block takes ceil(B / per_step) steps. Attention inside a block is
block-causal (the engine's chain mask), which is what the adapter was trained on
(``trainer``: the diffusion form of its training blocks). A finished block's
tokens are committed as plain rows in the next block's first forward (their KV is
then the target's own). Plain unmasking costs one target forward a step.

**Trajectory speculation** (``speculate=``): the steps after the next one are
guessed, every guessed state is scored in the same forward (the states form a
tree: they share their rows up to the first position where they differ, each
node at its position, the engine's ancestor mask keeping every state's context
its own: the "reference tokens at copied positions" of SimSD), and the true rule
is replayed on the exact outputs: the next guessed step is kept while it equals
the decision the rule takes from the state before it. So a forward decides one
step plus every correct guess, and the output is exactly plain unmasking's (in
the batch-invariant engine bit for bit; in fp32's ragged forward up to ties at
1e-6). Guessers:

- ``self`` (self-speculation, as in SSD for dLLMs): the dLLM's own outputs at the
  last exact state, ranked by confidence, are the next steps;
- ``draft``: an autoregressive drafter's tokens for the block (any ``Drafter``,
  e.g. prompt lookup over the context, or the target's own greedy continuation)
  at the positions the confidence ranking picks;
- ``both``: the two as sibling branches of the state tree;
- ``tree``: a best-first tree of ``budget`` guessed states, each a path of fills
  after the current state, scored by an estimate of the probability that the rule
  takes that path (``TreePrior``). What the block-causal attention makes exact: a
  prediction for offset k depends only on the fills at offsets < k, so after fills
  whose leftmost offset is m, every open offset left of m still has its prediction
  from the last exact outputs. Among those the rule can only take the most
  confident, with its argmax (every other candidate there is provably wrong and is
  never guessed); it competes with the open offsets right of m, whose predictions
  are stale: each of their top ``len(prior.token_rank)`` tokens is a candidate,
  weighted by how often the rule's choice had that offset rank and token rank
  under stale outputs (measured on plain trajectories: ``TreePrior.fit``; the
  conditioning on a new fill moves the argmax of a stale offset to a runner-up
  more often than not). ``width`` adds the ranking's runners-up as branches to
  ``self``.

Of the branches that hold, the longest is kept (all are the rule's own trajectory).
**Lookahead** (``lookahead=True``): after every complete guessed state the forward
also scores the next block's first forward (the block's tokens as plain rows, then
the next block's mask rows); when the rule's trajectory reaches that state, its
tokens are committed from those rows (the tree nodes' KV, bitwise a chain's in the
batch-invariant engine) and the next block starts from those outputs, saving the
forward that would otherwise only commit the block and open the next.

**Draft-and-refine** (``Unmasking.refine``): the whole block drafted in parallel
by the gated rows, then refined by the plain target: each forward feeds the
current draft as plain rows (their predictions, teacher-forced on the draft, are
the refined draft; Jacobi iteration) and tops the block up with mask rows; the
draft's prefix that equals the target's own predictions is committed with the
target's token after it. Its fixed point is the target's greedy decoding, so the
output is exactly plain autoregressive greedy decoding's, at one forward per
committed prefix instead of one per token.

Knows nothing about sessions, sampling or gRPC; runs on one engine slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

Fill = tuple[tuple[int, int], ...]  # one step: ((block offset, token), ...), offsets ascending


@dataclass(frozen=True)
class TreePrior:
    """How the rule's next step relates to stale outputs (the ``tree`` guesser's scores).

    After fills whose leftmost offset is m, ``exact`` is the chance the rule takes the
    most confident open offset left of m (its prediction exact, its token certain)
    when open offsets right of m compete: ``exact[0]`` when its confidence is below
    the best stale one's + ``gap``, ``exact[1]`` otherwise (1 when none competes).
    ``offset_rank[r]``: the chance the rule's offset, when right of m, is the r-th
    most confident of them under the stale outputs; ``token_rank[j]``: the chance its
    token is the j-th most probable there (its length: candidate tokens per offset).
    The defaults were fitted (``fit``) on plain trajectories of SmolLM2 with the
    bundled adapter, block 5, bf16, on prompts 4-9 of open_writing and chat_multiturn,
    64 tokens each (not the ones ``uno-study`` measures): 596 steps. ``uno-study
    --fit-prior N`` fits it again on N held-out prompts a workload."""

    exact: tuple[float, float] = (0.122, 0.417)
    gap: float = 0.2
    offset_rank: tuple[float, ...] = (0.768, 0.156, 0.046, 0.031)
    token_rank: tuple[float, ...] = (0.419, 0.164, 0.099, 0.043, 0.053, 0.025, 0.025, 0.012)

    def offset(self, r: int) -> float:
        return self.offset_rank[r] if r < len(self.offset_rank) else self.offset_rank[-1] / 2 ** (
            r - len(self.offset_rank) + 1)

    @classmethod
    def fit(cls, traces: Sequence[Sequence[tuple[dict, "Fill"]]], tokens: int = 8, gap: float = 0.2) -> "TreePrior":
        """The prior measured on plain trajectories: ``traces`` holds per block the
        successive (exact outputs, step taken) of plain unmasking (one position a step;
        ``Unmasking.generate(..., trace=)`` records them). Each step after a block's
        first is compared with the outputs of the state before it (stale by one fill).
        Add-one smoothing, so no rank gets probability zero."""
        ex = [[1, 2], [1, 2]]  # (wins, cases) of the exact offset, close / clear
        offs, toks, beyond = [], [1] * tokens, 1  # beyond: the rule's token was not a candidate
        for block in traces:
            for (stale, prev), (_, nxt) in zip(block, block[1:]):
                (o0, _), (o1, t1) = prev[0], nxt[0]
                conf = {k: float(p.max()) for k, p in stale.items() if k != o0}
                best, right = _sides(conf, conf, o0)
                if best is not None and right:
                    c = ex[int(conf[best] - conf[right[0]] >= gap)]
                    c[0] += o1 == best
                    c[1] += 1
                offs += [1] * (len(right) - len(offs))  # one rank per competing offset seen
                if o1 in right:
                    offs[right.index(o1)] += 1
                    rank = int((stale[o1] > stale[o1][t1]).sum())
                    if rank < tokens:
                        toks[rank] += 1
                    else:
                        beyond += 1
        offs = offs or [1]
        n_off, n_tok = sum(offs), sum(toks) + beyond
        return cls(exact=(ex[0][0] / ex[0][1], ex[1][0] / ex[1][1]), gap=gap,
                   offset_rank=tuple(round(v / n_off, 4) for v in offs),
                   token_rank=tuple(round(v / n_tok, 4) for v in toks))


@dataclass
class DiffusionStats:
    forwards: int = 0
    steps: int = 0
    blocks: int = 0
    new_tokens: int = 0
    guessed_steps: int = 0  # steps decided by a verified guess (speculation)
    lookahead_blocks: int = 0  # blocks whose first forward a verified complete guess had already run
    rows: int = 0  # rows scored in all forwards
    seconds: float = 0.0
    steps_per_forward: list[int] = field(default_factory=list)

    @property
    def forwards_per_block(self) -> float:
        return self.forwards / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict:
        return {"forwards": self.forwards, "steps": self.steps, "blocks": self.blocks, "new_tokens": self.new_tokens,
                "guessed_steps": self.guessed_steps, "lookahead_blocks": self.lookahead_blocks, "rows": self.rows,
                "seconds": round(self.seconds, 3),
                "forwards_per_block": round(self.forwards_per_block, 3),
                "tokens_per_s": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0}


def _sides(conf: dict[int, float], offsets, m: int) -> tuple[Optional[int], list[int]]:
    """Of the open ``offsets`` around the leftmost fill ``m`` since the exact outputs: the
    most confident one left of m (the rule's only possible choice there; ties: leftmost,
    as in ``decide``), or None, and those right of m, most confident first."""
    left = [k for k in offsets if k < m]
    right = sorted((k for k in offsets if k > m), key=lambda k: (-conf[k], k))
    return (min(left, key=lambda k: (-conf[k], k)) if left else None), right


def decide(probs: dict[int, torch.Tensor], per_step: int) -> Fill:
    """The rule: the ``per_step`` unfilled offsets whose prediction has the highest top
    probability (ties: the leftmost) get their argmax. ``probs``: offset -> [V]
    distribution (float64 comparisons)."""
    top = sorted(((-float(p.max()), k, int(p.argmax())) for k, p in probs.items()))[:per_step]
    return tuple(sorted((k, t) for _, k, t in top))


def ranked(probs: dict[int, torch.Tensor]) -> list[tuple[int, int]]:
    """(offset, argmax) of every unfilled offset, most confident first (the rule's order)."""
    return [(k, t) for _, k, t in sorted((-float(p.max()), k, int(p.argmax())) for k, p in probs.items())]


class _Trie:
    """States of one block as a token tree after the appended chain: node inputs, parents,
    gating; ``path(state)`` gives the node of each of its rows."""

    def __init__(self, engine, base_nodes: int):
        self.eng = engine
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.gated: list[int] = []
        self.base = base_nodes  # nodes before the trie (the appended chain; its last is the pending token)
        self._index: dict[tuple, int] = {}

    def add(self, fills: Sequence[Optional[int]]) -> list[int]:
        """Nodes of the rows at offsets 0..B-2 of a state (inputs ``fills[:-1]``); node -1
        of the result's parent is the pending token."""
        nodes, parent, key, seen_mask = [], self.base - 1, (), False
        for k in range(len(fills) - 1):
            f = fills[k]
            seen_mask = seen_mask or f is None
            key = key + (-1 if f is None else f,)
            parent = self._node(key, self.eng.mask_id if f is None else f, parent, seen_mask)
            nodes.append(parent)
        return nodes

    def _node(self, key: tuple, token: int, parent: int, gated: bool) -> int:
        """The node of ``key`` (a row's input prefix), added under ``parent`` if new."""
        n = self._index.get(key)
        if n is None:
            n = self.base + len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            if gated:
                self.gated.append(n)
            self._index[key] = n
        return n

    def extend(self, fills: Sequence[int]) -> tuple[list[int], list[int]]:
        """A complete state with the next block's first forward hung after it: (the nodes
        of its B tokens as plain rows, root to leaf; the next block's B - 1 mask rows)."""
        nodes = self.add(fills)
        parent = nodes[-1] if nodes else self.base - 1
        chain = []
        for j, tok in enumerate([fills[-1]] + [self.eng.mask_id] * (len(fills) - 1)):
            parent = self._node(tuple(fills) + (-2,) * j, tok, parent, j > 0)
            chain.append(parent)
        return nodes + chain[:1], chain[1:]


class Unmasking:
    """Block-wise iterative unmasking on an engine with a gated adapter attached."""

    def __init__(self, engine, block: int = 5, per_step: int = 1, slot: int = 0, lookahead: bool = True,
                 prior: Optional[TreePrior] = None):
        if engine.adapter is None:
            raise ValueError("the diffusion mode needs the engine's gated adapter (engine.attach_adapter)")
        if block < 2 or not 1 <= per_step <= block:
            raise ValueError(f"block must be >= 2 and per_step in [1, block], got {block}, {per_step}")
        trained = getattr(engine.adapter.cfg, "block", block - 1)
        if block - 1 > trained:
            raise ValueError(f"block {block} needs {block - 1} gated rows; the adapter was trained for {trained}")
        self.eng, self.B, self.k, self.slot = engine, block, per_step, slot
        self._p0: Optional[torch.Tensor] = None  # the block's offset-0 prediction (the pending token's row)
        self.lookahead = lookahead  # score the next block's first forward after complete guessed states
        self.prior = prior or TreePrior()  # the ``tree`` guesser's scores
        self._ahead: dict = {}

    # ------------------------------------------------------------ one forward
    def _forward(self, append: list[int], states: list[list[Optional[int]]], st: DiffusionStats,
                 lookahead: Sequence[int] = ()):
        """Score ``append`` (committed from now on; its last token is the pending one) and
        every state of the block in one forward. Returns, per state, offset -> [V] probs of
        its unfilled offsets. ``lookahead``: complete states after which the next block's
        first forward is scored too (``self._ahead``: state -> (its B nodes after the
        committed ones, to commit; the next block's offset -> probs))."""
        eng = self.eng
        self._ahead = {}
        trie = _Trie(eng, len(append))
        paths = [trie.add(s) for s in states]
        ahead = {i: trie.extend(states[i]) for i in lookahead}
        toks = list(append) + trie.tokens
        par = list(range(-1, len(append) - 1)) + trie.parents
        want: list[tuple[int, int, int]] = []  # (state, offset, node whose row predicts it)
        for i, (s, nodes) in enumerate(zip(states, paths)):
            for k, f in enumerate(s):
                if f is None and not (k == 0 and not append):  # offset 0: the pending row, scored once
                    want.append((i, k, len(append) - 1 if k == 0 else nodes[k - 1]))
        extra = sorted({n for path, masks in ahead.values() for n in [path[-1]] + masks})
        rows = sorted({n for _, _, n in want} | set(extra))
        if not rows and not append:  # only offset 0 is open: its prediction is known, no forward needed
            return [{0: self._p0} if s[0] is None else {} for s in states]
        out = eng.score(self.slot, toks, par, rows=rows or [len(toks) - 1], gated=trie.gated)
        eng.commit(self.slot, range(len(append)))
        st.forwards += 1
        st.rows += len(toks)
        probs = torch.softmax(out.logits.double(), -1)
        at = {n: j for j, n in enumerate(rows)}
        res: list[dict[int, torch.Tensor]] = [dict() for _ in states]
        for i, k, n in want:
            res[i][k] = probs[at[n]]
        self._ahead = {i: ([n - len(append) for n in path],
                           {j: probs[at[n]] for j, n in enumerate([path[-1]] + masks)})
                       for i, (path, masks) in ahead.items()}
        if append:  # the pending token's row (plain target): offset 0's prediction for the whole block
            self._p0 = probs[at[len(append) - 1]] if states[0][0] is None else None
        elif self._p0 is not None:
            for i, s in enumerate(states):
                if s[0] is None:
                    res[i][0] = self._p0
        return res

    # ------------------------------------------------------------ decoding
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                 speculate: Optional[str] = None, depth: int = 4,
                 drafter: Optional[Callable[[list[int], int], list[int]]] = None,
                 width: int = 1, budget: int = 16,
                 trace: Optional[list] = None) -> tuple[list[int], DiffusionStats]:
        """New tokens and stats. ``speculate``: None (plain unmasking), ``self``, ``draft``,
        ``both`` or ``tree`` (module docstring); ``depth``: guessed steps per forward;
        ``drafter``: (committed tokens, n) -> n proposed tokens for the block (``draft`` /
        ``both``); ``width``: self-guessed branches per forward (the ranking, then each of
        its ``width - 1`` runners-up as the next step); ``budget``: guessed states per
        forward of the ``tree`` guesser (fewer where the slot's room ends); ``trace``: a
        list that gets, per block of plain unmasking, its successive (exact outputs, step)
        (what ``TreePrior.fit`` reads)."""
        if trace is not None and speculate is not None:
            raise ValueError("trace records plain unmasking (speculate=None)")
        if speculate not in (None, "self", "draft", "both", "tree"):
            raise ValueError(f"speculate must be None, 'self', 'draft', 'both' or 'tree', got {speculate!r}")
        if speculate == "tree" and self.k != 1:
            raise ValueError("the tree guesser unmasks one position a step (per_step=1)")
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if speculate in ("draft", "both") and drafter is None:
            raise ValueError(f"speculate={speculate!r} needs a drafter")
        if width < 1 or depth < 1:
            raise ValueError(f"width and depth must be >= 1, got {width}, {depth}")
        eng, B = self.eng, self.B
        st = DiffusionStats()
        t0 = time.perf_counter()
        tokens = list(prompt_ids)
        eng.reset(self.slot)
        if len(tokens) > 1:
            eng.prefill(self.slot, tokens[:-1])
        append = [tokens[-1]]
        out: list[int] = []
        stops = set(stop_ids)
        carried = None
        try:
            while len(out) < max_new_tokens:
                # room for the plain path (the block's rows, then the next block's first forward);
                # guessed states are cut to what fits (``_fit``)
                if eng.length(self.slot) + len(append) + 2 * B >= eng.max_seq_len:
                    break
                if trace is not None:
                    trace.append([])
                block, carried = self._block(tokens, append, st, speculate, depth, drafter, width, budget, carried,
                                             trace[-1] if trace is not None else None)
                st.blocks += 1
                # committed in the next block's first forward (its last: the pending token), or already
                append = [] if carried is not None else list(block)
                tokens += block
                cut = next((i for i, t in enumerate(block) if t in stops), None)
                out += block if cut is None else block[:cut]
                if cut is not None:
                    break
        finally:
            eng.reset(self.slot)
        out = out[:max_new_tokens]
        st.new_tokens = len(out)
        st.seconds = time.perf_counter() - t0
        return out, st

    def refine(self, prompt_ids: Sequence[int], max_new_tokens: int,
               stop_ids: Sequence[int] = ()) -> tuple[list[int], DiffusionStats]:
        """Draft-and-refine (module docstring): the target's greedy output; ``blocks`` in
        the stats counts B-token blocks of output, ``steps`` the committed prefixes."""
        eng, B = self.eng, self.B
        st = DiffusionStats()
        t0 = time.perf_counter()
        eng.reset(self.slot)
        tokens = list(prompt_ids)
        if len(tokens) > 1:
            eng.prefill(self.slot, tokens[:-1])
        out: list[int] = []
        draft: list[int] = []
        stops = set(stop_ids)
        try:
            while len(out) < max_new_tokens and eng.length(self.slot) + B + 1 < eng.max_seq_len:
                n_mask = B - 1 - len(draft)
                toks = [tokens[-1]] + draft + [eng.mask_id] * n_mask
                res = eng.score(self.slot, toks, list(range(-1, len(toks) - 1)), rows=list(range(B)))
                st.forwards += 1
                st.rows += len(toks)
                pred = [int(x) for x in res.logits.argmax(-1)]  # pred[j]: the row before offset j
                c = 0
                while c < len(draft) and draft[c] == pred[c]:
                    c += 1
                eng.commit(self.slot, range(1 + c))  # the pending token and the draft's verified prefix
                new = draft[:c] + [pred[c]]
                st.steps += 1
                st.steps_per_forward.append(len(new))
                tokens += new
                cut = next((i for i, t in enumerate(new) if t in stops), None)
                out += new if cut is None else new[:cut]
                if cut is not None:
                    break
                draft = pred[c + 1:]  # the refined tail: the next forward's draft
        finally:
            eng.reset(self.slot)
        out = out[:max_new_tokens]
        st.new_tokens = len(out)
        st.blocks = -(-len(out) // B)
        st.seconds = time.perf_counter() - t0
        return out, st

    def _block(self, tokens, append, st, speculate, depth, drafter, width=1, budget=16,
               carried=None, trace=None) -> tuple[list[int], Optional[dict]]:
        """One block: (its tokens, the next block's first outputs where a verified guess
        completed it and the lookahead scored them; then its tokens are committed)."""
        B, k = self.B, self.k
        fills: list[Optional[int]] = [None] * B
        probs = carried if carried is not None else self._forward(append, [fills], st)[0]
        append = []
        guess_tokens = drafter(list(tokens), B) if speculate in ("draft", "both") else None
        while True:
            step = decide(probs, k)  # exact: from the outputs of the exact state
            if trace is not None:
                trace.append((probs, step))
            for o, t in step:
                fills[o] = t
            st.steps += 1
            if all(f is not None for f in fills):
                st.steps_per_forward.append(1)
                return [int(f) for f in fills], None
            if speculate is None:
                probs = self._forward(append, [list(fills)], st)[0]
                st.steps_per_forward.append(1)
                continue
            # guessed states after this one, from the same (last exact) outputs
            if speculate == "tree":
                branches = self._tree(probs, fills, step, depth, budget)
            else:
                branches = self._guesses(probs, fills, step, speculate, depth, guess_tokens, width)
            branches = self._fit(append, fills, branches)
            states = [list(fills)] + [s for br in branches for s in br]
            complete = [i for i, s in enumerate(states) if i and all(f is not None for f in s)] \
                if self.lookahead else []
            outs = self._forward(append, states, st, lookahead=complete)
            probs, n_ok = outs[0], 1
            best = (0, None, None, None)  # (steps, state, outputs, index) of the branch whose guesses hold longest
            for br_i, br in enumerate(branches):  # every branch that holds is the rule's own trajectory
                o = 1 + sum(len(b) for b in branches[:br_i])
                cur, p, ok = list(fills), outs[0], 0
                for j, s in enumerate(br):
                    nxt = decide(p, k)
                    want = tuple((q, t) for q, t in enumerate(s) if t is not None and cur[q] is None)
                    if nxt != want:
                        break
                    cur, p, ok, at = s, outs[o + j], ok + 1, o + j
                    if all(f is not None for f in cur):
                        break
                if ok > best[0]:
                    best = (ok, cur, p, at)
            if best[0]:
                ok, cur, p, at = best
                fills[:] = cur
                probs = p
                n_ok += ok
                st.steps += ok
                st.guessed_steps += ok
            st.steps_per_forward.append(n_ok)
            if all(f is not None for f in fills):
                if best[0] and best[3] in self._ahead:  # the next block's first forward is done
                    path, nxt = self._ahead[best[3]]
                    self.eng.commit(self.slot, path)
                    self._p0 = nxt[0]
                    st.lookahead_blocks += 1
                    return [int(f) for f in fills], nxt
                return [int(f) for f in fills], None

    def _guesses(self, probs, fills, step, speculate, depth, guess_tokens,
                 width: int = 1) -> list[list[list[Optional[int]]]]:
        """Branches of guessed states after ``fills`` (``step`` just applied): each a list
        of up to ``depth`` successive states; ``width`` > 1 adds a branch for each of the
        ``width - 1`` runners-up of the self ranking as the next step."""
        done = {o for o, _ in step}
        order = [(o, t) for o, t in ranked(probs) if o not in done]  # the last exact outputs' ranking
        k = self.k
        seqs = []
        for kind in (("self", "draft") if speculate == "both" else (speculate,)):
            seq = order if kind == "self" else [(o, int(guess_tokens[o])) for o, _ in order if o < len(guess_tokens)]
            seqs.append(seq)
            for a in range(1, width if kind == "self" else 1):  # the next step's runners-up, each a branch
                if k - 1 + a < len(seq):
                    alt = seq[k - 1 + a]
                    seqs.append(seq[: k - 1] + [alt] + [x for x in seq[k - 1:] if x != alt])
        out = []
        for seq in seqs:
            cur, br = list(fills), []
            for j in range(depth):
                chunk = seq[j * self.k:(j + 1) * self.k]
                if not chunk:
                    break
                cur = list(cur)
                for o, t in chunk:
                    cur[o] = t
                br.append(cur)
            if br and br not in out:
                out.append(br)
        return out

    def _fit(self, append, fills, branches):
        """``branches`` cut (from the last) to what the slot's room holds: the forward's
        rows are the appended chain and the states' trie (with the lookahead's rows)."""
        room = self.eng.max_seq_len - self.eng.length(self.slot) - len(append)
        trie = _Trie(self.eng, len(append))  # it only grows: the longest prefix of branches that fits
        trie.add(fills)
        for i, br in enumerate(branches):
            for s in br:
                if self.lookahead and all(f is not None for f in s):
                    trie.extend(s)
                else:
                    trie.add(s)
            if len(trie.tokens) > room:
                return branches[:i]
        return branches if len(trie.tokens) <= room else []

    def _tree(self, probs, fills, step, depth, budget) -> list[list[list[Optional[int]]]]:
        """Branches (root-to-leaf chains) of a best-first tree of ``budget`` guessed states
        after ``fills`` (``step`` just applied to them; ``probs``: the exact outputs of the
        state before it), at most ``depth`` steps deep. A node's score is its parent's
        times the prior chance of its fill (module docstring, ``TreePrior``): the most
        confident open offset left of every fill since the exact outputs, with its
        argmax (exact), or one of the top tokens of an open offset right of them
        (stale)."""
        import heapq

        pr = self.prior
        done = {o for o, _ in step}
        conf = {o: float(p.max()) for o, p in probs.items()}
        ntok = len(pr.token_rank)
        top = {o: torch.topk(p, min(ntok, p.numel())).indices.tolist() for o, p in probs.items()}

        def fills_after(node):  # (prior chance, offset, token) of every candidate next fill
            used = done | {o for o, _ in node}
            best, right = _sides(conf, [o for o in probs if o not in used], min(used))
            out, rest = [], 1.0
            if best is not None:
                pe = pr.exact[int(conf[best] - conf[right[0]] >= pr.gap)] if right else 1.0
                out.append((pe, best, int(probs[best].argmax())))  # the rule's own token (its tie-break)
                rest = 1.0 - pe
            for r, o in enumerate(right):
                out += [(rest * pr.offset(r) * pr.token_rank[j], o, t) for j, t in enumerate(top[o])]
            return out

        heap = [(-a, n, (o, t), ()) for n, (a, o, t) in enumerate(fills_after(()))]  # (-score, tie, fill, anc)
        heapq.heapify(heap)
        tie, chosen, children = len(heap), [], {}
        while heap and len(chosen) < budget:
            neg, _, fill, anc = heapq.heappop(heap)
            node = anc + (fill,)
            chosen.append(node)
            children.setdefault(anc, []).append(node)
            if len(node) < depth:
                for a, o, t in fills_after(node):
                    heapq.heappush(heap, (neg * a, tie, (o, t), node))
                    tie += 1
        out = []
        for node in chosen:
            if node in children:
                continue  # not a leaf
            br, cur = [], list(fills)
            for o, t in node:
                cur = list(cur)
                cur[o] = t
                br.append(cur)
            out.append(br)
        return out
