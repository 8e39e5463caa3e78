"""The OpenAI fields agents and structured-output users send, exact under speculation,
through the official ``openai`` client against the real HTTP API in front of a real
router + drafter + verifier stack on loopback (tiny model, ``CharCodec``: one token a
character, so JSON can be spelled):

- penalties, logit_bias, min_p: greedy output identical for every strategy and equal to
  the gRPC SDK's;
- logprobs (chat, streamed and not; completions): the same values for every strategy,
  aligned with the text, top_logprobs sorted;
- n: choices with their own seeds (choice 0 is the n=1 request), usage summed;
- structured outputs (response_format json_object / json_schema, guided_regex,
  guided_choice, guided_grammar): every output in the language, greedy and sampled, for
  every strategy; greedy identical across strategies;
- predicted outputs: the output is the unpredicted one, accepted / rejected prediction
  tokens reported in usage.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")

from tests.services.test_openai_http import CHAT, MODEL, PROMPT, Front  # noqa: E402

STRATEGIES = [{"strategy": "autoregressive"}, {"strategy": "external", "drafter": "prompt_lookup"},
              {"strategy": "self", "drafter": "layerskip"}, {"strategy": "external", "drafter": "suffix"}]
IDS = ["plain", "prompt_lookup", "layerskip", "suffix"]


@pytest.fixture(scope="module")
def front():
    f = Front(chars=True, max_seq_len=1536, max_prompt_tokens=1300, max_new_tokens=160)
    yield f
    f.close()


def chat(front, extra=None, **kw):
    args = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    args.update(kw)
    return front.oa.chat.completions.create(extra_body=extra or {}, **args)


# ---------------------------------------------------------------- penalties, logit_bias, min_p

def test_penalties_and_logit_bias_are_greedy_identical_across_strategies(front):
    pen = dict(presence_penalty=0.7, frequency_penalty=0.9, logit_bias={"40": 4, "41": -100})
    extra = {"repetition_penalty": 1.3, "min_p": 0.05}
    outs = [chat(front, dict(extra, **s), max_tokens=24, **pen).choices[0].message.content for s in STRATEGIES]
    assert len(set(outs)) == 1, dict(zip(IDS, outs))
    plain = chat(front, {"strategy": "autoregressive"}, max_tokens=24).choices[0].message.content
    assert outs[0] != plain  # they change the output
    assert chr(41 + 30) not in outs[0]  # token 41 is banned
    sdk = front.sdk.generate(messages=CHAT, max_new_tokens=24, temperature=0, presence_penalty=0.7,
                             frequency_penalty=0.9, logit_bias={40: 4, 41: -100}, repetition_penalty=1.3, min_p=0.05,
                             strategy="external", drafter="prompt_lookup")
    assert sdk.text == outs[0]


# ---------------------------------------------------------------- logprobs

def test_chat_logprobs_equal_across_strategies_and_streamed(front):
    got = []
    for s in STRATEGIES:
        r = chat(front, s, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        assert "".join(x.token for x in content) == r.choices[0].message.content
        for x in content:
            assert len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob >= x.top_logprobs[-1].logprob
            assert x.logprob <= x.top_logprobs[0].logprob + 1e-6 and bytes(x.bytes).decode() == x.token
        got.append([(x.token, round(x.logprob, 4)) for x in content])
    assert all(g == got[0] for g in got), got
    chunks = list(chat(front, STRATEGIES[1], logprobs=True, top_logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == got[0]


def test_completions_logprobs(front):
    r = front.oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                    extra_body={"strategy": "external", "drafter": "prompt_lookup"})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


# ---------------------------------------------------------------- n

@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_have_their_own_seeds_and_usage_is_summed(front, stream):
    kw = dict(temperature=1.0, seed=11, n=3, max_tokens=10)
    one = chat(front, STRATEGIES[1], temperature=1.0, seed=11, max_tokens=10)
    if stream:
        chunks = list(chat(front, STRATEGIES[1], stream=True, stream_options={"include_usage": True}, **kw))
        texts = ["", "", ""]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
        usage = chunks[-1].usage
    else:
        r = chat(front, STRATEGIES[1], **kw)
        texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        usage = r.usage
    assert texts[0] == one.choices[0].message.content
    assert len(set(texts)) > 1
    assert usage.completion_tokens == sum(len(t) for t in texts)  # one token a character
    sdk = front.sdk.generate_n(messages=CHAT, n=3, max_new_tokens=10, temperature=1.0, seed=11, strategy="external",
                               drafter="prompt_lookup")
    assert [x.text for x in sdk] == texts


# ---------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["cat", "dog", "owl"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "kind", "age"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_hold_the_schema_for_every_strategy(front, temperature):
    outs = []
    for s in STRATEGIES:
        r = chat(front, s, response_format=RF, max_tokens=60, temperature=temperature, seed=3)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        outs.append(text)
        st = r.model_extra["specmesh"]
        if s["strategy"] != "autoregressive":
            assert st["forced_tokens"] > 0  # keys, separators, enum tails: free drafts
    if temperature == 0:
        assert len(set(outs)) == 1, outs
        r = chat(front, {"strategy": "auto"}, response_format=RF, max_tokens=60, temperature=0)
        assert r.choices[0].message.content == outs[0]
        st = r.model_extra["specmesh"]
        assert "jump-forward" in st["strategy_reason"] and st["forced_tokens"] > 0, st


def test_regex_choice_and_grammar(front):
    r = chat(front, {"guided_regex": "[a-c]{3}-[0-9]{2}", **STRATEGIES[1]})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].message.content)
    r = chat(front, {"guided_choice": ["alpha", "beta"], **STRATEGIES[2]})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = chat(front, {"guided_grammar": 'start: "x" ("y" | "z")+ "!"', **STRATEGIES[3]}, max_tokens=30)
    assert re.fullmatch("x[yz]+!", r.choices[0].message.content)
    r = front.oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = chat(front, {"structured_outputs": {"regex": "(ab)+"}}, max_tokens=6)
    assert re.fullmatch("(ab)+", r.choices[0].message.content)


def test_a_bad_grammar_changes_no_other_request(front):
    before = chat(front, STRATEGIES[1]).choices[0].message.content
    for bad in ({"guided_json": {"type": "frob"}}, {"guided_regex": "a(", "response_format": RF}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(front, bad)
        assert e.value.body["param"] in ("guided_json", "guided_regex", "response_format")
    assert chat(front, STRATEGIES[1]).choices[0].message.content == before


# ---------------------------------------------------------------- predicted outputs

def test_prediction_drafts_and_reports_accepted_tokens(front):
    ref = chat(front, STRATEGIES[0], max_tokens=24).choices[0].message.content
    r = chat(front, {"prediction": {"type": "content", "content": ref}}, max_tokens=24)
    assert r.choices[0].message.content == ref
    d = r.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= len(ref) - 2 and d.rejected_prediction_tokens <= 2
    st = r.model_extra["specmesh"]
    assert st["drafter"] == "prediction" and st["target_forwards"] < len(ref) // 2
    edited = ref[:8] + "QQQQ" + ref[12:]
    r = chat(front, {"prediction": {"type": "content", "content": edited}}, max_tokens=24)
    assert r.choices[0].message.content == ref
    assert r.usage.completion_tokens_details.rejected_prediction_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        chat(front, {"prediction": {"type": "content", "content": ref}, "strategy": "self"})
    assert e.value.body["param"] == "prediction"


# ---------------------------------------------------------------- the real model (slow)

@pytest.mark.slow
def test_real_model_json_schema_logprobs_and_penalties(runtime):
    """SmolLM2 behind the real services: a json_schema request is valid JSON of the schema,
    the same with plain decoding and self speculation (which drafts the forced keys for
    free: fewer target forwards), logprobs and penalised output equal across strategies."""
    from tests.support import RuntimeStack

    from specmesh.serving.openai_http import start_http

    stack = RuntimeStack(runtime=runtime, n_slots=4)
    http = None
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "number"},
                                               "continent": {"enum": ["Africa", "Asia", "Europe", "North America",
                                                                      "South America", "Oceania"]}},
              "required": ["city", "country", "population_millions", "continent"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Give me the capital of France as JSON."}]
    try:
        http = start_http(stack.rs, stack.address, port=0)
        with openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0, timeout=300) as oa:
            rs = {}
            for strategy in ("autoregressive", "self", "auto"):
                rs[strategy] = oa.chat.completions.create(
                    model="smollm2-135m-instruct", messages=msgs, temperature=0, max_tokens=80, logprobs=True,
                    response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
                    extra_body={"strategy": strategy})
            pen = [oa.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, temperature=0,
                                              max_tokens=24, frequency_penalty=1.0, presence_penalty=0.5,
                                              extra_body={"strategy": s}).choices[0].message.content
                   for s in ("autoregressive", "self")]
            # tools on a template without them (the system-message rendering): required calls always parse
            weather = {"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                                        "parameters": {"type": "object", "properties": {
                                                            "city": {"type": "string", "maxLength": 30}},
                                                            "required": ["city"], "additionalProperties": False}}}
            for q, temp in (("What is the weather in Paris?", 0.0), ("Is it raining in Tokyo?", 0.8)):
                r = oa.chat.completions.create(model="smollm2-135m-instruct", temperature=temp, seed=1,
                                               max_tokens=60, tools=[weather], tool_choice="required",
                                               parallel_tool_calls=False, messages=[{"role": "user", "content": q}])
                (call,) = r.choices[0].message.tool_calls
                assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
                jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
        texts = {k: r.choices[0].message.content for k, r in rs.items()}
        assert len(set(texts.values())) == 1, texts
        jsonschema.validate(json.loads(texts["self"]), schema)
        lps = {k: [(x.token, x.logprob) for x in r.choices[0].logprobs.content] for k, r in rs.items()}
        for k in lps:
            assert [t for t, _ in lps[k]] == [t for t, _ in lps["autoregressive"]]
            assert max(abs(a - b) for (_, a), (_, b) in zip(lps[k], lps["autoregressive"])) < 1e-3
        sm = {k: r.model_extra["specmesh"] for k, r in rs.items()}
        assert sm["self"]["forced_tokens"] > 0 and sm["auto"]["forced_tokens"] > 0
        assert sm["self"]["target_forwards"] < sm["autoregressive"]["target_forwards"]
        assert pen[0] == pen[1]
    finally:
        if http is not None:
            http.stop()
        stack.close()


# ---------------------------------------------------------------- tools

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "look a word up", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "the time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("s", STRATEGIES, ids=IDS)
def test_required_and_named_tool_calls_parse_and_hold_the_schema(front, s):
    for temperature in (0.0, 1.0):
        r = chat(front, s, tools=[LOOKUP, CLOCK], tool_choice="required", max_tokens=120, temperature=temperature,
                 seed=5, parallel_tool_calls=False)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for c in choice.message.tool_calls:
            args = json.loads(c.function.arguments)
            schema = {"lookup": LOOKUP, "clock": CLOCK}[c.function.name]["function"]["parameters"]
            jsonschema.validate(args, schema)
            assert c.id.startswith("call_") and c.type == "function"
    r = chat(front, s, tools=[LOOKUP, CLOCK], tool_choice={"type": "function", "function": {"name": "clock"}},
             max_tokens=120)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "clock" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_tool_calls_stream_as_deltas_and_a_tool_result_is_the_next_turn(front):
    chunks = list(chat(front, STRATEGIES[1], tools=[CLOCK], tool_choice="required", max_tokens=120, stream=True,
                       parallel_tool_calls=False))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "clock"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    ref = chat(front, STRATEGIES[1], tools=[CLOCK], tool_choice="required", max_tokens=120,
               parallel_tool_calls=False).choices[0].message.tool_calls[0]
    assert (ref.function.name, ref.function.arguments) == (deltas[0].function.name, deltas[0].function.arguments)
    # the agent's next turn: the call, the tool's result, and an answer (tool_choice none: text)
    msgs = CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": ref.id, "type": "function", "function": {"name": "clock", "arguments": ref.function.arguments}}]},
        {"role": "tool", "tool_call_id": ref.id, "content": "12:00"}]
    r = front.oa.chat.completions.create(model=MODEL, messages=msgs, tools=[CLOCK], tool_choice="none",
                                         max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_bad_tools_are_refused_naming_the_field(front):
    for kw, param in [(dict(tools=[LOOKUP], tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
                      (dict(tools=[LOOKUP], tool_choice="required", response_format=RF), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(front, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_auto_tools_decode_under_their_triggered_grammar_identically_for_every_strategy(front):
    """tool_choice auto: the output is free text until the model opens a call (then held to the
    tools), the same tokens under every strategy as plain decoding, greedy and streamed."""
    outs = []
    for s in STRATEGIES:
        r = chat(front, s, tools=[LOOKUP, CLOCK], max_tokens=40)
        outs.append((r.choices[0].message.content, [(c.function.name, c.function.arguments)
                                                    for c in r.choices[0].message.tool_calls or []]))
    assert all(o == outs[0] for o in outs), dict(zip(IDS, outs))
    chunks = list(chat(front, STRATEGIES[1], tools=[LOOKUP, CLOCK], max_tokens=40, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (outs[0][0] or "")
    r = chat(front, {}, tools=[LOOKUP, CLOCK], max_tokens=40)  # auto: the grammar's drafter, and why
    sm = r.model_extra["specmesh"]
    assert (sm["strategy"], sm["drafter"]) == ("external", "prompt_lookup") and "tool calls grammar" in \
        sm["strategy_reason"], sm["strategy_reason"]


def test_tool_fields_are_honoured_or_refused_naming_them(front):
    strict_ok = {"type": "function", "function": dict(CLOCK["function"], strict=True)}
    r = chat(front, STRATEGIES[0], tools=[strict_ok], tool_choice="required", max_tokens=60)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
    loose = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    for extra, tools, param in [
            ({}, [loose], "tools"),  # strict, but additionalProperties is not false
            ({}, [{"type": "function", "function": dict(CLOCK["function"], strict="yes")}], "tools"),
            ({}, [{"type": "function", "function": dict(CLOCK["function"], examples=[])}], "tools"),
            ({}, [dict(CLOCK, cache_control={})], "tools"),
            ({"guided_regex": "[a-z]+"}, [CLOCK], "tool_choice")]:  # free text or a call: not both a regex
        with pytest.raises(openai.BadRequestError) as e:
            chat(front, extra, tools=tools)
        assert e.value.body["param"] == param, (extra, tools, e.value.body)
    from specmesh.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as e:  # a thinking phase is not constrained: no tools
        front.sdk.generate(messages=CHAT, tools=[CLOCK], reasoning=True, max_new_tokens=8)
    assert e.value.field == "tools"


def test_a_tool_whose_schema_nothing_satisfies_is_called_with_free_arguments_unless_strict(front):
    """BFCL's Events_3_BuyEventTickets: an integer whose enum lists strings. OpenAI accepts
    such a non-strict tool (it does not promise non-strict arguments): its arguments are any
    JSON object, forced or not; strict, it cannot be enforced: a 400 naming ``tools``."""
    params = {"type": "object", "properties": {"n": {"type": "integer", "enum": ["1", "2"]}}, "required": ["n"]}
    buy = {"type": "function", "function": {"name": "buy", "description": "buy tickets", "parameters": params}}
    r = chat(front, STRATEGIES[0], tools=[buy], tool_choice="required", max_tokens=40, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "buy" and isinstance(json.loads(call.function.arguments), dict)
    r = chat(front, STRATEGIES[0], tools=[buy, CLOCK], max_tokens=20)  # auto: served
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    strict = {"type": "function", "function": dict(buy["function"], strict=True, parameters=dict(
        params, additionalProperties=False))}
    with pytest.raises(openai.BadRequestError) as e:
        chat(front, STRATEGIES[0], tools=[strict], tool_choice="required", max_tokens=40)
    assert e.value.body["param"] == "tools" and "cannot be enforced" in e.value.body["message"], e.value.body


def test_a_response_format_with_auto_tools_is_that_json_or_calls_streamed_and_not(front):
    """tool_choice auto beside a JSON response_format: the reply is the format's JSON or a list
    of calls that hold their schemas (one grammar of both); the format's JSON, where it is an
    untagged call object of a requested tool (what Qwen2.5-Coder-1.5B-Instruct writes), is a
    call too; streamed as not; without tools the same JSON is content."""
    params = CLOCK["function"]["parameters"]
    schema = {"type": "object", "properties": {"name": {"const": "clock"}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    for s in STRATEGIES[:2]:
        r = chat(front, s, tools=[CLOCK, LOOKUP], response_format=rf, max_tokens=60, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        jsonschema.validate(json.loads(call.function.arguments), {"clock": CLOCK, "lookup": LOOKUP}[
            call.function.name]["function"]["parameters"])
    chunks = list(chat(front, STRATEGIES[1], tools=[CLOCK, LOOKUP], response_format=rf, max_tokens=60, stream=True,
                       parallel_tool_calls=False))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # without tools (or with tool_choice none) the format's JSON is content
    for kw in ({}, {"tools": [CLOCK], "tool_choice": "none"}):
        r = chat(front, STRATEGIES[1], response_format=rf, max_tokens=60, **kw)
        assert r.choices[0].message.tool_calls is None and json.loads(r.choices[0].message.content)["name"] == "clock"
