"""Fuzzing the two doors: the OpenAI front (schemathesis over its ``/openapi.json``) and the
router's gRPC ``Generate`` (Hypothesis strategies of ``GenerateRequest``).

The rule both are held to: every request ends in a success or in a refusal that names the
field at fault (HTTP 400 ``{"error": {..., "param": "<field>"}}``, gRPC INVALID_ARGUMENT
"<field>: <why>"), never a 5xx, an INTERNAL or a refusal that names nothing, and the
services still serve afterwards. ``judge_http`` / ``judge_grpc`` say what is wrong with
one answer (None: nothing); ``fuzz_http`` / ``fuzz_grpc`` run a fixed number of cases from
a fixed seed (deterministic: Hypothesis' ``seed``) and return a ``Tally``.

Used by ``tests/services/test_fuzz.py`` (a small budget, in CI), ``scripts/fuzz.py`` (the
long runs: >= 2,000 cases a door) and ``specmesh bench-serving --soak-serve`` (a fuzzing
client beside honest conversations). Needs the ``test`` extra (schemathesis, hypothesis).
Knows nothing about models: it speaks HTTP and the SDK's protos.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MODES = ("positive", "negative")
# gRPC statuses a request may end in: OK, or a refusal naming the field (INVALID_ARGUMENT)
FIELD_CODES = ("INVALID_ARGUMENT",)


@dataclass
class Tally:
    """Cases run, their outcomes (``"200"``, ``"400"``, ``"OK"``, ``"INVALID_ARGUMENT"`` ...) per
    door, and the failures (the first ``keep`` of them, with what was sent)."""

    cases: Counter = field(default_factory=Counter)  # door -> cases
    outcomes: Counter = field(default_factory=Counter)  # (door, outcome) -> cases
    failures: list = field(default_factory=list)
    failed: int = 0
    keep: int = 50
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, door: str, outcome: str, problem: Optional[str], sent: str = "") -> None:
        with self.lock:
            self.cases[door] += 1
            self.outcomes[(door, outcome)] += 1
            if problem:
                self.failed += 1
                if len(self.failures) < self.keep:
                    self.failures.append({"door": door, "outcome": outcome, "problem": problem,
                                          "sent": sent[:2000]})

    def to_dict(self) -> dict:
        return {"cases": dict(self.cases), "failed": self.failed,
                "outcomes": {f"{d} {o}": n for (d, o), n in sorted(self.outcomes.items())},
                "failures": self.failures}


# ---------------------------------------------------------------- judging one answer

def _error_of(obj) -> Optional[dict]:
    return obj.get("error") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else None


def judge_http(status: int, body: bytes, content_type: str = "") -> Optional[str]:
    """What is wrong with one HTTP answer, or None: a 2xx (a stream's events free of errors
    that name nothing or say server_error), or a 4xx whose OpenAI error names its field
    (401 excepted: a token names no field)."""
    text = body.decode("utf-8", "replace")
    if status >= 500:
        return f"HTTP {status}: {text[:300]}"
    if 200 <= status < 300:
        if "text/event-stream" not in content_type:
            return None
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                err = _error_of(json.loads(line[6:]))
            except ValueError:
                return f"a stream event that is not JSON: {line[:200]}"
            if err is not None and (err.get("type") == "server_error" or not err.get("param")):
                return f"a stream ended in an error that is not a field's: {err}"
        return None
    try:
        err = _error_of(json.loads(text))
    except ValueError:
        return f"HTTP {status} without a JSON error: {text[:300]}"
    if err is None:
        return f"HTTP {status} without an error object: {text[:300]}"
    if status == 401:
        return None
    if not err.get("param"):
        return f"HTTP {status} naming no field: {err}"
    return None


def judge_grpc(code: str, details: str) -> Optional[str]:
    """What is wrong with one gRPC ending (``code``: the status name), or None: OK, or an
    INVALID_ARGUMENT whose message starts with the field it names."""
    if code == "OK":
        return None
    if code not in FIELD_CODES:
        return f"{code}: {details[:300]}"
    head = details.split(":", 1)[0] if ":" in details else ""
    if not head or " " in head:
        return f"{code} naming no field: {details[:300]}"
    return None


# ---------------------------------------------------------------- the HTTP door (schemathesis)

def _hypothesis_settings(n: int):
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=n, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck), print_blob=False)


def fuzz_http(base: str, n: int, seed: int = 0, tally: Optional[Tally] = None, modes=MODES,
              endpoints=ENDPOINTS, stop: Optional[threading.Event] = None, timeout: float = 120.0) -> Tally:
    """``n`` schemathesis cases per endpoint and mode against the front at ``base`` (its root:
    ``http://host:port``), generated from its ``/openapi.json`` with Hypothesis seed ``seed``."""
    import requests
    import schemathesis
    from hypothesis import given
    from hypothesis import seed as hseed
    from schemathesis import GenerationMode

    tally = tally if tally is not None else Tally()
    with requests.get(base + "/openapi.json", timeout=30) as r:
        r.raise_for_status()
        schema = schemathesis.openapi.from_dict(r.json())
    ops = {op.ok().path: op.ok() for op in schema.get_all_operations()}
    session = requests.Session()
    for path in endpoints:
        for mode in modes:
            strategy = ops[path].as_strategy(generation_mode=GenerationMode(mode))

            @hseed(seed)
            @_hypothesis_settings(n)
            @given(case=strategy)
            def one(case):
                if stop is not None and stop.is_set():
                    return
                sent = case.as_curl_command()
                try:
                    resp = case.call(base_url=base, session=session, timeout=timeout)
                except Exception as e:  # noqa: BLE001 - a dropped connection is a failure too
                    tally.add(f"http {path}", type(e).__name__, f"no answer: {e}", sent)
                    return
                tally.add(f"http {path}", str(resp.status_code),
                          judge_http(resp.status_code, resp.content, resp.headers.get("content-type", "")), sent)

            one()
    session.close()
    return tally


# ---------------------------------------------------------------- the gRPC door (Hypothesis)

def generate_requests(max_new: int = 12):
    """A Hypothesis strategy of ``router_pb2.GenerateRequest``: every field, each an honest
    value nine times in ten and a hostile one otherwise (32-bit extremes, NaN and infinite
    floats, unknown names, control characters and special-token strings in text, grammars
    malformed or past the matcher's limits, resumes of nothing), so that cases reach
    generation as well as every refusal; mostly small enough to run."""
    from hypothesis import strategies as st

    from ...v1 import router_pb2

    def mostly(honest, hostile):  # (Hypothesis draws small integers far more often: not integers(0, 9) == 0)
        return st.sampled_from((False,) * 9 + (True,)).flatmap(lambda bad: hostile if bad else honest)

    i32 = st.integers(-(1 << 31), (1 << 31) - 1)
    f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
    words = st.sampled_from(["hello", "<|im_start|>system\n", "<|im_end|>", "\x00", "🙂", "   ", "def f():",
                             "{\"a\": 1}", "a" * 300, "The cat sat on the mat."])
    text = st.one_of(words, st.text(max_size=40), st.lists(words, max_size=4).map("".join))
    prose = st.sampled_from(["Say hi.", "Count to five.", "def add(a, b):", "The quick brown fox", "Why?"])

    def names(honest):
        return mostly(st.sampled_from(list(honest)), st.text(max_size=12))

    grammar = mostly(
        st.sampled_from([("", "")] * 6 + [("regex", "[a-z]+"), ("json_object", ""), ("choice", '["yes", "no"]'),
                                          ("json_schema", '{"type": "object"}'), ("lark", 'start: "ab" | "ba"')]),
        st.tuples(st.sampled_from(["regex", "json_schema", "json_object", "choice", "lark", "gbnf", "x"]),
                  st.one_of(st.sampled_from(["(", "{", '{"type": 3}', "start: " + " | ".join(['"a" "b"+ "c"'] * 2100)]),
                            text)))
    small = lambda lo, hi: mostly(st.integers(lo, hi), i32)  # noqa: E731

    @st.composite
    def request(draw):
        m = router_pb2.GenerateRequest()
        if draw(st.booleans()):
            m.prompt = draw(mostly(prose, text))
        else:
            for _ in range(draw(st.integers(1, 3))):
                m.messages.add(role=draw(names(("system", "user", "assistant", "tool"))),
                               content=draw(mostly(prose, text)),
                               name=draw(mostly(st.sampled_from(["", "", "alice"]), text)))
        m.strategy = draw(names(("", "auto", "autoregressive", "external", "self", "proactive", "ssr")))
        m.drafter = draw(names(("", "", "", "prompt_lookup", "suffix", "adaptive_lookup", "draft_lm", "layerskip",
                                "block", "block_tree")))
        if draw(st.booleans()):
            m.max_new_tokens = draw(small(1, max_new))
        sp = m.sampling
        sp.temperature = draw(mostly(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1e-38]), f32))
        if draw(st.integers(0, 2)) == 0:
            sp.top_p = draw(mostly(st.sampled_from([1.0, 0.9, 0.5]), f32))
        sp.top_k = draw(small(0, 50))
        sp.seed = draw(st.integers(0, (1 << 64) - 1))
        sp.acceptance = draw(names(("", "", "exact", "typical", "lenient", "topk", "contrastive", "divergence")))
        if draw(st.integers(0, 3)) == 0:
            sp.presence_penalty = draw(mostly(st.floats(-2, 2, width=32), f32))
            sp.repetition_penalty = draw(mostly(st.floats(0.5, 2, width=32), f32))
            sp.min_p = draw(mostly(st.floats(0, 1, width=32), f32))
            for t in draw(st.lists(small(0, 60), max_size=3)):
                sp.logit_bias[t] = draw(mostly(st.floats(-100, 100, width=32), f32))
        if draw(st.integers(0, 3)) == 0:
            sp.logprobs = draw(mostly(st.sampled_from([0, 1, 3]), i32))
        sp.grammar_kind, sp.grammar = draw(grammar)
        if draw(st.integers(0, 3)) == 0:
            m.draft_budget = draw(small(1, 8))
        m.raw_prompt = draw(st.booleans())
        m.conversation_id = draw(mostly(st.sampled_from(["", "", "conv-1"]), text))
        m.reasoning = draw(st.integers(0, 9)) == 0
        if draw(st.integers(0, 9)) == 0:
            m.thinking_budget = draw(small(1, 8))
        m.stop.extend(draw(mostly(st.lists(st.sampled_from([".", "\n", "zz"]), max_size=2), st.lists(text, max_size=3))))
        m.draft_ahead = draw(names(("", "", "on", "off", "auto")))
        m.prediction = draw(mostly(st.sampled_from(["", "", "Hello there."]), text))
        if draw(st.integers(0, 4)) == 0:
            for _ in range(draw(st.integers(1, 2))):
                m.tools.add(name=draw(mostly(st.just("lookup"), text)), description=draw(text),
                            parameters=draw(mostly(st.sampled_from(["", '{"type": "object"}']),
                                                   st.sampled_from(["{", '{"type": 3}', "[]"]))))
            m.tool_choice = draw(names(("", "auto", "none", "required", "function:lookup")))
            if draw(st.booleans()):
                m.parallel_tool_calls = draw(st.booleans())
        m.cache_salt = draw(mostly(st.sampled_from(["", "", "tenant-a"]), text))
        if draw(st.integers(0, 19)) == 0:
            m.resume.token_ids.extend(draw(st.lists(small(0, 60), max_size=4)))
            m.resume.text_chars = draw(st.integers(-2, 40))
        return m

    return request()


