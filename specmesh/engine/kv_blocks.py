"""Block storage of the prefix cache: KV blocks beside an engine's slots, copied in and out.

``KVBlockStore(engine, n_blocks, block_size)`` holds ``n_blocks`` blocks of
``block_size`` positions of the engine's K and V cache (every layer, every KV head, in
the cache dtype, on the engine's device), and optionally ``feature_dim`` values per
position of a second per-slot tensor (the verifier's kept hidden features). A block is
a storage id; which tokens it holds is the index's business (``specmesh.prefix_cache``).

- ``save(slot, pairs)``: copy the slot's positions ``[pos, pos + block_size)`` into
  block ``id`` for each (id, pos);
- ``load(slot, ids)``: copy blocks ``ids`` into the slot's positions ``[0, len(ids) *
  block_size)``, in order (a cached prefix).

Why copies, not a block table the forward reads: every attention path of the engine
(the key-list kernel, the SDPA tiles, the ragged forward, the CUDA graphs) reads a
slot's keys as one contiguous run, and a copy of a cached prefix costs what a memory
copy costs (about 8 ms for the K of 1,500 SmolLM2 positions, as much again for V, on 2
busy CPU cores) against the prefill it replaces (seconds there). The cost is memory: a
prefix a session holds is in its slot and in the store.

The storage is allocated once, uninitialised, at its full size: on the CPU its pages
are taken from the system as blocks are first written, so the process's memory grows
with the blocks stored, up to the budget. Knows nothing about tokens, sessions or the
index.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def kv_bytes_per_token(engine) -> int:
    """Bytes of K and V a position of a slot holds (every layer and KV head)."""
    return 2 * engine.n_layers * engine.n_kv * engine.head_dim * engine.k_cache.element_size()


class KVBlockStore:
    def __init__(self, engine, n_blocks: int, block_size: int, feature_dim: int = 0,
                 feature_dtype: torch.dtype = torch.bfloat16):
        self.engine = engine
        self.n_blocks, self.block_size, self.feature_dim = int(n_blocks), int(block_size), int(feature_dim)
        P = self.n_blocks * self.block_size
        shape = (engine.n_layers, engine.n_kv, P, engine.head_dim)
        dt, dev = engine.k_cache.dtype, engine.device
        self.k = torch.empty(shape, dtype=dt, device=dev)
        self.v = torch.empty(shape, dtype=dt, device=dev)
        self.features = torch.empty(P, self.feature_dim, dtype=feature_dtype, device=dev) if feature_dim else None
        self._offsets = torch.arange(self.block_size, device=dev)

    @staticmethod
    def bytes_per_block(engine, block_size: int, feature_dim: int = 0, feature_bytes: int = 2) -> int:
        return block_size * (kv_bytes_per_token(engine) + feature_dim * feature_bytes)

    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        return n + (self.features.numel() * self.features.element_size() if self.features is not None else 0)

    def _positions(self, ids: Sequence[int]) -> torch.Tensor:
        blocks = torch.tensor(list(ids), dtype=torch.long, device=self.engine.device)
        return (blocks[:, None] * self.block_size + self._offsets[None]).reshape(-1)

    def save(self, slot: int, pairs: Sequence[tuple[int, int]], features: Optional[torch.Tensor] = None) -> None:
        """Copy the slot's blocks into storage: for each (id, pos), positions [pos, pos + block_size).
        ``features``: the verifier's per-slot tensor [slots, positions, feature_dim] (with a
        store that keeps features)."""
        if not pairs:
            return
        e, B = self.engine, self.block_size
        runs: list[tuple[list[int], int]] = []  # consecutive positions: one copy each
        for bid, pos in pairs:
            if runs and runs[-1][1] + len(runs[-1][0]) * B == pos:
                runs[-1][0].append(bid)
            else:
                runs.append(([bid], pos))
        for ids, pos in runs:
            idx, end = self._positions(ids), pos + len(ids) * B
            self.k.index_copy_(2, idx, e.k_cache[:, slot, :, pos:end])
            self.v.index_copy_(2, idx, e.v_cache[:, slot, :, pos:end])
            if self.features is not None and features is not None:
                self.features.index_copy_(0, idx, features[slot, pos:end])

    def load(self, slot: int, ids: Sequence[int], features: Optional[torch.Tensor] = None) -> int:
        """Copy blocks ``ids`` into the slot's first ``len(ids) * block_size`` positions (and
        the features beside them); returns that many positions."""
        if not ids:
            return 0
        e = self.engine
        idx = self._positions(ids)
        n = idx.shape[0]
        e.k_cache[:, slot, :, :n] = self.k.index_select(2, idx)
        e.v_cache[:, slot, :, :n] = self.v.index_select(2, idx)
        if self.features is not None and features is not None:
            features[slot, :n] = self.features.index_select(0, idx)
        return n
