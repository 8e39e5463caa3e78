"""Adaptive prompt lookup: lexical n-gram match first, embedding retrieval when it
fails, and several continuations of one match sent as a branched tree.

1. Lexical: the longest suffix n-gram of the context (n from ``max_ngram`` down to
   ``min_ngram``) is looked up in the session's ``NgramIndex``. Every verified
   occurrence (most recent first, at most ``max_candidates``) gives a continuation.
2. Branches: the continuations are merged into a trie (shared prefixes share
   nodes). The branch whose first token is the most frequent (ties: the most
   recent occurrence) is drafted to the full budget; the others, up to
   ``max_branches`` in all, get ``branch_len`` nodes each where they diverge.
3. Retrieval: when no n-gram of length ``min_ngram`` matches, the last
   ``window`` tokens are embedded and compared (cosine) with every earlier,
   non-overlapping window of the context; the best windows with similarity
   >= ``min_similarity`` give the continuations (same trie), at most
   ``retrieval_len`` nodes.
4. Length: a lexical match of n tokens drafts at most ``spec_factor * n`` nodes
   (as suffix decoding bounds drafts by match length): long drafts after short
   matches mostly cost verify compute.

The embedding of a window is the mean of its tokens' vectors. With
``embeddings`` (a [V, D] matrix — the target model's input embedding table, which
the drafter service can read from the model file offline) the vectors carry the
target's own notion of token similarity, so a paraphrased or lightly edited
passage ("the total sum" vs "the sum total", renamed variables) still scores
high where an exact n-gram fails. The table is projected once to ``dim``
dimensions by a fixed random Gaussian matrix (cosines are preserved up to small
error, Johnson–Lindenstrauss) so a session's window sums cost ``dim`` floats per
token. Without a table each token id gets a fixed random ±1 vector (a hashed
bag-of-tokens sketch): windows then match by token overlap regardless of order —
weaker, but model-free (used in unit tests). Window vectors are prefix sums, so a
proposal costs one [n, dim] mat-vec and appending or rolling back is O(tokens).

All drafts are deterministic (one-hot, q empty); ``TokenTree.source`` says
"lexical" or "retrieval". This module knows nothing about the target's
probabilities, acceptance rules, tokenizers or gRPC.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..types import DraftContext, InvalidArgument, TokenTree
from .base import DrafterBase
from ..seqs import common_prefix_len
from .prompt_lookup import NgramIndex, SessionStates, periodic_continuation


def build_trie(continuations: Sequence[Sequence[int]], budget: int, branch_len: int,
               max_branches: int) -> TokenTree:
    """Merge continuations (best first) into a flattened tree of <= ``budget`` nodes.

    Rule: the first continuation gets the budget minus ``branch_len`` nodes reserved
    for each other continuation (at most half the budget is reserved); each later
    one walks the shared prefix and adds at most ``branch_len`` new nodes after its
    divergence; at most ``max_branches`` continuations add nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    branches = 0
    others = min(len(continuations), max_branches) - 1
    first = budget - min(branch_len * others, budget // 2)
    for ci, cont in enumerate(continuations):
        if len(tokens) >= budget or branches >= max_branches:
            break
        node, added = -1, 0
        limit = first if ci == 0 else branch_len
        for t in cont:
            nxt = children.get((node, t))
            if nxt is None:
                if added >= limit or len(tokens) >= budget:
                    break
                nxt = len(tokens)
                tokens.append(int(t))
                parents.append(node)
                children[(node, t)] = nxt
                added += 1
            node = nxt
        branches += added > 0
    return TokenTree(tokens, parents)


def rank_continuations(conts: list[list[int]]) -> list[list[int]]:
    """Order continuations (given most recent first): by how many share their first
    token (descending), ties by recency; duplicates dropped."""
    count: dict[int, int] = {}
    for c in conts:
        if c:
            count[c[0]] = count.get(c[0], 0) + 1
    seen, out = set(), []
    for i, c in sorted(enumerate(conts), key=lambda ic: (-count.get(ic[1][0], 0) if ic[1] else 0, ic[0])):
        key = tuple(c)
        if c and key not in seen:
            seen.add(key)
            out.append(c)
    return out


class _State:
    __slots__ = ("idx", "toks", "cum")

    def __init__(self, levels, dim: int):
        self.idx = NgramIndex(levels)
        self.toks: list[int] = []
        self.cum = torch.zeros(64, dim)  # cum[i] = sum of vectors of toks[:i]; row 0 is zero


class AdaptiveLookupDrafter(DrafterBase):
    """Lexical n-gram lookup, embedding-retrieval fallback, branched continuations."""

    def __init__(self, embeddings: Optional[torch.Tensor] = None, vocab_size: Optional[int] = None,
                 max_ngram: int = 4, min_ngram: int = 2, window: int = 6, min_similarity: float = 0.85,
                 max_branches: int = 3, branch_len: int = 2, max_candidates: int = 16, dim: int = 64,
                 spec_factor: Optional[float] = 2.0, retrieval_len: int = 4,
                 seed: int = 0, max_sessions: int = 256, name: str = "adaptive_lookup"):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise InvalidArgument("ngram", f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if window < 1 or max_branches < 1 or branch_len < 0 or dim < 1:
            raise InvalidArgument("window", "window, max_branches and dim must be >= 1, branch_len >= 0")
        if not -1.0 <= min_similarity <= 1.0:
            raise InvalidArgument("min_similarity", f"must be in [-1, 1], got {min_similarity}")
        self.name = name
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.min_similarity, self.max_branches, self.branch_len = min_similarity, max_branches, branch_len
        self.max_candidates = max_candidates
        self.spec_factor, self.retrieval_len = spec_factor, retrieval_len
        g = torch.Generator().manual_seed(seed)
        if embeddings is not None:
            emb = torch.as_tensor(embeddings).detach().float().cpu()  # host-side, whatever the engine's device
            proj = torch.randn(emb.shape[1], dim, generator=g) / dim ** 0.5
            self.vectors = emb @ proj  # [V, dim]
        else:
            if vocab_size is None:
                raise InvalidArgument("vocab_size", "is needed when no embedding table is given")
            self.vectors = torch.randint(0, 2, (vocab_size, dim), generator=g).float() * 2 - 1  # [V, dim] ±1
        self.dim = dim
        levels = range(min_ngram, max_ngram + 1)
        self._sessions: SessionStates[_State] = SessionStates(lambda: _State(levels, dim), max_sessions)

    # -- state -------------------------------------------------------------
    def _sync(self, st: _State, tokens: list[int]) -> None:
        keep = common_prefix_len(st.toks, tokens)
        st.idx.sync(tokens)
        new = tokens[keep:]
        if new:
            need = len(tokens) + 1
            if st.cum.shape[0] < need:
                grown = torch.zeros(max(need, 2 * st.cum.shape[0]), self.dim)
                grown[: keep + 1] = st.cum[: keep + 1]
                st.cum = grown
            vec = self.vectors[torch.tensor(new, dtype=torch.long).clamp_(0, self.vectors.shape[0] - 1)]
            st.cum[keep + 1: need] = st.cum[keep] + torch.cumsum(vec, 0)
        st.toks = list(tokens)

    # -- proposer contract ---------------------------------------------------
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        if budget <= 0 or not ctx.tokens:
            return TokenTree()
        st = self._sessions.get(ctx.session_id)
        tokens = ctx.tokens if isinstance(ctx.tokens, list) else list(ctx.tokens)
        self._sync(st, tokens)
        conts, k = self._lexical(st, budget)
        source = "lexical"
        if conts and self.spec_factor is not None:  # a short match drafts short (as suffix decoding does)
            budget = min(budget, max(2, int(self.spec_factor * k)))
        if not conts:
            budget = min(budget, self.retrieval_len)  # a similar window is a weaker hint than an exact match
            conts, source = self._retrieve(st, budget), "retrieval"
        if not conts:
            return TokenTree()
        tree = build_trie(rank_continuations(conts), budget, self.branch_len, self.max_branches)
        tree.source = source
        return tree

    def _lexical(self, st: _State, budget: int) -> tuple[list[list[int]], int]:
        idx, toks = st.idx, st.idx.tokens
        L = len(toks)
        for level in range(len(idx.levels) - 1, -1, -1):  # longest n first
            k = idx.levels[level]
            if k >= L:
                continue
            suffix = toks[L - k:]
            conts = []
            for j in idx.occurrences(level, toks, L):  # most recent first
                if toks[j - k:j] == suffix:
                    conts.append(periodic_continuation(toks, j, budget))
                    if len(conts) >= self.max_candidates:
                        break
            if conts:
                return conts, k
        return [], 0

    def _retrieve(self, st: _State, budget: int) -> list[list[int]]:
        w, toks = self.window, st.toks
        L = len(toks)
        last = L - w  # windows end at j in [w, L - w]: no overlap with the query window
        if last < w:
            return []
        cum = st.cum
        query = cum[L] - cum[L - w]  # [dim]
        wins = cum[w: last + 1] - cum[0: last + 1 - w]  # [n, dim]; row i = window ending at j = w + i
        sims = torch.nn.functional.cosine_similarity(wins, query[None], dim=-1)
        top = torch.topk(sims, min(self.max_branches, sims.shape[0]))
        conts = []
        for s, i in zip(top.values.tolist(), top.indices.tolist()):
            if s < self.min_similarity:
                break
            j = w + i
            conts.append(toks[j: j + budget])
        return [c for c in conts if c]

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id)


def embedding_table(model: str) -> torch.Tensor:
    """The input embedding table [V, H] (float32) of a model (alias or directory),
    read alone from its safetensors files (no model is built)."""
    from pathlib import Path

    from safetensors import safe_open

    from ..models.loading import resolve_model

    for f in sorted(Path(resolve_model(model, quiet=True)).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if k in fh.keys():
                    return fh.get_tensor(k).float()
    raise InvalidArgument("model", f"{model!r} has no embed_tokens.weight")
