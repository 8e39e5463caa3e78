"""The cache drafter: drafts from texts stored per conversation (or per request)
ahead of time — anticipated replies of the proactive strategy, SSR's early
answers — and from the session's own context.

Each cache is a ``SuffixDrafter`` whose "global" structure holds only that
cache's texts (``seed``) and whose per-request index is the session's context, so
the longer suffix match wins between "what was anticipated" and "what this
request already said" (suffix.py's rule), and a match with several cached
continuations becomes a branched tree. A proposal reads the cache named by
``DraftContext.cache_id``; ``TokenTree.source`` is "cache" when the draft came
from the cached texts and "context" when from the session itself.

Bounded: at most ``max_caches`` caches (least recently used dropped), each at
most ``max_tokens`` tokens (oldest texts evicted first) and alive ``ttl_s``
seconds after its last seed. This module knows nothing about how the texts were
produced, the target model or gRPC.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..types import DraftContext, InvalidArgument, TokenTree
from .base import DrafterBase
from .suffix import SuffixDrafter

SUFFIX_OPTIONS = dict(max_depth=24, min_match=2, tree=True, max_children=4, min_prob=0.1, max_spec_factor=None)


@dataclass
class _Cache:
    drafter: SuffixDrafter
    expires: float
    texts: int = 0
    tokens: int = 0


class CacheDrafter(DrafterBase):
    """Per-cache suffix drafting over seeded texts plus the session's context."""

    name = "cache"

    def __init__(self, max_caches: int = 256, max_tokens: int = 32768, ttl_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic, name: str = "cache", **suffix_options):
        if max_caches < 1 or max_tokens < 2 or ttl_s <= 0:
            raise InvalidArgument("max_caches", "max_caches >= 1, max_tokens >= 2 and ttl_s > 0 are required")
        self.name = name
        self.max_caches, self.max_tokens, self.ttl_s, self.clock = max_caches, max_tokens, ttl_s, clock
        self.options = dict(SUFFIX_OPTIONS, **suffix_options)
        self._caches: "OrderedDict[str, _Cache]" = OrderedDict()
        self._bound: dict[str, str] = {}  # session id -> cache id whose drafter holds its state
        self._lock = threading.Lock()

    # -- cache management ----------------------------------------------------
    def seed(self, cache_id: str, texts: Sequence[Sequence[int]], ttl_s: Optional[float] = None,
             replace: bool = False) -> tuple[int, int]:
        """Add token texts to a cache (``replace``: drop what it held first);
        returns (texts, tokens) now held. An empty ``texts`` with ``replace`` clears it."""
        if not cache_id:
            raise InvalidArgument("cache_id", "must be non-empty")
        ttl = self.ttl_s if ttl_s is None or ttl_s <= 0 else min(float(ttl_s), self.ttl_s)
        with self._lock:
            self._expire()
            c = self._caches.get(cache_id)
            if c is None or replace:
                c = _Cache(SuffixDrafter(max_global_tokens=self.max_tokens, **self.options), 0.0)
                self._caches[cache_id] = c
            self._caches.move_to_end(cache_id)
            c.expires = self.clock() + ttl
            for t in texts:
                t = [int(x) for x in t]
                if t:
                    c.drafter.add_output(t)
                    c.texts += 1
            c.texts = min(c.texts, c.drafter.global_outputs)
            c.tokens = c.drafter.global_tokens - c.drafter.global_outputs  # without the separators
            while len(self._caches) > self.max_caches:
                self._caches.popitem(last=False)
            return c.texts, c.tokens

    def drop(self, cache_id: str) -> bool:
        with self._lock:
            return self._caches.pop(cache_id, None) is not None

    def info(self, cache_id: str) -> Optional[dict]:
        with self._lock:
            self._expire()
            c = self._caches.get(cache_id)
            if c is None:
                return None
            return {"texts": c.texts, "tokens": c.tokens, "ttl_s": max(0.0, c.expires - self.clock())}

    def __len__(self) -> int:
        return len(self._caches)

    def _expire(self) -> None:
        now = self.clock()
        for cid in [k for k, c in self._caches.items() if c.expires <= now]:
            del self._caches[cid]

    # -- proposer contract ---------------------------------------------------
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        if budget <= 0 or not ctx.tokens:
            return TokenTree()
        with self._lock:
            self._expire()
            c = self._caches.get(ctx.cache_id) if ctx.cache_id else None
            if c is None:  # no (live) cache: draft from the context alone
                c = self._caches.get("") or _Cache(SuffixDrafter(max_global_outputs=1, **self.options), float("inf"))
                self._caches.setdefault("", c)
            old = self._bound.get(ctx.session_id)
            self._bound[ctx.session_id] = ctx.cache_id if ctx.cache_id in self._caches else ""
            if old is not None and old != self._bound[ctx.session_id] and old in self._caches:
                self._caches[old].drafter.release(ctx.session_id)
        tree = c.drafter.propose(ctx, budget)
        tree.source = {"global": "cache", "request": "context"}.get(tree.source, tree.source) if len(tree) else ""
        return tree

    def release(self, session_id: str) -> None:
        with self._lock:
            cid = self._bound.pop(session_id, None)
            c = self._caches.get(cid) if cid is not None else None
        if c is not None:
            c.drafter.release(session_id)
