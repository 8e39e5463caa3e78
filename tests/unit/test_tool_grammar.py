"""``specmesh.tools``' grammars on llguidance, over a one-character-a-token vocabulary
(plus the call tags as two special tokens, as Qwen2.5's tokenizer has them):

- ``required`` / a named function admit only a JSON list of calls whose arguments hold the
  schema (a grammar that spelled Qwen's special ``<tool_call>`` token as text matched
  nothing: issue 67's 400);
- ``auto`` is triggered: free text, and once the model opens a call of a tool (an object
  whose first key is ``"name"``, with the tool's name, in any form) its arguments held to
  the tool's schema; after the call free text again, or (``parallel_tool_calls`` false)
  text that opens no other call; an object naming no tool is text;
- rolled back and walked again, the matcher allows what a fresh one allows at every
  prefix (what makes speculation exact under the grammar);
- strict functions, OpenAI's rules; the fixed Qwen template."""

from __future__ import annotations

import json

import pytest

from specmesh import tools as tl
from specmesh.grammar import Matcher, Vocab
from specmesh.types import InvalidArgument

V = 96
OPEN_ID, CLOSE_ID = V, V + 1
TOKENS = [b"\n", b""] + [bytes([30 + i]) for i in range(2, V)] + [b"<tool_call>", b"</tool_call>"]
STOP = 1
CLOCK = tl.Tool("clock", "the time", json.dumps({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                 "required": ["zone"], "additionalProperties": False}))
LOOKUP = tl.Tool("lookup", "look a word up", json.dumps({"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}, "required": ["word"]}))
TOOLS = [CLOCK, LOOKUP]
SPECIAL = tl.ToolFormat(OPEN_ID, CLOSE_ID)


@pytest.fixture(scope="module")
def vocab():
    return Vocab.from_bytes(TOKENS, [STOP], special=[OPEN_ID, CLOSE_ID])


def ids(text: str) -> list[int]:
    """One token a character; the tags as their special tokens."""
    out, i = [], 0
    while i < len(text):
        for tag, t in ((tl.OPEN, OPEN_ID), (tl.CLOSE, CLOSE_ID)):
            if text.startswith(tag, i):
                out.append(t)
                i += len(tag)
                break
        else:
            out.append(0 if text[i] == "\n" else ord(text[i]) - 30)
            i += 1
    return out


def text_ids(text: str) -> list[int]:
    return [0 if c == "\n" else ord(c) - 30 for c in text]


def takes(m: Matcher, toks: list[int]) -> bool:
    m.back(len(m.consumed))
    return all(m.advance(t) for t in toks)


def allowed_chars(m: Matcher) -> str:
    return "".join("\n" if i == 0 else chr(30 + i) for i in m.allowed().nonzero().flatten().tolist() if 2 <= i < V)


CALL = '{"name": "clock", "arguments": {"zone": "UTC"}}'


def test_forced_choice_admits_only_a_list_of_calls_that_hold_the_schema(vocab):
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "required", True, SPECIAL))
    assert takes(m, text_ids(f"[{CALL}]")) and m.ends(STOP)
    two = f'[{CALL}, {CALL.replace("UTC", "CET")}]'
    assert takes(m, text_ids(two)) and m.ends(STOP)  # parallel: the model writes ", " for another, or "]"
    assert m.allowed()[STOP] and not takes(m, text_ids(two + "\n"))
    assert not takes(m, text_ids("Sure"))  # no text
    assert not takes(m, ids(f"{tl.OPEN}"))
    assert not takes(m, text_ids('[{"name": "clock", "arguments": {"zone": "PST"}}]'))
    assert not takes(m, text_ids('[{"name": "other"'))
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "required", False, SPECIAL))
    assert not takes(m, text_ids(f"[{CALL}, "))  # parallel_tool_calls false: one call
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "function:lookup", True, SPECIAL))
    assert takes(m, text_ids('[{"name": "lookup", "arguments": {"word": "abc"}}]')) and m.ends(STOP)
    assert not takes(m, text_ids('[{"name": "lookup", "arguments": {"word": "abc"}}, '))  # a named function: one
    assert not takes(m, text_ids('[{"name": "clock"'))
    assert not takes(m, text_ids('[{"name": "lookup", "arguments": {"word": "abcdefghi"'))


