"""Token-sequence helpers shared by the drafters, the router and the services.

``common_prefix_len`` is the sync rule of the protocol: a peer that holds one
token list and is sent another keeps their common prefix (``keep_len``) and
appends the rest.

Knows nothing about models, sessions or gRPC.
"""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two lists (C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
