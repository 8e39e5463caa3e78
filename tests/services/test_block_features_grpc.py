"""The block drafter outside the verifier: hidden features on the wire (tiny random models).

- the verifier returns each committed position's features once (a rejected draft's
  positions never), and the rows the router keeps equal the verifier's own copy;
- ``BlockFeatureDrafter`` fed those rows drafts exactly what the in-verifier
  ``BlockSelfDrafter`` drafts, round by round (chain and tree, greedy and sampled);
- through the services (router, drafter service, verifier service on loopback):
  ``external:block_tree`` / ``external:block`` give the tokens of ``self:`` and of
  plain decoding, with the same drafts (drafted and accepted counts);
- bad features get INVALID_ARGUMENT naming the field and change nothing; a verifier
  asked for bad layers too;
- killing the drafter service mid-stream changes no token: the rounds fall back to
  plain decoding, and a new replica on the same address is re-seeded with the
  committed tokens and the last window of features.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from specmesh.blockdraft.serve import BlockFeatureDrafter, BlockSelfDrafter
from specmesh.engine import LlamaEngine
from specmesh.loop import generate_tokens
from specmesh.router.adapters import FeatureLog
from specmesh.wire import convert
from specmesh.types import FeatureRows, InvalidArgument, SamplingParams, TokenTree, VerifyRequest
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh.verifier import EngineVerifier
from tests.support import (V, BlockStack, FakeCodec, code_of, healthy, shared_tiny_weights, tiny_block_factories,
                           tiny_block_model, wait_for)

PROMPT = "abcabcabcabc hello hello hello abcabc"
LAYERS = (0, 1)
DIM = 2 * 64


def _verifier() -> EngineVerifier:
    w = shared_tiny_weights()
    return EngineVerifier(LlamaEngine(w[0], w[1], n_slots=4, max_seq_len=256))


def reference(n: int) -> list[int]:
    out, _ = generate_tokens(None, _verifier(), FakeCodec().encode(PROMPT), max_new_tokens=n, stop_ids=[1])
    return out


def _rows(start: int, rows: int, **kw) -> FeatureRows:
    base = dict(start=start, rows=rows, dim=DIM, layers=LAYERS, dtype="bfloat16", data=bytes(rows * DIM * 2))
    base.update(kw)
    return FeatureRows(**base)


# ---------------------------------------------------------------- in process

def test_feature_rows_check_names_the_field():
    _rows(0, 3).check(LAYERS, DIM)
    for field, bad in (("features.dtype", _rows(0, 3, dtype="float16")), ("features.layers", _rows(0, 3, layers=(1,))),
                       ("features.dim", _rows(0, 3, dim=DIM + 1)), ("features.data", _rows(0, 3, data=b"\0" * 10)),
                       ("features.start", _rows(-1, 0))):
        with pytest.raises(InvalidArgument) as e:
            bad.check(LAYERS, DIM)
        assert e.value.field == field


def test_verifier_returns_each_committed_position_once_across_rollback():
    v = _verifier()
    prompt = FakeCodec().encode(PROMPT)
    log = FeatureLog(LAYERS, DIM, 16)
    r = v.verify(VerifyRequest("f", 0, prompt, feature_layers=LAYERS))
    assert (r.features.start, r.features.rows) == (0, len(prompt)) and r.cache_len == len(prompt)
    log.put(r.features, r.cache_len)
    tokens = prompt + [r.next_token]
    rejected = 0
    for i in range(6):  # a 3-node chain, mostly rejected: its positions are scored, never kept
        tree = TokenTree.chain([(7 * i + 3) % V, 5, 9])
        r = v.verify(VerifyRequest("f", len(tokens) - 1, tokens[-1:], tree, feature_layers=LAYERS))
        assert r.features.start == len(tokens) - 1 and r.features.end == r.cache_len
        assert r.features.rows == 1 + len(r.accepted)
        rejected += len(tree) - len(r.accepted)
        log.put(r.features, r.cache_len)
        tokens += r.accepted + [r.next_token]
    assert rejected > 0
    slot = v.slot_of("f")
    kept = v.session_features(slot, list(LAYERS)).to(torch.bfloat16)
    got = torch.frombuffer(bytearray(log.data), dtype=torch.bfloat16).view(-1, DIM)
    assert log.n == len(tokens) - 1 and torch.equal(got, kept)
    # one layer of two: its columns
    r = v.verify(VerifyRequest("f", len(tokens) - 1, tokens[-1:], feature_layers=(1,)))
    one = torch.frombuffer(bytearray(r.features.data), dtype=torch.bfloat16).view(-1, 64)
    assert torch.equal(one, v.session_features(slot, [1], start=r.features.start).to(torch.bfloat16))
    for bad in ((2,), (0, 0), (-1,)):
        with pytest.raises(InvalidArgument) as e:
            v.verify(VerifyRequest("g", 0, prompt, feature_layers=bad))
        assert e.value.field == "feature_layers"
    assert v.slot_of("g") is None


class _Tap:
    """The verifier with the router's feature handling: asks for the layers, keeps the rows."""

    def __init__(self, v, log):
        self.v, self.log, self.vocab_size = v, log, v.vocab_size

    def verify(self, req):
        req.feature_layers = self.log.layers
        res = self.v.verify(req)
        self.log.put(res.features, res.cache_len)
        return res

    def release(self, sid):
        self.v.release(sid)


