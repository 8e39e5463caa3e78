"""Serving with the prefix cache, over real gRPC services on loopback (tiny random model):

- ready means ready: a router whose verifier is not serving yet reports NOT_SERVING for
  ``specmesh.v1.Router`` (its process, "", SERVING), refuses a request with UNAVAILABLE
  naming why, and the OpenAI front answers 503 on ``/health`` and on requests; once the
  verifier serves, the router reads its Info (its self drafters) and both turn ready;
- reported: a request whose prompt the verifier has cached counts the cached tokens in the
  SDK's stats, in ``usage.prompt_tokens_details.cached_tokens``, on the prefill round's
  span (cached + computed = the prompt) and in the verifier's Prometheus counters
  ``specmesh_prefix_cache_queries_total`` / ``_hits_total`` (vLLM's names), with its
  bytes gauge and Info fields;
- a prompt plus max_tokens beyond the model's context is HTTP 400 naming ``max_tokens``.
"""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request

import grpc
import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from specmesh.client import Client  # noqa: E402
from specmesh.errors import UnavailableError  # noqa: E402
from specmesh.serving.openai_http import start_http  # noqa: E402
from specmesh.serving.server import build_server  # noqa: E402
from tests.support import (TRACED_SETTINGS, TinyTracedStack, TokenizerCodec, free_port, samples, scrape,  # noqa: E402
                           settings, spans_done, spans_of, tiny_layerskip_verifier, total, wait_for)

PROMPT = "the quick brown fox jumps over the lazy dog, then the quick brown fox sleeps. " * 1


def _status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_router_and_the_front_are_ready_only_once_a_verifier_serves():
    from specmesh.router.servicer import router_service
    from specmesh.verifier_service.servicer import verifier_service

    port = free_port()
    s = functools.partial(settings, TRACED_SETTINGS)
    rs = s(verifier_addresses=[f"127.0.0.1:{port}"], drafter_address="none", model="tiny-test-model",
           max_new_tokens=240)
    rsvc, router = router_service(rs, TokenizerCodec())
    rserver = build_server(rs, [rsvc], 0)
    http = start_http(rs, rserver.address, port=0)
    base = http.url.removesuffix("/v1")
    oa = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=30)
    vserver = batcher = None
    try:
        assert _status(rserver.address, "specmesh.v1.Router") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _status(rserver.address, "") == health_pb2.HealthCheckResponse.SERVING  # alive
        with Client(rserver.address, timeout=30) as c:
            assert c.ready(timeout=5) == (False, f"router {rserver.address}: NOT_SERVING")
            with pytest.raises(UnavailableError, match="not ready: no verifier replica is serving yet"):
                c.generate(PROMPT, max_new_tokens=4)
        code, body = _get(base + "/health")
        assert code == 503 and body["status"] == "not ready" and "NOT_SERVING" in body["message"]
        assert _get(base + "/live") == (200, {"status": "ok"})
        with pytest.raises(openai.APIStatusError) as e:
            oa.completions.create(model="tiny-test-model", prompt=PROMPT, max_tokens=4, temperature=0)
        assert e.value.status_code == 503 and "not ready" in e.value.message

        # the verifier comes up (its model loaded): the router reads its Info and turns ready
        svc, batcher = verifier_service(s(), tiny_layerskip_verifier())
        vserver = build_server(s(), [svc], port)
        assert wait_for(lambda: _status(rserver.address, "specmesh.v1.Router")
                        == health_pb2.HealthCheckResponse.SERVING, 20)
        assert router.runner.info_answered == {f"127.0.0.1:{port}"}
        assert router.runner.self_drafters() == frozenset({"layerskip"})
        with Client(rserver.address, timeout=30) as c:
            assert c.ready() == (True, "")
            assert c.generate(PROMPT, max_new_tokens=4, strategy="self").stats.drafter == "layerskip"
        assert wait_for(lambda: _get(base + "/health")[0] == 200, 10)
        r = oa.completions.create(model="tiny-test-model", prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        # a prompt plus max_tokens beyond the context: 400 naming max_tokens (rs.max_seq_len 256, one id a char)
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="tiny-test-model", prompt="x" * 120, max_tokens=200, temperature=0)
        assert e.value.body["param"] == "max_tokens" and "context of 256 tokens" in e.value.message
    finally:
        oa.close()
        http.stop()
        rserver.server.stop(0)
        router.close()
        if vserver is not None:
            vserver.server.stop(0)
            batcher.stop()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    st = TinyTracedStack(tmp_path_factory.mktemp("prefix") / "trace.jsonl")
    http = start_http(st.rs, st.address, port=0)
    yield st, http
    http.stop()
    st.close()


def test_cached_tokens_are_reported_everywhere(traced):
    st, http = traced
    oa = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=60)
    before = samples(scrape(st.ports["verifier"]))
    try:
        with Client(st.address, timeout=60) as c:
            first = c.generate(PROMPT, raw_prompt=True, max_new_tokens=6, strategy="autoregressive")
            again = c.generate(PROMPT, raw_prompt=True, max_new_tokens=6, strategy="autoregressive")
        n = len(PROMPT)  # TokenizerCodec: one id a character
        assert first.stats.prompt_tokens == again.stats.prompt_tokens == n
        assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == (n - 1) // 16 * 16
        assert again.token_ids == first.token_ids
        r = oa.completions.create(model=st.rs.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"strategy": "autoregressive"})
        assert r.usage.prompt_tokens == n and r.usage.prompt_tokens_details.cached_tokens == again.stats.cached_tokens
        assert r.model_extra["specmesh"]["cached_tokens"] == again.stats.cached_tokens
    finally:
        oa.close()
    after = samples(scrape(st.ports["verifier"]))
    moved = lambda name: total(after, name) - total(before, name)  # noqa: E731
    assert moved("specmesh_prefix_cache_queries_total") == 3 * n
    assert moved("specmesh_prefix_cache_hits_total") == 2 * again.stats.cached_tokens
    assert total(after, "specmesh_prefix_cache_bytes") > 0
    assert total(after, "specmesh_prefix_cache_budget_bytes") == st.rs.prefix_cache_mib * (1 << 20)
    info = st.verifier_info()
    assert info.prefix_cache and info.prefix_cache_hits >= 2 * again.stats.cached_tokens
    assert info.prefix_cache_block_size == 16
    # the trace: each prefill round's span splits its prompt into cached and computed tokens
    assert wait_for(lambda: spans_done(st.mem, [first, again]), 10)
    rounds = [sp for sp in spans_of(st.mem) if sp["name"] == "specmesh.round"
              and sp["attributes"].get("specmesh.round.prefill")
              and sp["attributes"].get("specmesh.round.cached_tokens") is not None]
    by_cached = sorted(sp["attributes"]["specmesh.round.cached_tokens"] for sp in rounds[-3:])
    assert by_cached == [0, again.stats.cached_tokens, again.stats.cached_tokens]
    for sp in rounds[-3:]:
        a = sp["attributes"]
        assert a["specmesh.round.cached_tokens"] + a["specmesh.round.computed_tokens"] == n
    gens = [sp for sp in spans_of(st.mem) if sp["name"] == "specmesh.generate"]
    assert {sp["attributes"].get("specmesh.cached_tokens") for sp in gens[-3:]} == {0, again.stats.cached_tokens}
