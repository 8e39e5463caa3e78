"""Default drafters in the router's strategy resolution, against fake replicas:
``self`` without a drafter gets the trained block drafter's tree when the verifiers
have it (layer-skip otherwise), ``auto`` picks it on fresh text and switches away
where it measured a slowdown, and the router's look-up of the verifiers' self
drafters (Verifier/Info, cached, intersected over replicas).
``tests/services/test_defaults_grpc.py`` checks the same defaults through real
gRPC servers on loopback."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from specmesh.router import strategies as rs
from specmesh.router.core import GenerateSpec
from specmesh.types import InvalidArgument

# ---------------------------------------------------------------- the look-up, fake replicas


class _Stub:
    def __init__(self, names=None, fail=False, context=()):
        self.names, self.fail, self.calls, self.context = names or [], fail, 0, list(context)

    def Info(self, req, timeout=None, metadata=()):
        self.calls += 1
        if self.fail:
            raise _RpcError()
        return SimpleNamespace(self_drafters=list(self.names), context_drafters=self.context)


class _RpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def _router(*stubs, default_drafter="prompt_lookup", context_drafters="verifier", drafter=None):
    peers = [SimpleNamespace(address=f"v{i}", stub=s, health=SimpleNamespace(available=lambda: True))
             for i, s in enumerate(stubs)]
    s = SimpleNamespace(verifier_timeout_s=5.0, default_drafter=default_drafter, default_strategy="external",
                        model="m", dtype="fp32", layerskip_exit=None, context_drafters=context_drafters)
    return rs.Collaborators(s=s, codec=None, replicas=SimpleNamespace(peers=peers), drafter=drafter, vocab_size=0)


def test_self_drafters_are_the_replicas_intersection_and_cached(monkeypatch):
    full = _Stub(["block", "block_tree", "layerskip"])
    st = rs.Strategies(_router(full))
    assert st.self_drafters() == {"block", "block_tree", "layerskip"}
    assert st.default_drafters()["self"] == "block_tree"
    st.self_drafters()
    assert full.calls == 1  # cached
    # a second replica without the block drafter: a session may land there, so layer-skip
    st = rs.Strategies(_router(_Stub(["block", "block_tree", "layerskip"]), _Stub(["layerskip"])))
    assert st.self_drafters() == {"layerskip"} and st.default_drafters()["self"] == "layerskip"
    # a replica that does not answer is left out; none answering: unknown (layer-skip) and retried soon
    st = rs.Strategies(_router(_Stub(fail=True), _Stub(["block_tree", "layerskip"])))
    assert st.default_drafters()["self"] == "block_tree"
    dead = _Stub(fail=True)
    st = rs.Strategies(_router(dead))
    assert st.self_drafters() == frozenset() and st.default_drafters()["self"] == "layerskip"
    clock = [1000.0]
    monkeypatch.setattr(rs.time, "monotonic", lambda: clock[0])
    st._self_until = 0.0
    st.self_drafters()
    n = dead.calls
    clock[0] += rs.SELF_INFO_RETRY_S / 2
    st.self_drafters()
    assert dead.calls == n
    clock[0] += rs.SELF_INFO_RETRY_S
    dead.fail, dead.names = False, ["layerskip", "block_tree"]
    assert st.self_drafters() == {"layerskip", "block_tree"} and dead.calls == n + 1


def test_resolve_self_default_and_validation():
    ids = [5, 6, 7]
    with_block = rs.Strategies(_router(_Stub(["block", "block_tree", "layerskip"])))
    r = with_block.resolve(GenerateSpec(prompt="x", strategy="self"), ids, False)
    assert (r.strategy, r.self_draft) == ("self", "block_tree") and "block drafter" in r.reason
    r = with_block.resolve(GenerateSpec(prompt="x", strategy="self", drafter="layerskip"), ids, False)
    assert r.self_draft == "layerskip" and r.reason == "requested"
    without = rs.Strategies(_router(_Stub(["layerskip"])))
    r = without.resolve(GenerateSpec(prompt="x", strategy="self"), ids, False)
    assert r.self_draft == "layerskip" and "no block drafter" in r.reason
    with pytest.raises(InvalidArgument, match="block"):
        without.resolve(GenerateSpec(prompt="x", strategy="self", drafter="block_tree"), ids, False)
    with pytest.raises(InvalidArgument):
        with_block.resolve(GenerateSpec(prompt="x", strategy="self", drafter="suffix"), ids, False)
    d = with_block.default_drafters()
    assert d == {"autoregressive": "", "external": "prompt_lookup", "self": "block_tree", "proactive": "cache",
                 "ssr": "cache", "auto": ""}


def test_resolve_auto_uses_the_block_tree_on_fresh_text_and_switches_away(monkeypatch):
    monkeypatch.setattr(rs.Strategies, "layerskip_speedup", lambda self: None)
    monkeypatch.setattr(rs, "_drafter_up", lambda router: True)
    ids = list(range(2, 30))
    fresh = GenerateSpec(prompt="Write a poem about autumn.", strategy="auto", conversation_id="c1")
    st = rs.Strategies(_router(_Stub(["block", "block_tree", "layerskip"])))
    r = st.resolve(fresh, ids, False)
    assert (r.strategy, r.self_draft, r.drafter) == ("self", "block_tree", None) and r.reason.startswith("auto:")
    code = GenerateSpec(prompt="Fix this:\n```python\nx = 1\n```", strategy="auto", conversation_id="c1")
    assert st.resolve(code, ids, False).drafter == "suffix"
    # the session measured the tree below 1x: the next request goes to suffix decoding, the switch is counted
    st.book.record("conv:c1", "self:block_tree", 1.1, 0.7)
    r = st.resolve(fresh, ids, False)
    assert (r.strategy, r.drafter) == ("external", "suffix") and "0.70x" in r.reason
    assert st.book.get("conv:c1")["self:block_tree"].skipped == 1
    # without a block drafter, fresh text goes to suffix decoding as before
    st2 = rs.Strategies(_router(_Stub(["layerskip"])))
    assert st2.resolve(fresh, ids, False).drafter == "suffix"


def test_divergence_without_a_drafter_gets_the_specialist():
    """Divergence verifies the specialist's own drafts, so a divergence request naming
    no drafter is routed to self/specialist whatever default strategy the router has
    (the SDK, the CLI and the OpenAI front alike); ListStrategies says so."""
    from specmesh.types import SamplingParams

    ids = [5, 6, 7]
    st = rs.Strategies(_router(_Stub(["layerskip", "specialist", "block_tree"])))
    div = SamplingParams(acceptance="divergence")
    for strategy in ("", "self", "auto"):
        r = st.resolve(GenerateSpec(prompt="x", strategy=strategy, sampling=div), ids, False)
        assert (r.strategy, r.self_draft, r.drafter) == ("self", "specialist", None), strategy
        assert "divergence" in r.reason
    # a named drafter is kept (the verifier then says divergence needs the specialist's drafts)
    r = st.resolve(GenerateSpec(prompt="x", strategy="self", drafter="layerskip", sampling=div), ids, False)
    assert r.self_draft == "layerskip"
    # other rules keep the usual default
    r = st.resolve(GenerateSpec(prompt="x", strategy="self"), ids, False)
    assert r.self_draft == "block_tree"
    assert "divergence" in rs.STRATEGIES["self"] and "specialist" in rs.STRATEGIES["self"]


def test_draft_lm_is_marked_a_stand_in_where_it_is_listed():
    from specmesh.drafters import registry

    assert "stand-in" in registry.DRAFT_LM_NOTE and "make setup-qwen" in registry.DRAFT_LM_NOTE
    assert "qwen2.5-coder-1.5b-instruct" in registry.DRAFT_LM_NOTE
    assert registry.DRAFT_LM_NOTE in rs.STRATEGIES["external"]  # ListStrategies' description of external
    assert "STAND-IN" in registry.spec("draft_lm").summary


def test_external_context_drafters_run_in_the_verifiers_that_all_host_them(monkeypatch):
    """An external request's prompt lookup or suffix drafter runs in the verifier (its
    rounds: SelfDraft with the drafter's name, no drafter service needed) where every
    replica that answered Info hosts it and the router's ``context_drafters`` is
    "verifier"; otherwise on the drafter service, as before."""
    ids = [5, 6, 7]
    service = SimpleNamespace(health=SimpleNamespace(available=lambda: True))
    both = rs.Strategies(_router(_Stub(["layerskip"], context=["prompt_lookup", "suffix"]),
                                 _Stub(["layerskip"], context=["suffix"])))
    r = both.resolve(GenerateSpec(prompt="x", strategy="external", drafter="suffix"), ids, False)
    assert (r.strategy, r.drafter, r.self_draft) == ("external", None, "suffix") and "in the verifier" in r.reason
    assert both.self_drafters() == {"layerskip"} and both.context_drafters() == {"suffix"}
    # not every replica hosts prompt_lookup: the drafter service drafts it (none here: refused)
    with pytest.raises(InvalidArgument, match="drafter service"):
        both.resolve(GenerateSpec(prompt="x", strategy="external", drafter="prompt_lookup"), ids, False)
    on_service = rs.Strategies(_router(_Stub(["layerskip"], context=["suffix"]), context_drafters="drafter",
                                       drafter=service))
    r = on_service.resolve(GenerateSpec(prompt="x", strategy="external", drafter="suffix"), ids, False)
    assert (r.drafter, r.self_draft) == ("suffix", None) and r.reason == "requested"
    # auto's suffix choice stands with the drafter service down where the verifiers run suffix
    monkeypatch.setattr(rs.Strategies, "layerskip_speedup", lambda self: None)
    code = GenerateSpec(prompt="Fix this:\n```python\nx = 1\n```", strategy="auto")
    r = both.resolve(code, ids, False)
    assert (r.strategy, r.drafter, r.self_draft) == ("external", None, "suffix")
    no_suffix = rs.Strategies(_router(_Stub(["layerskip"])))
    assert no_suffix.resolve(code, ids, False).strategy == "autoregressive"  # drafter service down, none hosts it


class _DrafterStub:
    """A drafter service's Info: a real draft model, measured (issue 62)."""

    def __init__(self, model="qwen2.5-coder-0.5b-instruct", prefill_ms=2.0, token_ms=25.0):
        self.model, self.prefill_ms, self.token_ms, self.calls = model, prefill_ms, token_ms, 0

    def Info(self, req, timeout=None, metadata=()):
        self.calls += 1
        return SimpleNamespace(feature_drafters=[], draft_model=self.model, draft_prefill_ms=self.prefill_ms,
                               draft_token_ms=self.token_ms)


