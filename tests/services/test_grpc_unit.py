"""Fast tests of the gRPC layer on a tiny random-weight Llama (no real model):
conversions, stale stubs, interceptors, the dynamic batcher, bad input to every
service, the router end to end over loopback (greedy and sampled output equal
the in-process loop), faults (verifier restart, drafter loss), cancellation and
limits, the SDK and the CLI."""

from __future__ import annotations

import asyncio
from concurrent.futures import CancelledError
import importlib.util
import os
import queue
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.drafters import PromptLookupDrafter
from specmesh.engine import LlamaEngine
from specmesh.errors import InvalidArgumentError, ResourceExhaustedError, from_rpc_error
from specmesh.loop import generate_tokens
from specmesh.wire import convert
from specmesh.serving.interceptors import AuthInterceptor, ErrorInterceptor
from specmesh.serving.server import build_server
from specmesh.serving.settings import load_settings
from specmesh.types import (GenerationStats, InvalidArgument, ResourceExhausted, SamplingParams, SelfDraft,
                            SessionLost, TokenTree, VerifyRequest, VerifyResult)
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, router_pb2, verifier_pb2
from specmesh.v1 import verifier_pb2_grpc
from specmesh.verifier import EngineVerifier
from specmesh.verifier_service.batcher import VerifyBatcher
from tests.support import (ROOT, V, FakeCodec, GatedVerifier, TinyStack, code_of, healthy, settings,
                           shared_tiny_weights, wait_for)

TOKEN = "unit-test-token"
_W = shared_tiny_weights()  # the GatedVerifiers' weights


def reference(prompt: str, n: int, **kw) -> list[int]:
    """In-process generation on an identical tiny model (plain greedy unless drafter/sampling given)."""
    v = EngineVerifier(LlamaEngine(_W[0], _W[1], n_slots=2, max_seq_len=256))
    drafter = kw.pop("drafter", None)
    out, _ = generate_tokens(drafter, v, FakeCodec().encode(prompt), max_new_tokens=n, stop_ids=[1], **kw)
    return out


@pytest.fixture(scope="module")
def cluster():
    c = TinyStack()
    yield c
    c.close()


PROMPT = "abcabcabcabc hello hello hello abcabc"


# ---------------------------------------------------------------- conversions, stubs, settings

def test_convert_roundtrips():
    for sp in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=12345),
               SamplingParams(temperature=1.0, acceptance="typical", typical_epsilon=0.2, typical_delta=0.1)):
        assert convert.sampling_from_proto(convert.sampling_to_proto(sp)) == sp
    assert convert.sampling_from_proto(common_pb2.SamplingParams()).top_p == 1.0  # unset = disabled
    with pytest.raises(InvalidArgument) as e:
        convert.sampling_from_proto(common_pb2.SamplingParams(top_p=0.0))
    assert e.value.field == "sampling.top_p"
    trees = [TokenTree(), TokenTree.chain([3, 4, 5]), TokenTree([1, 2, 3], [-1, -1, 0]),
             TokenTree.chain([7, 8], q_ids=[[7, 9], [8]], q_probs=[[0.25, 0.75], [1.0]])]
    for t in trees:
        assert convert.tree_from_proto(convert.tree_to_proto(t)) == t
    req = VerifyRequest("s", 3, [5, 6], trees[3], SamplingParams(temperature=0.5, seed=9), 77, None, True)
    assert convert.verify_request_from_proto(convert.verify_request_to_proto(req)) == req
    req2 = VerifyRequest("s", 0, [5], TokenTree(), SamplingParams(), 1, SelfDraft("layerskip", 4))
    assert convert.verify_request_from_proto(convert.verify_request_to_proto(req2)) == req2
    res = VerifyResult([1, 2], 3, 4, 5, [0, 1], 0.5, 1.5, 2.5, 10, 2, batch_rows=13)
    assert convert.verify_result_to_proto(res).batch_rows == 13
    assert convert.verify_result_from_proto(convert.verify_result_to_proto(res, 3.0)) == res
    assert convert.verify_result_from_proto(verifier_pb2.VerifyResponse()).batch_rows == 0  # an older verifier
    st = convert.RouterStats(strategy="external", drafter="suffix", network_s=0.25, verifier="a:1", reprefills=1)
    st.record_round(4, 2, 4)
    st.record_round(4, 4, 4)
    st.finish_reason, st.new_tokens, st.total_s = "length", 8, 2.0
    m = convert.stats_to_proto(st)
    assert m.tau == pytest.approx(st.tau) and list(m.position_acceptance) == pytest.approx(st.position_acceptance)
    assert convert.stats_from_proto(m) == st
    assert isinstance(convert.stats_from_proto(m), GenerationStats)


def test_generated_stubs_are_fresh():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.stale_files() == [], "generated stubs are stale: run `make protos`"


