"""Agents on the real pair, opt-in: Qwen2.5-Coder-1.5B-Instruct (int4) behind the real
services and the OpenAI HTTP API, driven with the official ``openai`` client, greedy
(issue 67):

- forced tool choice (``required``, a named function, with and without parallel calls,
  plain decoding and ``auto``, streamed and not) returns a call whose arguments hold the
  schema, never a 400 (Qwen's ``<tool_call>`` is a special token: a grammar spelling it as
  text matched nothing);
- under ``auto`` every call the model writes is a call whose arguments hold the schema
  (the triggered grammar), the same tokens under every strategy as plain decoding's;
  ``parallel_tool_calls: false`` returns one call at most;
- an agent loop (two cities, a tool result each) ends in an answer that uses both
  results within 4 requests.

Skipped unless the models are installed (`make setup-qwen`)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_qwen_pair import TARGET, _installed

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
FACTORIAL = {"type": "function", "function": {"name": "factorial", "description": "n! of an integer n",
                                              "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                             "required": ["n"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FACTORIAL)}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER_AT = {"Paris": {"temp_c": 18, "sky": "sunny"}, "Rome": {"temp_c": 27, "sky": "cloudy"}}


@pytest.fixture(scope="module")
def oa():
    if not _installed():
        pytest.skip("the Qwen2.5-Coder pair is not installed (`make setup-qwen`)")
    from specmesh.runtime import Runtime
    from specmesh.serving.openai_http import start_http
    from tests.support import RuntimeStack

    rt = Runtime(TARGET, dtype="int4", n_slots=2, max_seq_len=2048, quiet=True, uno=False, specialist=None)
    stack = RuntimeStack(n_slots=2, runtime=rt, model=TARGET, dtype="int4", drafter_timeout_s=300.0,
                         max_seq_len=2048)
    http = start_http(stack.rs, stack.address, port=0)
    client = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=900)
    yield client
    client.close()
    http.stop()
    stack.close()


def chat(oa, messages, strategy="", **kw):
    """``strategy``: "" (the server's, auto), a name, or name:drafter."""
    kw.setdefault("max_tokens", 60)
    name, _, drafter = strategy.partition(":")
    extra = {k: v for k, v in (("strategy", name), ("drafter", drafter)) if v}
    return oa.chat.completions.create(model=TARGET, messages=messages, temperature=0, extra_body=extra or None, **kw)


def held(calls) -> list:
    """(name, arguments) of each call, after checking that its arguments hold its schema."""
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed(oa, messages, **kw):
    """(content, calls as (name, arguments), finish_reason) of a streamed request."""
    chunks = list(chat(oa, messages, stream=True, **kw))
    calls = [(d.function.name, json.loads(d.function.arguments)) for c in chunks if c.choices
             for d in (c.choices[0].delta.tool_calls or [])]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return content, calls, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.parametrize("strategy", ["autoregressive", ""])
@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_forced_tool_choice_returns_a_call_that_holds_the_schema(oa, strategy, choice, parallel):
    r = chat(oa, PARIS, strategy, tools=[WEATHER, FACTORIAL], tool_choice=choice, parallel_tool_calls=parallel)
    (choice0,) = r.choices
    calls = held(choice0.message.tool_calls or [])
    assert choice0.finish_reason == "tool_calls" and calls[0] == ("get_weather", {"city": "Paris"}), choice0
    assert parallel or len(calls) == 1
    content, scalls, finish = streamed(oa, PARIS, strategy=strategy, tools=[WEATHER, FACTORIAL], tool_choice=choice,
                                       parallel_tool_calls=parallel)
    assert (scalls, finish) == (calls, "tool_calls") and not content.strip()


def test_auto_calls_hold_their_schemas_and_every_strategy_writes_plain_decodings_tokens(oa):
    q = [{"role": "user", "content": "What are the factorials of 5 and of 7?"}]
    rs = {s: chat(oa, q, s, tools=[FACTORIAL, WEATHER], max_tokens=120)
          for s in ("autoregressive", "auto", "external:prompt_lookup", "self")}
    outs = {s: (r.choices[0].message.content, [(c.function.name, c.function.arguments)
                                               for c in r.choices[0].message.tool_calls or []])
            for s, r in rs.items()}
    assert len(set(map(str, outs.values()))) == 1, outs
    calls = held(rs["auto"].choices[0].message.tool_calls)
    assert ("factorial", {"n": 5}) in calls and rs["auto"].choices[0].finish_reason == "tool_calls"
    assert "grammar" in rs["auto"].model_extra["specmesh"]["strategy_reason"]
    # one call at most without parallel calls
    r = chat(oa, q, tools=[FACTORIAL, WEATHER], max_tokens=120, parallel_tool_calls=False)
    assert len(held(r.choices[0].message.tool_calls or [])) <= 1


def test_a_call_with_a_list_for_a_string_is_not_returned(oa):
    """Issue 67: '{"city": ["Paris", "Rome"]}' came back as a call to a string parameter."""
    q = [{"role": "user", "content": "What's the weather in Paris and in Rome? Use the tool."}]
    for kw in ({}, {"parallel_tool_calls": False}):
        r = chat(oa, q, tools=[WEATHER], max_tokens=120, **kw)
        held(r.choices[0].message.tool_calls or [])  # each returned call holds the schema
        content, calls, _ = streamed(oa, q, tools=[WEATHER], max_tokens=120, **kw)
        assert calls == held(r.choices[0].message.tool_calls or [])


def test_an_agent_loop_over_two_cities_ends_in_an_answer_using_both_results(oa):
    msgs = [{"role": "user", "content": "What's the weather in Paris and in Rome? Use the tool."}]
    for request in range(4):
        r = chat(oa, msgs, tools=[WEATHER], max_tokens=150)
        m = r.choices[0].message
        if not m.tool_calls:
            break
        calls = held(m.tool_calls)
        msgs.append({"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]})
        for c, (_, args) in zip(m.tool_calls, calls):
            msgs.append({"role": "tool", "tool_call_id": c.id,
                         "content": json.dumps(dict(city=args["city"], **WEATHER_AT.get(args["city"], {})))})
    else:
        pytest.fail(f"no answer within 4 requests: {msgs}")
    answer = m.content or ""
    assert r.choices[0].finish_reason == "stop" and "18" in answer and "27" in answer, (request, msgs, answer)
