"""Draft-ahead in process (``specmesh.ahead``): the same output, the same draws, a bounded cache.

Every race that matters is forced with events (a drafter that blocks until told),
never with sleeps or timings: the tests hold the ahead worker inside a drafter call,
do the thing (release, propose, fail), then let it go.
"""

from __future__ import annotations

import threading

import pytest

from specmesh import seeding
from specmesh.ahead import AheadDrafter, OverlapPolicy, assumed_outcomes, main_path, truncate
from specmesh.drafters import PromptLookupDrafter, SuffixDrafter, make_drafter
from specmesh.drafters.model_drafters import DraftLMDrafter
from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.types import DraftContext, InvalidArgument, SamplingParams, TokenTree
from specmesh.verifier import EngineVerifier
from tests.support import SMALL_DRAFT, SMALL_TARGET, SMALL_V

PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 2]
N_NEW = 24
GREEDY_SP = SamplingParams(temperature=0.0)


def target() -> EngineVerifier:
    return EngineVerifier(LlamaEngine(*SMALL_TARGET, n_slots=4, max_seq_len=128))


def draft_lm(weights=SMALL_DRAFT) -> DraftLMDrafter:
    return DraftLMDrafter(LlamaEngine(*weights, n_slots=4, max_seq_len=128), top_k=SMALL_V)


def drafters(ver) -> dict:
    return {"prompt_lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
            "adaptive_lookup": make_drafter("adaptive_lookup", embeddings=ver.engine.embed, min_similarity=0.0),
            "draft_lm": draft_lm()}


class Gate:
    """Wraps a drafter: its ahead rounds (calls on the worker thread with a budget above 1;
    the guesses ask for 1) block at ``entered`` until ``go`` is set, once ``hold`` is set."""

    def __init__(self, inner, fail: bool = False):
        self.inner, self.name = inner, getattr(inner, "name", "gate")
        self.hold, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()
        self.fail = fail
        self.main = threading.get_ident()

    def propose(self, ctx, budget):
        if threading.get_ident() != self.main:
            if self.hold.is_set() and budget > 1:
                self.entered.set()
                self.go.wait()
            if self.fail:
                raise RuntimeError("drafter died")
        return self.inner.propose(ctx, budget)

    def release(self, sid):
        self.inner.release(sid)

    def finish(self, sid, toks, p):
        self.inner.finish(sid, toks, p)


# ---------------------------------------------------------------- pure parts

def test_outcomes_are_all_accepted_then_each_rejection_with_the_second_choice():
    guesses = {(9,): [7, 8], (9, 4): [5, 6], (9, 4, 5): [3, 5], (9, 4, 5, 6): [2]}
    out = list(assumed_outcomes([9], TokenTree.chain([4, 5, 6]), lambda t, n: guesses[tuple(t)][:n]))
    assert out == [("all", [9, 4, 5, 6, 2]), ("reject@0", [9, 7]), ("reject@1", [9, 4, 6]), ("reject@2", [9, 4, 5, 3])]
    tree = TokenTree([4, 8, 5], [-1, -1, 0])  # the main path follows first children: 4, 5
    assert main_path(tree) == [4, 5]
    assert main_path(TokenTree()) == []
    chain = TokenTree.chain([1, 2, 3], q_ids=[[1], [2], [3]], q_probs=[[1.0], [1.0], [1.0]])
    assert truncate(chain, 2).tokens == [1, 2] and truncate(chain, 2).q_ids == [[1], [2]]


def test_overlap_policy_auto_turns_overlap_off_where_it_measured_slower():
    pol = OverlapPolicy("auto", probe=4, every=32)
    seen = []
    for _ in range(200):
        on = pol.on()
        seen.append(on)
        # overlapped rounds: 3 tokens in 1.5 s; plain rounds: 3 tokens in 1.0 s
        pol.observe(on, 1.5 if on else 1.0, 3, "miss" if on else "off")
    assert seen[:4] == [True] * 4 and seen[4:8] == [False] * 4
    assert not pol.faster() and seen[-20:].count(True) <= 4  # off but for the re-probes
    fast = OverlapPolicy("auto", probe=4)
    for _ in range(40):
        on = fast.on()
        fast.observe(on, 0.5 if on else 1.0, 3, "hit" if on else "off")
    assert fast.faster() and fast.on() and fast.hit_rate > 0.9
    assert OverlapPolicy("on").on() and not OverlapPolicy("off").on()
    with pytest.raises(InvalidArgument, match="draft_ahead"):
        OverlapPolicy("sometimes")