def test_settings_sources(tmp_path, monkeypatch):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("max_new_tokens: 300\nn_slots: 3\nhost: 0.0.0.0\nverifier_addresses: [a:1, b:2]\n")
    monkeypatch.setenv("SPECMESH_N_SLOTS", "5")
    monkeypatch.setenv("SPECMESH_AUTH_TOKEN", "from-env")
    s = load_settings(cfg, host="127.0.0.1")
    assert (s.max_new_tokens, s.n_slots, s.host) == (300, 5, "127.0.0.1")  # yaml < env < flags
    assert s.verifier_targets() == ["a:1", "b:2"] and s.token() == "from-env"
    monkeypatch.setenv("SPECMESH_VERIFIER_ADDRESSES", "x:1, y:2")
    assert load_settings().verifier_targets() == ["x:1", "y:2"]
    tok = tmp_path / "tok"
    tok.write_text("from-file\n")
    assert load_settings(auth_token_file=str(tok)).token() == "from-file"
    assert load_settings().host == "127.0.0.1"  # loopback by default
    # `specmesh serve` hands the resolved settings to its children as SPECMESH_* variables
    from specmesh.cli.serve import _settings_env

    s = load_settings(cfg, n_slots=7, verifier_addresses=["p:1", "q:2"], auth_token_file=str(tok))
    for k in list(os.environ):
        if k.startswith("SPECMESH_") and k != "SPECMESH_AUTH_TOKEN":
            monkeypatch.delenv(k)
    for k, v in _settings_env(s).items():
        monkeypatch.setenv(k, v)
    assert load_settings() == s
    with pytest.raises(Exception):
        load_settings(tls_cert=str(tok))  # cert without key


# ---------------------------------------------------------------- interceptors

def test_interceptors_map_errors_and_check_token():
    errors = {b"invalid": InvalidArgument("tree.parents", "bad"), b"exhausted": ResourceExhausted("full"),
              b"lost": SessionLost("gone"), b"boom": KeyError("secret detail"), b"timeout": TimeoutError()}

    def unary(req, ctx):
        if req in errors:
            raise errors[req]
        return b"ok:" + req

    def stream(req, ctx):
        yield b"first"
        raise errors[req]

    handler = grpc.method_handlers_generic_handler("test.Dummy", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary), "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[AuthInterceptor(TOKEN), ErrorInterceptor(1024)])
    server.add_generic_rpc_handlers((handler,))
    from grpc_health.v1 import health

    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            md = (("authorization", f"Bearer {TOKEN}"),)
            u, s = ch.unary_unary("/test.Dummy/Unary"), ch.unary_stream("/test.Dummy/Stream")
            assert u(b"x", metadata=md, timeout=5) == b"ok:x"
            assert code_of(lambda: u(b"x", timeout=5))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: u(b"x", metadata=(("authorization", "Bearer nope"),), timeout=5))[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            expect = {b"invalid": grpc.StatusCode.INVALID_ARGUMENT, b"exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
                      b"lost": grpc.StatusCode.FAILED_PRECONDITION, b"boom": grpc.StatusCode.INTERNAL,
                      b"timeout": grpc.StatusCode.DEADLINE_EXCEEDED}
            for req, code in expect.items():
                c, d = code_of(lambda: u(req, metadata=md, timeout=5))
                assert c == code, req
                c2, _ = code_of(lambda: list(s(req, metadata=md, timeout=5)))
                assert c2 == code, req
            assert "tree.parents" in code_of(lambda: u(b"invalid", metadata=md, timeout=5))[1]
            assert "secret" not in code_of(lambda: u(b"boom", metadata=md, timeout=5))[1]
            c, d = code_of(lambda: u(b"x" * 2000, metadata=md, timeout=5))
            assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("request:")
            # health probes need no token
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            try:
                u(b"invalid", metadata=md, timeout=5)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                assert isinstance(err, InvalidArgumentError) and err.field == "tree.parents"
    finally:
        server.stop(0)


# ---------------------------------------------------------------- batcher

def _requests(state, rng, round_no, greedy_ids):
    reqs = []
    for sid, st in state.items():
        if round_no == 0:
            reqs.append(VerifyRequest(sid, 0, list(st["tokens"]), TokenTree(), st["sampling"], 1))
            continue
        n = rng.randint(0, 5)
        toks = [rng.randrange(V) for _ in range(n)]
        if n >= 3 and rng.random() < 0.5:
            tree = TokenTree(toks, [-1, -1] + [rng.randrange(-1, i) for i in range(2, n)])
        else:
            tree = TokenTree.chain(toks)
        if st["q"] and n:
            tree.q_ids = [[t, (t + 1) % V] for t in tree.tokens]
            tree.q_probs = [[0.6, 0.4] for _ in tree.tokens]
            tree.siblings = "iid"  # each node a draw from its own q
        reqs.append(VerifyRequest(sid, st["kv"], st["tokens"][st["kv"]:], tree, st["sampling"], 100 + round_no,
                                  want_entropy=True))
    return reqs


def test_batcher_equals_unbatched():
    a = EngineVerifier(LlamaEngine(_W[0], _W[1], n_slots=6, max_seq_len=256))
    b = EngineVerifier(LlamaEngine(_W[0], _W[1], n_slots=6, max_seq_len=256))
    batcher = VerifyBatcher(b, window_ms=50, max_batch=8)
    rng = random.Random(0)
    state = {}
    for i in range(5):  # ragged: different prompt lengths, greedy and sampled, with and without q
        samp = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=20, seed=i)
        state[f"s{i}"] = {"tokens": [rng.randrange(V) for _ in range(3 + 4 * i)], "kv": 0, "sampling": samp,
                          "q": i == 3}
    try:
        for rnd in range(6):
            reqs = _requests(state, rng, rnd, None)
            bad = VerifyRequest("bad", 0, [V + 5], TokenTree(), SamplingParams(), 0)
            expected = [a.verify(r) for r in reqs]
            futs = [batcher.submit(r) for r in reqs[:2]] + [batcher.submit(bad)] + [batcher.submit(r) for r in reqs[2:]]
            got = [f.result(30) for f in futs[:2] + futs[3:]]
            with pytest.raises(InvalidArgument):
                futs[2].result(30)
            for r, e, g in zip(reqs, expected, got):
                assert (g.accepted, g.next_token, g.accepted_nodes, g.cache_len) == \
                    (e.accepted, e.next_token, e.accepted_nodes, e.cache_len), (rnd, r.session_id)
                assert g.entropy == pytest.approx(e.entropy, rel=1e-4, abs=1e-5)
                st = state[r.session_id]
                st["tokens"] = st["tokens"][:r.keep_len + len(r.append_tokens)] + e.accepted + [e.next_token]
                st["kv"] = e.cache_len
        assert batcher.max_batch_seen > 1 and batcher.batches < batcher.requests
        assert "bad" not in b.info()["sessions"]
        # a request whose caller went away (cancelled, deadline) is dropped unrun
        forwards = b.forwards
        fut = batcher.submit(VerifyRequest("gone", 0, [1, 2, 3], TokenTree(), SamplingParams(), 0), alive=lambda: False)
        with pytest.raises(CancelledError):
            fut.result(30)
        assert b.forwards == forwards and "gone" not in b.info()["sessions"]
    finally:
        batcher.stop()


