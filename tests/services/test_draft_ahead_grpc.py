"""Draft-ahead through the real services (``Drafter/ProposeAhead``, the router's ``draft_ahead``).

Greedy output equals plain decoding for every token-only drafter with overlap on; the
round trace shows the drafter's ahead span overlapping the verify it ran beside (forced
with the verifier paused inside that verify until the ahead round is drafted: events,
no timing); the metrics count hits and misses; bad ProposeAhead input is
INVALID_ARGUMENT naming the field with no state change; a drafter that dies mid-stream
and a session released while its ahead round runs change no token and leave nothing held.
"""

from __future__ import annotations

import functools
import threading

import grpc
import pytest

from specmesh.drafters import PromptLookupDrafter, SuffixDrafter
from specmesh.drafters.adaptive_lookup import AdaptiveLookupDrafter
from specmesh.drafters.model_drafters import DraftLMDrafter
from specmesh.engine import LlamaEngine
from specmesh.wire import convert
from specmesh.types import SamplingParams, TokenTree
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, router_pb2
from tests.support import (TRACED_SETTINGS, V, FakeCodec, GatedVerifier, TracedStack, code_of, samples, scrape,
                           settings, shared_tiny_weights, spans_of, total)

PROMPT = "abcabcabdabcabcabd"
N = 24


class Watched(PromptLookupDrafter):
    """Prompt lookup (the last token repeated where it finds nothing) that records the
    committed length of every ahead round it drafts (calls on the draft-ahead worker), can
    hold the ahead rounds of at least ``gate[0]`` committed tokens until the event
    ``gate[1]`` is set, and can fail from the ``fail_after``-th call on."""

    def __init__(self):
        super().__init__()
        self.cv = threading.Condition()
        self.ahead_lengths: list[int] = []
        self.gate = None
        self.fail_after = None
        self.calls = 0

    def propose(self, ctx, budget):
        self.calls += 1
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("drafter died")
        ahead = threading.current_thread().name.startswith("draft-ahead") and budget > 1
        if ahead and self.gate is not None and len(ctx.tokens) >= self.gate[0]:
            assert self.gate[1].wait(20)
        tree = super().propose(ctx, budget)
        if not len(tree) and budget > 0:  # always a draft, so every round has an outcome to draft ahead for
            tree = TokenTree.chain([ctx.tokens[-1]] * budget)
        if ahead:
            with self.cv:
                self.ahead_lengths.append(len(ctx.tokens))
                self.cv.notify_all()
        return tree


class Stack(TracedStack):
    """Overlap on, every external drafter on the drafter service (draft-ahead is its feature:
    context_drafters "drafter"); ``watched``: the drafter service's prompt_lookup is a
    ``Watched`` one."""

    def __init__(self, path, mode: str = "on", watched: bool = False):
        w = shared_tiny_weights()
        self.watched = Watched()
        drafters = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter,
                    "adaptive_lookup": lambda: AdaptiveLookupDrafter(vocab_size=V),
                    "draft_lm": lambda: DraftLMDrafter(LlamaEngine(w[0], w[1], n_slots=4, max_seq_len=256))}
        if watched:
            drafters = {"prompt_lookup": lambda: self.watched}
        super().__init__(path, [GatedVerifier], FakeCodec(), V, settings=functools.partial(settings, TRACED_SETTINGS),
                         drafters=drafters, router_settings={"draft_ahead": mode, "context_drafters": "drafter"})

    def generate(self, strategy="external", drafter="prompt_lookup", n=N, budget=3, draft_ahead=""):
        req = router_pb2.GenerateRequest(prompt=PROMPT, raw_prompt=True, max_new_tokens=n, strategy=strategy,
                                         drafter=drafter, draft_budget=budget, draft_ahead=draft_ahead,
                                         sampling=convert.sampling_to_proto(SamplingParams()))
        final = None
        for msg in self.stub.Generate(req, timeout=60):
            if msg.HasField("final"):
                final = msg.final
        return list(final.token_ids), final


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("ahead") / "spans.jsonl")
    yield s
    s.close()


@pytest.fixture(scope="module")
def wstack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("watched") / "spans.jsonl", watched=True)
    yield s
    s.close()


def test_propose_ahead_is_registered_as_a_drafter_rpc():
    assert "ProposeAhead" in drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].methods_by_name


