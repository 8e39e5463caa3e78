"""A draft model and a Decode stream do not share the CPUs: before the loop asks a drafter
that computes (a draft LM, not a lookup) for a draft, it tells the verifier adapter
(``RemoteVerifier.drafting``), which ends its Decode stream (the verifier would otherwise
go on decoding up to its lead of steps that the drafted round drops, beside the draft:
through ``specmesh serve`` on 2 cores a 5-token draft of the 0.5B took 425 ms instead of
~90, its cost per token read 1.4 target forwards and the policy kept the draft LM off)."""

from __future__ import annotations

from specmesh.drafters import PromptLookupDrafter
from specmesh.loop import speculative_generate
from specmesh.router.adapters import RemoteDrafter
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_PROMPT as PROMPT
from tests.support import small_target_engine as target_engine


class _Verifier:
    """The engine verifier, logging each ``drafting`` and ``verify`` call."""

    def __init__(self, log: list):
        self.inner, self.log = EngineVerifier(target_engine(2)), log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def drafting(self):
        self.log.append("drafting")

    def verify(self, req):
        self.log.append("verify")
        return self.inner.verify(req)


class _Drafter(PromptLookupDrafter):
    def __init__(self, log: list, computes: bool):
        super().__init__()
        self.log, self.computes = log, computes

    def propose(self, ctx, budget):
        self.log.append("propose")
        return super().propose(ctx, budget)


def _run(computes: bool) -> list:
    log: list = []
    for _ in speculative_generate(_Drafter(log, computes), _Verifier(log), PROMPT, max_new_tokens=6, budget=3):
        pass
    return log


def test_the_stream_ends_before_a_computing_drafter_drafts():
    log = _run(computes=True)
    assert "propose" in log
    assert all(log[i - 1] == "drafting" for i, x in enumerate(log) if x == "propose")


def test_a_lookup_drafter_leaves_the_stream_alone():
    assert "drafting" not in _run(computes=False)


def test_remote_drafters_that_compute():
    assert RemoteDrafter(None, "draft_lm", None).computes
    assert not RemoteDrafter(None, "prompt_lookup", None).computes
    assert not RemoteDrafter(None, "suffix", None).computes