# ---------------------------------------------------------------- bad input to verifier and drafter

def test_verifier_bad_input_is_invalid_argument_and_changes_nothing(cluster):
    addr = cluster.vservers[0].address
    with grpc.insecure_channel(addr) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        ok = verifier_pb2.VerifyRequest(session_id="vb", sync=common_pb2.SessionSync(keep_len=0, append_tokens=[5, 6]))
        stub.Verify(ok)  # no deadline at all is fine too
        before = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5)
        keep = common_pb2.SessionSync(keep_len=2, append_tokens=[7])
        cases = {
            "tree.parents": verifier_pb2.VerifyRequest(session_id="vb", sync=keep,
                                                       tree=common_pb2.TokenTree(tokens=[1, 2], parents=[-1])),
            "tree.parents ": verifier_pb2.VerifyRequest(session_id="vb", sync=keep,
                                                        tree=common_pb2.TokenTree(tokens=[1, 2], parents=[-1, 1])),
            "tree.tokens": verifier_pb2.VerifyRequest(session_id="vb", sync=keep,
                                                      tree=common_pb2.TokenTree(tokens=[-5], parents=[-1])),
            "append_tokens": verifier_pb2.VerifyRequest(
                session_id="vb", sync=common_pb2.SessionSync(keep_len=2, append_tokens=[V + 1])),
            "keep_len": verifier_pb2.VerifyRequest(session_id="vb",
                                                   sync=common_pb2.SessionSync(keep_len=-1, append_tokens=[3])),
            "tree.q_probs": verifier_pb2.VerifyRequest(session_id="vb", sync=keep, tree=common_pb2.TokenTree(
                tokens=[3], parents=[-1], q=[common_pb2.SparseDistribution(ids=[3, 4], probs=[0.9, 0.9])])),
            "session_id": verifier_pb2.VerifyRequest(session_id="", sync=keep),
            "sampling.temperature": verifier_pb2.VerifyRequest(session_id="vb", sync=keep,
                                                               sampling=common_pb2.SamplingParams(temperature=-1)),
            "self_draft.method": verifier_pb2.VerifyRequest(session_id="vb", sync=keep,
                                                            self_draft=verifier_pb2.SelfDraft(method="nope", budget=2)),
            "request": verifier_pb2.VerifyRequest(session_id="vb", sync=common_pb2.SessionSync(
                keep_len=2, append_tokens=[3] * 10_000)),
        }
        for name, req in cases.items():
            c, d = code_of(lambda: stub.Verify(req, timeout=10))
            assert c == grpc.StatusCode.INVALID_ARGUMENT, (name, c, d)
            assert d.startswith(name.strip()), (name, d)
        c, _ = code_of(lambda: stub.Prefill(verifier_pb2.PrefillRequest(session_id="vb2", tokens=[V]), timeout=5))
        assert c == grpc.StatusCode.INVALID_ARGUMENT
        # unknown session with keep_len > 0: FAILED_PRECONDITION (re-prefill), not a new session
        c, _ = code_of(lambda: stub.Verify(verifier_pb2.VerifyRequest(session_id="ghost", sync=keep), timeout=5))
        assert c == grpc.StatusCode.FAILED_PRECONDITION
        after = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5)
        assert list(after.sessions) == list(before.sessions) and after.forwards == before.forwards
        # the session is intact: the next good round continues from its 2 tokens
        r = stub.Verify(verifier_pb2.VerifyRequest(session_id="vb", sync=keep), timeout=10)
        assert r.cache_len == 3
        stub.Release(verifier_pb2.VerifierReleaseRequest(session_id="vb"), timeout=5)
    assert healthy(addr) and healthy(addr, "specmesh.v1.Verifier")