def call_generate(stub, req, metadata=(), timeout: float = 120.0) -> tuple[str, str]:
    """(status name, details) of one raw Generate call, the stream read to its end."""
    import grpc

    try:
        for _ in stub.Generate(req, timeout=timeout, metadata=metadata):
            pass
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def fuzz_grpc(address: str, n: int, seed: int = 0, tally: Optional[Tally] = None, token: Optional[str] = None,
              max_new: int = 12, on_case: Optional[Callable] = None, stop: Optional[threading.Event] = None,
              timeout: float = 120.0) -> Tally:
    """``n`` Hypothesis cases of ``GenerateRequest`` against the router at ``address``, seed
    ``seed``; raw stubs, so what the SDK refuses before sending reaches the router too."""
    import grpc
    from hypothesis import given
    from hypothesis import seed as hseed

    from ...v1 import router_pb2_grpc

    tally = tally if tally is not None else Tally()
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        @hseed(seed)
        @_hypothesis_settings(n)
        @given(req=generate_requests(max_new))
        def one(req):
            if stop is not None and stop.is_set():
                return
            code, details = call_generate(stub, req, md, timeout)
            tally.add("grpc Generate", code, judge_grpc(code, details), str(req))
            if on_case is not None:
                on_case(req, code, details)

        one()
    return tally


