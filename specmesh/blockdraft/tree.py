"""Best-first draft trees from a block drafter's per-slot distributions.

The block drafter gives, for each slot k after the anchor, a distribution over
tokens that does not depend on which tokens were drafted at earlier slots: its
marginals are *prefix-blind*. Verification is not: a node is accepted only if
its whole path is the target's. A tree node's score is the probability that it
is accepted *given its parent was accepted*; a path's score is the product of
its nodes' scores, i.e. the probability that the whole path is accepted. The
expected accepted length of a tree is the sum of its nodes' path scores, and a
child never scores above its parent, so taking the ``budget`` highest-scoring
nodes best-first (a node only after its parent; siblings distinct, in
descending score order) is the priority search that maximises the expected
accepted length at that node budget. The result is a valid flattened
``TokenTree``. Two scorers, both fitted on held-out verifier outcomes:

- ``Calibration``: per slot and drafter-probability bin (prefix-blind, as in
  DDTree with calibration);
- ``PathCalibration`` (prefix-aligned, after PRESTO / TAPS): also per *path
  class*, the number of nodes on the path, this one included, that are not
  their slot's top candidate (0: the drafter's own chain; 1; 2 or more). The
  slot marginals describe continuations of the drafter's likeliest path, so a
  node under a path that left it is accepted less often than its marginal says
  (measured: ``specmesh tree-study``); cells with few samples fall back to the
  prefix-blind rate.

Knows nothing about models or verification.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Union

from ..types import TokenTree

PATH_CLASSES = 3  # non-top nodes on the path: 0, 1, 2 or more


def _bin(edges: list[float], p: float, n: int) -> int:
    return min(max(bisect.bisect_right(edges, p) - 1, 0), n - 1)


@dataclass
class Calibration:
    """Per slot: bin edges over drafter probability and the acceptance rate in each bin."""

    edges: list[float] = field(default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.01])
    rates: list[list[float]] = field(default_factory=list)  # [K][len(edges) - 1]

    def __call__(self, slot: int, p: float, path_class: int = 0) -> float:
        if not self.rates:
            return p
        row = self.rates[min(slot, len(self.rates) - 1)]
        return row[_bin(self.edges, p, len(row))]

    @classmethod
    def fit(cls, samples: list[tuple], n_slots: int, prior: float = 2.0) -> "Calibration":
        """samples: (slot, drafter prob, accepted given parent accepted[, path class]).
        Each bin's rate is smoothed towards the bin's mean probability with ``prior``
        pseudo-counts."""
        cal = cls()
        nb = len(cal.edges) - 1
        hits = [[0.0] * nb for _ in range(n_slots)]
        tot = [[0.0] * nb for _ in range(n_slots)]
        psum = [[0.0] * nb for _ in range(n_slots)]
        for k, p, ok, *_ in samples:
            b = _bin(cal.edges, p, nb)
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


@dataclass
class PathCalibration:
    """Per slot, path class and drafter-probability bin: the acceptance rate given the
    parent was accepted. ``base`` (prefix-blind) is the prior of every cell."""

    base: Calibration
    rates: list[list[list[float]]] = field(default_factory=list)  # [K][PATH_CLASSES][bins]

    def __call__(self, slot: int, p: float, path_class: int = 0) -> float:
        if not self.rates:
            return self.base(slot, p)
        row = self.rates[min(slot, len(self.rates) - 1)][min(path_class, PATH_CLASSES - 1)]
        return row[_bin(self.base.edges, p, len(row))]

    @classmethod
    def fit(cls, samples: list[tuple[int, float, bool, int]], n_slots: int, prior: float = 8.0) -> "PathCalibration":
        """samples: (slot, drafter prob, accepted given parent accepted, path class). A cell's
        rate is smoothed towards the prefix-blind rate of its slot and bin (fitted on the same
        samples) with ``prior`` pseudo-counts, so sparse cells keep the prefix-blind value."""
        base = Calibration.fit(samples, n_slots)
        nb = len(base.edges) - 1
        hits = [[[0.0] * nb for _ in range(PATH_CLASSES)] for _ in range(n_slots)]
        tot = [[[0.0] * nb for _ in range(PATH_CLASSES)] for _ in range(n_slots)]
        for k, p, ok, c in samples:
            b, c = _bin(base.edges, p, nb), min(c, PATH_CLASSES - 1)
            hits[k][c][b] += ok
            tot[k][c][b] += 1
        rates = [[[(hits[k][c][b] + prior * base.rates[k][b]) / (tot[k][c][b] + prior) for b in range(nb)]
                  for c in range(PATH_CLASSES)] for k in range(n_slots)]
        return cls(base, rates)

    def to_dict(self) -> dict:
        return {"base": self.base.to_dict(), "rates": self.rates}

    @classmethod
    def from_dict(cls, d: dict) -> "PathCalibration":
        return cls(Calibration.from_dict(d["base"]), [[list(r) for r in c] for c in d["rates"]])


Scorer = Union[Calibration, PathCalibration]


def load_scorer(d: dict) -> Scorer:
    """A calibration.json: prefix-blind (``edges``/``rates``) or with ``path`` (preferred)."""
    return PathCalibration.from_dict(d["path"]) if "path" in d else Calibration.from_dict(d)


def best_first_tree(cands: list[list[tuple[int, float]]], budget: int, calib: Scorer) -> TokenTree:
    """cands[k]: [(token, drafter prob)] of slot k in descending probability.
    Returns the ``budget`` best nodes as a flattened tree (parents precede children)."""
    tokens: list[int] = []
    parents: list[int] = []
    if not cands or budget <= 0:
        return TokenTree()
    # heap entries: (-score, tiebreak, slot, rank, parent node, parent score, parent's path class)
    heap = [(-calib(0, cands[0][0][1], 0), 0, 0, 0, -1, 1.0, 0)]
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, k, r, par, pscore, pcls = heapq.heappop(heap)
        node = len(tokens)
        cls = pcls + (r > 0)
        tokens.append(cands[k][r][0])
        parents.append(par)
        if r + 1 < len(cands[k]):  # next sibling under the same parent (a non-top candidate)
            heapq.heappush(heap, (-(pscore * calib(k, cands[k][r + 1][1], pcls + 1)), tie, k, r + 1, par, pscore,
                                  pcls))
            tie += 1
        if k + 1 < len(cands):  # first child
            heapq.heappush(heap, (-(-neg * calib(k + 1, cands[k + 1][0][1], cls)), tie, k + 1, 0, node, -neg, cls))
            tie += 1
    return TokenTree(tokens, parents)
