"""The OpenAI-compatible HTTP API (``specmesh.serving.openai_http``), driven by the
official ``openai`` client against the real server on loopback, in front of a real
router + drafter service + verifier service stack (tiny random model; one slow test
on the real SmolLM2).

- chat and completions, streaming and not: greedy output equal to the gRPC SDK's for
  the same request, usage counts equal to the router's stats, the speculation stats
  in the ``specmesh`` field (on the final chunk of a stream);
- ``stop`` (applied by the router) cuts the text before the stop string (streaming and not);
- bad input -> ``openai.BadRequestError`` naming the parameter (the router's
  INVALID_ARGUMENT, and the checks of the HTTP layer: ``n``, ``logprobs``, types);
  an unknown model -> ``NotFoundError``; a wrong or missing token ->
  ``AuthenticationError``;
- the router's latency histograms (TTFT, inter-token, end-to-end) and prompt-token
  counter move by exactly what the requests did, for HTTP and gRPC requests alike;
- ``specmesh serve router`` starts the HTTP API on its own port.

No test depends on wall-clock timing: counts are compared, never durations.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")

from specmesh.client import Client  # noqa: E402
from specmesh.serving.openai_http import start_http  # noqa: E402
from specmesh.cli.stack import LocalStack  # noqa: E402
from tests.support import (ROOT, TRACED_SETTINGS, CharCodec, TokenizerCodec, V, free_port, samples,  # noqa: E402
                           scrape, settings, tiny_grammar_verifier, tiny_layerskip_verifier, total, wait_for)

MODEL = "tiny-test-model"
N = 12
PROMPT = "abcabcabcabc the cat sat"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcabcabc abc ab"}]


class Front:
    """A tiny-model stack with metrics, its OpenAI HTTP API on a free port, an
    ``openai.OpenAI`` client and a gRPC SDK client, both to the same router."""

    def __init__(self, token=None, chars: bool = False, **overrides):
        """``chars``: the ``CharCodec`` (JSON can be spelled) and a verifier serving grammars;
        ``overrides``: settings (a longer ``max_seq_len`` goes to the verifier too)."""
        from specmesh.drafters import PromptLookupDrafter, SuffixDrafter

        kw = dict(TRACED_SETTINGS, model=MODEL, **overrides)
        if token:
            kw["auth_token"] = token
        codec = CharCodec() if chars else TokenizerCodec()
        make = tiny_grammar_verifier if chars else tiny_layerskip_verifier
        self.stack = LocalStack([lambda: make(max_seq_len=kw["max_seq_len"])], codec, V,
                                settings=functools.partial(settings, kw),
                                drafters={"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter},
                                metrics=True)
        try:
            self.http = start_http(self.stack.rs, self.stack.address, port=0)
        except BaseException:
            self.stack.close()
            raise
        self.url = self.http.url
        self.oa = openai.OpenAI(base_url=self.url, api_key=token or "unused", max_retries=0, timeout=60)
        self.sdk = Client(self.stack.address, token=token, timeout=60)

    def metrics(self) -> dict:
        return samples(scrape(self.stack.ports["router"]))

    def close(self):
        self.oa.close()
        self.sdk.close()
        self.http.stop()
        self.stack.close()


@pytest.fixture(scope="module")
def front():
    f = Front()
    yield f
    f.close()


def _greedy(**kw):
    return dict(temperature=0, max_tokens=N, **kw)


# ---------------------------------------------------------------- generations

@pytest.mark.parametrize("strategy,drafter", [("external", "prompt_lookup"), ("self", "layerskip"),
                                              ("autoregressive", "")])
def test_chat_greedy_equals_the_sdk(front, strategy, drafter):
    extra = {"strategy": strategy, "drafter": drafter}
    ref = front.sdk.generate(messages=CHAT, max_new_tokens=N, temperature=0, **extra)
    r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra, **_greedy())
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ("length" if ref.stats.finish_reason == "length" else "stop")
    st = ref.stats
    assert r.usage.prompt_tokens == st.prompt_tokens and r.usage.completion_tokens == st.new_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == st.prompt_tokens + st.new_tokens
    sm = r.model_extra["specmesh"]
    assert sm["strategy"] == strategy and sm["drafter"] == drafter and sm["lossy"] is False
    assert sm["new_tokens"] == st.new_tokens and sm["session_id"]
    assert sm["accepted_tokens"] <= sm["drafted_tokens"]
    assert sm["tau"] > 0 and sm["rounds"] >= 1 and isinstance(sm["accept_hist"], list)
    if strategy == "autoregressive":
        assert sm["drafted_tokens"] == 0


def test_chat_stream_equals_the_sdk_and_ends_with_stats(front):
    extra = {"strategy": "external", "drafter": "suffix"}
    ref = front.sdk.generate(messages=CHAT, max_new_tokens=N, temperature=0, **extra)
    chunks = list(front.oa.chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body=extra,
                                                   stream_options={"include_usage": True}, **_greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-2], "the finish chunk, then the usage chunk"
    sm = finals[0].model_extra["specmesh"]
    assert sm["strategy"] == "external" and sm["drafter"] == "suffix"
    assert sm["new_tokens"] == ref.stats.new_tokens and sm["drafted_tokens"] >= sm["accepted_tokens"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == ref.stats.new_tokens
    assert usage.usage.prompt_tokens == ref.stats.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_equals_the_sdk(front, stream):
    ref = front.sdk.generate(PROMPT, raw_prompt=True, max_new_tokens=N, temperature=0)
    kw = dict(model=MODEL, prompt=PROMPT, **_greedy())
    if stream:
        chunks = list(front.oa.completions.create(stream=True, **kw))
        assert all(c.object == "text_completion" for c in chunks)
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].model_extra["specmesh"]["new_tokens"] == ref.stats.new_tokens
    else:
        r = front.oa.completions.create(**kw)
        assert r.object == "text_completion" and r.choices[0].text == ref.text
        assert r.usage.prompt_tokens == ref.stats.prompt_tokens == len(PROMPT)  # TokenizerCodec: one id a character
        assert r.usage.completion_tokens == ref.stats.new_tokens
        assert r.model_extra["specmesh"]["strategy"] == ref.stats.strategy


def test_sampling_with_a_seed_is_the_sdks_draw(front):
    kw = dict(temperature=0.9, top_p=0.9, seed=7)
    lab = dict(strategy="external", drafter="prompt_lookup")  # named: auto may choose by measured speed
    ref = front.sdk.generate(messages=CHAT, max_new_tokens=N, top_k=5, **kw, **lab)
    r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, extra_body={"top_k": 5, **lab},
                                         **kw)
    assert r.choices[0].message.content == ref.text
    # no seed: one is drawn (OpenAI samples afresh on every call) and reported
    r2 = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.9)
    assert isinstance(r2.model_extra["specmesh"]["seed"], int)


def test_typical_acceptance_is_labelled_lossy(front):
    r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0.7, seed=1,
                                         extra_body={"acceptance": "typical", "strategy": "self"})
    assert r.model_extra["specmesh"]["lossy"] is True


def test_relaxed_rules_take_their_parameters_as_extra_fields(front):
    """``lenience`` / ``accept_top_k`` ride along as flat extra fields (vLLM style) and
    reach the verifier: the response names the rule and is labelled lossy; a bad
    value is a 400 naming the parameter."""
    for extra in ({"acceptance": "lenient", "lenience": 0.5}, {"acceptance": "topk", "accept_top_k": 3}):
        r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0.7, seed=1,
                                             extra_body=dict(extra, strategy="self"))
        sm = r.model_extra["specmesh"]
        assert sm["lossy"] is True and sm["acceptance"] == extra["acceptance"], sm
    with pytest.raises(openai.BadRequestError) as e:
        front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N,
                                         extra_body={"acceptance": "lenient", "lenience": 2.0})
    assert e.value.body["param"] == "lenience", e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_stop_cuts_before_the_stop_string(front, stream):
    """The router applies the stop strings (the OpenAI rule): the text ends before the
    first one, finish_reason stop, the router's stats count the tokens through it."""
    full = front.sdk.generate(messages=CHAT, max_new_tokens=N, temperature=0).text
    assert len(full) >= 8
    stop = full[4:6]
    want = full[: full.find(stop)]
    kept = len(want) + len(stop)  # TokenizerCodec: one character a token; tokens run through the stop string
    kw = dict(model=MODEL, messages=CHAT, stop=[stop, "\x00never"], **_greedy())
    if stream:
        chunks = list(front.oa.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        fin = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
        assert fin.choices[0].finish_reason == "stop"
        st = fin.model_extra["specmesh"]
        usage = chunks[-1].usage
    else:
        r = front.oa.chat.completions.create(**kw)
        text, usage = r.choices[0].message.content, r.usage
        assert r.choices[0].finish_reason == "stop"
        st = r.model_extra["specmesh"]
    assert text == want
    assert st["finish_reason"] == "stop" and st["new_tokens"] == kept and "tau" in st
    sdk = front.sdk.generate(messages=CHAT, max_new_tokens=N, temperature=0, stop=[stop])
    assert sdk.text == want and len(sdk.token_ids) == kept and sdk.stats.finish_reason == "stop"
    assert usage.prompt_tokens == sdk.stats.prompt_tokens and usage.completion_tokens == kept
    # completions, a single stop string
    r = front.oa.completions.create(model=MODEL, prompt=PROMPT, stop=stop, **_greedy())
    full_c = front.sdk.generate(PROMPT, raw_prompt=True, max_new_tokens=N, temperature=0).text
    assert r.choices[0].text == (full_c[: full_c.find(stop)] if stop in full_c else full_c)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=9), "n"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(logit_bias={"96": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}),
     "response_format"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[str(i) for i in range(17)]), "stop"),
    (dict(stop=["x" * 257]), "stop"),
    (dict(extra_body={"strategy": "warp"}), "strategy"),
    (dict(extra_body={"drafter": "oracle", "strategy": "external"}), "drafter"),
    (dict(extra_body={"acceptance": "bogus"}), "acceptance"),
    (dict(extra_body={"draft_budget": 999}), "draft_budget"),
    (dict(extra_body={"top_k": "many"}), "top_k"),
    (dict(extra_body={"strategy": "proactive"}), "conversation_id"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_is_a_bad_request_naming_the_parameter(front, kw, param, stream):
    with pytest.raises(openai.BadRequestError) as e:
        r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, stream=stream, **kw)
        if stream:
            list(r)
    err = e.value
    assert err.status_code == 400
    assert err.body["param"] == param and err.body["type"] == "invalid_request_error", err.body
    assert err.body["message"].startswith(f"{param}:")