def test_forced_calls_are_free_drafts_up_to_the_name(vocab):
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "function:clock", True, SPECIAL))
    forced = []
    while (t := m.forced()) is not None:
        forced.append(t)
        m.advance(t)
    assert "".join(chr(30 + t) for t in forced) == '[{"name": "clock", "arguments": {"zone": "'


@pytest.mark.parametrize("opening", ["", "Sure, checking.\n", "```json\n", "{", "[", "<tool_call>\n"])
def test_auto_is_free_until_a_call_of_a_tool_opens_and_then_holds_it_to_its_schema(vocab, opening):
    g = tl.grammar(TOOLS, "auto", True, SPECIAL)
    m = Matcher(vocab, "lark", g)
    assert takes(m, ids("Any text at all: {\"a\": [1, 2]} <b> ``` done")) and m.ends(STOP)
    # an object naming a function that is no tool is no call: free text (and content)
    assert takes(m, ids(opening + '{"name": "Alice", "age": "x"}')) and m.ends(STOP)
    head = ids(opening + '{"name": "clock"')  # a call of a tool opens: its arguments are held
    assert takes(m, head)
    assert not takes(m, head + text_ids("}"))  # arguments come next
    assert not takes(m, head + text_ids(', "arguments": {"zone": "PST"'))
    assert not takes(m, head + text_ids(', "arguments": {"zone": "UTC", "x": 1'))  # additionalProperties
    assert not takes(m, head + text_ids(', "arguments": {"zone": "UTC"}, "id": 1'))  # no other keys
    assert takes(m, head + text_ids(',\n  "arguments": {\n    "zone": "UTC"\n  }\n}'))  # the model's spacing
    head = ids(opening + '{"name": "lookup"')
    assert not takes(m, head + text_ids(', "arguments": {"word": 7'))
    assert takes(m, head + text_ids(', "parameters": {"word": "abc", "n": 2}}'))


def test_auto_calls_in_every_form_parse_back_and_after_one_call_the_text_is_free_again(vocab):
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "auto", True, SPECIAL))
    text = (f"Checking.\n{tl.OPEN}\n{CALL}\n{tl.CLOSE}\n```json\n{CALL}\n```\n{{{CALL}}}\n"
            f'[{CALL}, {CALL.replace("UTC", "CET")}]\n<tool_call>{CALL}</tool_call>\nDone.')
    assert takes(m, ids(text)) and m.ends(STOP)  # the tags as special tokens, and as text
    content, calls = tl.parse(text, ["clock", "lookup"])
    assert len(calls) == 6 and content.startswith("Checking.") and content.endswith("Done.")


def test_auto_without_parallel_calls_admits_one_call(vocab):
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "auto", False, SPECIAL))
    assert takes(m, ids(f"{CALL}\nThat is all.")) and m.ends(STOP)
    assert not takes(m, ids(f'{CALL}\n{{"name": "clock"'))  # a second call cannot open
    assert not takes(m, ids(f'{CALL}\n{{"name": "lookup"'))
    assert takes(m, ids(f'{CALL}\n{{"name": "other"}}')) and m.ends(STOP)  # no call of a tool: text
    assert not takes(m, ids(f"[{CALL}, {CALL}"))
    assert takes(m, ids(f"{tl.OPEN}\n{CALL}\n{tl.CLOSE}")) and m.ends(STOP)
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "auto", False, tl.TEXT_TAGS))
    assert takes(m, text_ids(f"{tl.OPEN}\n{CALL}\n{tl.CLOSE}")) and m.ends(STOP)
    assert not takes(m, text_ids(f'{tl.OPEN}\n{CALL}\n{tl.CLOSE}{tl.OPEN}{{"name": "lookup"'))