def test_drafter_bad_input_is_invalid_argument_and_changes_nothing(cluster):
    addr = cluster.dserver.address
    with grpc.insecure_channel(addr) as ch:
        stub = drafter_pb2_grpc.DrafterStub(ch)
        sync = common_pb2.SessionSync(keep_len=0, append_tokens=[5, 6, 7, 5, 6])
        r = stub.Propose(drafter_pb2.ProposeRequest(session_id="db", drafter="prompt_lookup", sync=sync,
                                                    prompt_len=5, budget=4), timeout=5)
        assert list(r.tree.tokens)[:1] == [7] and r.held_len == 5
        before = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
        cases = {
            "sync.keep_len": dict(sync=common_pb2.SessionSync(keep_len=-1, append_tokens=[1])),
            "sync.append_tokens": dict(sync=common_pb2.SessionSync(keep_len=5, append_tokens=[V])),
            "drafter": dict(drafter="nope"),
            "budget": dict(budget=-1),
            "prompt_len": dict(prompt_len=99),
            "sampling.top_p": dict(sampling=common_pb2.SamplingParams(top_p=2.0)),
            "session_id": dict(session_id=""),
        }
        for name, kw in cases.items():
            args = dict(session_id="db", drafter="prompt_lookup", prompt_len=5, budget=4,
                        sync=common_pb2.SessionSync(keep_len=5, append_tokens=[7]))
            args.update(kw)
            c, d = code_of(lambda: stub.Propose(drafter_pb2.ProposeRequest(**args), timeout=5))
            assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name), (name, c, d)
        c, _ = code_of(lambda: stub.Propose(drafter_pb2.ProposeRequest(
            session_id="db", drafter="prompt_lookup", budget=2, sync=common_pb2.SessionSync(keep_len=50)), timeout=5))
        assert c == grpc.StatusCode.FAILED_PRECONDITION
        after = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
        assert after.sessions == before.sessions and after.proposals == before.proposals
        # state unchanged: a delta from 5 held tokens still works
        r = stub.Propose(drafter_pb2.ProposeRequest(session_id="db", drafter="prompt_lookup", prompt_len=5, budget=3,
                                                    sync=common_pb2.SessionSync(keep_len=5, append_tokens=[7])),
                         timeout=5)
        assert r.held_len == 6 and list(r.tree.tokens) == [5, 6, 7]
        assert stub.Release(drafter_pb2.DrafterReleaseRequest(session_id="db"), timeout=5).released
    assert healthy(addr)


# ---------------------------------------------------------------- router

def test_router_greedy_equals_in_process(cluster):
    from specmesh.client import Client

    ref = reference(PROMPT, 40)
    with Client(cluster.address, timeout=30) as c:
        for strategy, drafter in (("autoregressive", ""), ("external", "prompt_lookup"), ("external", "suffix"),
                                  ("self", ""), ("auto", "")):
            r = c.generate(PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=40)
            assert r.token_ids == ref, (strategy, drafter)
            assert r.text == FakeCodec().decode(ref)
            assert r.stats.new_tokens == len(ref) and r.stats.finish_reason in ("length", "stop")
            assert r.stats.verifier == cluster.vservers[0].address
        assert r.stats.strategy == "external" and r.stats.strategy_reason.startswith("auto")
        s = c.stream(PROMPT, strategy="external", max_new_tokens=40)
        pieces = list(s)
        assert "".join(pieces) == s.result.text and s.token_ids == ref and s.stats.rounds > 0
        assert s.stats.accepted_tokens > 0 and s.stats.tau > 1.0  # the repetitive prompt pays
    assert wait_for(lambda: len(cluster.verifier_info().sessions) == 0)
    assert wait_for(lambda: cluster.drafter_info().sessions == 0)


def test_router_sampled_equals_in_process_loop(cluster):
    from specmesh.client import Client

    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    ref = reference(PROMPT, 32, drafter=PromptLookupDrafter(), sampling=sp, budget=6)
    with Client(cluster.address, timeout=30) as c:
        r = c.generate(PROMPT, strategy="external", drafter="prompt_lookup", max_new_tokens=32, temperature=0.8,
                       top_p=0.95, seed=7)
        assert r.token_ids == ref
        r2 = c.generate(PROMPT, strategy="external", max_new_tokens=32, temperature=0.8, top_p=0.95, seed=8)
        assert r2.token_ids != ref  # the seed matters


def test_external_context_drafters_run_in_the_verifier(cluster):
    """An external request's prompt lookup or suffix drafter runs in the verifier by default
    (router ``context_drafters`` "verifier", verifier ``verifier_drafters``): its rounds are
    drafted there on the Decode stream, the drafter service is not asked, the output is
    plain decoding's (greedy) and the in-process loop's with that drafter (seeded sampled);
    Info lists them apart from the self drafters; the response says where it drafted."""
    from specmesh.client import Client

    info = cluster.verifier_info()
    assert set(info.context_drafters) == {"prompt_lookup", "suffix"} and "suffix" not in info.self_drafters
    ref = reference(PROMPT, 40)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    with Client(cluster.address, timeout=30) as c:
        for d in ("prompt_lookup", "suffix"):
            proposals, steps = cluster.drafter_info().proposals, cluster.verifier_info().decode_steps
            r = c.generate(PROMPT, strategy="external", drafter=d, max_new_tokens=40)
            assert r.token_ids == ref, d
            assert r.stats.drafter == d and r.stats.strategy == "external"
            assert r.stats.strategy_reason == f"requested; {d} drafted in the verifier"
            assert r.stats.drafted_tokens > 0 and r.stats.accepted_tokens > 0, d
            assert cluster.verifier_info().decode_steps > steps  # drafted rounds read from the stream
            assert cluster.drafter_info().proposals == proposals, "the drafter service drafted nothing"
        r = c.generate(PROMPT, strategy="external", drafter="prompt_lookup", max_new_tokens=32, temperature=0.8,
                       top_p=0.95, seed=7, draft_budget=4)
        assert r.token_ids == reference(PROMPT, 32, drafter=PromptLookupDrafter(), sampling=sp, budget=4)
    assert wait_for(lambda: len(cluster.verifier_info().sessions) == 0)
    assert not any(cluster.verifiers[0].history)  # released with its sessions


