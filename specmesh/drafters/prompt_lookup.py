"""Prompt lookup decoding (n-gram drafting) and the n-gram index it runs on.

``PromptLookupDrafter`` finds the most recent earlier occurrence of the longest
suffix n-gram of the session's context (prompt + generated, n from ``max_ngram``
down to ``min_ngram``) and proposes, as a one-hot chain, the tokens that followed
it (like HF ``prompt_lookup_num_tokens`` / vLLM's ngram proposer, but taking the
most recent occurrence). When the match is so recent that its continuation runs
into the end of the context, the continuation keeps copying itself (a period-p
repetition drafts the full budget, not just p tokens); ``extend_periodic=False``
turns that off.

``NgramIndex`` is an incremental LZ77-style hash-chain index over one token
stream: for each level k, ``heads[k][key(last k tokens)]`` is the most recent
position whose preceding k tokens have that key and ``prev`` chains back to older
ones. Appending a token costs O(levels); truncating (rollback) undoes appends
exactly; evicting a prefix (the suffix drafter's global stream) just moves
``start``. Keys for k >= 2 are Python tuple hashes: a collision can only make a
worse draft, never a wrong output (the target verifies), and lookups here check
the real tokens anyway.

This module knows nothing about models, probabilities, tokenizers or gRPC; it
only sees token ids.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Callable, Generic, Sequence, TypeVar

from ..seqs import common_prefix_len
from ..types import DraftContext, InvalidArgument, TokenTree
from .base import DrafterBase

_NOT_INDEXED = -2  # prev entry of a position with fewer than k tokens before it


def _key(seq: Sequence[int], end: int, k: int) -> int:
    """Hash key of seq[end-k:end] (the token itself for k == 1)."""
    return seq[end - 1] if k == 1 else hash(tuple(seq[end - k:end]))


class NgramIndex:
    """Hash-chain index of the k-grams (k in ``levels``) of one growing stream.

    Position j ("entry j") stands for the k tokens before j; its continuation
    starts at token j, so only j <= len - 1 is indexed (the trailing suffix of the
    stream is the query, never its own match). Positions are absolute: the stream
    list holds positions ``base ..``, and positions below ``start`` are evicted.
    """

    __slots__ = ("levels", "tokens", "heads", "prevs", "base", "start")

    def __init__(self, levels: Sequence[int]):
        self.levels = tuple(sorted(set(int(k) for k in levels)))
        if not self.levels or self.levels[0] < 1:
            raise ValueError(f"n-gram levels must be >= 1, got {levels!r}")
        self.tokens: list[int] = []  # stream[pos - base]
        self.heads: list[dict[int, int]] = [{} for _ in self.levels]
        self.prevs: list[array] = [array("q") for _ in self.levels]  # prev[pos - base]
        self.base = 0
        self.start = 0

    def __len__(self) -> int:  # absolute end position
        return self.base + len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        toks, base, start = self.tokens, self.base, self.start
        lv = list(zip(self.levels, self.heads, self.prevs))
        for t in new:
            i = len(toks)  # local index of entry j = base + i (continuation = t)
            j = base + i
            toks.append(t)
            for k, head, prev in lv:
                if j - k < start:
                    prev.append(_NOT_INDEXED)
                    continue
                key = toks[i - 1] if k == 1 else hash(tuple(toks[i - k:i]))
                prev.append(head.get(key, -1))
                head[key] = j

    def truncate(self, n: int) -> None:
        """Undo appends back to absolute length ``n`` (rollback)."""
        toks, base = self.tokens, self.base
        if n < self.start:
            raise ValueError("cannot truncate into the evicted prefix")
        lv = list(zip(self.levels, self.heads, self.prevs))
        while base + len(toks) > n:
            i = len(toks) - 1
            for k, head, prev in lv:
                p = prev.pop()
                if p == _NOT_INDEXED:
                    continue
                key = toks[i - 1] if k == 1 else hash(tuple(toks[i - k:i]))
                if p < 0:
                    head.pop(key, None)
                else:
                    head[key] = p
            toks.pop()

    def evict_front(self, new_start: int) -> None:
        """Forget positions below ``new_start`` (FIFO eviction); chains stop there."""
        new_start = min(new_start, len(self))
        toks, base = self.tokens, self.base
        for j in range(self.start, new_start):
            i = j - base
            for k, head in zip(self.levels, self.heads):
                if i - k < 0:
                    continue
                key = toks[i - 1] if k == 1 else hash(tuple(toks[i - k:i]))
                if head.get(key) == j:
                    del head[key]
        self.start = new_start
        dead = new_start - base
        if dead > 4096 and dead * 4 > len(toks):  # compact now and then, not every eviction
            del toks[:dead]
            for prev in self.prevs:
                del prev[:dead]
            self.base = new_start

    def occurrences(self, level: int, query: Sequence[int], end: int):
        """Yield positions j (most recent first) whose key at ``level`` (index into
        ``levels``) equals the key of query[end-k:end]; callers verify tokens."""
        k = self.levels[level]
        p = self.heads[level].get(_key(query, end, k))
        prev, base, start = self.prevs[level], self.base, self.start
        while p is not None and p >= start:
            yield p
            p = prev[p - base]

    def sync(self, tokens: list[int]) -> None:
        """Make the stream equal ``tokens`` (a per-request context): keep the common
        prefix, undo the rest, index what is new."""
        toks = self.tokens
        n = len(toks)
        if len(tokens) >= n and tokens[:n] == toks:
            keep = n
        else:
            keep = common_prefix_len(toks, tokens)
            if (n - keep) > keep:  # mostly new: a rebuild is cheaper than undoing
                self.__init__(self.levels)
                keep = 0
            else:
                self.truncate(keep)
        if len(tokens) > keep:
            self.extend(tokens[keep:])


S = TypeVar("S")


class SessionStates(Generic[S]):
    """Per-session state, LRU-bounded so forgotten sessions cannot grow memory."""

    def __init__(self, factory: Callable[[], S], max_sessions: int = 4096):
        self._factory = factory
        self._max = max_sessions
        self._states: "OrderedDict[str, S]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: str) -> S:
        with self._lock:
            st = self._states.get(session_id)
            if st is None:
                st = self._states[session_id] = self._factory()
                while len(self._states) > self._max:
                    self._states.popitem(last=False)
            else:
                self._states.move_to_end(session_id)
            return st

    def pop(self, session_id: str) -> None:
        with self._lock:
            self._states.pop(session_id, None)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._states

    def __len__(self) -> int:
        return len(self._states)


def periodic_continuation(toks: list[int], j: int, budget: int) -> list[int]:
    """toks[j:j+budget]; past the end of toks the copy continues from itself
    (s[L+i] = s[j+i]), which turns a period-(L-j) loop into a full draft."""
    L = len(toks)
    out = toks[j:j + budget]
    while len(out) < budget:
        out.append(out[len(out) - (L - j)])
    return out


class PromptLookupDrafter(DrafterBase):
    """n-gram prompt lookup: most recent match of the longest suffix n-gram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt_lookup",
                 extend_periodic: bool = True, max_sessions: int = 4096):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise InvalidArgument("ngram", f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.extend_periodic = extend_periodic
        levels = range(min_ngram, max_ngram + 1)
        self._sessions: SessionStates[NgramIndex] = SessionStates(lambda: NgramIndex(levels), max_sessions)

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        if budget <= 0 or not ctx.tokens:
            return TokenTree()
        idx = self._sessions.get(ctx.session_id)
        tokens = ctx.tokens if isinstance(ctx.tokens, list) else list(ctx.tokens)
        idx.sync(tokens)
        toks = idx.tokens
        L = len(toks)
        for level in range(len(idx.levels) - 1, -1, -1):  # longest n first
            k = idx.levels[level]
            if k >= L:
                continue
            suffix = toks[L - k:]
            for j in idx.occurrences(level, toks, L):  # most recent first
                if toks[j - k:j] == suffix:
                    if self.extend_periodic:
                        return TokenTree.chain(periodic_continuation(toks, j, budget))
                    return TokenTree.chain(toks[j:j + budget])
        return TokenTree()

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id)
