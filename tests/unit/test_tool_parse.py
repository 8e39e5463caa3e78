"""``specmesh.tool_parse``: every form of call the served families write is a call (tags,
fences, bare objects one after another, JSON lists, the template echo ``{{...}}``), with
the text before it as content; anything else stays content, exactly; whole and streamed
piece by piece (any piece size) alike; ``parallel=False`` keeps one call. And a refusal the
router passes on names the request's field (``tools``), never the stage (``downstream``)."""

from __future__ import annotations

import json

import pytest

from specmesh.tool_parse import ToolStream, parse

NAMES = ("multiply", "word_count", "get_weather")
FENCED = '```json\n{\n  "name": "multiply",\n  "arguments": {\n    "a": 1234,\n    "b": 5678\n  }\n}\n```'
PARIS, ROME = ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})
MUL = ("multiply", {"a": 1234, "b": 5678})


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(text: str, step: int, names=NAMES, parallel: bool = True):
    s = ToolStream(names, parallel)
    out, seen = [], []
    for i in range(0, len(text), step):
        out.append(s.push(text[i:i + step]))
        seen += s.new
    out.append(s.flush())
    seen += s.new
    assert seen == s.calls  # each call announced once
    return "".join(out), s.calls


def both(text: str, names=NAMES, parallel: bool = True):
    """parse(text), after checking that every streaming of it gives the same."""
    content, calls = parse(text, names, parallel)
    for step in (1, 2, 5, len(text) or 1):
        c2, calls2 = streamed(text, step, names, parallel)
        assert (c2, [(c.name, c.arguments) for c in calls2]) == (content, [(c.name, c.arguments) for c in calls])
    return content, calls_of(calls)


@pytest.mark.parametrize("text, content, calls", [
    (FENCED, "", [MUL]),
    ('{"name": "multiply", "arguments": {"a": 1234, "b": 5678}}', "", [MUL]),
    ('\n```\n{"name":"multiply","parameters":{"a":1234,"b":5678}}\n```\n', "", [MUL]),
    # several objects one after another (what Qwen2.5-Coder writes for "Paris and Rome")
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_weather", "arguments": {"city": '
     '"Rome"}}', "", [PARIS, ROME]),
    # tags, with text before them
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', "Let me check.",
     [PARIS, ROME]),
    # the template echo: Qwen2.5's template shows its example call in doubled braces
    ('{{"name": "get_weather", "arguments": {"city": "Rome"}}}', "", [ROME]),
    # a JSON list, bare, fenced, and in a tag (SmolLM2's own format)
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": '
     '{"city": "Rome"}}]', "", [PARIS, ROME]),
    ('```json\n[\n {"name": "get_weather", "arguments": {"city": "Paris"}},\n {"name": "get_weather", '
     '"parameters": {"city": "Rome"}}\n]\n```\nDone.', "Done.", [PARIS, ROME]),
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>', "", [PARIS]),
    # arguments as a JSON string holding an object
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', "", [PARIS]),
    ("Sure: " + FENCED, "Sure:", [MUL]),
    (FENCED + " done", "done", [MUL]),
])
def test_every_form_of_call_is_a_call_with_the_text_before_it_as_content(text, content, calls):
    assert both(text) == (content, calls)


@pytest.mark.parametrize("text", [
    FENCED.replace("multiply", "divide"),  # not a requested tool (issue 68: never a call)
    '<tool_call>\n{"name": "divide", "arguments": {}}\n</tool_call>',  # a tag naming an unknown function
    '{"name": "multiply", "arguments": {"a": 1}, "note": "x"}',  # other keys: an answer in JSON, not a call
    '{"arguments": {"a": 1}, "name": "multiply"}',  # a call opens with its name (the grammar holds it from there)
    '{"name": "multiply", "arguments": "oops"}',  # arguments no object (issue 68)
    '{"name": "multiply", "arguments": [1, 2]}',
    '{"name": "multiply", "arguments": {"a": 1',  # cut
    "```python\nprint({'name': 1})\n```\nend",
    'The answer is {"a": 1} and [1, 2]; a < b, `x` and ``y``.',
    "Hello world  \n",  # a reply without calls is its text exactly, trailing whitespace too
    "<tool_", "```", "{", "[{",  # held back while they might open a call, content once the reply ends
])
def test_anything_else_stays_content_exactly(text):
    assert both(text) == (text, [])


def test_without_names_only_tags_are_calls_and_plain_text_is_not_held_back():
    assert both(FENCED, names=()) == (FENCED, [])
    assert both('<tool_call>\n{"name": "any", "arguments": {}}\n</tool_call>', names=()) == ("", [("any", {})])
    s = ToolStream(NAMES)
    assert s.push("The answer") == "The answer"  # cannot begin a call: emitted at once
    assert s.push(" is {") == " is"  # "{" may open one: held back
    assert s.push('"a": 1}') == ' {"a": 1}'  # decided: content
    assert s.flush() == "" and s.calls == []


def test_parallel_false_keeps_the_first_call_and_the_rest_is_content():
    two = ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
           '{"name": "get_weather", "arguments": {"city": "Rome"}}')
    content, calls = both(two, parallel=False)
    assert calls == [PARIS] and content == '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    listed = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {}}]'
    assert both(listed, parallel=False)[1] == [PARIS]


def test_calls_stream_as_they_close_and_content_before_them_is_not_held():
    s = ToolStream(NAMES)
    assert s.push("Checking both.\n") == "Checking both."  # the newline waits: it touches a call if one comes
    assert s.push('{"name": "get_weather", "arguments": {"city": "Paris"}}') == "" and calls_of(s.new) == [PARIS]
    assert s.push('\n{"name": "get_weather", "arguments": {"city"') == "" and s.new == []
    assert s.push(': "Rome"}}') == "" and calls_of(s.new) == [ROME]
    assert s.flush() == "" and len(s.calls) == 2


def test_a_refusal_the_router_passes_on_names_the_requests_field_never_the_stage():
    """Issue 67: a verifier's refusal reached the HTTP API as param "downstream"."""
    from specmesh.errors import InvalidArgumentError
    from specmesh.serving.openai_request import from_specmesh

    e = InvalidArgumentError("downstream: sampling.grammar: the session's committed output does not match it")
    assert e.field == "sampling.grammar" and e.reason == "the session's committed output does not match it"
    body = from_specmesh(e, {"sampling.grammar": "tools"}).body()["error"]
    assert body["param"] == "tools" and body["message"] == "tools: the session's committed output does not match it"
    assert InvalidArgumentError("top_p: must be in (0, 1]").field == "top_p"