@pytest.mark.parametrize("drafter", ["prompt_lookup", "suffix", "adaptive_lookup", "draft_lm"])
def test_greedy_output_with_draft_ahead_equals_plain_decoding(stack, drafter):
    ref, _ = stack.generate("autoregressive", "")
    before = samples(scrape(stack.ports["router"]))
    out, final = stack.generate("external", drafter)
    assert out == ref
    after = samples(scrape(stack.ports["router"]))
    counted = {r: total(after, "specmesh_draft_ahead_total", drafter=drafter, result=r)
               - total(before, "specmesh_draft_ahead_total", drafter=drafter, result=r) for r in ("hit", "miss", "off")}
    # a round after one whose drafter found nothing is not drafted ahead (nothing to hide); every other is
    empty = final.stats.rounds - (final.stats.position_drafted[0] if final.stats.position_drafted else 0)
    assert counted["hit"] + counted["miss"] >= 1 and counted["off"] <= empty
    assert (final.stats.ahead_hits, final.stats.ahead_misses) == (counted["hit"], counted["miss"])
    assert sum(counted.values()) <= final.stats.rounds
    assert stack.host._ahead[drafter].held() == {"sessions": 0, "entries": 0}  # released with the generation


def test_the_trace_shows_the_ahead_span_overlapping_the_verify(wstack):
    """Round 1's verify pauses until the drafter has drafted an ahead round of round 2 (an
    outcome of round 1: committed length >= prompt + 2), and the drafter starts those only
    once the verifier is inside that verify (the ProposeAhead goes out before the Verify, so
    left alone it can finish first); its span lies inside that verify. Ordered by events only."""
    stack = wstack
    stack.mem.clear()
    p_len = len(FakeCodec().encode(PROMPT))
    v = stack.verifier
    v.arm(2)  # verify_batch call 2: round 1 (call 1 is the prefill)
    stack.watched.gate = (p_len + 2, v.reached)  # the prefill's ahead round (p_len + 1) is not held
    result = {}
    t = threading.Thread(target=lambda: result.update(out=stack.generate("external", "prompt_lookup")))
    t.start()
    try:
        assert v.reached.wait(20)
        with stack.watched.cv:
            assert stack.watched.cv.wait_for(lambda: any(n >= p_len + 2 for n in stack.watched.ahead_lengths), 20)
    finally:
        stack.watched.gate = None
        v.resume.set()
    t.join(60)
    assert result["out"][0] == stack.generate("autoregressive", "")[0]
    spans = spans_of(stack.mem)
    rounds = {s["span_id"]: s for s in spans if s["name"] == "specmesh.round"}
    ahead = [s for s in spans if s["name"] == "specmesh.draft_ahead"]
    assert ahead and all(s["parent_id"] in rounds for s in ahead)
    r1 = next(s for s in rounds.values() if s["attributes"]["specmesh.round.index"] == 1)
    verify = next(s for s in spans if s["parent_id"] == r1["span_id"] and s["name"].endswith("Verifier/Verify"))
    mine = [s for s in ahead if s["parent_id"] == r1["span_id"]]
    assert mine, "the ahead work of round 2 hangs under round 1"
    a = mine[0]
    assert a["start_ns"] < verify["end_ns"] and a["end_ns"] > verify["start_ns"]  # overlapping
    r2 = next(s for s in rounds.values() if s["attributes"]["specmesh.round.index"] == 2)
    assert r2["attributes"]["specmesh.round.ahead"].split(":")[0] in ("hit", "miss")
    for k in ("drafter_busy_ms", "drafter_idle_ms", "verifier_busy_ms", "verifier_idle_ms"):
        assert r2["attributes"][f"specmesh.round.{k}"] >= 0


def test_propose_ahead_bad_input_names_the_field_and_changes_nothing(stack):
    with grpc.insecure_channel(stack.dserver.address) as ch:
        stub = drafter_pb2_grpc.DrafterStub(ch)
        held = stack.host.info()["sessions"]

        def call(**kw):
            base = dict(session_id="bad", drafter="prompt_lookup", budget=2,
                        sync=convert.sync_to_proto(0, [3, 4, 5]), prompt_len=3,
                        tree=convert.tree_to_proto(TokenTree.chain([3, 4])))
            base.update(kw)
            return lambda: stub.ProposeAhead(drafter_pb2.ProposeAheadRequest(**base), timeout=5)

        for kw, field in [(dict(budget=0), "budget"), (dict(drafter="nope"), "drafter"),
                          (dict(tree=convert.tree_to_proto(TokenTree([3, 4], [-1, 5]))), "tree.parents"),
                          (dict(tree=convert.tree_to_proto(TokenTree.chain([3, V + 7]))), "tree.tokens"),
                          (dict(prompt_len=9), "prompt_len"), (dict(session_id=""), "session_id")]:
            code, details = code_of(call(**kw))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (field, details)
        assert stack.host.info()["sessions"] == held


