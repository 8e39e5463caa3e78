"""A context-only drafter run inside the verifier, for external requests.

Prompt lookup and suffix decoding read nothing but the session's tokens, so the
verifier that scores their drafts can run them itself: an ``external`` request's
rounds then need no hop to the drafter service and none back to the router (the
router sends the budget once, as for a self drafter, and the rounds run on its
Decode stream). ``InVerifier`` adapts such a drafter to the verifier's self-drafter
calls: ``propose`` reads the session's committed tokens from the verifier's
``history`` (session -> [prompt_len, tokens], kept beside the KV: the last token is
the pending one) instead of the context the verifier passes (its pending tokens
only), and ``release`` hands the drafter the session's tokens (``finish``: suffix
decoding's global tree learns from past outputs, as on the drafter service).

A session the verifier does not know the tokens of gets no draft (a round without
one: plain decoding, never a wrong token). What it knows nothing about: models,
KV, acceptance, gRPC.
"""

from __future__ import annotations

from ..types import DraftContext, TokenTree

# the drafters a verifier may host: they read the session's tokens and nothing else (adaptive
# lookup also needs an embedding table, draft_lm a model: they stay on the drafter service)
HOSTABLE = ("prompt_lookup", "suffix")


class InVerifier:
    """``inner`` (a ``base.Drafter`` that reads tokens only) drafting from ``history``."""

    fused = False
    context_only = True  # the verifier need not commit the pending tokens to its KV before drafting

    def __init__(self, inner, history: dict):
        self.inner = inner
        self.name = inner.name
        self._history = history
        self._drafted: set[str] = set()  # sessions this drafter keeps state for

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        h = self._history.get(ctx.session_id)
        if h is None or not h[1]:
            return TokenTree()
        self._drafted.add(ctx.session_id)
        if len(self._drafted) > 4096:  # sessions evicted from the verifier without a release
            self._drafted.intersection_update(self._history)
        full = DraftContext(ctx.session_id, list(h[1]), min(h[0], len(h[1])), ctx.sampling, round_seed=ctx.round_seed)
        return self.inner.propose(full, budget)

    def release(self, session_id: str) -> None:
        if session_id not in self._drafted:
            return
        self._drafted.discard(session_id)
        h = self._history.get(session_id)
        if h is not None:
            self.inner.finish(session_id, list(h[1]), min(h[0], len(h[1])))
        else:
            self.inner.release(session_id)