# ---------------------------------------------------------------- identity and draws

@pytest.mark.parametrize("name", ["prompt_lookup", "suffix", "adaptive_lookup", "draft_lm"])
def test_greedy_output_with_overlap_equals_plain_decoding(name):
    ver = target()
    ref, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N_NEW)
    d = AheadDrafter(drafters(ver)[name])
    out, st = generate_tokens(d, ver, PROMPT, max_new_tokens=N_NEW, budget=3, draft_ahead=OverlapPolicy("on"))
    assert out == ref
    assert st.ahead_hits + st.ahead_misses >= st.rounds - 1
    assert d.held() == {"sessions": 0, "entries": 0}  # the generation's end released its cache


def test_an_ahead_round_is_the_draft_drafting_afresh_would_draw():
    """Sampled draft LM: the drafted-ahead round for an outcome equals a fresh proposal
    after it, token for token and q for q (draws keyed by the assumed committed length)."""
    sp = SamplingParams(temperature=1.0, seed=11)
    d = Gate(draft_lm())
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT), sp)
    first = a.propose(ctx, 3)
    d.hold.set()
    assert a.propose_ahead(ctx, first, 3)
    d.entered.wait()  # the worker is in the first ahead round ("all accepted + guess")
    d.hold.clear()
    d.go.set()
    guess = draft_lm().guess(DraftContext("g", PROMPT + first.tokens, len(PROMPT)), 1)[0]
    outcome = DraftContext("s", PROMPT + first.tokens + [guess], len(PROMPT), sp)
    tree, info = a.propose_info(outcome, 3)
    assert info.result == "hit", info
    fresh = draft_lm().propose(DraftContext("t", outcome.tokens, len(PROMPT), sp,
                                            round_seed=seeding.round_seed(sp.seed, len(outcome.tokens))), 3)
    assert (tree.tokens, tree.q_ids) == (fresh.tokens, fresh.q_ids)
    # q to fp32 rounding: the fresh drafter prefilled the context in one chunk, the ahead
    # one incrementally (the ragged fp32 forward's bits depend on that; the draws do not here)
    for a, b in zip(tree.q_probs, fresh.q_probs):
        assert a == pytest.approx(b, abs=1e-6)


# ---------------------------------------------------------------- failures and races

class Endless:
    """A preemptible drafter whose ahead rounds (worker thread, budget above 1) draft until
    ``stop()`` says so (at most ``cap`` tokens), recording whether they were stopped; its
    other calls delegate to prompt lookup."""

    preemptible = True
    name = "endless"

    def __init__(self, cap: int = 100_000):
        self.inner, self.cap = PromptLookupDrafter(), cap
        self.main = threading.get_ident()
        self.entered, self.stopped, self.go = threading.Event(), [], threading.Event()

    def propose(self, ctx, budget, stop=None):
        if threading.get_ident() != self.main and budget > 1:
            self.entered.set()
            n = 0
            while n < self.cap and not (stop is not None and stop()):
                if self.go.is_set():
                    break
                n += 1
                self.go.wait(0.001)
            self.stopped.append(n < self.cap and not self.go.is_set())
            return TokenTree.chain([7] * budget)
        return self.inner.propose(ctx, budget)

    def release(self, sid):
        self.inner.release(sid)


def test_a_miss_stops_the_ahead_round_being_drafted():
    """The real outcome is not the ahead round being drafted: a preemptible drafter is told
    to stop between tokens, so the real round does not wait for the wrong one to finish."""
    d = Endless()
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT), SamplingParams())
    first = TokenTree.chain([1, 2])
    assert a.propose_ahead(ctx, first, 4)
    d.entered.wait()  # the worker drafts an ahead round ("all": PROMPT + first + a guess)
    tree, info = a.propose_info(DraftContext("s", PROMPT + [9], len(PROMPT), SamplingParams()), 4)
    assert info.result == "miss"
    assert d.stopped == [True]  # stopped by the cancel, not by running to its cap
    assert tree.tokens == PromptLookupDrafter().propose(
        DraftContext("x", PROMPT + [9], len(PROMPT), SamplingParams()), 4).tokens