def test_a_drafter_dying_mid_stream_changes_no_token(wstack):
    stack = wstack
    ref, _ = stack.generate("autoregressive", "")
    stack.watched.calls, stack.watched.fail_after = 0, 5  # ahead rounds and Proposes fail from the 5th call on
    try:
        out, final = stack.generate("external", "prompt_lookup")
    finally:
        stack.watched.fail_after = None
    assert out == ref and final.stats.fallbacks > 0
    # the router stops drafting after the INTERNAL and does not know what the service holds, so it
    # sends no Release (as without draft-ahead): the service's LRU and the ahead cache's TTL free it
    assert stack.host._ahead["prompt_lookup"].held()["entries"] == 0


class Held(PromptLookupDrafter):
    """Prompt lookup whose ahead rounds (worker thread, budget above 1) block at ``entered``
    until ``go`` while ``hold`` is set; logs every call per session in order."""

    def __init__(self):
        super().__init__()
        self.hold, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()
        self.log: list[tuple[str, str]] = []

    def propose(self, ctx, budget):
        if threading.current_thread().name.startswith("draft-ahead") and budget > 1 and self.hold.is_set():
            self.entered.set()
            self.go.wait(20)
        out = super().propose(ctx, budget)
        self.log.append(("propose", ctx.session_id))
        return out

    def release(self, session_id):
        super().release(session_id)
        self.log.append(("release", session_id))


def test_a_session_released_while_its_ahead_round_runs_leaves_nothing_held():
    """On the drafter service's host: Release arrives while the worker is inside an ahead
    round of the session; it waits for that round (the drafter's lock), frees the
    drafter's state after it, and no later ahead round of the session runs."""
    from specmesh.drafter_service.host import DrafterHost

    d = Held()
    host = DrafterHost({"prompt_lookup": lambda: d}, V)
    toks = [3, 4, 5, 3, 4, 5, 3, 4]
    tree, _, _ = host.propose("s", "prompt_lookup", 0, toks, 4, SamplingParams(), 2)
    d.hold.set()
    assert host.propose_ahead("s", "prompt_lookup", len(toks), [], 4, SamplingParams(), tree, 2) == len(toks)
    assert d.entered.wait(20)
    t = threading.Thread(target=host.release, args=("s",))
    t.start()
    d.hold.clear()
    d.go.set()
    t.join(20)
    assert host.info()["sessions"] == 0
    assert host._ahead["prompt_lookup"].held() == {"sessions": 0, "entries": 0}
    assert [e for e in d.log if e[1] == "s"][-1] == ("release", "s")  # nothing of it after the release


class Stoppable(PromptLookupDrafter):
    """Prompt lookup whose ahead rounds (worker thread, budget above 1) draft until
    ``stop()`` (a preemptible drafter, like the draft LM), at most ``cap`` polls."""

    preemptible = True

    def __init__(self, cap: int = 20_000):
        super().__init__()
        self.cap, self.main = cap, threading.get_ident()
        self.entered, self.stopped = threading.Event(), []

    def propose(self, ctx, budget, stop=None):
        if threading.get_ident() != self.main and budget > 1 and stop is not None:
            self.entered.set()
            n = 0
            while n < self.cap and not stop():
                n += 1
                threading.Event().wait(0.001)
            self.stopped.append(n < self.cap)
        return super().propose(ctx, budget)


def test_a_propose_for_another_outcome_stops_the_ahead_round_at_once():
    """On the drafter service's host: the Propose of the real outcome arrives while the worker
    drafts an ahead round of another; the host reaches the cancel without waiting for the
    drafter's lock (which the ahead round holds), so the round stops between tokens and the
    Propose is a miss drafted afresh (before 2026-12-06 it waited for the wrong round)."""
    from specmesh.drafter_service.host import DrafterHost

    d = Stoppable()
    host = DrafterHost({"prompt_lookup": lambda: d}, V)
    toks = [3, 4, 5, 3, 4, 5, 3, 4]
    tree, _, _ = host.propose("s", "prompt_lookup", 0, toks, 4, SamplingParams(), 2)
    assert host.propose_ahead("s", "prompt_lookup", len(toks), [], 4, SamplingParams(), tree, 3) == len(toks)
    assert d.entered.wait(20)
    other = [t for t in range(V) if t not in tree.tokens[:1]][0]  # round r rejected at 0, another token
    _, held, _, info = host.propose_info("s", "prompt_lookup", len(toks), [other], 4, SamplingParams(), 3)
    assert held == len(toks) + 1 and info.result == "miss"
    assert d.stopped and d.stopped[0] is True  # stopped by the cancel, not by its cap


