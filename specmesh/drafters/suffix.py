"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024) as a one-hot tree drafter.

Two suffix structures answer "where did the end of this context occur before, and
what followed?": a per-request one over the session's context (prompt + output so
far) and a global one over past outputs (``finish`` adds ``tokens[prompt_len:]``;
at most ``max_global_outputs`` outputs / ``max_global_tokens`` tokens, FIFO
eviction). Both are ``NgramIndex`` hash chains over a token stream (global outputs
are joined with a separator so no match crosses two outputs); the match length of
a candidate is measured backwards from it, up to ``max_depth`` tokens.

Proposal: take the longest match m >= ``min_match`` (per-request vs global: the
longer wins, a tie goes to the higher score); every occurrence with that match
length gives a continuation. The draft tree is grown best-first over those
continuations, a node's score being the empirical probability of its path
(product of child-count / parent-count), at most ``budget`` nodes (and at most
``floor(m * max_spec_factor + max_spec_offset)`` when a factor is set, as in
vLLM/Arctic), depth <= ``max_depth``, nodes with score < ``min_prob`` dropped.
``tree=False`` follows only the most frequent child (ties: the most recent
occurrence) and returns a chain. Per-request continuations that run into the end
of the context keep copying themselves (periodic repetition).

This module knows nothing about models, target probabilities, tokenizers or gRPC:
its drafts are deterministic (q left empty = one-hot) and only as good as the
repetition in the text it has stored.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from typing import Optional, Sequence

from ..types import DraftContext, InvalidArgument, TokenTree
from .base import DrafterBase
from .prompt_lookup import NgramIndex, SessionStates

_SEP = -1  # separator between global outputs; never equals a token id
_LEVELS = (1, 2, 4, 8)


def _longest_match(idx: NgramIndex, query: list[int], max_len: int, max_cands: int) -> tuple[int, list[int]]:
    """Longest m <= max_len such that query's last m tokens occur in ``idx``'s
    stream before an indexed position; returns (m, positions after those
    occurrences, most recent first, at most ``max_cands`` scanned)."""
    L = len(query)
    toks, base, start = idx.tokens, idx.base, idx.start
    for level in range(len(idx.levels) - 1, -1, -1):
        k = idx.levels[level]
        if k > L or k > max_len:
            continue
        best, occ, n = 0, [], 0
        for p in idx.occurrences(level, query, L):
            lim = min(max_len, L, p - start)
            m, i, q = 0, p - base - 1, L - 1
            while m < lim and toks[i - m] == query[q - m]:
                m += 1
            if m > best:
                best, occ = m, [p]
            elif m == best and m:
                occ.append(p)
            n += 1
            if n >= max_cands:
                break
        if best >= k:  # a real match at this level (shorter ones live lower down)
            return best, occ
    return 0, []


