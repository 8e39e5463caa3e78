"""The verifier's prefix cache at work: its sessions' KV slots against the cached blocks.

``PrefixReuse`` joins the index (``specmesh.prefix_cache.PrefixCache``) and the block
storage (``specmesh.engine.kv_blocks.KVBlockStore``) for an ``EngineVerifier``:

- ``reuse(session, slot, tokens)``: a new session whose first tokens are ``tokens``
  starts from the longest cached prefix of all but the last of them (the last one is
  scored: its logits are the request's first token), copied into its slot; returns how
  many tokens that is (0: none cached). The session holds those blocks from now on.
- ``committed(session, slot, tokens, length)``: after a forward, the session's first
  ``length`` tokens are in its slot: their full blocks the cache lacks are stored (a
  running session's prefix is reusable at once: sixteen users with one system prompt
  compute it once), the ones it has are shared.
- ``truncated`` / ``ended`` / ``forked``: the session kept fewer tokens, left its slot
  (released or evicted), or started as a copy of another's prefix.

Budget: ``budget_bytes`` of storage (KV, and the kept hidden features where the
verifier keeps them: ``feature_dim``), refused at construction when it cannot hold one
sequence of ``max_seq_len`` tokens. ``rebuild(feature_dim)`` starts over empty when the
verifier starts keeping features (a block must carry them for the drafters that read
them: the block drafter conditions on a cached prefix's features as on computed ones).

Lossless where the engine is batch-invariant (bf16, int8 and int4 on the CPU, the
CUDA graphs' ``invariant`` mode): a position's K, V and hidden features do not depend on
how its sequence was split into forwards, so a cached block holds exactly what the
prefill it replaces would compute. Knows nothing about requests, acceptance or gRPC.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .engine.kv_blocks import KVBlockStore, kv_bytes_per_token
from .prefix_cache import PrefixCache
from .types import InvalidArgument

MiB = 1 << 20
DEFAULT_BUDGET = 512 * MiB  # the serving setting prefix_cache_mib's default
DEFAULT_BLOCK = 16  # tokens per block (vLLM's default block size)


def min_budget(engine, block_size: int = DEFAULT_BLOCK, feature_dim: int = 0) -> int:
    """The smallest budget that holds one sequence of the engine's ``max_seq_len``."""
    blocks = -(-engine.max_seq_len // block_size)
    return blocks * KVBlockStore.bytes_per_block(engine, block_size, feature_dim)


class PrefixReuse:
    def __init__(self, engine, budget_bytes: int = DEFAULT_BUDGET, block_size: int = DEFAULT_BLOCK,
                 feature_dim: int = 0):
        if block_size < 1:
            raise InvalidArgument("prefix_block", f"must be >= 1, got {block_size}")
        self.engine, self.budget, self.block_size = engine, int(budget_bytes), int(block_size)
        self._check(feature_dim)
        self.index: PrefixCache
        self.store: KVBlockStore
        self.frozen: set[str] = set()  # live sessions whose slots lack features a block now carries
        self._build(feature_dim)

    def _check(self, feature_dim: int) -> None:
        need = min_budget(self.engine, self.block_size, feature_dim)
        if self.budget < need:
            raise InvalidArgument(
                "prefix_cache_mib", f"{self.budget / MiB:.1f} MiB cannot hold one request of the configured maximum: "
                f"{self.engine.max_seq_len} tokens (max_seq_len) of {kv_bytes_per_token(self.engine) + 2 * feature_dim}"
                f" bytes each (KV{' and kept hidden features' if feature_dim else ''}) need {need / MiB:.1f} MiB; "
                "raise it, lower max_seq_len, or turn the prefix cache off (prefix_cache false)")

    def _build(self, feature_dim: int) -> None:
        per = KVBlockStore.bytes_per_block(self.engine, self.block_size, feature_dim)
        n = self.budget // per
        old = getattr(self, "index", None)
        self.index = PrefixCache(n, self.block_size)
        if old is not None:  # the totals go on
            for k in ("queries", "hits", "inserted", "evictions", "skipped"):
                setattr(self.index, k, getattr(old, k))
        self.store = KVBlockStore(self.engine, n, self.block_size, feature_dim)
        self.feature_dim = feature_dim

    def rebuild(self, feature_dim: int, frozen: Sequence[str] = ()) -> None:
        """Start over, empty, with blocks of ``feature_dim`` feature values a position
        (the verifier keeps other hidden features now); the budget holds fewer blocks.
        ``frozen``: live sessions whose earlier positions lack those features: nothing of
        theirs is cached until they end or start over. Raises where the budget cannot
        hold one sequence any more (nothing changes then)."""
        if feature_dim == self.feature_dim:
            return
        self._check(feature_dim)
        self.store = None  # free the old storage before the new one is taken
        self._build(feature_dim)
        self.frozen = set(frozen)

    # ------------------------------------------------------------ sessions
    def peek(self, tokens: Sequence[int], salt: str = "") -> int:
        """Tokens ``reuse`` would find cached now for a new session starting with ``tokens``."""
        return self.index.peek(tokens, len(tokens) - 1, salt)

    def reuse(self, session: str, slot: int, tokens: Sequence[int], features=None, salt: str = "") -> int:
        """A new session (its slot empty) starts with ``tokens``: load the longest cached
        prefix of ``tokens[:-1]`` under ``salt`` (the request's tenant: ``PrefixCache``) into
        the slot (and ``features``, the verifier's per-slot tensor, where both keep them); the
        session's blocks are stored under ``salt`` from now on. Returns the positions loaded;
        the engine's length of the slot is the caller's to set."""
        self.frozen.discard(session)
        chain = self.index.match(tokens, len(tokens) - 1, salt)
        self.index.attach(session, chain, salt)
        return self.store.load(slot, [b.id for b in chain], features)

    def salted(self, session: str, salt: str) -> None:
        """A new session that reuses nothing stores its blocks under ``salt`` all the same."""
        self.frozen.discard(session)
        self.index.attach(session, [], salt)

    def committed(self, session: str, slot: int, tokens: Sequence[int], length: int, features=None) -> None:
        """The slot holds the session's first ``length`` tokens (``tokens[:length]``)."""
        if session in self.frozen:
            return
        new = self.index.grow(session, tokens, length)
        self.store.save(slot, new, features)

    def truncated(self, session: str, length: int) -> None:
        self.index.truncate(session, length)

    def ended(self, session: str) -> None:
        self.frozen.discard(session)
        self.index.detach(session)

    def forked(self, source: str, session: str, length: int) -> None:
        self.index.fork(source, session, length)
        if source in self.frozen:
            self.frozen.add(session)

    def info(self) -> dict:
        s = self.index.stats()
        per = KVBlockStore.bytes_per_block(self.engine, self.block_size, self.feature_dim)
        return {"prefix_cache_queries": s["queries"], "prefix_cache_hits": s["hits"],
                "prefix_cache_bytes": s["blocks_used"] * per, "prefix_cache_capacity_bytes": s["blocks_total"] * per,
                "prefix_cache_budget_bytes": self.budget, "prefix_cache_evictions": s["evictions"],
                "prefix_cache_blocks": s["blocks_used"], "prefix_cache_blocks_held": s["blocks_held"],
                "prefix_cache_block_size": self.block_size, "prefix_cache_skipped": s["skipped"]}


def make(engine, enabled: bool, budget_bytes: Optional[int], block_size: int) -> Optional[PrefixReuse]:
    """The verifier's prefix cache per its settings (None: off)."""
    if not enabled:
        return None
    return PrefixReuse(engine, DEFAULT_BUDGET if budget_bytes is None else budget_bytes, block_size)
