"""Routing by cached prefix: which verifier replica likely holds a request's prompt.

Each replica's prefix cache (``specmesh.prefix_reuse``) keeps the KV of what it computed
in blocks of ``block_size`` tokens; a request prefills only what its replica lacks. The
router cannot see those caches, so it keeps its own approximate index of them (as
SGLang's cache-aware router does): per replica, the chained hashes of the token blocks
it sent there (a block's hash covers its tokens and every token before it, as the
verifier's index does), least recently used first out past ``max_blocks``.

``choose(candidates, tokens, conversation)`` for a new session, from the candidates'
(address, load) pairs (load: the generations pinned there now):

1. a conversation stays on its replica while that one is a candidate and not busy;
2. else, of the candidates that are not busy, the one with the longest indexed prefix
   of the prompt (ties: the less loaded), when it matches at least one block;
3. else None: the caller balances by load.

Busy: at least ``slack`` more generations than the least loaded candidate and more than
``ratio`` times as many (both, as SGLang's absolute and relative balance thresholds), so
a hot prefix spreads over the replicas once its first one fills up. ``record(address,
tokens)``: the replica computed (or will) these tokens (the prompt when a session is
pinned, prompt and output when it ends); ``forget(address)`` when it leaves.

Pure Python, no gRPC: knows nothing about replicas but their addresses and loads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

BLOCK = 16  # tokens a block, as the verifiers' (settings prefix_block)
MAX_BLOCKS = 32768  # blocks remembered per replica (~512k tokens; more than a default cache holds)
MAX_CONVERSATIONS = 65536
SLACK, RATIO = 2, 1.5  # busy: >= SLACK more generations than the least loaded, and > RATIO times as many


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK) -> list[int]:
    """The chained hash of each full block of ``tokens`` (a block's covers its prefix)."""
    out, h = [], 0
    for j in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[j * block_size:(j + 1) * block_size])))
        out.append(h)
    return out


class PrefixAffinity:
    def __init__(self, block_size: int = BLOCK, max_blocks: int = MAX_BLOCKS, slack: int = SLACK,
                 ratio: float = RATIO):
        self.block_size, self.max_blocks, self.slack, self.ratio = block_size, max_blocks, slack, ratio
        self._blocks: dict[str, "OrderedDict[int, None]"] = {}
        self._conversations: "OrderedDict[str, str]" = OrderedDict()
        self._lock = threading.Lock()
        self.routed = {"conversation": 0, "prefix": 0, "load": 0}

    def record(self, address: str, tokens: Sequence[int], conversation: str = "") -> None:
        """``address`` holds (or is about to compute) ``tokens``; the conversation lives there."""
        hs = block_hashes(tokens, self.block_size)
        with self._lock:
            idx = self._blocks.setdefault(address, OrderedDict())
            for h in hs:
                idx[h] = None
                idx.move_to_end(h)
            while len(idx) > self.max_blocks:
                idx.popitem(last=False)
            if conversation:
                self._conversations[conversation] = address
                self._conversations.move_to_end(conversation)
                while len(self._conversations) > MAX_CONVERSATIONS:
                    self._conversations.popitem(last=False)

    def forget(self, address: str) -> None:
        with self._lock:
            self._blocks.pop(address, None)
            for c in [c for c, a in self._conversations.items() if a == address]:
                del self._conversations[c]

    def matched(self, address: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` indexed for ``address``."""
        idx = self._blocks.get(address)
        if not idx:
            return 0
        n = 0
        for h in hashes:
            if h not in idx:
                break
            n += 1
        return n

    def busy(self, load: int, least: int) -> bool:
        return load - least >= self.slack and load > self.ratio * least

    def choose(self, candidates: Sequence[tuple[str, int]], tokens: Sequence[int] = (),
               conversation: str = "") -> Optional[tuple[str, str]]:
        """(address, why: "conversation" | "prefix") of the replica for a new session, or None
        (balance by load); see the module docstring."""
        if not candidates:
            return None
        least = min(load for _, load in candidates)
        with self._lock:
            home = self._conversations.get(conversation) if conversation else None
            for address, load in candidates:
                if address == home and not self.busy(load, least):
                    self.routed["conversation"] += 1
                    return address, "conversation"
            hs = block_hashes(tokens, self.block_size)
            free = [c for c in candidates if not self.busy(c[1], least)]
            if hs and free:
                best, _ = max(free, key=lambda c: (self.matched(c[0], hs), -c[1]))
                if self.matched(best, hs) > 0:
                    self.routed["prefix"] += 1
                    return best, "prefix"
            self.routed["load"] += 1
        return None
