"""Fast tests of the router's run-time replica sets used under Ray
(``specmesh.router.replicas``), over real gRPC servers on loopback with a tiny
random model; Ray itself is not needed.

- ``DrafterPool``: new sessions go round-robin over the drafter replicas and
  stick to theirs; a replica that dies mid-session fails over to another and
  the session resyncs from the caller's tokens; no replica -> UNAVAILABLE.
- ``ReplicaSet`` with addresses set at run time (imported here as
  ``DynamicReplicaSet``) behind the real router: greedy output equals the
  in-process loop while verifier replicas are added and removed.
- ``specmesh.deploy.k8s_discovery``: names resolve to every address (a headless
  Service's ready pods) and the follower updates both sets.
"""

from __future__ import annotations

import grpc
import pytest

from specmesh.drafters import PromptLookupDrafter
from specmesh.loop import generate_tokens
from specmesh.router.adapters import Calls, RemoteDrafter
from specmesh.wire.channels import channel
from specmesh.serving.server import Service, build_server
from specmesh.serving.settings import load_settings
from specmesh.types import DraftContext
from specmesh.verifier import EngineVerifier
from tests.support import V, FakeCodec, tiny_engine

PROMPT = "abcabcabcabc hello hello hello abcabc"


def _settings(**kw):
    base = dict(max_seq_len=128, n_slots=4, max_new_tokens=32, default_max_new_tokens=16, max_prompt_tokens=64,
                workers=4, drain_s=0.0, verifier_retry_s=2.0, drafter_backoff_s=0.2, drafter_backoff_max_s=0.5)
    base.update(kw)
    return load_settings(**base)


def _drafter_server(s):
    from specmesh.drafter_service.servicer import drafter_service

    svc = drafter_service(s, vocab_size=V, factories={"prompt_lookup": PromptLookupDrafter})
    return build_server(s, [svc], 0), svc.servicer.host


def _verifier_server(s):
    from specmesh.verifier_service.servicer import verifier_service

    svc, batcher = verifier_service(s, EngineVerifier(tiny_engine(n_slots=4, max_seq_len=128)[0]))
    return build_server(s, [svc], 0), batcher