def _grow(idx: NgramIndex, occ: list[int], budget: int, max_depth: int, min_prob: float,
          width: int, self_end: Optional[int]) -> tuple[list[int], list[int], float]:
    """Best-first draft tree over the continuations at positions ``occ``.

    Rule: child score = parent score * count(child token) / count(positions with
    a next token); pop the best unemitted node, emit it, push its ``width`` most
    frequent children (width 1 = a chain).
    ``self_end`` (the per-request stream length) lets a continuation that reaches
    the end of the stream read on from the drafted path itself.
    Returns (tokens, parents, total score = expected accepted nodes under the
    empirical distribution).
    """
    toks, base = idx.tokens, idx.base
    n_local = len(toks)
    out_t: list[int] = []
    out_p: list[int] = []
    heap: list = []
    seq = 0
    score = 0.0

    def path_of(node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(out_t[node])
            node = out_p[node]
        path.reverse()
        return path

    def expand(node: int, prob: float, positions: list[int], d: int) -> None:
        nonlocal seq
        groups: dict[int, list[int]] = {}
        path = None
        for j in positions:
            i = j + d - base
            if i < n_local:
                t = toks[i]
                if t == _SEP:
                    continue
            elif self_end is not None:
                if path is None:
                    path = path_of(node)
                t = path[j + d - self_end]
            else:
                continue
            g = groups.get(t)
            if g is None:
                groups[t] = [j]
            else:
                g.append(j)
        if not groups:
            return
        total = sum(len(g) for g in groups.values())
        # most frequent first; equal counts keep first-seen order = most recent occurrence
        children = sorted(groups.items(), key=lambda kv: -len(kv[1]))
        for t, g in children[:width]:
            p = prob * len(g) / total
            if p < min_prob:
                break
            heapq.heappush(heap, (-p, seq, node, t, g, d + 1))
            seq += 1

    expand(-1, 1.0, occ, 0)
    while heap and len(out_t) < budget:
        negp, _, parent, t, g, d = heapq.heappop(heap)
        node = len(out_t)
        out_t.append(t)
        out_p.append(parent)
        score -= negp
        if d < max_depth and len(out_t) < budget:
            expand(node, -negp, g, d)
    return out_t, out_p, score


class SuffixDrafter(DrafterBase):
    """Per-request + global suffix matching; best-first draft trees."""

    def __init__(self, max_depth: int = 24, min_match: int = 1, tree: bool = True,
                 max_children: int = 8, min_prob: float = 0.1,
                 max_spec_factor: Optional[float] = 1.0, max_spec_offset: float = 0.0,
                 max_candidates: int = 64, max_global_outputs: int = 1024,
                 max_global_tokens: int = 1 << 18, max_sessions: int = 4096, name: str = "suffix"):
        if not isinstance(max_depth, int) or max_depth < 1:
            raise InvalidArgument("max_depth", f"must be an integer >= 1, got {max_depth!r}")
        if not isinstance(min_match, int) or not (1 <= min_match <= max_depth):
            raise InvalidArgument("min_match", f"must be in [1, max_depth], got {min_match!r}")
        if not isinstance(max_children, int) or max_children < 1:
            raise InvalidArgument("max_children", f"must be an integer >= 1, got {max_children!r}")
        if not (0.0 <= min_prob <= 1.0):
            raise InvalidArgument("min_prob", f"must be in [0, 1], got {min_prob!r}")
        if max_global_outputs < 1 or max_global_tokens < 2:
            raise InvalidArgument("max_global_tokens", "global limits must allow at least one output")
        self.name = name
        self.max_depth = max_depth
        self.min_match = min_match
        self.tree = tree
        self.max_children = max_children
        self.min_prob = min_prob
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.max_candidates = max(max_candidates, max_children)
        self.max_global_outputs = max_global_outputs
        self.max_global_tokens = max_global_tokens
        levels = tuple(k for k in _LEVELS if k <= max_depth)
        self._levels = levels
        self._sessions: SessionStates[NgramIndex] = SessionStates(lambda: NgramIndex(levels), max_sessions)
        self._global = NgramIndex(levels)
        self._global_docs: deque[int] = deque()  # start position of each stored output (its SEP)
        self._global_lock = threading.Lock()

    # -- proposer contract -------------------------------------------------
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        if budget <= 0 or not ctx.tokens:
            return TokenTree()
        idx = self._sessions.get(ctx.session_id)
        tokens = ctx.tokens if isinstance(ctx.tokens, list) else list(ctx.tokens)
        idx.sync(tokens)
        query = idx.tokens
        m_r, occ_r = _longest_match(idx, query, self.max_depth, self.max_candidates)
        m_r = m_r if m_r >= self.min_match else 0
        best_g = None
        with self._global_lock:
            m_g, occ_g = _longest_match(self._global, query, self.max_depth, self.max_candidates)
            m_g = m_g if m_g >= self.min_match else 0
            if m_g and m_g >= m_r:  # the longer match wins; a tie is settled by score
                best_g = self._draft(self._global, occ_g, m_g, budget, None)
        best_r = self._draft(idx, occ_r, m_r, budget, len(query)) if m_r and m_r >= m_g else None
        best = best_r if best_g is None or (best_r is not None and best_r[2] >= best_g[2]) else best_g
        if best is None:
            return TokenTree()
        return TokenTree(best[0], best[1], source="global" if best is best_g else "request")

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id)

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        self.add_output(list(tokens)[max(0, int(prompt_len)):])
        self.release(session_id)

    # -- global structure --------------------------------------------------
    def add_output(self, output: Sequence[int]) -> None:
        """Insert one past output into the global structure (FIFO-bounded)."""
        output = [int(t) for t in output]
        if not output:
            return
        if len(output) + 1 > self.max_global_tokens:
            output = output[-(self.max_global_tokens - 1):]
        with self._global_lock:
            g = self._global
            self._global_docs.append(len(g))
            g.extend([_SEP] + output)
            while len(self._global_docs) > self.max_global_outputs or len(g) - g.start > self.max_global_tokens:
                self._global_docs.popleft()
                g.evict_front(self._global_docs[0] if self._global_docs else len(g))

    @property
    def global_outputs(self) -> int:
        return len(self._global_docs)

    @property
    def global_tokens(self) -> int:
        return len(self._global) - self._global.start

    # -- helpers -----------------------------------------------------------
    def _draft(self, idx: NgramIndex, occ: list[int], m: int, budget: int,
               self_end: Optional[int]) -> tuple[list[int], list[int], float]:
        if self.max_spec_factor is not None:
            budget = min(budget, max(1, math.floor(m * self.max_spec_factor + self.max_spec_offset + 1e-6)))
        width = self.max_children if self.tree else 1
        return _grow(idx, occ, budget, self.max_depth, self.min_prob, width, self_end)

