"""Per-row logits processors: what makes penalties, logit_bias and grammars exact under speculation.

A verify scores rows: row 0 is the target's distribution after the committed tokens,
row i + 1 the distribution after draft node i, i.e. after the committed tokens and the
path of draft tokens from the root to node i. Plain decoding scores only row 0. A
processor that depends on the tokens before a row (a penalty counts them, a grammar is in
the state they lead to) must therefore see, at row i + 1, the committed tokens *and* the
draft path to node i: then every row's processed logits are exactly the ones plain
decoding would form at that position, greedy speculation returns plain decoding's tokens
and the exact acceptance rule samples the processed distribution (vLLM's first penalties
under speculation and SGLang's "relaxed" single vector per request are wrong here).

- ``process_rows(logits, sampling, context, prompt_len, tree, masks)``: ``logit_bias``
  added, then ``repetition_penalty`` (any token of the prompt or the output before the
  row), then ``frequency_penalty`` x its count and ``presence_penalty`` once for each
  token of the output before the row (OpenAI's definitions; vLLM's order), then the
  grammar's mask (-inf where it allows nothing). Row-wise and deterministic: a row's
  values do not depend on the other rows, so a row scored alone equals the same row in a
  draft (bitwise, on the batch-invariant engine).
- ``constrain(matcher, tree, extend)``: the draft as the grammar takes it, and each row's
  mask. A deterministic draft node whose token the grammar rejects ends its branch (it
  and its descendants are dropped: the exact rule would reject it with certainty and its
  residual is unchanged, so dropping it changes nothing); a node that carries a draft
  distribution q is kept (its residual depends on q) but its descendants are dropped,
  except at a row the grammar forces (one allowed token f: the target is one-hot on f,
  so the residual after rejecting any other draft is one-hot on f too, and the node can
  go). Jump-forward: along a chain, where the grammar allows exactly one token that token
  is the draft (a drafter's token that differs from it ends the drafter's draft), and
  after the chain the forced tokens follow, up to ``extend`` of them: free drafts,
  one-hot, accepted with certainty.
- ``token_logprobs(logits, tree, path, next_token, k)``: the target's log-probabilities
  (log-softmax of the raw logits) of the emitted tokens, from the rows that decided them.

This module knows nothing about models, sessions or gRPC; the grammar is any object with
``allowed()``, ``advance(t)``, ``ends(t)``, ``back(n)`` (``specmesh.grammar.Matcher``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import trees
from .types import SamplingParams, TokenLogprob, TokenTree


def row_prefixes(parents: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """The draft tokens before each row: [] for row 0, the path root..node i for row i + 1."""
    out: list[list[int]] = [[]]
    for i, p in enumerate(parents):
        out.append((out[p + 1] if p >= 0 else []) + [tokens[i]])
    return out


def process_rows(logits: torch.Tensor, sampling: SamplingParams, context: Sequence[int], prompt_len: int,
                 tree: TokenTree, masks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[len(tree) + 1, V] logits -> the processed float32 logits of every row (see the
    module docstring). ``context``: the session's committed tokens (prompt + output; the
    last one is the pending token), ``prompt_len`` how many of them are the prompt;
    ``masks`` [n, V] bool (None: no grammar)."""
    x = logits.float().clone()
    n, V = x.shape
    dev = x.device
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long, device=dev)
        vals = torch.tensor([float(b) for _, b in sampling.logit_bias], dtype=torch.float32, device=dev)
        x[:, ids] += vals
    if sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty:
        pre = row_prefixes(tree.parents, tree.tokens)
        rows = torch.tensor([r for r, p in enumerate(pre) for _ in p], dtype=torch.long)
        cols = torch.tensor([t for p in pre for t in p], dtype=torch.long)
        path = torch.zeros(n, V, dtype=torch.float32)
        if rows.numel():
            path.index_put_((rows, cols), torch.ones(rows.numel()), accumulate=True)
        out = torch.bincount(torch.tensor(list(context[prompt_len:]), dtype=torch.long), minlength=V)[:V].float()
        counts = (out[None] + path).to(dev)  # the output's tokens before each row
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool)
            seen[torch.tensor(list(context), dtype=torch.long)] = True
            seen = (seen[None] | (path > 0)).to(dev)  # prompt and output before each row
            r = float(sampling.repetition_penalty)
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if sampling.frequency_penalty:
            x -= float(sampling.frequency_penalty) * counts
        if sampling.presence_penalty:
            x -= float(sampling.presence_penalty) * (counts > 0).float()
    if masks is not None:
        x = x.masked_fill(~masks.to(dev), float("-inf"))
    return x


