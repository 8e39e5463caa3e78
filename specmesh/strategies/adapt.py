"""Small adapters between the strategies and the one loop.

- ``TreeBudget``: ``loop.AdaptiveBudget`` (draft length from the accepted-length
  EMA and the cost model) whose draft size is capped by an entropy-guided depth:
  low target entropy → longer/deeper drafts, high → shorter/shallower (the
  entropy-guided scheduling of EntMTP). The cap is on the node budget the drafter
  is asked for, so a tree drafter grows a smaller (shallower) best-first tree and
  nothing it proposes is thrown away.
- ``ResumePrefix``: the verifier already holds the first ``resume_len`` tokens
  of the prompt for this session (a warmed conversation prefix, or the previous
  phase of a reasoning request): the first verify sends only the rest; if the
  session is gone it falls back to the full prefill. Output is unchanged either way.
- ``KeepSession``: the loop's final ``release`` is deferred (a reasoning request
  continues the same KV in its next phase); ``release_now`` frees it.
- ``CacheMeter``: counts, per draft source (``TokenTree.source``), the drafted
  nodes and how many of them the target accepted, by comparing each draft with
  the committed tokens the next proposal (or ``finish``) sees.

Knows nothing about models, gRPC or how drafts are made.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

from ..loop import AdaptiveBudget
from ..types import DraftContext, SessionLost, TokenTree, VerifyRequest, VerifyResult


class TreeBudget(AdaptiveBudget):
    """AdaptiveBudget with an entropy-guided depth cap on the draft size.

    depth = max_depth * s / (s + H) for the target's entropy H (nats) at the last
    round, at least 1 (H = 0, e.g. before the first round: max_depth); ``next()``
    = min(the cost model's length, depth).
    ``fixed_length``: the cost model's length is replaced by ``max_budget`` (for
    drafters whose drafts cost next to nothing and that limit themselves, e.g.
    suffix decoding by its match length); the EMAs are still kept and the cap
    still follows entropy."""

    def __init__(self, max_budget: int = 8, max_depth: Optional[int] = None, depth_scale: float = 2.0,
                 fixed_length: bool = False, **kw):
        super().__init__(max_budget, **kw)
        self.max_depth = max_depth or max_budget
        self.depth_scale = depth_scale
        self.fixed_length = fixed_length

    def next(self) -> int:
        k = super().next()
        if self.fixed_length:
            k = self.max_budget
        return min(k, self.depth()) if k > 0 else 0

    def depth(self) -> int:
        if self.entropy <= 0 or self.per_round_draft:  # a one-pass block costs the same at any depth
            return self.max_depth
        return max(1, int(round(self.max_depth * self.depth_scale / (self.depth_scale + self.entropy))))


class _Wrap:
    """Forward every other attribute (network_s, skipped, vocab_size, ...) to the inner object."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ResumePrefix(_Wrap):
    """A verifier whose first call reuses ``resume_len`` tokens already in the session's KV."""

    def __init__(self, verifier, resume_len: int):
        super().__init__(verifier)
        self.resume_len = max(0, int(resume_len))
        self.used = 0  # prompt tokens actually served from the warm KV
        self._first = True

    def verify(self, req: VerifyRequest) -> VerifyResult:
        if self._first:
            self._first = False
            n = self.resume_len
            if 0 < n < len(req.append_tokens) and req.keep_len == 0:
                short = dataclasses.replace(req, keep_len=n, append_tokens=list(req.append_tokens[n:]))
                try:
                    res = self.inner.verify(short)
                    self.used = n
                    # the warm KV's prompt tokens were not computed for this request: cached, as the
                    # prefix cache's are (usage.prompt_tokens_details.cached_tokens counts them)
                    res.cached_tokens = max(res.cached_tokens, n)
                    return res
                except SessionLost:
                    pass  # the warm KV is gone (evicted, another replica): prefill everything
        return self.inner.verify(req)

    def release(self, session_id: str) -> None:
        self.inner.release(session_id)


class KeepSession(_Wrap):
    """A verifier whose ``release`` waits for ``release_now`` (multi-phase requests)."""

    def verify(self, req: VerifyRequest) -> VerifyResult:
        return self.inner.verify(req)

    def release(self, session_id: str) -> None:
        pass

    def release_now(self, session_id: str) -> None:
        self.inner.release(session_id)


class CacheMeter(_Wrap):
    """Counts drafted / accepted nodes per ``TokenTree.source`` of a drafter's drafts."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.drafted: dict[str, int] = defaultdict(int)
        self.accepted: dict[str, int] = defaultdict(int)
        self._last: dict[str, tuple[int, TokenTree]] = {}  # session -> (context length, draft)

    @staticmethod
    def accepted_len(tree: TokenTree, new_tokens: list[int]) -> int:
        """How far the committed tokens that followed the draft walk down its tree
        (= the accepted path: a target token equal to a child is always accepted)."""
        node, n = -1, 0
        for t in new_tokens:
            nxt = next((i for i in tree.children(node) if tree.tokens[i] == t), None)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def _settle(self, session_id: str, tokens: list[int]) -> None:
        last = self._last.pop(session_id, None)
        if last is not None and len(tokens) > last[0]:
            self.accepted[last[1].source] += self.accepted_len(last[1], tokens[last[0]:])

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        self._settle(ctx.session_id, ctx.tokens)
        return self._count(ctx, self.inner.propose(ctx, budget))

    def propose_info(self, ctx: DraftContext, budget: int):
        """The loop drafts through this where the drafter can draft ahead: counted the same
        (forwarding it to the inner drafter unmetered lost every count)."""
        if not hasattr(self.inner, "propose_info"):
            return self.propose(ctx, budget), None
        self._settle(ctx.session_id, ctx.tokens)
        tree, info = self.inner.propose_info(ctx, budget)
        return self._count(ctx, tree), info

    def _count(self, ctx: DraftContext, tree: TokenTree) -> TokenTree:
        if len(tree):
            self.drafted[tree.source] += len(tree)
            self._last[ctx.session_id] = (len(ctx.tokens), tree)
        return tree

    def release(self, session_id: str) -> None:
        self._last.pop(session_id, None)
        self.inner.release(session_id)

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        self._settle(session_id, list(tokens))
        self.inner.finish(session_id, tokens, prompt_len)

    def fill(self, stats, source: str = "cache") -> None:
        """Add this meter's counts for ``source`` to the generation stats."""
        stats.cache_drafted_tokens += self.drafted.get(source, 0)
        stats.cache_accepted_tokens += self.accepted.get(source, 0)
        stats.cache_hit = stats.cache_hit or stats.cache_accepted_tokens > 0
