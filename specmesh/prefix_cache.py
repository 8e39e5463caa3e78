"""The verifier's prefix cache index: which token blocks have their KV stored, shared and evicted.

A sequence's KV is cut into blocks of ``block_size`` tokens. A block is identified by
its tokens *and every token before it* (the KV of a position depends on the whole
prefix), so the index is a tree of blocks: the root is the empty prefix, a block's
children are keyed by their tokens, and a path from the root spells a prefix (a radix
tree at block granularity; vLLM's chained block hashes name the same thing). Only full
blocks are indexed.

- ``match(tokens, limit)``: the longest chain of cached blocks that spells a prefix of
  ``tokens`` (at most ``limit`` tokens: a request must still compute the last token of
  its prompt to get its logits); counts the lookup (``queries`` / ``hits``, in tokens,
  as vLLM counts them) and marks the chain used now.
- ``attach(session, chain)`` / ``grow(session, tokens, length)`` / ``truncate`` /
  ``detach``: what each live session holds. A session holds (a reference on) every
  block of its chain: the blocks its KV slot mirrors. ``grow`` adds the full blocks of
  its first ``length`` tokens it does not hold yet: a block another session already
  stored is shared (a reference more, nothing copied), a new one gets a storage id
  (``grow`` returns the (id, position) pairs the caller must copy into storage).
- Eviction: ``n_blocks`` storage ids in all (the byte budget divided by a block's
  bytes). A new block takes a free id, else the least recently used block that no
  session holds and that has no children (a leaf: a prefix's tail goes before its
  head), ties going to the deeper one; when every block is held the new block is not
  stored (``skipped``) and the session's chain stops there.

Tenants: every lookup and insertion names a ``salt`` (vLLM's ``cache_salt``; "" by
default), and each salt has a root of its own: a block stored under one salt is never
matched, shared or reported (``hits``, a request's cached tokens) under another, so a
client cannot learn from cached tokens whether another tenant's text (a prompt, or an
answer stored as it was generated) is in the cache.

Blocks are immutable: a block is written once, when it is inserted, and read by every
session that matches it. What they hold is the caller's business (the engine's KV,
``specmesh.engine.kv_blocks``; hidden features beside it).

Pure Python: knows nothing about tensors, models, sessions' slots or gRPC. Not
thread-safe (the verifier calls it under its lock, on its model thread).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional, Sequence


class Block:
    """One cached block: ``tokens`` after its parent's prefix, its storage ``id``,
    the sessions holding it (``refs``), when it was last used (``stamp``) and its
    depth (blocks from the root)."""

    __slots__ = ("tokens", "parent", "children", "id", "refs", "stamp", "depth")

    def __init__(self, tokens: tuple, parent: Optional["Block"], block_id: int, depth: int):
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple, Block] = {}
        self.id = block_id
        self.refs = 0
        self.stamp = 0
        self.depth = depth


class PrefixCache:
    """The index over ``n_blocks`` storage ids of ``block_size`` tokens (see the module docstring)."""

    def __init__(self, n_blocks: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        self.block_size = int(block_size)
        self.n_blocks = int(n_blocks)
        self.roots: dict[str, Block] = {"": Block((), None, -1, 0)}  # salt -> its tree's root
        self.salts: dict[str, str] = {}  # live session -> the salt its chain grows under
        self._free = list(range(self.n_blocks))[::-1]
        self._heap: list = []  # (stamp, -depth, seq, block): eviction candidates, checked when popped
        self._seq = itertools.count()
        self._clock = itertools.count(1)
        self.sessions: dict[str, list[Block]] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # ... of them found cached
        self.inserted = 0  # blocks stored
        self.evictions = 0  # blocks evicted to make room
        self.skipped = 0  # blocks not stored: every block held

    # ------------------------------------------------------------ sizes
    @property
    def root(self) -> Block:
        """The unsalted tree's root."""
        return self.roots[""]

    def _root(self, salt: str) -> Block:
        r = self.roots.get(salt)
        if r is None:  # a root's ``tokens`` name its salt
            r = self.roots[salt] = Block((salt,) if salt else (), None, -1, 0)
        return r

    def _drop_root(self, key: tuple) -> None:
        """Forget a salt's root once its tree is empty (salts may be one per request)."""
        r = self.roots.get(key[0]) if key else None
        if r is not None and not r.children:
            del self.roots[key[0]]

    @property
    def used(self) -> int:
        """Blocks stored (held or not)."""
        return self.n_blocks - len(self._free)

    @property
    def held(self) -> int:
        """Distinct blocks some session holds."""
        seen: set[int] = set()
        for chain in self.sessions.values():
            seen.update(id(b) for b in chain)
        return len(seen)

    # ------------------------------------------------------------ lookup
    def _walk(self, tokens: Sequence[int], limit: int, salt: str = "") -> list[Block]:
        B, node, chain = self.block_size, self.roots.get(salt), []
        if node is None:
            return chain
        for j in range(max(0, limit) // B):
            child = node.children.get(tuple(tokens[j * B:(j + 1) * B]))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain

    def peek(self, tokens: Sequence[int], limit: Optional[int] = None, salt: str = "") -> int:
        """Tokens a ``match`` would find now (nothing counted or touched)."""
        return len(self._walk(tokens, len(tokens) if limit is None else min(limit, len(tokens)), salt)) * \
            self.block_size

    def match(self, tokens: Sequence[int], limit: Optional[int] = None, salt: str = "") -> list[Block]:
        """The longest chain of cached blocks under ``salt`` spelling a prefix of
        ``tokens[:limit]``, marked used now; counts ``len(tokens)`` queried tokens and the
        chain's as hits."""
        chain = self._walk(tokens, len(tokens) if limit is None else min(limit, len(tokens)), salt)
        self.queries += len(tokens)
        self.hits += len(chain) * self.block_size
        now = next(self._clock)
        for b in chain:
            b.stamp = now
        if chain and not chain[-1].refs and not chain[-1].children:
            self._candidate(chain[-1])  # its old entry is stale now
        return chain

    # ------------------------------------------------------------ sessions
    def attach(self, session: str, chain: Sequence[Block], salt: str = "") -> None:
        """``session`` now holds ``chain`` (a chain from ``salt``'s root, e.g. ``match``'s),
        and nothing it held before; it grows under ``salt``."""
        self.detach(session)
        for b in chain:
            b.refs += 1
        self.sessions[session] = list(chain)
        self.salts[session] = salt

    def holds(self, session: str) -> int:
        """Tokens of the session's chain."""
        return len(self.sessions.get(session, ())) * self.block_size

    def grow(self, session: str, tokens: Sequence[int], length: int) -> list[tuple[int, int]]:
        """The session's first ``length`` tokens (``tokens[:length]``) are committed: it
        holds their full blocks from now on, sharing the cached ones and storing the
        others (until none can be stored). Returns (storage id, first position) of each
        new block, for the caller to copy its content into."""
        B = self.block_size
        chain = self.sessions.setdefault(session, [])
        node = chain[-1] if chain else self._root(self.salts.setdefault(session, ""))
        now = next(self._clock)
        new: list[tuple[int, int]] = []
        for j in range(len(chain), min(length, len(tokens)) // B):
            key = tuple(tokens[j * B:(j + 1) * B])
            child = node.children.get(key)
            if child is None:
                bid = self._allocate()
                if bid is None:
                    self.skipped += 1
                    break
                child = Block(key, node, bid, node.depth + 1)
                node.children[key] = child
                self.inserted += 1
                new.append((bid, j * B))
            child.refs += 1
            child.stamp = now
            chain.append(child)
            node = child
        return new

    def truncate(self, session: str, length: int) -> None:
        """The session keeps only its first ``length`` tokens: it lets go of the blocks past them."""
        chain = self.sessions.get(session)
        if chain is None:
            return
        keep = max(0, length) // self.block_size
        for b in chain[keep:]:
            self._unref(b)
        del chain[keep:]

    def detach(self, session: str) -> None:
        """The session ended (released or evicted from its slot): it holds nothing."""
        salt = self.salts.pop(session, "")
        for b in self.sessions.pop(session, ()):
            self._unref(b)
        if salt:
            self._drop_root((salt,))

    def fork(self, source: str, session: str, length: int) -> None:
        """``session`` starts as a copy of ``source``'s first ``length`` tokens (its salt too)."""
        chain = self.sessions.get(source, [])[: max(0, length) // self.block_size]
        self.attach(session, chain, self.salts.get(source, ""))

    # ------------------------------------------------------------ eviction
    def _unref(self, b: Block) -> None:
        b.refs -= 1
        if b.refs == 0 and not b.children:
            self._candidate(b)

    def _candidate(self, b: Block) -> None:
        heapq.heappush(self._heap, (b.stamp, -b.depth, next(self._seq), b))

    def _allocate(self) -> Optional[int]:
        if self._free:
            return self._free.pop()
        while self._heap:
            stamp, _, _, b = heapq.heappop(self._heap)
            if b.parent is None or b.refs or b.children or b.stamp != stamp:
                continue  # evicted already, held again, no longer a leaf, or used since
            parent = b.parent
            del parent.children[b.tokens]
            b.parent = None
            self.evictions += 1
            if parent.parent is not None and parent.refs == 0 and not parent.children:
                self._candidate(parent)
            elif parent.parent is None:
                self._drop_root(parent.tokens)
            return b.id
        return None

    def clear(self) -> None:
        """Forget every block (storage ids all free again); live sessions hold nothing. The
        counters go on (they are totals)."""
        self.roots = {"": Block((), None, -1, 0)}
        self._free = list(range(self.n_blocks))[::-1]
        self._heap = []
        self.sessions = {}
        self.salts = {}

    def stats(self) -> dict:
        return {"blocks_total": self.n_blocks, "blocks_used": self.used, "blocks_held": self.held,
                "block_size": self.block_size, "queries": self.queries, "hits": self.hits,
                "inserted": self.inserted, "evictions": self.evictions, "skipped": self.skipped}


def walk_all(cache: PrefixCache, fn: Callable[[Block], None]) -> None:
    """Call ``fn`` on every stored block, under every salt (tests and debugging)."""
    stack = [b for r in cache.roots.values() for b in r.children.values()]
    while stack:
        b = stack.pop()
        fn(b)
        stack.extend(b.children.values())
