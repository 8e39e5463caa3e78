"""A generation's phase times split the rounds' wall time: draft + verify of the rounds
after the prefill never exceed their wall and none is negative, even where the verifier
reports a draft longer than the round's wait (a step a Decode stream decided ahead: its
self draft ran while the loop was busy elsewhere, the wait for it was ~0)."""

from __future__ import annotations

from specmesh.loop import speculative_generate
from specmesh.types import GenerationStats
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_PROMPT as PROMPT
from tests.support import small_target_engine as target_engine


class _DecidedAhead:
    """The verifier whose every step after the first says it drafted for 5 s (decided ahead)."""

    def __init__(self, inner: EngineVerifier):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, req):
        res = self.inner.verify(req)
        if req.keep_len > 0:
            res.draft_ms = 5000.0
        return res


def test_a_draft_decided_ahead_counts_no_more_than_the_round_wall():
    ver = _DecidedAhead(EngineVerifier(target_engine(2)))
    stats = GenerationStats()
    out = [t for chunk in speculative_generate(None, ver, PROMPT, max_new_tokens=6, stats=stats) for t in chunk]
    assert len(out) == 6 and stats.rounds >= 2
    assert stats.verify_s >= 0.0 and stats.draft_s >= 0.0
    assert stats.prefill_s + stats.draft_s + stats.verify_s <= stats.total_s
    assert stats.draft_s < 1.0  # not the 5 s a step reported