class _Both:
    """Drafts with the feature drafter (fed the log's rows by delta) and checks the in-verifier
    drafter proposes the same tree."""

    name = "both"

    def __init__(self, fd, sd, log):
        self.fd, self.sd, self.log = fd, sd, log
        self.held, self.rows, self.rounds = 0, 0, 0

    def propose(self, ctx, budget):
        keep = min(self.held, len(ctx.tokens))
        feats = self.log.rows(self.rows if keep else max(0, self.log.n - self.log.window))
        self.fd.check_features(ctx.session_id, feats, keep, len(ctx.tokens))
        self.fd.sync_features(ctx.session_id, feats, keep)
        self.held, self.rows = len(ctx.tokens), feats.end
        ours = self.fd.propose(ctx, budget)
        theirs = self.sd.propose(ctx, budget)
        assert (ours.tokens, ours.parents, ours.q_ids, ours.q_probs) == \
            (theirs.tokens, theirs.parents, theirs.q_ids, theirs.q_probs)
        self.rounds += len(ours) > 0
        return ours

    def release(self, sid):
        self.fd.release(sid)

    def finish(self, sid, toks, p):
        self.fd.release(sid)


@pytest.mark.parametrize("tree,temperature", [(True, 0.0), (False, 0.0), (False, 0.9)])
def test_feature_drafter_drafts_what_the_self_drafter_drafts(tree, temperature):
    model = tiny_block_model(shared_tiny_weights()[1], V)
    v = _verifier()
    sd = BlockSelfDrafter(v, model, tree=tree, amp=False)
    fd = BlockFeatureDrafter(model, tree=tree, amp=False)
    log = FeatureLog(fd.feature_layers, fd.feature_dim, fd.context_window)
    both = _Both(fd, sd, log)
    sp = SamplingParams(temperature=temperature, seed=3)
    out, st = generate_tokens(both, _Tap(v, log), FakeCodec().encode(PROMPT), max_new_tokens=60, budget=4,
                              sampling=sp, session_id="s")
    assert both.rounds >= 20 and st.drafted_tokens > 0  # the window (16) was passed: the cache slid
    if sp.greedy:  # sampled: the same distribution, not the same tokens (tests/unit/test_distribution.py)
        assert out == reference(60)


def test_feature_drafter_sync_rules():
    """Rows that connect extend; rows that jump replace (and must cover the window); a
    session the drafter dropped is SessionLost (resend from 0); the window bounds memory."""
    from specmesh.types import SessionLost

    fd = BlockFeatureDrafter(tiny_block_model(shared_tiny_weights()[1], V), amp=False, max_sessions=1)
    fd.check_features("a", _rows(0, 40), 0, 41)
    fd.sync_features("a", _rows(0, 40), 0)
    assert fd.feature_len("a") == (0, 40)
    fd.sync_features("a", _rows(40, 30), 41)  # more than twice the window (16 + block 4): compacted
    lo, hi = fd.feature_len("a")
    assert hi == 70 and lo == 70 - 20
    with pytest.raises(InvalidArgument) as e:  # a jump that does not cover the window
        fd.check_features("a", _rows(75, 0), 71, 76)
    assert e.value.field == "features.rows"
    fd.sync_features("a", _rows(60, 15), 71)  # connects inside the held rows: keeps [50, 60)
    assert fd.feature_len("a") == (50, 75)
    fd.check_features("a", _rows(40, 36), 75, 77)  # before the held rows, covering the window: replaces
    fd.sync_features("a", _rows(40, 36), 75)
    assert fd.feature_len("a") == (40, 76)
    fd.sync_features("b", _rows(0, 3), 0)  # max_sessions=1: "a" is dropped
    with pytest.raises(SessionLost):
        fd.check_features("a", _rows(76, 1), 77, 78)
    fd.check_features("a", _rows(60, 17), 0, 78)  # the full resend is fine