def test_plain_decoding_reads_a_decode_stream(cluster):
    """Plain decoding through the router: every round after the first comes from one
    Verifier/Decode stream (the verifier decodes ahead of the router), with Verify's
    tokens, greedy and seeded sampled; ``decode_stream`` false makes it a Verify a round."""
    from specmesh.client import Client

    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    ref, ref_sampled = reference(PROMPT, 40), reference(PROMPT, 32, sampling=sp)
    with Client(cluster.address, timeout=30) as c:
        before = cluster.verifier_info().decode_steps
        r = c.generate(PROMPT, strategy="autoregressive", max_new_tokens=40)
        assert r.token_ids == ref
        steps = cluster.verifier_info().decode_steps - before
        assert len(ref) - 2 <= steps <= len(ref), steps  # all rounds but the first; none decoded past the end
        r = c.generate(PROMPT, strategy="autoregressive", max_new_tokens=32, temperature=0.8, top_p=0.95, seed=7)
        assert r.token_ids == ref_sampled
        # a drafting strategy whose drafting stops and starts again: prompt lookup finds a match now and
        # then (which rounds find none follows from the tokens alone, so the runs of rounds without a
        # draft, and the switches, come whatever the timings); each switch back to drafting drops what
        # the verifier decoded ahead
        for kw, want in ((dict(strategy="external", drafter="prompt_lookup"), ref),
                         (dict(strategy="external", drafter="prompt_lookup", temperature=0.8, top_p=0.95, seed=7),
                          reference(PROMPT, 40, drafter=PromptLookupDrafter(), sampling=sp, budget=6))):
            before = cluster.verifier_info().decode_steps
            r = c.generate(PROMPT, max_new_tokens=40, **kw)
            assert r.token_ids == want, kw
            assert cluster.verifier_info().decode_steps > before, kw
            assert r.stats.drafted_tokens > 0, kw
        # the self drafter's budget policy turns drafting off on timings (then its rounds use streams)
        assert c.generate(PROMPT, max_new_tokens=40, strategy="self").token_ids == ref
        # a self drafter drafting every round (a fixed budget) reads every round after the first from the
        # stream: the stream carries the budget and the verifier drafts in its own turn
        self_kw = dict(strategy="self", draft_budget=3)
        before = cluster.verifier_info().decode_steps
        r = c.generate(PROMPT, max_new_tokens=40, **self_kw)
        assert r.token_ids == ref and r.stats.drafted_tokens > 0
        assert cluster.verifier_info().decode_steps - before >= r.stats.rounds - 1, r.stats.rounds
        sampled_kw = dict(self_kw, temperature=0.8, top_p=0.95, seed=7)
        self_sampled = c.generate(PROMPT, max_new_tokens=32, **sampled_kw)
        assert self_sampled.stats.drafted_tokens > 0
    assert wait_for(lambda: len(cluster.verifier_info().sessions) == 0)
    off = TinyStack(decode_stream=False)
    try:
        with Client(off.address, timeout=30) as c:
            assert c.generate(PROMPT, strategy="autoregressive", max_new_tokens=40).token_ids == ref
            # the same seeded self-drafted request, a Verify call a round: the same draws
            assert c.generate(PROMPT, max_new_tokens=32, **sampled_kw).token_ids == self_sampled.token_ids
        assert off.verifier_info().decode_steps == 0
    finally:
        off.close()


