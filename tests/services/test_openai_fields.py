"""Nothing silently ignored: every request field of OpenAI's chat and completions APIs
(as the official ``openai`` client declares them) is in ``specmesh.serving.openai_fields``'
tables, and a request setting it through the real HTTP API either works (implemented) or
is a 400 naming that field (refused). An unknown field is a 400 naming it too.

The walk sends each field with a value that asks for something (``SAMPLES``), through
the official client against a tiny-model stack on loopback, and checks the table's
verdict; fields whose table entry accepts some values (``n: 1``, ``store: false``, ...)
are also sent with such a value (``ACCEPTED``) and must work."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="pip install -e '.[test]'")

from openai.types import completion_create_params as cc  # noqa: E402
from openai.types.chat import completion_create_params as chat_cc  # noqa: E402

from specmesh.serving import openai_fields  # noqa: E402
from tests.services.test_openai_http import CHAT, MODEL, PROMPT, Front  # noqa: E402

TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                        "required": ["word"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
LARK = 'start: "ab" | "ba"'

# a value of each field that asks for something
SAMPLES = {
    "model": MODEL, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["zz"], "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": True}, "user": "user-1", "n": 2,
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 10}, "logprobs": True, "top_k": 5,
    "min_p": 0.1, "repetition_penalty": 1.2, "strategy": "autoregressive", "drafter": "prompt_lookup",
    "acceptance": "exact", "draft_budget": 2, "conversation_id": "conv-1", "messages": CHAT,
    "max_completion_tokens": 3, "top_logprobs": 2, "safety_identifier": "who", "metadata": {"k": "v"},
    "store": True, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "mp3"},
    "service_tier": "flex", "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
    "prompt_cache_key": "key", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": 1},
    "moderation": {"model": "omni"}, "functions": [TOOL["function"]], "function_call": "auto",
    "response_format": {"type": "json_object"}, "tools": [TOOL], "tool_choice": "auto",
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "abc abc"},
    "guided_json": SCHEMA, "guided_regex": "[a-c]+", "guided_choice": ["abc", "cab"], "guided_grammar": LARK,
    "structured_outputs": {"regex": "[a-c]+"}, "prompt": PROMPT, "echo": True, "suffix": "end", "best_of": 2,
    "lenience": 0.5, "cache_salt": "tenant-1",
}
# fields sent together with another (a sample alone would be refused for the other's sake)
WITH = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [TOOL]}, "parallel_tool_calls": {"tools": [TOOL]},
        "stream_options": {"stream": True}, "lenience": {"acceptance": "lenient"}}
# values that a partly refused field accepts
ACCEPTED = {"n": 1, "store": False, "metadata": {}, "modalities": ["text"], "service_tier": "auto",
            "response_format": {"type": "text"}, "tool_choice": "none", "echo": False, "best_of": 1, "suffix": "",
            "prompt_cache_key": "", "functions": []}


def test_the_tables_cover_the_openai_clients_fields():
    chat = set(chat_cc.CompletionCreateParamsBase.__annotations__) | {"stream"}
    comp = set(cc.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert chat <= set(openai_fields.CHAT), sorted(chat - set(openai_fields.CHAT))
    assert comp <= set(openai_fields.COMPLETIONS), sorted(comp - set(openai_fields.COMPLETIONS))
    for table in openai_fields.TABLES.values():
        assert set(table) <= set(SAMPLES), sorted(set(table) - set(SAMPLES))


def test_check_refuses_unknown_fields_and_names_them():
    with pytest.raises(openai_fields.FieldRefused) as e:
        openai_fields.check({"temperature": 1.0, "frobnicate": 3}, "chat")
    assert e.value.param == "frobnicate" and "unknown" in e.value.why
    with pytest.raises(openai_fields.FieldRefused) as e:
        openai_fields.check({"max_completion_tokens": 3}, "completion")
    assert e.value.param == "max_completion_tokens" and "chat API" in e.value.why
    openai_fields.check({"lenience": 0.5, "acceptance": "lenient"}, "chat")  # a rule's parameter


@pytest.fixture(scope="module")
def front():
    f = Front(chars=True, max_seq_len=2048, max_prompt_tokens=1800, max_new_tokens=160)  # the tools prompt in characters
    yield f
    f.close()


def _send(front, api: str, body: dict):
    base = dict(model=MODEL, max_tokens=3, temperature=0)
    base.update({"messages": CHAT} if api == "chat" else {"prompt": PROMPT})
    extra = {k: v for k, v in body.items() if k not in base}
    for k in set(body) & set(base):
        base[k] = body[k]
    stream = bool(extra.pop("stream", False))
    create = front.oa.chat.completions.create if api == "chat" else front.oa.completions.create
    r = create(stream=stream, extra_body=extra, **base)
    return list(r) if stream else r


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_every_field_is_implemented_or_refused_naming_it(front, api):
    table = openai_fields.TABLES[api]
    outcomes = {}
    for name, rule in table.items():
        if rule == openai_fields.IMPLEMENTED:
            _send(front, api, dict(WITH.get(name, {}), **{name: SAMPLES[name]}))  # raises on an error status
            outcomes[name] = "ok"
        else:
            with pytest.raises(openai.BadRequestError) as e:
                _send(front, api, {name: SAMPLES[name]})
            assert e.value.body["param"] == name, (name, e.value.body)
            assert e.value.body["message"].startswith(f"{name}:"), e.value.body
            outcomes[name] = "refused"
            if name in ACCEPTED:
                _send(front, api, {name: ACCEPTED[name]})
    assert "ok" in outcomes.values()
    with pytest.raises(openai.BadRequestError) as e:
        _send(front, api, {"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"


def test_message_fields_not_served_are_refused_naming_them(front):
    with pytest.raises(openai.BadRequestError) as e:
        front.oa.chat.completions.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"].startswith("messages[0].content")


def test_developer_role_is_the_system_role(front):
    dev = [{"role": "developer", "content": "be brief"}] + CHAT[1:]
    a = front.oa.chat.completions.create(model=MODEL, messages=dev, max_tokens=6, temperature=0)
    b = front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_obfuscation_pads_stream_chunks(front):
    chunks = list(front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                   stream=True, stream_options={"include_obfuscation": True}))
    assert chunks and all(c.to_dict().get("obfuscation") for c in chunks)
    plain = list(front.oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                  stream=True))
    assert not any(c.to_dict().get("obfuscation") for c in plain)