def test_bad_bodies(front):
    with pytest.raises(openai.BadRequestError) as e:
        front.oa.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        front.oa.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        front.oa.completions.create(model=MODEL, prompt=[1, 2, 3])
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as e:
        front.oa.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    # not JSON at all: the raw HTTP status and error shape
    req = urllib.request.Request(front.url + "/chat/completions", data=b"{nope", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    assert he.value.code == 400 and json.loads(he.value.read())["error"]["type"] == "invalid_request_error"


def test_models(front):
    (m,) = front.oa.models.list().data
    assert m.id == MODEL and m.owned_by == "specmesh"


# ---------------------------------------------------------------- metrics: HTTP and gRPC requests alike

def test_latency_histograms_count_every_request(front):
    lab = dict(strategy="external", drafter="prompt_lookup")
    before = front.metrics()
    r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, extra_body=lab, **_greedy())
    g = front.sdk.generate(messages=CHAT, max_new_tokens=N, temperature=0, **lab)
    assert wait_for(lambda: total(front.metrics(), "specmesh_e2e_request_latency_seconds_count", **lab)
                    - total(before, "specmesh_e2e_request_latency_seconds_count", **lab) >= 2)
    after = front.metrics()
    d = lambda name: total(after, name, **lab) - total(before, name, **lab)  # noqa: E731
    gen = r.usage.completion_tokens + g.stats.new_tokens
    assert d("specmesh_time_to_first_token_seconds_count") == 2
    assert d("specmesh_inter_token_latency_seconds_count") == gen - 2
    assert d("specmesh_e2e_request_latency_seconds_count") == 2
    assert d("specmesh_prompt_tokens_total") == r.usage.prompt_tokens + g.stats.prompt_tokens
    assert d("specmesh_generated_tokens_total") == gen
    assert d("specmesh_drafts_total") <= d("specmesh_rounds_total")
    assert d("specmesh_accepted_tokens_total") == r.model_extra["specmesh"]["accepted_tokens"] + \
        g.stats.accepted_tokens