def test_a_request_turns_draft_ahead_off_or_on_and_a_bad_mode_is_refused(stack):
    """GenerateRequest.draft_ahead overrides the router's setting for one request (how one
    ``specmesh serve`` compares overlap on and off side by side); other values are
    INVALID_ARGUMENT naming the field."""
    ref, _ = stack.generate("autoregressive", "")
    before = samples(scrape(stack.ports["router"]))
    out, final = stack.generate("external", "suffix", draft_ahead="off")
    after = samples(scrape(stack.ports["router"]))
    assert out == ref and final.stats.ahead_hits == final.stats.ahead_misses == 0
    assert total(after, "specmesh_draft_ahead_total", drafter="suffix", result="off") > \
        total(before, "specmesh_draft_ahead_total", drafter="suffix", result="off")
    code, details = code_of(lambda: stack.generate("external", "suffix", draft_ahead="sometimes"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("draft_ahead")


def test_bench_services_names_overlapped_systems():
    from specmesh.cli.bench.services import systems_of

    s = {d["name"]: d for d in systems_of("ar,draft_lm_overlap,draft_lm_serial,suffix")}
    assert s["draft_lm_overlap"]["ours"] == "ours_draft_lm_overlap" and s["draft_lm_overlap"]["draft_ahead"] == "on"
    assert s["draft_lm_serial"]["draft_ahead"] == "off" and s["draft_lm_serial"]["drafter"] == "draft_lm"
    assert s["suffix"]["draft_ahead"] == "" and s["ar"]["strategy"] == "autoregressive"


class Oracle(PromptLookupDrafter):
    """Drafts plain decoding's own continuation (``ref``: prompt and output ids), so every
    round is accepted whole and the drafter's guess of the bonus token is the target's."""

    ref: list = []

    def propose(self, ctx, budget):
        n = len(ctx.tokens)
        if ctx.tokens != self.ref[:n]:
            return TokenTree()
        return TokenTree.chain(self.ref[n:n + budget])


def test_rounds_drafted_ahead_for_all_accepted_are_hits_through_the_services(tmp_path):
    """The ProposeAhead answer carries the "all accepted" ahead round; when the verify ends in
    exactly that outcome the router uses it with no Propose once the answer is in (a hop
    less), else asks the service, which waits for that round (the mechanism, without
    timing: tests/router/test_remote_drafter_ahead.py). With a drafter whose rounds are all
    accepted every drafted round is a hit either way, the output is plain decoding's, and
    no round costs more Proposes than without draft-ahead."""
    oracle = Oracle()

    class OStack(Stack):
        def __init__(self, path):
            TracedStack.__init__(self, path, [GatedVerifier], FakeCodec(), V,
                                 settings=functools.partial(settings, TRACED_SETTINGS),
                                 drafters={"prompt_lookup": lambda: oracle},
                                 router_settings={"draft_ahead": "on", "context_drafters": "drafter"})

    st = OStack(tmp_path / "spans.jsonl")
    try:
        ref, _ = st.generate("autoregressive", "")
        oracle.ref = FakeCodec().encode(PROMPT) + ref
        before = st.host.proposals
        out, final = st.generate("external", "prompt_lookup")
        assert out == ref
        proposes = st.host.proposals - before
        assert final.stats.rounds >= 4 and final.stats.ahead_misses == 0
        # every drafted round (the first too: the prefill round drafts ahead) was drafted ahead
        assert final.stats.ahead_hits == final.stats.rounds
        assert proposes <= final.stats.rounds
        st.mem.clear()
        out, _ = st.generate("external", "prompt_lookup", draft_ahead="off")
        assert out == ref and st.host.proposals - before - proposes == final.stats.rounds  # without: one a round
    finally:
        st.close()


def test_propose_ahead_answers_at_once_while_enough_handlers_wait():
    """A ProposeAhead with return_first waits for its first ahead round and carries it; once
    ``max_waiting`` handlers wait, the next answers at once without it (handler threads stay
    free for the Propose calls)."""
    from specmesh.drafter_service.host import DrafterHost
    from specmesh.drafter_service.servicer import DrafterServicer

    host = DrafterHost({"prompt_lookup": PromptLookupDrafter}, V)
    sv = DrafterServicer(host, max_waiting=1)
    toks = [3, 4, 5, 3, 4, 5, 3, 4]
    tree, _, _ = host.propose("s", "prompt_lookup", 0, toks, 4, SamplingParams(), 2)
    req = drafter_pb2.ProposeAheadRequest(session_id="s", drafter="prompt_lookup",
                                          sync=convert.sync_to_proto(len(toks), []), prompt_len=4,
                                          sampling=convert.sampling_to_proto(SamplingParams()), budget=2,
                                          tree=convert.tree_to_proto(tree), return_first=True)

    class Context:
        @staticmethod
        def time_remaining():
            return 30.0

    full = sv.ProposeAhead(req, Context())
    assert list(full.first_assumed)[:len(tree)] == tree.tokens and len(full.first_tree.tokens) > 0
    assert sv._waiting.acquire(blocking=False)  # the one waiting slot taken
    quick = sv.ProposeAhead(req, Context())
    assert quick.held_len == len(toks) and not quick.first_assumed and not quick.first_tree.tokens