def test_resolve_auto_tries_the_paired_draft_model_the_drafter_service_runs(monkeypatch):
    monkeypatch.setattr(rs.Strategies, "layerskip_speedup", lambda self: None)
    stub = _DrafterStub()
    peer = SimpleNamespace(address="d", stub=stub, health=SimpleNamespace(available=lambda: True))
    parts = _router(_Stub(["layerskip"]), drafter=peer)
    parts.s.drafter_timeout_s = None
    st = rs.Strategies(parts)
    ids = list(range(2, 30))
    fresh = GenerateSpec(prompt="Write a function that merges two sorted lists.", strategy="auto",
                         conversation_id="c1")
    r = st.resolve(fresh, ids, False)
    assert (r.strategy, r.drafter) == ("external", "draft_lm") and "qwen2.5-coder-0.5b-instruct" in r.reason
    code = GenerateSpec(prompt="Fix this:\n```python\nx = 1\n```", strategy="auto", conversation_id="c1")
    assert st.resolve(code, ids, False).drafter == "suffix"  # copy cues keep suffix decoding
    # measured faster in the session: kept; slower: suffix decoding, the switch counted
    st.book.record("conv:c1", "external:draft_lm", 5.0, 1.4)
    assert st.resolve(fresh, ids, False).drafter == "draft_lm"
    st.book.record("conv:c2", "external:draft_lm", 1.1, 0.6)
    r = st.resolve(GenerateSpec(prompt=fresh.prompt, strategy="auto", conversation_id="c2"), ids, False)
    assert r.drafter == "suffix" and "0.60x" in r.reason and st.book.get("conv:c2")["external:draft_lm"].skipped == 1
    assert stub.calls == 1  # the drafter's Info is cached
    # the stand-in draft LM (no real model): fresh text goes to suffix decoding as before
    stub.model = ""
    st2 = rs.Strategies(parts)
    assert st2.resolve(fresh, ids, False).drafter == "suffix"