# ---------------------------------------------------------------- auth

def test_bearer_token():
    f = Front(token="s3cret")
    try:
        r = f.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        for headers in ({}, {"Authorization": ""}):  # a wrong token; no token at all
            bad = openai.OpenAI(base_url=f.url, api_key="wrong", max_retries=0, timeout=30, default_headers=headers)
            with pytest.raises(openai.AuthenticationError) as e:
                bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
            bad.close()
        with urllib.request.urlopen(f.url.removesuffix("/v1") + "/health", timeout=30) as h:
            assert h.status == 200  # probes need no token
    finally:
        f.close()


# ---------------------------------------------------------------- specmesh serve router

def test_serve_router_starts_the_http_api(tmp_path):
    """``specmesh serve router`` prints the API's URL; it answers /v1/models (no
    verifier is needed for that) and health, and stops with the router."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "specmesh.cli", "serve", "router", "--port", "0", "--metrics", "false",
           "--http-port", str(port), "--verifier-addresses", "127.0.0.1:1", "--drafter-address", "none"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "OpenAI API on" in line or "WARNING" in line:
                break
        assert f"specmesh router OpenAI API on http://127.0.0.1:{port}/v1" in "".join(lines), "".join(lines)
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        assert [m.id for m in oa.models.list().data] == ["smollm2-135m-instruct"]
        oa.close()
    finally:
        p.terminate()
        p.wait(60)


# ---------------------------------------------------------------- the real model (slow)

@pytest.mark.slow
def test_real_model_stream_with_self_speculation(runtime):
    """SmolLM2 behind the real services: a streamed chat completion with
    ``strategy: self`` is the SDK's greedy output, which is plain greedy decoding."""
    from tests.support import RuntimeStack

    stack = RuntimeStack(runtime=runtime, n_slots=4)
    http = None
    try:
        http = start_http(stack.rs, stack.address, port=0)
        msgs = [{"role": "user", "content": "List the planets of the solar system in order from the sun."}]
        with openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=300) as oa:
            chunks = list(oa.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, stream=True,
                                                     temperature=0, max_tokens=32, extra_body={"strategy": "self"}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with Client(stack.address, timeout=300) as c:
            ref = c.generate(messages=msgs, max_new_tokens=32, temperature=0, strategy="self")
        assert text == ref.text and ref.token_ids == stack.ref(messages=msgs, n=32)
        sm = chunks[-1].model_extra["specmesh"]
        assert sm["strategy"] == "self" and sm["drafter"] and sm["tau"] >= 1.0 and sm["lossy"] is False
    finally:
        if http is not None:
            http.stop()
        stack.close()


def test_a_plain_request_gets_the_routers_default_strategy_auto(front):
    """A vLLM user's request names no strategy: the router's default, auto, picks one and
    says why (issue 50: the default was external:prompt_lookup)."""
    r = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    sm = r.model_extra["specmesh"]
    assert sm["strategy_reason"].startswith("auto"), sm