def test_the_real_outcomes_ahead_round_is_drafted_to_its_end():
    """The ahead round being drafted is the real outcome's: it is not stopped, and it is the hit."""
    d = Endless()
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT), SamplingParams())
    first = TokenTree.chain([1, 2])
    assert a.propose_ahead(ctx, first, 4)
    d.entered.wait()
    guess = PromptLookupDrafter().propose(DraftContext("g", PROMPT + [1, 2], len(PROMPT), GREEDY_SP), 1).tokens
    real = PROMPT + [1, 2] + guess[:1]
    # let the round go from another thread, before or after propose_info marks it wanted:
    # either order must end in the hit
    threading.Thread(target=d.go.set).start()
    tree, info = a.propose_info(DraftContext("s", real, len(PROMPT), SamplingParams()), 4)
    assert info.result == "hit", info
    assert tree.tokens == [7, 7, 7, 7]
    # the worker's first drafted round is this outcome's: it ran until let go, never told to stop
    # (if go came before the hit, the worker may have gone on to the next outcomes' calls: later entries)
    assert d.stopped[:1] == [False]


def test_the_drafter_dying_in_an_ahead_round_changes_no_token():
    ver = target()
    ref, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N_NEW)
    d = AheadDrafter(Gate(PromptLookupDrafter(), fail=True))  # every ahead round raises
    out, st = generate_tokens(d, ver, PROMPT, max_new_tokens=N_NEW, budget=3, draft_ahead=OverlapPolicy("on"))
    assert out == ref and st.ahead_hits == 0 and st.ahead_misses > 0 and st.fallbacks == 0


def test_the_drafter_dying_outright_falls_back_to_plain_decoding():
    class Dead:
        name = "dead"

        def propose(self, ctx, budget):
            raise RuntimeError("gone")

        def release(self, sid):
            pass

        def finish(self, sid, toks, p):
            pass

    ver = target()
    ref, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N_NEW)
    out, st = generate_tokens(AheadDrafter(Dead()), ver, PROMPT, max_new_tokens=N_NEW, budget=3,
                              draft_ahead=OverlapPolicy("on"))
    assert out == ref and st.fallbacks > 0


def test_a_verifier_that_rejects_everything_changes_no_token():
    class Wrong:
        """Drafts a token the target never picks at the first slot (it is not the argmax)."""

        name = "wrong"

        def __init__(self, ver):
            self.ver = ver

        def propose(self, ctx, budget):
            return TokenTree.chain([(ctx.tokens[-1] + 1) % SMALL_V] * budget)

        def release(self, sid):
            pass

        def finish(self, sid, toks, p):
            pass

    ver = target()
    ref, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N_NEW)
    out, st = generate_tokens(AheadDrafter(Wrong(ver)), ver, PROMPT, max_new_tokens=N_NEW, budget=2,
                              draft_ahead=OverlapPolicy("on"))
    assert out == ref and st.accepted_tokens < st.drafted_tokens


def test_a_stale_ahead_round_is_not_used():
    """Same (committed length, last token), other tokens before it: a miss, drafted afresh."""
    d = Gate(PromptLookupDrafter())
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT))
    first = a.propose(ctx, 2)
    d.hold.set()
    a.propose_ahead(ctx, TokenTree.chain([3, 0]), 2)
    d.entered.wait()
    d.hold.clear()
    d.go.set()
    other = DraftContext("s", PROMPT[:-1] + [4, 3, 0, 1], len(PROMPT))  # not what any ahead round assumed
    tree, info = a.propose_info(other, 2)
    assert info.result == "miss" and info.reason in ("outcome", "unfinished")
    assert tree.tokens == PromptLookupDrafter().propose(other, 2).tokens
    assert first is not None


def test_an_expired_ahead_round_is_not_used():
    now = [0.0]
    d = Gate(PromptLookupDrafter())
    a = AheadDrafter(d, ttl_s=5.0, clock=lambda: now[0])
    ctx = DraftContext("s", list(PROMPT), len(PROMPT))
    tree = a.propose(ctx, 2)
    d.hold.set()
    a.propose_ahead(ctx, tree, 2)
    d.entered.wait()
    d.hold.clear()
    d.go.set()
    guess = PromptLookupDrafter().propose(DraftContext("g", PROMPT + tree.tokens, len(PROMPT)), 1).tokens[0]
    now[0] = 10.0
    _, info = a.propose_info(DraftContext("s", PROMPT + tree.tokens + [guess], len(PROMPT)), 2)
    assert info.result == "miss" and info.reason == "expired"


