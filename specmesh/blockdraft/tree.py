"""Best-first draft trees from a block drafter's per-slot distributions.

The block drafter gives, for each slot k after the anchor, a distribution over
tokens that does not depend on which tokens were drafted at earlier slots. A
tree node at slot k with drafter probability p scores ``calib[k](p)``: the
probability, calibrated on held-out data, that the node is accepted *given its
parent was accepted* (this corrects for the dependence between slots: when the
drafter is right early it tends to be right later). A path's score is the
product of its nodes' scores; the tree takes the ``budget`` highest-scoring
nodes best-first (a node is only added after its parent; siblings are distinct
tokens, in descending score order), so it is a valid flattened ``TokenTree``.

Knows nothing about models or verification.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from ..types import TokenTree


@dataclass
class Calibration:
    """Per slot: bin edges over drafter probability and the acceptance rate in each bin."""

    edges: list[float] = field(default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.01])
    rates: list[list[float]] = field(default_factory=list)  # [K][len(edges) - 1]

    def __call__(self, slot: int, p: float) -> float:
        if not self.rates:
            return p
        row = self.rates[min(slot, len(self.rates) - 1)]
        b = min(max(bisect.bisect_right(self.edges, p) - 1, 0), len(row) - 1)
        return row[b]

    @classmethod
    def fit(cls, samples: list[tuple[int, float, bool]], n_slots: int, prior: float = 2.0) -> "Calibration":
        """samples: (slot, drafter prob, accepted given parent accepted). Each bin's rate is
        smoothed towards the bin's mean probability with ``prior`` pseudo-counts."""
        cal = cls()
        nb = len(cal.edges) - 1
        hits = [[0.0] * nb for _ in range(n_slots)]
        tot = [[0.0] * nb for _ in range(n_slots)]
        psum = [[0.0] * nb for _ in range(n_slots)]
        for k, p, ok in samples:
            b = min(max(bisect.bisect_right(cal.edges, p) - 1, 0), nb - 1)
            hits[k][b] += ok
            tot[k][b] += 1
            psum[k][b] += p
        for k in range(n_slots):
            row = []
            for b in range(nb):
                mid = psum[k][b] / tot[k][b] if tot[k][b] else (cal.edges[b] + min(cal.edges[b + 1], 1.0)) / 2
                row.append((hits[k][b] + prior * mid) / (tot[k][b] + prior))
            cal.rates.append(row)
        return cal

    def to_dict(self) -> dict:
        return {"edges": self.edges, "rates": self.rates}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(list(d["edges"]), [list(r) for r in d["rates"]])


def best_first_tree(cands: list[list[tuple[int, float]]], budget: int, calib: Calibration) -> TokenTree:
    """cands[k]: [(token, drafter prob)] of slot k in descending probability.
    Returns the ``budget`` best nodes as a flattened tree (parents precede children)."""
    tokens: list[int] = []
    parents: list[int] = []
    if not cands or budget <= 0:
        return TokenTree()
    # heap entries: (-score, tiebreak, slot, rank, parent node, parent score)
    heap = [(-calib(0, cands[0][0][1]), 0, 0, 0, -1, 1.0)]
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, k, r, par, pscore = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(cands[k][r][0])
        parents.append(par)
        if r + 1 < len(cands[k]):  # next sibling under the same parent
            heapq.heappush(heap, (-(pscore * calib(k, cands[k][r + 1][1])), tie, k, r + 1, par, pscore))
            tie += 1
        if k + 1 < len(cands):  # first child
            heapq.heappush(heap, (-(-neg * calib(k + 1, cands[k + 1][0][1])), tie, k + 1, 0, node, -neg))
            tie += 1
    return TokenTree(tokens, parents)
