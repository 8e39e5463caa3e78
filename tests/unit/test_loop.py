"""The draft–verify loop on a tiny random model: greedy identity with arbitrary
drafts (chains and trees), session loss -> re-prefill, a failing drafter -> plain
decoding, stop ids, limits, verifier session pool, and bad input."""

from __future__ import annotations

import random

import pytest

from specmesh.drafters.model_drafters import DraftLMDrafter, LayerSkipDrafter
from specmesh.loop import generate_tokens
from specmesh.types import (InvalidArgument, ResourceExhausted, SamplingParams, TokenTree, VerifyRequest)
from specmesh.verifier import EngineVerifier
from tests.support import tiny_engine


class OracleDrafter:
    """Drafts the true greedy continuation with some corruption, as a chain or a tree."""

    name = "oracle"

    def __init__(self, truth, prompt_len, tree=False, noise=0.3, seed=0):
        self.truth, self.p, self.tree, self.noise = truth, prompt_len, tree, noise
        self.rng = random.Random(seed)

    def propose(self, ctx, budget):
        done = len(ctx.tokens) - self.p
        cont = self.truth[done: done + budget]
        cont = [t if self.rng.random() > self.noise else (t + 1) % 96 for t in cont]
        if not self.tree or len(cont) < 2:
            return TokenTree.chain(cont)
        alt = [(cont[0] + 7) % 96]
        toks = alt + cont
        return TokenTree(toks, [-1, -1] + list(range(1, len(cont))))

    def release(self, sid):
        pass

    def finish(self, sid, tokens, prompt_len):
        pass


class BrokenDrafter(OracleDrafter):
    def propose(self, ctx, budget):
        if len(ctx.tokens) - self.p > 5:
            raise ConnectionError("drafter died")
        return super().propose(ctx, budget)


PROMPT = [5, 17, 33, 2, 64, 12, 12, 80]


@pytest.fixture()
def ver():
    eng, _ = tiny_engine(n_slots=3, max_seq_len=128)
    return EngineVerifier(eng)


def _plain(ver, n=40):
    out, _ = generate_tokens(None, ver, PROMPT, max_new_tokens=n)
    return out


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("budget", [1, 4, 7])
def test_greedy_identity_with_noisy_drafts(ver, tree, budget):
    ref = _plain(ver)
    d = OracleDrafter(ref + [0] * 10, len(PROMPT), tree=tree, seed=budget)
    out, st = generate_tokens(d, ver, PROMPT, max_new_tokens=40, budget=budget)
    assert out == ref
    assert st.accepted_tokens > 0 and st.tau > 1.0
    assert sum(st.accept_hist) == st.rounds
    assert ver.info()["slots_used"] == 0  # released at the end


def test_the_target_entropy_is_asked_for_only_where_something_drafts(ver):
    """Plain decoding asks the verifier for no entropy (a softmax over the vocabulary a
    round, for a budget policy that has nothing to size), nor does a policy that ignores
    it (a fixed budget, a block drafter's without a tree schedule); a drafter under the
    adaptive policy does, after its first round."""
    from specmesh.loop import AdaptiveBudget

    asked = []
    verify = ver.verify

    def recording(req):
        asked.append(req.want_entropy)
        return verify(req)

    ver.verify = recording
    ref = _plain(ver, 12)
    assert asked and not any(asked)
    asked.clear()
    out, _ = generate_tokens(OracleDrafter(ref + [0] * 10, len(PROMPT)), ver, PROMPT, max_new_tokens=12, budget=4)
    assert out == ref and len(asked) > 1 and not any(asked)  # a fixed budget
    for policy, wants in ((AdaptiveBudget(4), True), (AdaptiveBudget(4, per_round_draft=True), False)):
        asked.clear()
        out, _ = generate_tokens(OracleDrafter(ref + [0] * 10, len(PROMPT)), ver, PROMPT, max_new_tokens=12,
                                 budget=policy)
        assert out == ref and policy.uses_entropy is wants and len(asked) > 1
        assert asked[0] is False and all(a is wants for a in asked[1:])


def test_session_lost_reprefills(ver):
    ref = _plain(ver)

    class Forgetful(OracleDrafter):
        def propose(self, ctx, budget):
            if len(ctx.tokens) - self.p in (3, 11):
                ver.release(ctx.session_id)  # the verifier "restarts"
            return super().propose(ctx, budget)

    out, _ = generate_tokens(Forgetful(ref + [0] * 10, len(PROMPT)), ver, PROMPT, max_new_tokens=40, budget=4)
    assert out == ref


def test_drafter_failure_falls_back_to_plain(ver):
    ref = _plain(ver)
    errors = []
    out, st = generate_tokens(BrokenDrafter(ref + [0] * 10, len(PROMPT)), ver, PROMPT, max_new_tokens=40, budget=4,
                              on_drafter_error=lambda e: errors.append(e) or False)
    assert out == ref and st.fallbacks == 1 and len(errors) == 1