def test_drafter_pool_round_robin_sticky_failover_and_empty():
    from specmesh.router.replicas import DrafterPool

    s = _settings()
    (a, ha), (b, hb) = _drafter_server(s), _drafter_server(s)
    pool = DrafterPool(lambda addr: channel(addr), backoff_s=0.2, max_backoff_s=0.5)
    try:
        pool.set_addresses([a.address, b.address])
        d = RemoteDrafter(pool.peer, "prompt_lookup", Calls(), timeout_s=5)
        toks = FakeCodec().encode(PROMPT)
        ref = PromptLookupDrafter().propose(DraftContext("x", toks, len(toks)), 4)
        for i in range(4):
            tree = d.propose(DraftContext(f"s{i}", toks, len(toks)), 4)
            assert tree.tokens == ref.tokens
        assert pool.calls[a.address] == 2 and pool.calls[b.address] == 2  # round-robin over new sessions
        assert ha.info()["sessions"] == 2 and hb.info()["sessions"] == 2
        # a session sticks to its replica: the next round sends only the delta there
        on_a = next(sid for sid in ("s0", "s1") if sid in ha.info()["session_ids"])
        d.propose(DraftContext(on_a, toks + [5], len(toks)), 4)
        assert pool.calls[a.address] == 3
        # replica a dies: the call fails over to b, which resyncs the session from the caller's tokens
        a.server.stop(0)
        tree = d.propose(DraftContext(on_a, toks + [5, 6], len(toks)), 4)
        assert pool.failovers == 1 and on_a in hb.info()["session_ids"]
        assert tree.tokens == PromptLookupDrafter().propose(DraftContext("y", toks + [5, 6], len(toks)), 4).tokens
        d.finish(on_a, toks + [5, 6], len(toks))
        assert on_a not in hb.info()["session_ids"]
        # the registry drops a; then nobody is left: UNAVAILABLE, and the router-level peer backs off
        pool.set_addresses([b.address])
        assert pool.addresses == [b.address]
        pool.set_addresses([])
        with pytest.raises(grpc.RpcError) as e:
            d.propose(DraftContext("s9", toks, len(toks)), 4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and not pool.peer.health.healthy
    finally:
        pool.close()
        for srv in (a, b):
            srv.server.stop(0)


def test_router_over_dynamic_verifier_set_keeps_greedy_output():
    from specmesh import Client
    from specmesh.router.core import Router
    from specmesh.router.replicas import DrafterPool
    from specmesh.router.replicas import ReplicaSet as DynamicReplicaSet
    from specmesh.router.servicer import RouterServicer
    from specmesh.v1 import router_pb2, router_pb2_grpc

    s = _settings()
    (v1, b1), (v2, b2) = _verifier_server(s), _verifier_server(s)
    dsrv, _ = _drafter_server(s)
    reps = DynamicReplicaSet(lambda addr: channel(addr), wait_s=0.5, choice="least_loaded")  # spread by hash
    pool = DrafterPool(lambda addr: channel(addr))
    router = Router(s, FakeCodec(), reps, pool.peer, V)
    rsrv = build_server(s, [Service(router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
                                    router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(router))], 0)
    ref = generate_tokens(None, EngineVerifier(tiny_engine(n_slots=1, max_seq_len=128)[0]),
                          FakeCodec().encode(PROMPT), max_new_tokens=16, stop_ids=[1])[0]
    try:
        with Client(rsrv.address, timeout=30) as c:
            with pytest.raises(Exception) as e:  # no verifier registered yet
                c.generate(PROMPT, strategy="autoregressive", raw_prompt=True)
            assert "UNAVAILABLE" in repr(e.value) or "no verifier" in str(e.value)
            reps.set_addresses([v1.address])
            pool.set_addresses([dsrv.address])
            r = c.generate(PROMPT, strategy="external", raw_prompt=True)
            assert r.token_ids == ref and r.stats.verifier == v1.address and r.stats.rounds > 0
            reps.set_addresses([v1.address, v2.address])
            rs = [c.generate(PROMPT, strategy="external", raw_prompt=True) for _ in range(16)]
            assert all(r.token_ids == ref for r in rs)
            # sequential sessions tie on load; the session-id hash spreads them (all 16 on one: p = 2^-15)
            assert {r.stats.verifier for r in rs} == {v1.address, v2.address}
            reps.set_addresses([v2.address])  # v1 leaves (replaced by Ray)
            v1.server.stop(0)
            for _ in range(2):
                r = c.generate(PROMPT, strategy="external", raw_prompt=True)
                assert r.token_ids == ref and r.stats.verifier == v2.address
    finally:
        rsrv.server.stop(0)
        router.close()
        for srv in (v1, v2, dsrv):
            srv.server.stop(0)
        b1.stop()
        b2.stop()


def test_dns_discovery_resolves_and_follows(monkeypatch):
    import socket

    from specmesh.deploy.k8s_discovery import DnsFollower, resolve
    from specmesh.router.replicas import DrafterPool
    from specmesh.router.replicas import ReplicaSet as DynamicReplicaSet

    assert resolve("localhost:50053") in (["127.0.0.1:50053"], ["127.0.0.1:50053", "[::1]:50053"],
                                          ["[::1]:50053"])
    pods = {"verifier": ["10.0.0.2", "10.0.0.1"], "drafter": []}

    def lookup(host, port, type=0):  # a headless Service: one A record per ready pod
        if not pods[host]:
            raise socket.gaierror("no such host")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in pods[host]]

    assert resolve("dns:///verifier:50053", lookup) == ["10.0.0.1:50053", "10.0.0.2:50053"]
    assert resolve("drafter:50052", lookup) == []
    with pytest.raises(ValueError):
        resolve("no-port")
    reps, pool = DynamicReplicaSet(lambda a: channel(a)), DrafterPool(lambda a: channel(a))
    import specmesh.deploy.k8s_discovery as disc

    monkeypatch.setattr(disc, "resolve", lambda t: resolve(t, lookup))
    try:
        f = DnsFollower("verifier:50053", "drafter:50052", reps, pool)
        f.refresh()
        assert reps.addresses == ["10.0.0.1:50053", "10.0.0.2:50053"] and pool.addresses == []
        pods["verifier"], pods["drafter"] = ["10.0.0.2"], ["10.0.1.1"]  # HPA scaled verifiers down, drafters up
        f.refresh()
        assert reps.addresses == ["10.0.0.2:50053"] and pool.addresses == ["10.0.1.1:50052"]
    finally:
        reps.close()
        pool.close()