def test_decode_is_verify_round_by_round_and_checks_its_input(cluster):
    """Verifier/Decode's steps are the Verify calls a router would send (same tokens, seeded
    sampling included); a stop token ends it; bad input is INVALID_ARGUMENT and changes nothing."""
    from specmesh.seeding import round_seed

    prompt, seed = [5, 6, 7, 5, 6, 2], 11
    sp = common_pb2.SamplingParams(temperature=0.9, seed=seed)

    def first(sid):
        return stub.Verify(verifier_pb2.VerifyRequest(
            session_id=sid, sync=common_pb2.SessionSync(keep_len=0, append_tokens=prompt), sampling=sp,
            round_seed=round_seed(seed, len(prompt))), timeout=10).next_token

    def decode(sid, tok, **kw):
        req = verifier_pb2.DecodeRequest(session_id=sid, sampling=sp, **kw,
                                         sync=common_pb2.SessionSync(keep_len=len(prompt), append_tokens=[tok]))
        return [m.next_token for m in stub.Decode(iter([req]), timeout=10)]

    with grpc.insecure_channel(cluster.vservers[0].address) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        by_verify, n = [first("d1")], len(prompt)
        for _ in range(8):
            by_verify.append(stub.Verify(verifier_pb2.VerifyRequest(
                session_id="d1", sync=common_pb2.SessionSync(keep_len=n, append_tokens=[by_verify[-1]]), sampling=sp,
                round_seed=round_seed(seed, n + 1)), timeout=10).next_token)
            n += 1
        assert by_verify[0] == first("d2")
        assert [by_verify[0]] + decode("d2", by_verify[0], max_steps=8) == by_verify
        # from the same point again (keep_len drops what the last stream decoded), ending at a stop token
        stop = by_verify[3]
        assert decode("d2", by_verify[0], max_steps=8, stop_ids=[stop]) == by_verify[1:by_verify.index(stop, 1) + 1]
        # flow control: the verifier decodes the steps granted and no more; a later grant goes on in the
        # same stream; closing the request side ends it once the grants are decoded
        grants: "queue.SimpleQueue" = queue.SimpleQueue()
        grants.put(verifier_pb2.DecodeRequest(session_id="d2", sampling=sp, max_steps=2, sync=common_pb2.SessionSync(
            keep_len=len(prompt), append_tokens=[by_verify[0]])))
        steps0 = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5).decode_steps
        call = stub.Decode(iter(grants.get, None), timeout=10)
        got = [next(call).next_token for _ in range(2)]
        assert stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5).decode_steps == steps0 + 2  # none past the grant
        grants.put(verifier_pb2.DecodeRequest(max_steps=3))
        got += [next(call).next_token for _ in range(3)]
        grants.put(None)
        assert list(call) == [] and got == by_verify[1:6]
        assert stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5).decode_steps == steps0 + 5
        # a later message grants steps and nothing else (the stream's first step stands: it is what a
        # Verify of that round gives, and the next call's keep_len drops it)
        opened = verifier_pb2.DecodeRequest(session_id="d2", sampling=sp, max_steps=1, sync=common_pb2.SessionSync(
            keep_len=len(prompt), append_tokens=[by_verify[0]]))
        for name, grant in (("DecodeRequest", verifier_pb2.DecodeRequest(session_id="d2", max_steps=2)),
                            ("max_steps", verifier_pb2.DecodeRequest(max_steps=0))):
            c, d = code_of(lambda: list(stub.Decode(iter([opened, grant]), timeout=10)))
            assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name), (name, c, d)
        before = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5)
        cases = {"max_steps": dict(max_steps=0), "sampling.temperature": dict(
            max_steps=2, sampling=common_pb2.SamplingParams(temperature=-1))}
        for name, kw in cases.items():
            req = verifier_pb2.DecodeRequest(session_id="d2", sampling=kw.pop("sampling", sp), **kw,
                                             sync=common_pb2.SessionSync(keep_len=len(prompt), append_tokens=[1]))
            c, d = code_of(lambda: list(stub.Decode(iter([req]), timeout=10)))
            assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name), (name, c, d)
        c, d = code_of(lambda: list(stub.Decode(iter([]), timeout=10)))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("request"), (c, d)
        c, _ = code_of(lambda: list(stub.Decode(iter([verifier_pb2.DecodeRequest(
            session_id="ghost", max_steps=2, sync=common_pb2.SessionSync(keep_len=3, append_tokens=[1]))]), timeout=10)))
        assert c == grpc.StatusCode.FAILED_PRECONDITION  # an unknown session is not created
        after = stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=5)
        assert list(after.sessions) == list(before.sessions) and after.forwards == before.forwards
        for sid in ("d1", "d2"):
            stub.Release(verifier_pb2.VerifierReleaseRequest(session_id=sid), timeout=5)


def test_router_bad_requests(cluster):
    def req(**kw):
        base = dict(prompt="hello", max_new_tokens=8)
        base.update(kw)
        return router_pb2.GenerateRequest(**base)

    cases = {
        "prompt": req(prompt=""),
        "prompt ": req(prompt="x" * 200),  # over max_prompt_tokens (128)
        "strategy": req(strategy="warp"),
        "drafter": req(strategy="external", drafter="oracle"),
        "max_new_tokens": req(max_new_tokens=0),
        "max_new_tokens ": req(max_new_tokens=-3),
        "max_new_tokens  ": req(max_new_tokens=10_000),
        "sampling.temperature": req(sampling=common_pb2.SamplingParams(temperature=-0.5)),
        "sampling.top_p": req(sampling=common_pb2.SamplingParams(top_p=0.0)),
        "sampling.top_p ": req(sampling=common_pb2.SamplingParams(top_p=1.5)),
        "sampling.top_k": req(sampling=common_pb2.SamplingParams(top_k=-1)),
        "sampling.acceptance": req(sampling=common_pb2.SamplingParams(acceptance="yolo")),
        "draft_budget": req(draft_budget=0),
        "messages": router_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="robot", content="hi")]),
        "request": req(prompt="y" * 10_000),  # over max_message_bytes (8192)
    }
    for name, r in cases.items():
        c, d = code_of(lambda: list(cluster.stub.Generate(r, timeout=10)))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name.strip()), (name, c, d)
    assert healthy(cluster.address) and healthy(cluster.address, "specmesh.v1.Router")
    assert len(cluster.verifier_info().sessions) == 0 and cluster.drafter_info().sessions == 0
    from specmesh.client import Client

    with Client(cluster.address) as c:
        with pytest.raises(InvalidArgumentError) as e:
            c.generate("hi", strategy="warp")
        assert e.value.field == "strategy"
        names = [s.name for s in c.list_strategies().strategies]
        assert {"autoregressive", "external", "self", "auto"} <= set(names)
    c, d = code_of(lambda: cluster.stub.Anticipate(router_pb2.AnticipateRequest(conversation_id="c"), timeout=5))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("messages"), (c, d)  # no conversation given