# ---------------------------------------------------------------- through the services

@pytest.fixture(scope="module")
def stack():
    st = BlockStack()
    yield st
    st.close()


def test_external_block_drafters_equal_self_and_plain(stack):
    from specmesh.client import Client

    ref = reference(48)
    with Client(stack.address, timeout=60) as c:
        for name in ("block_tree", "block"):
            # a pinned budget: the same rounds (an adaptive one follows each run's timings)
            own = c.generate(PROMPT, strategy="self", drafter=name, max_new_tokens=48, draft_budget=6)
            ext = c.generate(PROMPT, strategy="external", drafter=name, max_new_tokens=48, draft_budget=6)
            assert ext.token_ids == own.token_ids == ref, name
            assert ext.stats.drafter == name and ext.stats.strategy == "external" and ext.stats.fallbacks == 0
            # the same drafts: the drafter service read the verifier's features
            assert (ext.stats.drafted_tokens, ext.stats.accepted_tokens) == \
                (own.stats.drafted_tokens, own.stats.accepted_tokens), name
            assert ext.stats.drafted_tokens > 0
        sp = dict(temperature=0.9, seed=11)
        own = c.generate(PROMPT, strategy="self", drafter="block", max_new_tokens=40, **sp)
        ext = c.generate(PROMPT, strategy="external", drafter="block", max_new_tokens=40, **sp)
        assert ext.token_ids == own.token_ids
        assert (ext.stats.drafted_tokens, ext.stats.accepted_tokens) == \
            (own.stats.drafted_tokens, own.stats.accepted_tokens)
        info = {x.name: list(x.drafters) for x in c.list_strategies().strategies}
    assert {"block", "block_tree"} <= set(info["external"])
    specs = {f.drafter: (list(f.layers), f.dim, f.context_window) for f in stack.drafter_info().feature_drafters}
    assert specs == {"block": ([0, 1], DIM, 16), "block_tree": ([0, 1], DIM, 16)}
    assert wait_for(lambda: stack.drafter_info().sessions == 0)


def test_strategies_without_feature_drafters_pay_nothing(stack):
    """Only a drafter that needs features makes the router ask for them."""
    from specmesh.client import Client

    seen = []
    v = stack.verifiers[0]
    orig = v.verify_batch

    def spy(reqs, *limits):
        seen.extend(tuple(r.feature_layers) for r in reqs)
        return orig(reqs, *limits)

    v.verify_batch = spy
    try:
        with Client(stack.address, timeout=60) as c:
            for strategy, drafter in (("external", "prompt_lookup"), ("self", "block_tree"), ("autoregressive", "")):
                c.generate(PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=12)
            assert seen and all(layers == () for layers in seen)
            seen.clear()
            c.generate(PROMPT, strategy="external", drafter="block_tree", max_new_tokens=12)
            assert seen and all(layers == LAYERS for layers in seen)
    finally:
        del v.verify_batch


def _propose(stub, sid, keep, append, feats=None, drafter="block_tree", budget=3):
    req = drafter_pb2.ProposeRequest(session_id=sid, drafter=drafter, budget=budget, prompt_len=1,
                                     sync=common_pb2.SessionSync(keep_len=keep, append_tokens=append))
    if feats is not None:
        req.features.CopyFrom(convert.features_to_proto(feats))
    return stub.Propose(req, timeout=10)


