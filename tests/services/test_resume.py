"""Resumable generation (issue 51), fast, on the tiny random model over real gRPC servers:

- ``GenerateRequest.resume`` from every round boundary of a stream gives the
  uninterrupted output, greedy and seeded sampled, in each fixed-budget strategy:
  same tokens, same text, the caller's text plus the new deltas equal to it (no
  character twice, none lost), ``max_new_tokens`` counted from the original start,
  ``resumed_tokens`` in the stats (the block drafter too, in the verifier and on the
  drafter service); a resume that already has every token only ends it;
- bad resumes are INVALID_ARGUMENT naming the field, and change nothing;
- the SDK (blocking and asyncio) resumes a stream whose router went away on the
  next router address, with the uninterrupted output and its counter, and with
  ``resume=False`` raises UNAVAILABLE as before.

A router is made to go away mid-stream without timing: the gated verifier holds
a round (``GatedVerifier.arm``) while the test stops the first router's server.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specmesh.errors import UnavailableError
from specmesh.serving.server import build_server
from specmesh.v1 import common_pb2, router_pb2
from tests.support import FakeCodec, TinyStack, code_of, wait_for

PROMPT = "abcabcabcabc hello hello hello abcabc"
CASES = [  # (strategy, drafter, sampling): fixed draft budgets
    ("autoregressive", "", None), ("external", "prompt_lookup", None), ("self", "layerskip", None),
    ("auto", "", None),  # greedy: any strategy
    ("autoregressive", "", dict(temperature=0.9, top_p=0.95, seed=11)),
    ("external", "prompt_lookup", dict(temperature=0.8, seed=5)),
    ("self", "layerskip", dict(temperature=0.7, top_k=20, seed=3)),
]


@pytest.fixture(scope="module")
def stack():
    s = TinyStack()
    yield s
    s.close()


def request(strategy: str, drafter: str, sampling, n: int = 30, **kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(prompt=PROMPT, strategy=strategy, drafter=drafter, max_new_tokens=n,
                                      sampling=common_pb2.SamplingParams(**(sampling or {})), **kw)


def run(stack, req):
    """(deltas as (token_ids, text), final) of one Generate stream."""
    deltas, final = [], None
    for m in stack.stub.Generate(req, timeout=60):
        if m.HasField("final"):
            final = m.final
        else:
            deltas.append((list(m.delta.token_ids), m.delta.text))
    return deltas, final


@pytest.mark.parametrize("strategy,drafter,sampling", CASES)
def test_a_resume_from_any_round_boundary_is_the_uninterrupted_run(stack, strategy, drafter, sampling):
    full_deltas, full = run(stack, request(strategy, drafter, sampling))
    assert full.stats.resumed_tokens == 0 and len(full_deltas) > 2
    for k in range(1, len(full_deltas)):
        ids = [t for d in full_deltas[:k] for t in d[0]]
        had = "".join(d[1] for d in full_deltas[:k])
        req = request(strategy, drafter, sampling)
        req.resume.token_ids.extend(ids)
        req.resume.text_chars = len(had)
        deltas, final = run(stack, req)
        assert list(final.token_ids) == list(full.token_ids), (k, strategy, drafter, sampling)
        assert final.text == full.text
        assert had + "".join(d[1] for d in deltas) == full.text  # each character once
        assert ids + [t for d in deltas for t in d[0]] == list(full.token_ids)
        assert final.stats.resumed_tokens == len(ids)
        assert final.stats.new_tokens == full.stats.new_tokens  # counted from the original start
        assert final.stats.finish_reason == full.stats.finish_reason
        assert final.stats.prompt_tokens == full.stats.prompt_tokens


@pytest.mark.parametrize("strategy,drafter", [("self", "block_tree"), ("external", "block_tree"),
                                              ("external", "block")])
def test_a_resume_with_the_block_drafter_is_the_uninterrupted_run(strategy, drafter):
    """The block drafter, in the verifier and on the drafter service (fed the target's
    hidden features through the router: the resumed prefill sends their rows first)."""
    from tests.support import BlockStack

    with BlockStack() as block:
        for sampling in (None, dict(temperature=0.8, seed=5)):
            full_deltas, full = run(block, request(strategy, drafter, sampling))
            for k in range(1, len(full_deltas)):
                req = request(strategy, drafter, sampling)
                req.resume.token_ids.extend(t for d in full_deltas[:k] for t in d[0])
                req.resume.text_chars = len("".join(d[1] for d in full_deltas[:k]))
                final = run(block, req)[1]
                assert list(final.token_ids) == list(full.token_ids), (k, sampling)
                assert final.stats.fallbacks == 0  # the drafter drafted from the first round on


def test_a_resume_owes_held_back_text_and_skips_text_the_caller_has(stack):
    full_deltas, full = run(stack, request("autoregressive", "", None, n=12))
    ids = [t for d in full_deltas[:4] for t in d[0]]
    for chars in (0, 2, len(FakeCodec().decode(ids))):
        req = request("autoregressive", "", None, n=12)
        req.resume.token_ids.extend(ids)
        req.resume.text_chars = chars
        deltas, final = run(stack, req)
        assert full.text[:chars] + "".join(d[1] for d in deltas) == full.text
    # every token delivered, the final message lost: the resume only ends the stream
    req = request("autoregressive", "", None, n=12)
    req.resume.token_ids.extend(full.token_ids)
    req.resume.text_chars = len(full.text)
    deltas, final = run(stack, req)
    assert deltas == [] and list(final.token_ids) == list(full.token_ids) and final.text == full.text
    assert final.stats.finish_reason == "length" and final.stats.new_tokens == 12


def test_bad_resumes_are_invalid_argument_naming_the_field(stack):
    _, full = run(stack, request("autoregressive", "", None, n=12))

    def resumed(ids, chars=0, **kw):
        req = request(kw.pop("strategy", "autoregressive"), "", None, n=kw.pop("n", 12), **kw)
        req.resume.token_ids.extend(ids)
        req.resume.text_chars = chars
        return req

    cases = {
        "resume.token_ids": resumed([5, 96]),  # outside the vocabulary (96)
        "resume.token_ids ": resumed([5, -1]),
        "resume.token_ids  ": resumed([5] * 13),  # more than max_new_tokens
        "resume.token_ids   ": resumed([5, 1, 6]),  # the stop token: that generation ended
        "resume.token_ids    ": resumed([87, 88, 89], stop=["y"]),  # stop string matched
        "resume.text_chars": resumed([5, 6], chars=3),  # beyond their text
        "resume.text_chars ": resumed([5, 6], chars=-1),
        "resume": resumed([5, 6], reasoning=True),
    }
    for name, r in cases.items():
        c, d = code_of(lambda: list(stack.stub.Generate(r, timeout=10)))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith(name.strip() + ":"), (name, c, d)
    assert len(stack.verifier_info().sessions) == 0 and stack.drafter_info().sessions == 0
    assert run(stack, request("autoregressive", "", None, n=12))[1].token_ids == full.token_ids  # still serving


class TwoRouters:
    """A second router server in front of the same router, and a way to take the
    first one away in the middle of a stream."""

    def __init__(self, stack):
        self.stack = stack
        self.first = build_server(stack.rs, [stack.rsvc], 0)
        self.addresses = [self.first.address, stack.address]

    def hold(self, at: int = 4):
        self.stack.verifiers[0].arm(at)  # the at-th verify call waits

    def kill_first_when_held(self):
        v = self.stack.verifiers[0]
        assert v.reached.wait(60)
        self.first.server.stop(0)  # in-flight calls end: the client sees UNAVAILABLE
        v.pause_at = None
        v.resume.set()


def test_the_sdk_resumes_on_the_next_router(stack):
    from specmesh import Client

    kw = dict(strategy="external", drafter="prompt_lookup", max_new_tokens=30, temperature=0.8, seed=5)
    with Client(stack.address, timeout=60) as c:
        ref = c.generate(PROMPT, **kw)
    two = TwoRouters(stack)
    with Client(two.addresses, timeout=60) as c:
        two.hold()
        s = c.stream(PROMPT, **kw)
        it = iter(s)
        pieces = [next(it)]
        two.kill_first_when_held()
        pieces += list(it)
    assert "".join(pieces) == ref.text and s.result.text == ref.text
    assert s.token_ids == ref.token_ids and s.result.token_ids == ref.token_ids
    assert s.resumes == 1 and c.resumes == 1 and s.result.stats.resumed_tokens > 0
    assert s.result.stats.new_tokens == ref.stats.new_tokens
    assert wait_for(lambda: len(stack.verifier_info().sessions) == 0)


def test_the_async_sdk_resumes_and_resume_false_does_not(stack):
    from specmesh import AsyncClient

    kw = dict(strategy="autoregressive", max_new_tokens=30)

    async def go(addresses, resume: bool, hold):
        async with AsyncClient(addresses, timeout=60, resume=resume) as c:
            if hold is None:
                return await c.generate(PROMPT, **kw), None
            hold.hold()
            s = c.stream(PROMPT, **kw)
            pieces = []
            loop = asyncio.get_running_loop()
            try:
                async for p in s:
                    pieces.append(p)
                    if len(pieces) == 1:
                        await loop.run_in_executor(None, hold.kill_first_when_held)
            except UnavailableError as e:
                return e, pieces
            return s, pieces

    ref, _ = asyncio.run(go(stack.address, True, None))
    two = TwoRouters(stack)
    s, pieces = asyncio.run(go(two.addresses, True, two))
    assert "".join(pieces) == ref.text and s.token_ids == ref.token_ids and s.resumes == 1
    two = TwoRouters(stack)
    err, pieces = asyncio.run(go(two.addresses, False, two))
    assert isinstance(err, UnavailableError) and "".join(pieces) == ref.text[:len("".join(pieces))]
    assert wait_for(lambda: len(stack.verifier_info().sessions) == 0)


def test_an_async_client_pointed_at_other_routers_resumes_there(stack):
    """``AsyncClient.set_addresses`` (the Ray OpenAI front following the registry): a
    stream in flight on a router that goes away resumes on the new addresses."""
    from specmesh import AsyncClient

    kw = dict(strategy="external", drafter="prompt_lookup", max_new_tokens=30, temperature=0.8, seed=5)
    two = TwoRouters(stack)

    async def go():
        async with AsyncClient(two.addresses[0], timeout=60) as c:
            ref = await c.generate(PROMPT, **kw)
            two.hold()
            s, pieces = c.stream(PROMPT, **kw), []
            async for p in s:
                pieces.append(p)
                if len(pieces) == 1:
                    c.set_addresses([two.addresses[1]])
                    await asyncio.get_running_loop().run_in_executor(None, two.kill_first_when_held)
            return ref, s, pieces

    ref, s, pieces = asyncio.run(go())
    assert "".join(pieces) == ref.text and s.token_ids == ref.token_ids and s.resumes == 1


class FrontProcess:
    """``specmesh serve openai`` in front of ``addresses``, a process of its own."""

    def __init__(self, addresses, *extra: str):
        import os
        import subprocess
        import sys

        from tests.support import ROOT, free_port

        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "specmesh.cli", "serve", "openai", "--port", str(self.port), "--model", "tiny",
               "--router-addresses", ",".join(addresses), *extra]
        self.p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=ROOT)
        self.lines = []
        for line in self.p.stdout:
            self.lines.append(line)
            if "listening on" in line:
                break
        self.url = f"http://127.0.0.1:{self.port}/v1"
        assert f"specmesh openai listening on {self.url}" in "".join(self.lines), "".join(self.lines)

    def health(self) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=30) as h:
            return json.loads(h.read())

    def stop(self) -> int:
        self.p.terminate()
        return self.p.wait(60)


def test_the_openai_front_process_resumes_its_streams_on_the_next_router(stack):
    """``specmesh serve openai`` (a process of its own) in front of two router
    addresses: an HTTP stream whose router goes away finishes with the text of the
    uninterrupted run, each character once; /health counts the resume."""
    openai = pytest.importorskip("openai")
    two = TwoRouters(stack)
    front = FrontProcess(two.addresses)
    try:
        oa = openai.OpenAI(base_url=front.url, api_key="x", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0.8, seed=5,
                  extra_body={"strategy": "external", "drafter": "prompt_lookup"})
        ref = oa.completions.create(**kw)  # new streams take the addresses in turn: this one the first,
        assert oa.completions.create(**kw).choices[0].text == ref.choices[0].text  # this one the second,
        two.hold()  # and the stream below the first again: the one that goes away
        pieces, last = [], None
        for chunk in oa.completions.create(stream=True, **kw):
            pieces.append(chunk.choices[0].text)
            if len(pieces) == 1:
                two.kill_first_when_held()
            last = chunk
        assert "".join(pieces) == ref.choices[0].text
        assert last.choices[0].finish_reason == ref.choices[0].finish_reason
        assert last.model_extra["specmesh"]["resumed_tokens"] > 0
        assert last.model_extra["specmesh"]["new_tokens"] == ref.usage.completion_tokens
        assert front.health()["resumes"] == 1
        oa.close()
    finally:
        assert front.stop() == 0, "".join(front.lines)


def test_a_router_not_back_before_the_deadline_is_one_clear_error(stack):
    """The only router goes away for good: the SDK raises DEADLINE_EXCEEDED at the
    call's deadline, the OpenAI front answers 504 at its ``--http-timeout-s``."""
    from specmesh import Client
    from specmesh.errors import DeadlineExceededError

    openai = pytest.importorskip("openai")
    two = TwoRouters(stack)
    with Client(two.addresses[0], timeout=30) as c:
        two.hold()
        s = c.stream(PROMPT, strategy="autoregressive", max_new_tokens=30)
        it = iter(s)
        next(it)
        two.kill_first_when_held()
        with pytest.raises(DeadlineExceededError):
            list(it)
        assert s.resumes == 1
    two = TwoRouters(stack)
    front = FrontProcess(two.addresses[:1], "--http-timeout-s", "30")
    try:
        oa = openai.OpenAI(base_url=front.url, api_key="x", max_retries=0, timeout=120)
        two.hold()
        import threading

        threading.Thread(target=two.kill_first_when_held, daemon=True).start()
        with pytest.raises(openai.APIStatusError) as e:
            oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, extra_body={"strategy": "autoregressive"})
        assert e.value.status_code == 504
        oa.close()
    finally:
        assert front.stop() == 0, "".join(front.lines)