@pytest.mark.parametrize("strategy", ["external", "autoregressive"])  # autoregressive: on a Decode stream
def test_cancel_and_deadline_free_the_slot(cluster, strategy):
    from specmesh.client import Client

    v, servicer = cluster.verifiers[0], cluster.vsvcs[0].servicer
    with Client(cluster.address, timeout=30) as c:
        v.arm(3)  # the 3rd forward (a step of the Decode stream the verifier decodes ahead on) waits
        s = c.stream(PROMPT, strategy=strategy, max_new_tokens=60)
        it = iter(s)
        next(it)
        assert v.reached.wait(10)
        assert len(cluster.verifier_info().sessions) == 1
        forwards, abandoned = cluster.verifier_info().forwards, servicer.decode_abandoned
        s.cancel()
        # the router cancels the Decode stream as soon as its caller cancels (not when the step in flight
        # returns): the verifier learns it while the step still waits, so no step follows it (no timing:
        # the order is cancel -> the verifier knows -> the step ends)
        assert wait_for(lambda: servicer.decode_abandoned == abandoned + 1), "the Decode stream must be cancelled"
        v.resume.set()
        assert wait_for(lambda: len(cluster.verifier_info().sessions) == 0), "cancel must free the KV slot"
        assert wait_for(lambda: cluster.drafter_info().sessions == 0)
        assert cluster.verifier_info().forwards - forwards == 1  # the step in flight, then stopped
        # an expired deadline frees it too
        v.arm(3)
        s = c.stream(PROMPT, strategy=strategy, max_new_tokens=60, timeout=1.0)
        assert v.reached.wait(10)
        with pytest.raises(Exception) as e:
            list(s)
        assert type(e.value).__name__ == "DeadlineExceededError"
        v.resume.set()
        assert wait_for(lambda: len(cluster.verifier_info().sessions) == 0), "deadline must free the KV slot"


def test_sessions_per_client_limit():
    from specmesh.client import Client

    cl = TinyStack(max_sessions_per_client=2)
    try:
        v = cl.verifiers[0]
        v.arm(1)
        with Client(cl.address, timeout=30, client_id="alice") as c, Client(cl.address, client_id="bob") as c2:
            streams = [c.stream(PROMPT, max_new_tokens=8) for _ in range(2)]
            results = []
            threads = [threading.Thread(target=lambda s=s: results.append(list(s))) for s in streams]
            for t in threads:
                t.start()
            assert v.reached.wait(10)
            assert wait_for(lambda: sum(cl.router._clients.values()) == 2)
            with pytest.raises(ResourceExhaustedError):
                c.generate(PROMPT, max_new_tokens=8)
            v.resume.set()
            for t in threads:
                t.join(30)
            assert len(results) == 2
            assert c2.generate(PROMPT, max_new_tokens=8).token_ids == c.generate(PROMPT, max_new_tokens=8).token_ids
    finally:
        cl.close()


def test_verifier_restart_and_failover_keep_the_output():
    from specmesh.client import Client
    from specmesh.verifier_service.servicer import verifier_service

    ref = reference(PROMPT, 48)
    cl = TinyStack(n_verifiers=2)
    try:
        with Client(cl.address, timeout=60) as c:
            # 1) the pinned replica dies mid-stream: the router re-prefills on the other one
            for v in cl.verifiers:
                v.arm(4)
            s = c.stream(PROMPT, strategy="external", max_new_tokens=48)
            it = iter(s)
            next(it)
            assert wait_for(lambda: any(v.reached.is_set() for v in cl.verifiers))
            dead = next(i for i, v in enumerate(cl.verifiers) if v.reached.is_set())
            cl.verifiers[1 - dead].pause_at = None
            cl.vservers[dead].server.stop(0)
            cl.verifiers[dead].resume.set()
            list(it)
            assert s.token_ids == ref
            assert s.stats.reprefills >= 1 and s.stats.verifier == cl.vservers[1 - dead].address
            for v in cl.verifiers:
                v.pause_at = None
            # 2) the only left replica restarts on the same port: the router waits and re-prefills
            alive = 1 - dead
            port = cl.vservers[alive].port
            cl.verifiers[alive].arm(4)
            s = c.stream(PROMPT, strategy="autoregressive", max_new_tokens=48)
            it = iter(s)
            next(it)
            assert cl.verifiers[alive].reached.wait(10)
            cl.vservers[alive].server.stop(0)
            cl.verifiers[alive].resume.set()
            nv = GatedVerifier()
            svc, b = verifier_service(cl.s, nv)
            cl.batchers.append(b)
            cl.verifiers.append(nv)
            time.sleep(0.3)
            cl.vservers.append(build_server(cl.s, [svc], port))
            list(it)
            assert s.token_ids == ref and s.stats.reprefills >= 1
    finally:
        cl.close()