def test_bad_features_are_invalid_argument_and_change_nothing(stack):
    addr = stack.dserver.address
    with grpc.insecure_channel(addr) as ch:
        stub = drafter_pb2_grpc.DrafterStub(ch)
        r = _propose(stub, "fb", 0, [5, 6, 7, 8, 9], _rows(0, 4))  # 5 tokens: rows of positions 0..3
        assert r.held_len == 5 and len(r.tree.tokens) > 0
        before = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
        good = _rows(4, 1)
        cases = {
            "features.dtype": _rows(4, 1, dtype="float32"),
            "features.data": _rows(4, 1, data=b"\0" * (DIM * 2 - 2)),
            "features.dim": _rows(4, 1, dim=DIM - 2, data=bytes((DIM - 2) * 2)),
            "features.layers": _rows(4, 1, layers=(1, 0)),
            "features.rows": _rows(4, 0),  # missing the new position's row
            "features.rows ": _rows(4, 3),  # rows past the pending token
        }
        for name, feats in cases.items():
            c, d = code_of(lambda: _propose(stub, "fb", 5, [3], feats))
            assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name.strip()), (name, c, d)
        c, d = code_of(lambda: _propose(stub, "fb", 5, [3], None))  # no features at all
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("features.rows"), d
        c, d = code_of(lambda: _propose(stub, "fb", 5, [3], good, drafter="prompt_lookup"))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("features"), d
        # rows that do not follow the held ones: resend from 0
        c, _ = code_of(lambda: _propose(stub, "fb", 5, [3], _rows(6, 0)))
        assert c in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        after = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
        assert after.sessions == before.sessions and after.proposals == before.proposals
        # nothing changed: the good delta from 5 tokens / 4 rows still applies
        r = _propose(stub, "fb", 5, [3], good)
        assert r.held_len == 6
        assert stub.Release(drafter_pb2.DrafterReleaseRequest(session_id="fb"), timeout=5).released
    with grpc.insecure_channel(stack.vservers[0].address) as ch:
        vstub = verifier_pb2_grpc.VerifierStub(ch)
        c, d = code_of(lambda: vstub.Verify(verifier_pb2.VerifyRequest(
            session_id="vf", sync=common_pb2.SessionSync(keep_len=0, append_tokens=[5, 6]), feature_layers=[9]),
            timeout=10))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("feature_layers"), d
        assert stack.verifiers[0].slot_of("vf") is None
    assert healthy(addr)


def test_killing_the_drafter_mid_stream_keeps_the_output_and_reseeds_a_new_replica():
    from specmesh.client import Client
    from specmesh.drafter_service.servicer import drafter_service
    from specmesh.serving.server import build_server

    n = 64
    ref = reference(n)
    st = BlockStack(max_new_tokens=n)
    v = st.verifiers[0]
    calls, gates = [0], {4: (threading.Event(), threading.Event()), 8: (threading.Event(), threading.Event())}
    orig = v.verify_batch

    def gated(reqs, *limits):  # pauses inside the 4th and the 8th verify forward
        calls[0] += 1
        if calls[0] in gates:
            reached, resume = gates[calls[0]]
            reached.set()
            resume.wait(30)
        return orig(reqs, *limits)

    v.verify_batch = gated
    try:
        with Client(st.address, timeout=60) as c:
            s = c.stream(PROMPT, strategy="external", drafter="block_tree", max_new_tokens=n, draft_budget=4)
            it = iter(s)
            next(it)
            assert gates[4][0].wait(10)
            port = st.dserver.port
            st.dserver.server.stop(0)  # the drafter replica dies mid-stream
            gates[4][1].set()
            assert gates[8][0].wait(10)  # rounds went on without drafts meanwhile
            dsvc = drafter_service(st.s, vocab_size=V, factories=tiny_block_factories())
            st.dserver = build_server(st.s, [dsvc], port)  # a new replica on the same address
            assert wait_for(lambda: healthy(f"127.0.0.1:{port}"), 10)
            time.sleep(2.5)  # the router's backoff and its channel's reconnect
            gates[8][1].set()
            list(it)
        assert s.token_ids == ref
        assert s.stats.fallbacks >= 1
        new = dsvc.servicer.host
        assert new.proposals > 0, "the new replica was re-seeded and drafted"
        assert s.stats.drafted_tokens > 0
    finally:
        for _, resume in gates.values():
            resume.set()
        st.close()
