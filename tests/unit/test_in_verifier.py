"""Context-only drafters run inside the verifier (``EngineVerifier.host_context_drafters``,
``drafters.in_verifier``) on a tiny random model: the verifier's token history follows
its KV through verifies, re-prefills, forks and releases; greedy rounds drafted there
give plain decoding's tokens; a seeded sampled run gives the tokens the same drafter
gives from the loop (same drafts, same draws); a released session is handed to the
drafter's ``finish``; bad settings are refused. The gRPC path is in
``tests/services/test_grpc_unit.py``."""

from __future__ import annotations

import pytest

from specmesh.drafters import PromptLookupDrafter, SuffixDrafter
from specmesh.loop import generate_tokens
from specmesh.types import InvalidArgument, SamplingParams, SelfDraft, TokenTree, VerifyRequest
from specmesh.verifier import EngineVerifier
from tests.support import tiny_engine

PROMPT = [5, 17, 33, 2, 64, 12, 12, 80, 5, 17, 33, 2, 64]


class Recording(PromptLookupDrafter):
    """Prompt lookup that records what it is asked and what it is handed at the end."""

    def __init__(self):
        super().__init__()
        self.contexts: list[tuple[list[int], int]] = []
        self.finished: list[tuple[str, list[int], int]] = []

    def propose(self, ctx, budget):
        self.contexts.append((list(ctx.tokens), ctx.prompt_len))
        return super().propose(ctx, budget)

    def finish(self, session_id, tokens, prompt_len):
        self.finished.append((session_id, list(tokens), prompt_len))
        super().finish(session_id, tokens, prompt_len)


def _verifier(**drafters) -> EngineVerifier:
    eng, _ = tiny_engine(n_slots=3, max_seq_len=160)
    v = EngineVerifier(eng)
    v.host_context_drafters(drafters or {"prompt_lookup": PromptLookupDrafter(), "suffix": SuffixDrafter()})
    return v


def test_history_follows_the_kv_and_the_drafter_reads_it():
    rec = Recording()
    v = _verifier(prompt_lookup=rec)
    r0 = v.verify(VerifyRequest("s", 0, list(PROMPT)))
    assert v.history["s"] == [len(PROMPT), list(PROMPT)]
    committed = list(PROMPT) + [r0.next_token]
    r1 = v.verify(VerifyRequest("s", len(PROMPT), [r0.next_token], self_draft=SelfDraft("prompt_lookup", 4)))
    assert rec.contexts[-1] == (committed, len(PROMPT))  # every committed token, the pending one last
    committed += r1.accepted
    assert v.history["s"][1] == committed == [*PROMPT, r0.next_token, *r1.accepted]
    assert v.engine.length(v.slot_of("s")) == len(committed)
    # a rollback (keep_len below what it holds) truncates the history with the KV
    v.verify(VerifyRequest("s", len(PROMPT), [r0.next_token]))
    assert v.history["s"][1][:len(PROMPT) + 1] == [*PROMPT, r0.next_token]
    assert len(v.history["s"][1]) == v.engine.length(v.slot_of("s"))
    # a fork starts with the source's first n tokens; Prefill sets them
    v.fork("s", "f", 6)
    assert v.history["f"] == [6, PROMPT[:6]]
    v.prefill("p", PROMPT[:5])
    assert v.history["p"] == [5, PROMPT[:5]]
    # released: the drafter that drafted for the session gets its tokens, the history is gone
    held = list(v.history["s"][1])
    v.release("s")
    assert rec.finished == [("s", held, len(PROMPT))] and "s" not in v.history
    v.release("p")
    assert len(rec.finished) == 1  # never drafted for: nothing handed over
    info = v.info()
    assert info["context_drafters"] == ["prompt_lookup"] and "prompt_lookup" not in info["self_drafters"]


def test_an_unknown_history_drafts_nothing_and_changes_no_token():
    v = _verifier()
    r0 = v.verify(VerifyRequest("s", 0, list(PROMPT)))
    v.history.pop("s")  # as if evicted from the history only
    r = v.verify(VerifyRequest("s", len(PROMPT), [r0.next_token], self_draft=SelfDraft("suffix", 4)))
    assert r.drafted == 0 and "s" not in v.history


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix"])
@pytest.mark.parametrize("budget", [1, 5])
def test_greedy_rounds_drafted_in_the_verifier_equal_plain_decoding(drafter, budget):
    plain, _ = generate_tokens(None, _verifier(), PROMPT, max_new_tokens=48)
    out, st = generate_tokens(None, _verifier(), PROMPT, max_new_tokens=48, self_draft=drafter, budget=budget)
    assert out == plain
    assert st.drafted_tokens > 0  # the prompt repeats: the lookups found something to draft


@pytest.mark.parametrize("drafter", [PromptLookupDrafter, SuffixDrafter])
def test_sampled_rounds_drafted_in_the_verifier_equal_the_loop_drafting_them(drafter):
    """Same drafter, same tokens, same budget: the same drafts, so the same seeded draws."""
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    for n in (24, 40):
        ref, _ = generate_tokens(drafter(), _verifier(), PROMPT, max_new_tokens=n, sampling=sp, budget=3)
        out, st = generate_tokens(None, _verifier(), PROMPT, max_new_tokens=n, sampling=sp, budget=3,
                                  self_draft=drafter().name)
        assert out == ref and st.rounds > 0


def test_bad_hosting_is_refused():
    v = _verifier()
    with pytest.raises(InvalidArgument, match="already"):
        v.host_context_drafters({"suffix": SuffixDrafter()})
    from specmesh.serving.settings import ServeSettings

    assert ServeSettings(verifier_drafters="suffix, prompt_lookup").verifier_drafters == ["suffix", "prompt_lookup"]
    assert ServeSettings(verifier_drafters="").verifier_drafters == []
    for bad in ("draft_lm", "layerskip", "cache", "nope"):
        with pytest.raises(ValueError, match="context-only"):
            ServeSettings(verifier_drafters=bad)
    with pytest.raises(ValueError):
        ServeSettings(context_drafters="router")


def test_a_tree_drafted_in_the_verifier_is_checked_like_any_other():
    """A hosted drafter's tree goes through the verifier's acceptance as a self draft does:
    its tokens are only ever accepted where the target agrees (greedy)."""
    class Wrong(PromptLookupDrafter):
        def propose(self, ctx, budget):
            return TokenTree.chain([(ctx.tokens[-1] + 1) % 96] * budget)

    plain, _ = generate_tokens(None, _verifier(), PROMPT, max_new_tokens=24)
    out, st = generate_tokens(None, _verifier(prompt_lookup=Wrong()), PROMPT, max_new_tokens=24,
                              self_draft="prompt_lookup", budget=4)
    assert out == plain and st.drafted_tokens > 0