def test_autoscaling_policy_follows_reported_load():
    from types import SimpleNamespace

    from specmesh.deploy.ray.autoscale import load_policy
    from specmesh.deploy.ray.config import Autoscaling

    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 4.0)
    ctx = lambda m, target=2: SimpleNamespace(aggregated_metrics=m, config=cfg, target_num_replicas=target)  # noqa
    assert load_policy(ctx({"load": {"r1": 6.0, "r2": 6.0}}))[0] == 3.0  # 12 sessions / 4 per replica
    assert load_policy(ctx({"load": {"r1": 0.0}}))[0] == 0.0  # Serve clamps to min_replicas
    assert load_policy(ctx({}, target=2))[0] == 2  # no report yet: keep the current target
    assert Autoscaling().to_serve()["policy"]["policy_function"] == "specmesh.deploy.ray.autoscale:load_policy"
    with pytest.raises(ValueError):
        Autoscaling(min_replicas=3, max_replicas=2)


def test_drafter_pool_seeds_every_live_replica():
    from types import SimpleNamespace

    from specmesh.router.replicas import DrafterPool, Peer, PeerHealth

    class Stub:
        def __init__(self, held, down=False):
            self.held, self.down, self.seeded = held, down, []

        def Seed(self, request, timeout=None, metadata=None):
            if self.down:
                raise DownError()
            self.seeded.append(request)
            return SimpleNamespace(texts=1, tokens=self.held + 3)

    class DownError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    pool = DrafterPool(lambda a: None)
    stubs = {"a": Stub(0), "b": Stub(5), "c": Stub(0, down=True)}
    pool.members = {k: Peer(k, SimpleNamespace(close=lambda: None), st, PeerHealth()) for k, st in stubs.items()}
    req = SimpleNamespace(cache_id="conv:1")
    assert pool.Seed(req).tokens == 8  # the largest cache's answer
    assert stubs["a"].seeded == [req] and stubs["b"].seeded == [req]
    assert not pool.members["c"].health.available()  # the dead one is marked down, the seed still succeeds


def test_prefix_routing_over_a_dynamic_verifier_set():
    """The default choice (prefix) over a set that follows a registry (Ray, Kubernetes):
    a conversation's turns stay on the replica that caches them (their prompts found
    there), a replica that joins takes other prefixes, and when the conversation's
    replica leaves its next turn moves and keeps the greedy output."""
    from specmesh import Client
    from specmesh.router.servicer import dynamic_router

    s = _settings(max_prompt_tokens=110)
    (v1, b1), (v2, b2) = _verifier_server(s), _verifier_server(s)
    svc, router, verifiers, drafters = dynamic_router(s, codec=FakeCodec())
    rsrv = build_server(s, [svc], 0)
    history = PROMPT * 2  # 74 ids: 4 blocks
    try:
        verifiers.set_addresses([v1.address])
        with Client(rsrv.address, timeout=30) as c:
            first = c.generate(history, strategy="autoregressive", raw_prompt=True, conversation_id="c1",
                               max_new_tokens=8)
            verifiers.set_addresses([v1.address, v2.address])  # a replica joins
            turns = [first]
            for k in range(2):
                history += FakeCodec().decode(turns[-1].token_ids) + f" turn {k}"
                turns.append(c.generate(history, strategy="autoregressive", raw_prompt=True, conversation_id="c1",
                                        max_new_tokens=8))
            assert {t.stats.verifier for t in turns} == {v1.address}  # it stayed
            assert all(t.stats.cached_tokens >= 64 for t in turns[1:])  # and found its prefix there
            routed = dict(verifiers.affinity.routed)
            c.generate("zzzz yyyy xxxx wwww vvvv uuuu tttt ssss", strategy="autoregressive", raw_prompt=True,
                       max_new_tokens=4)  # nothing cached anywhere: by load
            assert verifiers.affinity.routed["load"] == routed["load"] + 1
            ref = c.generate(history, strategy="autoregressive", raw_prompt=True, max_new_tokens=8)
            verifiers.set_addresses([v2.address])  # its replica leaves
            v1.server.stop(0)
            moved = c.generate(history, strategy="autoregressive", raw_prompt=True, conversation_id="c1",
                               max_new_tokens=8)
            assert moved.stats.verifier == v2.address and moved.token_ids == ref.token_ids
    finally:
        rsrv.server.stop(0)
        router.close()
        for srv in (v1, v2):
            srv.server.stop(0)
        b1.stop()
        b2.stop()