def test_release_while_an_ahead_round_runs_frees_the_session():
    inner = draft_lm()
    d = Gate(inner)
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT), SamplingParams(temperature=1.0, seed=3))
    tree = a.propose(ctx, 3)
    d.hold.set()
    a.propose_ahead(ctx, tree, 3)
    d.entered.wait()  # the worker is inside an ahead round of "s"
    released = threading.Thread(target=a.release, args=("s",))
    released.start()  # waits for the round in flight (the drafter's lock)
    d.hold.clear()
    d.go.set()
    released.join()
    assert a.held() == {"sessions": 0, "entries": 0}
    assert "s" not in inner.sessions  # the draft LM's slot was freed after the round in flight
    _, info = a.propose_info(ctx, 3)
    assert info.result == "off"  # nothing of the released session is used


def test_the_cache_is_bounded_in_sessions_and_time():
    now = [0.0]
    a = AheadDrafter(PromptLookupDrafter(), max_sessions=3, ttl_s=5.0, clock=lambda: now[0], max_outcomes=2)
    for i in range(10):
        ctx = DraftContext(f"s{i}", list(PROMPT), len(PROMPT))
        a.propose_ahead(ctx, a.propose(ctx, 2), 2)
    assert a.held()["sessions"] == 3
    now[0] = 100.0  # every session idle past its TTL: the next call drops them
    a.propose_ahead(DraftContext("late", list(PROMPT), len(PROMPT)), TokenTree(), 2)
    assert a.held()["sessions"] == 1
    a.close()


def test_every_drafter_call_runs_where_run_puts_it():
    """With ``run`` (the drafter service's model thread) the ahead rounds, their guesses,
    the misses and the release all run on that one thread."""
    from specmesh.threads import ModelThread

    seen = set()

    class Where(PromptLookupDrafter):
        def propose(self, ctx, budget):
            seen.add(threading.current_thread().name)
            return super().propose(ctx, budget)

    mt = ModelThread("test-drafter-thread")
    try:
        a = AheadDrafter(Where(), run=mt.run)
        ver = target()
        ref, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=N_NEW)
        out, st = generate_tokens(a, ver, PROMPT, max_new_tokens=N_NEW, budget=3, draft_ahead=OverlapPolicy("on"))
        assert out == ref and st.ahead_hits + st.ahead_misses > 0
        assert seen == {"test-drafter-thread"}
    finally:
        mt.stop()


def test_the_first_ahead_round_is_handed_out_once_drafted_and_not_when_cancelled():
    """``first_round``: the "all accepted" round of the latest ahead call (what the drafter
    service returns with ProposeAhead), exactly the round a Propose would be answered with;
    None once the real outcome cancelled it before it was drafted whole."""
    d = Gate(draft_lm())
    a = AheadDrafter(d)
    ctx = DraftContext("s", list(PROMPT), len(PROMPT), SamplingParams())
    first = a.propose(ctx, 3)
    assert a.propose_ahead(ctx, first, 3)
    toks, tree, info = a.first_round("s", timeout=60)
    guess = draft_lm().guess(DraftContext("g", PROMPT + first.tokens, len(PROMPT)), 1)[0]
    assert toks == PROMPT + first.tokens + [guess] and len(tree) == 3 and info.result == "hit"
    same, got = a.propose_info(DraftContext("s", toks, len(PROMPT), SamplingParams()), 3)
    assert got.result == "hit" and same.tokens == tree.tokens
    d.hold.set()  # the next ahead round blocks inside the drafter ...
    assert a.propose_ahead(DraftContext("s", toks, len(PROMPT), SamplingParams()), same, 3)
    d.entered.wait()
    miss = threading.Thread(target=a.propose_info,  # ... the real outcome is another: a miss cancels it
                            args=(DraftContext("s", toks + [(same.tokens[0] + 1) % SMALL_V], len(PROMPT),
                                               SamplingParams()), 3))
    miss.start()
    while a._sessions["s"].job is not None:  # until the miss has cancelled the job (then it waits for the lock)
        miss.join(0.01)
    d.hold.clear()
    d.go.set()
    miss.join(60)
    assert a.first_round("s", timeout=60) is None