def test_rolled_back_the_matcher_allows_what_a_fresh_one_allows_at_every_prefix(vocab):
    """Speculation walks drafts past a call's opening and back: every prefix's mask must be
    the one plain decoding sees there."""
    g = tl.grammar(TOOLS, "auto", True, SPECIAL)
    toks = ids(f'Ok {{"name": "lookup", "arguments": {{"word": "ab"}}}}\n{tl.OPEN}\n{CALL}\n{tl.CLOSE} end')
    walker = Matcher(vocab, "lark", g)
    for k in range(len(toks) + 1):
        assert walker.sync(toks)  # all the way, then back to k (as a rejected draft rolls back)
        walker.sync(toks[:k])
        fresh = Matcher(vocab, "lark", g)
        assert fresh.sync(toks[:k])
        assert bool((walker.allowed() == fresh.allowed()).all()), k


def test_a_json_answer_or_calls_under_auto_with_a_response_format(vocab):
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    m = Matcher(vocab, "lark", tl.grammar(TOOLS, "auto", True, SPECIAL, answer))
    assert takes(m, text_ids('{"city":"Paris"}')) and m.ends(STOP)
    assert takes(m, text_ids(f"[{CALL}]")) and m.ends(STOP)
    assert not takes(m, text_ids("Paris"))


def test_strict_functions_follow_openais_rules():
    ok = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                                 "required": ["b"], "additionalProperties": False}},
          "required": ["a"], "additionalProperties": False}
    assert tl.strict_problem(ok) is None
    loose = json.loads(json.dumps(ok))
    loose["properties"]["a"]["additionalProperties"] = True
    assert "parameters.a" in tl.strict_problem(loose)
    partial = dict(ok, properties={"a": {"type": "string"}, "b": {"type": "string"}})
    assert "['b']" in tl.strict_problem(partial)
    tl.check_tools([tl.Tool("f", "", json.dumps(ok), strict=True)], "auto")
    tl.check_tools([tl.Tool("f", "", json.dumps(loose), strict=False)], "auto")  # not strict: any schema
    with pytest.raises(InvalidArgument) as e:
        tl.check_tools([tl.Tool("f", "", json.dumps(loose), strict=True)], "auto")
    assert e.value.field == "tools" and "strict" in str(e.value)
    assert tl.arguments_schema(tl.Tool("f", "", json.dumps(ok), strict=True), False)["x-guidance"]["lenient"] is False
    assert tl.arguments_schema(tl.Tool("f", "", json.dumps(ok)), False)["x-guidance"]["lenient"] is True


def test_qwens_template_is_fixed_where_it_misleads_the_model():
    line = ('"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
            '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": '
            '<args-json-object>}}\\n</tool_call><|im_end|>\\n"')
    tool_end = ('{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
                "            {{- '<|im_end|>\\n' }}")
    fixed = tl.tools_template("{{- " + line + " }}" + tool_end)
    assert tl.RESULTS_ASK in fixed and fixed.endswith("{{- '<|im_end|>\\n' }}")
    assert "{{\\\"name\\\"" not in fixed and '{\\"name\\": <function-name>' in fixed
    assert "Answer with a JSON list of the calls" in fixed
    assert tl.tools_template("{{ messages }}") is None
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [{"id": "a", "name": "clock", "arguments": "{}"}]},
            {"role": "tool", "content": "12:00"}]
    assert tl.fallback_messages(msgs, [CLOCK])[-1]["content"].endswith(tl.RESULTS_ASK)  # an answer, not a call
    assert tl.fallback_messages(msgs + [{"role": "user", "content": "and now?"}], [CLOCK])[-2]["content"] == \
        "<tool_response>\n12:00\n</tool_response>"
