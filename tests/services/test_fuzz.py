"""Both doors fuzzed, on a real stack on loopback (router, drafter service, verifier service
serving grammars, the OpenAI front; tiny random model, ``CharCodec``):

- schemathesis over the front's own ``/openapi.json`` (positive and negative cases, each
  endpoint), and Hypothesis over the gRPC ``GenerateRequest``: every case ends in a
  success or a refusal naming its field (``specmesh.cli.bench.fuzz.judge_http`` /
  ``judge_grpc``), and the services still serve afterwards;
- a small fixed budget and a fixed seed (deterministic, about a minute on 2 cores); the
  >= 2,000-case runs are ``scripts/fuzz.py`` (docs/development.md, "Fuzzing");
- the judges themselves, and the cases fuzzing found: bytes that are not the message
  (INVALID_ARGUMENT ``request``), the schema's strategy names equal to the router's.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("schemathesis", reason="pip install -e '.[test]'")

from specmesh.cli.bench import fuzz  # noqa: E402
from specmesh.cli.stack import LocalStack  # noqa: E402
from specmesh.serving.openai_http import start_http  # noqa: E402
from tests.support import TRACED_SETTINGS, CharCodec, V, settings, tiny_grammar_verifier  # noqa: E402

CASES = 50  # per endpoint and mode (HTTP); gRPC cases: 3x. CI's budget (about 20 s)
SEED = 68


@pytest.fixture(scope="module")
def stack():
    from specmesh.drafters import PromptLookupDrafter, SuffixDrafter

    kw = dict(TRACED_SETTINGS, model="tiny-test-model", max_seq_len=512, max_prompt_tokens=400, max_new_tokens=16)
    s = LocalStack([lambda: tiny_grammar_verifier(max_seq_len=512)], CharCodec(), V,
                   settings=functools.partial(settings, kw),
                   drafters={"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter})
    http = start_http(s.rs, s.address, port=0)
    s.base = http.url.removesuffix("/v1")
    yield s
    http.stop()
    s.close()


def test_the_http_door_answers_every_case_with_success_or_a_named_field(stack):
    tally = fuzz.fuzz_http(stack.base, CASES, SEED)
    assert sum(tally.cases.values()) >= 2 * len(fuzz.ENDPOINTS) * CASES * 0.5, tally.to_dict()
    assert tally.failed == 0, tally.to_dict()["failures"][:5]
    assert fuzz.still_serving(stack.base, stack.address) == []


def test_the_grpc_door_answers_every_case_with_success_or_a_named_field(stack):
    tally = fuzz.fuzz_grpc(stack.address, CASES * 3, SEED)
    assert tally.cases["grpc Generate"] == CASES * 3
    assert tally.outcomes[("grpc Generate", "OK")] > 0  # the cases reach generation too
    assert tally.failed == 0, tally.to_dict()["failures"][:5]
    assert fuzz.still_serving(stack.base, stack.address) == []


def test_bytes_that_are_not_the_message_are_refused_naming_the_request(stack):
    import grpc

    with grpc.insecure_channel(stack.address) as ch:
        raw = ch.unary_stream("/specmesh.v1.Router/Generate", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        bad_utf8 = b"\x0a\x03\xff\xfe\xfd"  # field 1 (prompt): 3 bytes that are not UTF-8
        with pytest.raises(grpc.RpcError) as e:
            list(raw(bad_utf8, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request:")


def test_the_schema_names_the_routers_strategies():
    from specmesh.router.strategies import STRATEGIES
    from specmesh.serving.openai_schema import STRATEGIES as DOCUMENTED

    assert set(DOCUMENTED) == set(STRATEGIES)


def test_the_judges():
    j = fuzz.judge_http
    assert j(200, b'{"choices": []}', "application/json") is None
    assert j(400, b'{"error": {"message": "m", "type": "invalid_request_error", "param": "top_p"}}') is None
    assert "naming no field" in j(400, b'{"error": {"message": "m", "type": "invalid_request_error", "param": null}}')
    assert "HTTP 500" in j(500, b"Internal Server Error")
    assert "without a JSON error" in j(429, b"slow down")
    ok = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert j(200, ok, "text/event-stream") is None
    err = b'data: {"error": {"message": "m", "type": "server_error", "param": null}}\n\n'
    assert "not a field's" in j(200, err, "text/event-stream")
    assert fuzz.judge_grpc("OK", "") is None
    assert fuzz.judge_grpc("INVALID_ARGUMENT", "sampling.top_p: must be in (0, 1]") is None
    assert "naming no field" in fuzz.judge_grpc("INVALID_ARGUMENT", "bad things happened: no")
    assert fuzz.judge_grpc("INTERNAL", "boom")