def test_model_drafters_identity(ver):
    ref = _plain(ver)
    eng2, _ = tiny_engine(n_slots=2, max_seq_len=128, seed=1)
    out, _ = generate_tokens(DraftLMDrafter(eng2), ver, PROMPT, max_new_tokens=40, budget=3)
    assert out == ref
    out, _ = generate_tokens(LayerSkipDrafter(ver, exit_layer=2), ver, PROMPT, max_new_tokens=40, budget=3)
    assert out == ref
    ver.self_drafters["layerskip"] = LayerSkipDrafter(ver, exit_layer=2)
    out, st = generate_tokens(None, ver, PROMPT, max_new_tokens=40, budget=3, self_draft="layerskip")
    assert out == ref and st.drafted_tokens > 0


def test_sampling_is_seeded_and_runs_with_model_drafter(ver):
    eng2, _ = tiny_engine(n_slots=2, max_seq_len=128, seed=1)
    s = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    a, _ = generate_tokens(DraftLMDrafter(eng2), ver, PROMPT, sampling=s, max_new_tokens=30, budget=3)
    b, _ = generate_tokens(DraftLMDrafter(eng2), ver, PROMPT, sampling=s, max_new_tokens=30, budget=3)
    assert a == b and len(a) == 30


def test_stop_ids_and_length(ver):
    ref = _plain(ver)
    stop = ref[10]
    first = ref.index(stop)
    out, st = generate_tokens(None, ver, PROMPT, max_new_tokens=40, stop_ids=[stop])
    assert out == ref[:first] and st.finish_reason == "stop"
    out, st = generate_tokens(OracleDrafter(ref, len(PROMPT)), ver, PROMPT, max_new_tokens=13, budget=6)
    assert out == ref[:13] and st.finish_reason == "length"


@pytest.mark.parametrize("kw,field", [
    (dict(prompt_ids=[]), "prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt_ids=[1, 2, 999]), "prompt_ids"),
    (dict(max_new_tokens=50, max_new_limit=10), "max_new_tokens"),
])
def test_bad_requests_name_the_field(ver, kw, field):
    args = dict(prompt_ids=PROMPT, max_new_tokens=5)
    args.update(kw)
    with pytest.raises(InvalidArgument) as e:
        generate_tokens(None, ver, args.pop("prompt_ids"), **args)
    assert e.value.field == field
    assert ver.info()["slots_used"] == 0


def test_verifier_rejects_malformed_trees_without_state_change(ver):
    ver.verify(VerifyRequest("s", 0, PROMPT, TokenTree()))
    before = ver.engine.length(ver.slot_of("s"))
    bad = [
        (TokenTree([1, 2], [-1, 3]), "tree.parents"),
        (TokenTree([1, 500], [-1, 0]), "tree.tokens"),
        (TokenTree([1, 2], [-1]), "tree.parents"),
        (TokenTree([1], [-1], q_ids=[[1, 2]], q_probs=[[0.2, 0.2]]), "tree.q_probs"),
        (TokenTree([1], [-1], q_ids=[[3, 2]], q_probs=[[0.5, 0.5]]), "tree.q_ids"),
    ]
    for tree, field in bad:
        with pytest.raises(InvalidArgument) as e:
            ver.verify(VerifyRequest("s", before - 2, [7], tree))
        assert e.value.field == field
        assert ver.engine.length(ver.slot_of("s")) == before
    with pytest.raises(InvalidArgument):
        ver.verify(VerifyRequest("s", -1, [7]))
    with pytest.raises(InvalidArgument):
        ver.verify(VerifyRequest("s", before, []))
    assert ver.engine.length(ver.slot_of("s")) == before


def test_session_pool_lru_and_exhaustion(ver):
    for s in ("a", "b", "c"):
        ver.verify(VerifyRequest(s, 0, [1, 2, 3]))
    ver.verify(VerifyRequest("d", 0, [1, 2, 3]))  # evicts the least recently used: "a"
    assert set(ver.info()["sessions"]) == {"b", "c", "d"} and ver.info()["evictions"] == 1
    ver.pool.busy.update({"b", "c", "d"})
    with pytest.raises(ResourceExhausted):
        ver.verify(VerifyRequest("e", 0, [1, 2, 3]))
    ver.pool.busy.clear()


def test_batch_equals_single(ver):
    reqs = [VerifyRequest(f"s{i}", 0, PROMPT[: 3 + i], TokenTree.chain([1, 2, 3][: i + 1])) for i in range(3)]
    batched = ver.verify_batch(reqs)
    for r in reqs:
        ver.release(r.session_id)
    single = [ver.verify(r) for r in reqs]
    assert [(b.accepted, b.next_token) for b in batched] == [(s.accepted, s.next_token) for s in single]
    assert batched[0].batch_size == 3
    # the rows the one forward scored for all three (appended + tree nodes: 4 + 6 + 8)
    assert [b.batch_rows for b in batched] == [18] * 3 and [s.batch_rows for s in single] == [4, 6, 8]
