"""Predicted outputs (OpenAI's ``prediction: {"type": "content", ...}``): the text the
caller expects back, drafted through a lookup drafter.

``PredictionDrafter`` holds one request's predicted tokens and drafts from them: the
continuation, in the prediction, of the longest suffix (up to ``max_ngram`` tokens) of
the output so far that occurs there, the occurrence nearest after where the last draft
was aligned; at the first round, the prediction's start. Where nothing matches (the
output left the prediction: an edit) it asks ``fallback`` (the request's own drafter, if
any), so a request that names a drafter keeps it for the parts the prediction does not
cover. Drafts are deterministic (one-hot): the exact rule accepts a predicted token only
where the target would have produced it, so the output is plain decoding's.

How far it drafts: the whole budget while the output follows the prediction; after a
draft the target cut short (the output left the prediction, and realigns on a short
match that is often wrong) at most twice the tokens that draft had accepted (at least
``MIN_DRAFT``), doubling after each draft accepted whole. A rejected predicted token
costs a scored row of the verify; a long draft after an edit was mostly rejected rows
(a short edit with the prediction drafting the budget each round ran 0.43x plain
decoding on SmolLM2 before).

``accepted`` / ``rejected`` count predicted tokens drafted and accepted / drafted and
rejected (usage's accepted_prediction_tokens and rejected_prediction_tokens).

Knows nothing about models, sessions on services or gRPC.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..types import DraftContext, TokenTree
from .base import DrafterBase

MIN_DRAFT = 2  # the draft length after a draft that was rejected at its first token


class PredictionDrafter(DrafterBase):
    name = "prediction"

    def __init__(self, prediction: Sequence[int], fallback=None, max_ngram: int = 8, min_ngram: int = 2):
        self.pred = list(prediction)
        self.fallback = fallback
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.at = 0  # where in the prediction the output was last aligned
        self._last: Optional[tuple[int, list[int]]] = None  # (output length, predicted tokens drafted)
        self.accepted = self.rejected = 0
        self.cap: Optional[int] = None  # the draft length after a miss (None: the budget)

    def _settle(self, out: Sequence[int]) -> None:
        """Count the last predicted draft's accepted tokens (those the output now holds)."""
        if self._last is None:
            return
        n0, d = self._last
        self._last = None
        new = out[n0:]
        a = 0
        while a < len(d) and a < len(new) and new[a] == d[a]:
            a += 1
        a = min(a, max(0, len(new) - 1))  # the last new token is the target's own (correction or bonus)
        self.accepted += a
        self.rejected += len(d) - a
        if a < len(d):  # cut short: the next drafts start small
            self.cap = max(MIN_DRAFT, 2 * a)
        elif self.cap is not None:
            self.cap *= 2

    def _align(self, out: Sequence[int]) -> Optional[int]:
        """The prediction index the output continues at, or None."""
        if not out:
            return 0
        for k in range(min(self.max_ngram, len(out)), self.min_ngram - 1, -1):
            tail = list(out[-k:])
            hits = [j + k for j in range(len(self.pred) - k + 1) if self.pred[j:j + k] == tail]
            if hits:
                after = [h for h in hits if h >= self.at]
                return min(after) if after else hits[-1]
        return None

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        out = ctx.tokens[ctx.prompt_len:]
        self._settle(out)
        j = self._align(out)
        n = budget if self.cap is None else min(budget, self.cap)
        draft = self.pred[j:j + n] if j is not None else []
        if draft:
            self.at = j
            self._last = (len(out), draft)
            return TokenTree.chain(draft)
        if self.fallback is not None:
            return self.fallback.propose(ctx, budget)
        return TokenTree()

    def release(self, session_id: str) -> None:
        if self.fallback is not None:
            self.fallback.release(session_id)

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        self._settle(tokens[prompt_len:] + [-1])  # the last output token counts as accepted if drafted
        if self.fallback is not None:
            self.fallback.finish(session_id, tokens, prompt_len)