def constrain(matcher, tree: TokenTree, extend: int = 0) -> tuple[TokenTree, torch.Tensor, int]:
    """(the draft the grammar takes, [len + 1, V] bool masks of its rows, forced tokens
    added). ``matcher`` is at the committed state and is left there."""
    if len(tree) == 0 or tree.is_chain:
        return _chain(matcher, tree, extend)
    return _tree(matcher, tree)


def _q(tree: TokenTree, i: int) -> tuple[list, list]:
    if tree.q_ids is None or not tree.q_ids[i]:
        return [], []
    return list(tree.q_ids[i]), list(tree.q_probs[i])


def _build(tokens, parents, qs, siblings) -> TokenTree:
    if any(ids for ids, _ in qs):
        return TokenTree(tokens, parents, [ids for ids, _ in qs], [ps for _, ps in qs], siblings=siblings)
    return TokenTree(tokens, parents)


def _chain(matcher, tree: TokenTree, extend: int) -> tuple[TokenTree, torch.Tensor, int]:
    toks: list[int] = []
    qs: list[tuple[list, list]] = []
    masks = [matcher.allowed()]
    forced = consumed = 0
    i, own = 0, True  # own: still following the drafter's chain
    try:
        while True:
            a = masks[-1]
            one = a.nonzero()
            f = int(one[0, 0]) if one.shape[0] == 1 else None
            if own and i < len(tree):
                t, q = tree.tokens[i], _q(tree, i)
                if f is not None and t != f:
                    own = False  # the grammar forces another token: the drafter's chain ends here
                    continue
                i += 1
                if not a[t]:  # the grammar rejects it: the draft ends (a node with q stays, as a leaf)
                    if q[0]:
                        toks.append(t)
                        qs.append(q)
                        masks.append(torch.ones_like(a))  # unreachable: the node is rejected with certainty
                    break
            elif f is not None and forced < extend:
                own = False
                t, q = f, ([], [])
                forced += 1
            else:
                break
            toks.append(t)
            qs.append(q)
            if matcher.ends(t) or not matcher.advance(t):  # a stop token (or a state the grammar ended)
                masks.append(torch.ones_like(a))  # after the end: the loop stops there, any row will do
                break
            consumed += 1
            masks.append(matcher.allowed())
    finally:
        matcher.back(consumed)
    out = _build(toks, list(range(-1, len(toks) - 1)), qs, tree.siblings)
    return out, torch.stack(masks), forced


def _tree(matcher, tree: TokenTree) -> tuple[TokenTree, torch.Tensor, int]:
    kids = trees.children_index(tree.parents)
    toks: list[int] = []
    pars: list[int] = []
    qs: list[tuple[list, list]] = []
    masks = [matcher.allowed()]

    def visit(node: int, new_parent: int, row: int) -> None:
        a = masks[row]
        forced = int(a.sum()) == 1  # the row is one-hot: every other child is rejected, the residual unchanged
        for c in kids.get(node, []):
            t, q = tree.tokens[c], _q(tree, c)
            if not a[t]:
                if q[0] and not forced:  # kept as a leaf: its residual depends on its q
                    toks.append(t)
                    pars.append(new_parent)
                    qs.append(q)
                    masks.append(torch.ones_like(a))
                continue
            toks.append(t)
            pars.append(new_parent)
            qs.append(q)
            me = len(toks) - 1
            if matcher.ends(t) or not matcher.advance(t):
                masks.append(torch.ones_like(a))
                continue
            masks.append(matcher.allowed())
            visit(c, me, me + 1)
            matcher.back(1)

    visit(-1, -1, 0)
    return _build(toks, pars, qs, tree.siblings), torch.stack(masks), 0


def token_logprobs(logits: torch.Tensor, tree: TokenTree, path: Sequence[int], next_token: int,
                   k: int) -> list[TokenLogprob]:
    """The raw log-probabilities of the emitted tokens: accepted node ``path[j]`` (token
    ``tree.tokens[path[j]]``) from the row before it, ``next_token`` from the row after
    the last accepted node; with ``k`` > 0 the k most likely tokens of each such row."""
    rows = [0] + [p + 1 for p in path]
    toks = [tree.tokens[p] for p in path] + [next_token]
    lp = torch.log_softmax(logits[rows].float(), -1)
    chosen = lp.gather(1, torch.tensor(toks, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    if k > 0:
        vals, idx = torch.topk(lp, k, dim=-1)
        vals, idx = vals.cpu().tolist(), idx.cpu().tolist()
    chosen = chosen.cpu().tolist()
    return [TokenLogprob(t, float(c), list(zip(idx[j], vals[j])) if k > 0 else [])
            for j, (t, c) in enumerate(zip(toks, chosen))]


__all__ = ["constrain", "process_rows", "row_prefixes", "token_logprobs"]