def still_serving(http_base: Optional[str], grpc_address: Optional[str]) -> list[str]:
    """What is no longer serving (empty: all is): the front's /health and a greedy request
    through it, the router's health and a greedy Generate."""
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ...v1 import router_pb2, router_pb2_grpc

    down = []
    if http_base:
        try:
            with urllib.request.urlopen(http_base + "/health", timeout=30) as r:
                if r.status != 200:
                    down.append(f"front /health {r.status}")
        except OSError as e:
            down.append(f"front /health: {e}")
    if grpc_address:
        with grpc.insecure_channel(grpc_address) as ch:
            try:
                st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specmesh.v1.Router"),
                                                          timeout=30).status
                if st != health_pb2.HealthCheckResponse.SERVING:
                    down.append(f"router health {st}")
                req = router_pb2.GenerateRequest(prompt="Say hi.", max_new_tokens=2)
                code, details = call_generate(router_pb2_grpc.RouterStub(ch), req, timeout=120)
                if code != "OK":
                    down.append(f"a greedy Generate: {code} {details}")
            except grpc.RpcError as e:
                down.append(f"router: {e.code().name} {e.details()}")
    return down


__all__ = ["Tally", "call_generate", "fuzz_grpc", "fuzz_http", "generate_requests", "judge_grpc", "judge_http",
           "still_serving"]
