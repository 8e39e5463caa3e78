"""Geometry of flattened token trees, written once.

A tree is a ``parents`` list: ``parents[i]`` is node i's parent, -1 = a child of
the last committed (pending) token, and parents precede children. Everything that
needs the shape of a tree — the domain type (``types.TokenTree``), the acceptance
rules, the verifier's extend-and-verify layout and the engine's attention —
reads it through these functions. (The batched tensor form for many padded trees
on a device is ``kernels.tree_mask_and_positions``; ``kernels`` stays a leaf
package importing only torch and triton.)

Knows nothing about tokens, models or sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # torch only where a mask is built: types.py (and the SDK) stay torch-free
    import torch


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 0 for children of the pending token."""
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def children_index(parents: Sequence[int]) -> dict[int, list[int]]:
    """node (-1 = root) -> its children in sibling order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def ancestor_mask(parents: Sequence[int], device: Optional["torch.device | str"] = None) -> "torch.Tensor":
    """[n, n] bool: mask[i, j] = node j is node i itself or one of its ancestors.

    Each node's ancestry is a Python-int bitset (its parent's | its own bit), unpacked 32
    bits at a time: bit 63 of a 64-node tree does not fit a signed 64-bit tensor element,
    and a few tensor ops beat one row copy a node (4x at 64 nodes)."""
    import torch

    n = len(parents)
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((0 if p < 0 else bits[p]) | (1 << i))
    cols = []
    for lo in range(0, n, 32):
        part = torch.tensor([(x >> lo) & 0xFFFFFFFF for x in bits], dtype=torch.long)
        cols.append((part[:, None] >> torch.arange(min(32, n - lo))) & 1)
    m = (cols[0] if len(cols) == 1 else torch.cat(cols, 1)).bool() if n else torch.zeros(0, 0, dtype=torch.bool)
    return m if device is None else m.to(device)


def root_to_leaf_paths(parents: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Cover a tree by root-to-leaf paths: [(path, new)], path = node indices root to
    leaf, new = the nodes first covered by it (a suffix of the path). Every node is in
    exactly one ``new``; leaves in index order."""
    n = len(parents)
    has_child = [False] * n
    for p in parents:
        if p >= 0:
            has_child[p] = True
    done = [False] * n
    out = []
    for leaf in range(n):
        if has_child[leaf]:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        new = [i for i in path if not done[i]]
        for i in new:
            done[i] = True
        out.append((path, new))
    return out


def after_chain(n_chain: int, parents: Sequence[int]) -> list[int]:
    """Parents of one flattened tree made of a chain of ``n_chain`` tokens followed by
    the tree ``parents`` hanging off the chain's last token (how the verifier scores
    the committed tokens it lacks and the draft in one forward)."""
    return list(range(-1, n_chain - 1)) + [n_chain - 1 if p < 0 else p + n_chain for p in parents]