def test_drafter_loss_falls_back_and_is_retried_later():
    from specmesh.drafter_service.servicer import drafter_service
    from specmesh.client import Client

    ref = reference(PROMPT, 48)
    cl = TinyStack(context_drafters="drafter")  # prompt lookup on the drafter service, not in the verifier
    try:
        v = cl.verifiers[0]
        with Client(cl.address, timeout=60) as c:
            v.arm(4)
            s = c.stream(PROMPT, strategy="external", max_new_tokens=48)
            it = iter(s)
            next(it)
            assert v.reached.wait(10)
            port = cl.dserver.port
            cl.dserver.server.stop(0)
            v.resume.set()
            list(it)
            assert s.token_ids == ref and s.stats.fallbacks >= 1
            assert not cl.router.drafter.health.healthy  # marked unhealthy
            r = c.generate(PROMPT, strategy="external", max_new_tokens=48)  # still correct while it is down
            assert r.token_ids == ref
            # the drafter comes back on the same port; after the backoff the router uses it again
            cl.dserver = build_server(cl.s, [drafter_service(cl.s, vocab_size=V, factories={
                "prompt_lookup": PromptLookupDrafter})], port)
            for _ in range(20):  # the channel reconnects, then the next probe after the backoff succeeds
                time.sleep(0.3)
                r = c.generate(PROMPT, strategy="external", max_new_tokens=48)
                assert r.token_ids == ref
                if r.stats.accepted_tokens > 0:
                    break
            assert r.stats.accepted_tokens > 0 and cl.router.drafter.health.healthy
    finally:
        cl.close()


def test_auth_token_on_every_service():
    from specmesh.client import Client

    os.environ["SPECMESH_AUTH_TOKEN"] = TOKEN
    try:
        cl = TinyStack()
    finally:
        del os.environ["SPECMESH_AUTH_TOKEN"]
    try:
        with Client(cl.address) as c:
            with pytest.raises(Exception) as e:
                c.generate(PROMPT, max_new_tokens=4)
            assert type(e.value).__name__ == "UnauthenticatedError"
        with Client(cl.address, token=TOKEN) as c:
            assert c.generate(PROMPT, max_new_tokens=8, strategy="external").token_ids == reference(PROMPT, 8)
            # plain decoding's Decode stream carries the token too
            assert c.generate(PROMPT, max_new_tokens=8, strategy="autoregressive").token_ids == reference(PROMPT, 8)
        with grpc.insecure_channel(cl.vservers[0].address) as ch:
            c2, _ = code_of(lambda: verifier_pb2_grpc.VerifierStub(ch).Info(verifier_pb2.VerifierInfoRequest()))
            assert c2 == grpc.StatusCode.UNAUTHENTICATED
            info = verifier_pb2_grpc.VerifierStub(ch).Info(verifier_pb2.VerifierInfoRequest(), timeout=5,
                                                           metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert info.decode_steps > 0
            decode = verifier_pb2.DecodeRequest(session_id="x", max_steps=1,
                                                sync=common_pb2.SessionSync(keep_len=0, append_tokens=[1]))
            c3, _ = code_of(lambda: list(verifier_pb2_grpc.VerifierStub(ch).Decode(iter([decode]))))
            assert c3 == grpc.StatusCode.UNAUTHENTICATED
        assert healthy(cl.vservers[0].address)  # probes stay open
    finally:
        cl.close()


def test_async_client_and_cli(cluster, capsys):
    from specmesh import AsyncClient
    from specmesh.cli import main

    ref = reference(PROMPT, 24)

    async def run():
        async with AsyncClient(cluster.address, timeout=30) as c:
            r = await c.generate(PROMPT, strategy="external", max_new_tokens=24)
            s = c.stream(PROMPT, max_new_tokens=24)
            pieces = [p async for p in s]
            with pytest.raises(InvalidArgumentError):
                await c.generate(PROMPT, max_new_tokens=0)
            strategies = await c.list_strategies()
            return r, pieces, s, strategies

    r, pieces, s, strategies = asyncio.run(run())
    assert r.token_ids == ref and "".join(pieces) == r.text == s.result.text
    assert len(strategies.strategies) >= 4
    assert main(["generate", PROMPT, "--address", cluster.address, "--max-new-tokens", "24",
                 "--strategy", "external", "--drafter", "suffix"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == FakeCodec().decode(ref).strip()
    assert "tau" in out.err and "acceptance histogram" in out.err and "finish" in out.err
    assert main(["generate", PROMPT, "--address", cluster.address, "--strategy", "warp"]) == 2
    assert "strategy" in capsys.readouterr().err


def test_concurrent_streams_batch_in_the_verifier(cluster):
    from specmesh.client import Client

    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
    refs = [reference(p, 24) for p in prompts]
    before = cluster.verifier_info()
    out = [None] * len(prompts)
    with Client(cluster.address, timeout=60) as c:
        def run(i):
            out[i] = c.generate(prompts[i], strategy="external", max_new_tokens=24).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert out == refs
    after = cluster.verifier_info()
    assert after.max_batch_seen > 1
    assert after.batches - before.batches < after.batched_requests - before.batched_requests


def test_sigterm_drains_and_stops():
    import signal

    from specmesh.drafter_service.servicer import drafter_service
    from specmesh.serving.server import serve_until_signal

    s = settings(drain_s=2.0)
    running = build_server(s, [drafter_service(s, vocab_size=V)], 0)
    assert healthy(running.address)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    serve_until_signal(running, s.drain_s)  # returns after the signal, drained
    assert time.monotonic() - t0 < 5
    with grpc.insecure_channel(running.address) as ch:
        c, _ = code_of(lambda: drafter_pb2_grpc.DrafterStub(ch).Info(drafter_pb2.DrafterInfoRequest(), timeout=1))
    assert c == grpc.StatusCode.UNAVAILABLE
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