def test_the_draft_lm_deadline_follows_its_measured_speed():
    from specmesh.router.adapters import Calls, DraftSpeed, RemoteDrafter

    speed = DraftSpeed(prefill_ms=2.0, token_ms=25.0)
    # a first Propose of a 2,000-token prompt and 8 draft tokens: 2 + 4 x (4 + 0.2) s
    assert speed.deadline_s(2.0, 2000, 8) == pytest.approx(2.0 + 4 * (2000 * 2.0 + 8 * 25.0) / 1e3)
    d = RemoteDrafter(SimpleNamespace(), "draft_lm", Calls(timeout_s=60.0), 2.0, speed=speed)
    assert d._deadline(2000, 8) == pytest.approx(18.8) and d._deadline(1, 8) == pytest.approx(2.808)
    assert RemoteDrafter(SimpleNamespace(), "suffix", Calls(timeout_s=60.0), 2.0)._deadline(2000, 8) == 2.0
    assert d._deadline(100_000, 8) == 60.0  # never past the generation's own deadline
    assert rs.drafter_timeout(SimpleNamespace(drafter_timeout_s=None)) == rs.DRAFTER_TIMEOUT_S
    assert rs.drafter_timeout(SimpleNamespace(drafter_timeout_s=30.0)) == 30.0
