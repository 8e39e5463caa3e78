"""``specmesh.tools``' output parsing: tagged calls, and a reply that is one untagged call
object of a requested tool (bare or in a code fence: what Qwen2.5-Coder-1.5B-Instruct
writes instead of the tags), whole and streamed piece by piece alike."""

from __future__ import annotations

import json

import pytest

from specmesh.tools import ToolStream, parse

NAMES = ("multiply", "word_count")
FENCED = '```json\n{\n  "name": "multiply",\n  "arguments": {\n    "a": 1234,\n    "b": 5678\n  }\n}\n```'


def streamed(text: str, names=NAMES, step: int = 3):
    s = ToolStream(names)
    out, seen = [], []
    for i in range(0, len(text), step):
        out.append(s.push(text[i:i + step]))
        seen += s.new
    out.append(s.flush())
    seen += s.new
    return "".join(out), s.calls, seen


@pytest.mark.parametrize("text", [FENCED, '{"name": "multiply", "arguments": {"a": 1234, "b": 5678}}',
                                  '\n```\n{"name":"multiply","parameters":{"a":1234,"b":5678}}\n```\n'])
def test_a_reply_that_is_one_untagged_call_is_that_call(text):
    content, calls = parse(text, NAMES)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("multiply",
                                                                                      {"a": 1234, "b": 5678})]
    content, calls2, seen = streamed(text)
    assert content == "" and [(c.name, c.arguments) for c in calls2] == [(c.name, c.arguments) for c in calls]
    assert seen == calls2  # announced once, at the end


@pytest.mark.parametrize("text", [
    FENCED.replace("multiply", "divide"),  # not a requested tool
    '{"name": "multiply", "arguments": {"a": 1}, "note": "x"}',  # other keys: an answer in JSON, not a call
    "Sure: " + FENCED,  # text around it
    FENCED + " done",
    '{"name": "multiply", "arguments": {"a": 1',  # cut
    "```python\nprint(1)\n```",
    '{"name": "multiply", "arguments": "a=1"}',  # arguments not an object
])
def test_anything_else_stays_content(text):
    assert parse(text, NAMES) == (text, [])
    content, calls, _ = streamed(text)
    assert (content, calls) == (text, [])


def test_without_names_only_tags_are_calls_and_plain_text_is_not_held_back():
    assert parse(FENCED) == (FENCED, [])
    s = ToolStream(NAMES)
    assert s.push("The answer") == "The answer"  # cannot begin an untagged call: emitted at once
    assert s.push(' is {"name": "multiply", "arguments": {}}') == ' is {"name": "multiply", "arguments": {}}'
    assert s.flush() == "" and s.calls == []


def test_tagged_calls_still_parse_when_a_reply_starts_like_json():
    text = '<tool_call>\n{"name": "word_count", "arguments": {"text": "a b"}}\n</tool_call>'
    for content, calls in (parse(text, NAMES), streamed(text)[:2]):
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("word_count",
                                                                                          {"text": "a b"})]
