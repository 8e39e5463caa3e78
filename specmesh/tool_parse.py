"""The tool calls in a model's reply, whole or streamed: every form the served families write.

A call is a JSON object ``{"name": NAME, "arguments": {...}}`` whose first key is
``"name"``, naming one of the request's tools (``"parameters"`` is taken for
``"arguments"``, and arguments written as a JSON string holding an object are that object;
``specmesh.tools``' grammar holds a call to its tool's schema from the moment its name is
written, so a call written otherwise would not be held), in any of these forms:

- in Hermes / Qwen2.5 tags: ``<tool_call>\\n{...}\\n</tool_call>`` (the tag may hold one
  object, several, or a JSON list of them: SmolLM2's own format);
- in a Markdown code fence (```` ```json ... ``` ````), one object, several or a list;
- bare, one object after another, or in a JSON list ``[{...}, {...}]``;
- the template echo ``{{"name": ..., "arguments": {...}}}``: Qwen2.5's chat template
  shows its example call with doubled braces, and the model copies them.

Everything else is content: text, code, JSON that is not a call of a requested tool (an
object with other keys, an unknown function, arguments that are no object), a tag or
fence whose body is not calls, an object whose first key is not ``"name"``. Content
keeps its text exactly, except the whitespace
that touches a call (the newline before a fence, between two calls). With
``parallel=False`` only the first call is a call; later ones stay content.

``ToolStream.push(piece)`` returns the content that is safe to emit: text that may begin
a call (``{``, ``[``, a fence, a tag, even a part of one) is held back until it is
decided, and each call is announced (``new``) once it closes, so a stream's content
and calls equal ``parse`` of the whole reply. Every decision depends only on the text
up to the point decided, which is what makes the two equal.

Knows nothing about models, tokenizers, grammars, gRPC or HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
WS = " \t\r\n"
_CANDIDATE = re.compile(r"[<`{\[]")  # where a call may begin
_FENCE_HEAD = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*(\n?)")
_KEYS = {"name", "arguments", "parameters"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def as_call(d, names: Sequence[str]) -> Optional[ToolCall]:
    """``d`` (decoded JSON) as a call of a tool in ``names`` (any name when empty), else None."""
    if not isinstance(d, dict) or next(iter(d), None) != "name" or not isinstance(d["name"], str) \
            or not set(d) <= _KEYS:
        return None
    if names and d["name"] not in names:
        return None
    args = d.get("arguments", d.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(d["name"], json.dumps(args, ensure_ascii=False))


def json_end(s: str, i: int) -> int:
    """The index just past the JSON object or array that opens at ``s[i]``, -1 if ``s``
    ends before it closes (strings and escapes followed, nothing else checked)."""
    depth, in_str, esc = 0, False, False
    for k in range(i, len(s)):
        c = s[k]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return -1


def _name_key(rest: str) -> Optional[bool]:
    """Whether ``rest`` (just inside an object's ``{``) opens with the key ``"name"`` and
    its colon: True, False, or None while too short to tell."""
    rest = rest.lstrip(WS)
    key = '"name"'
    if len(rest) < len(key):
        return None if key.startswith(rest) else False
    if not rest.startswith(key):
        return False
    rest = rest[len(key):].lstrip(WS)
    return None if not rest else rest[0] == ":"


def opening(s: str) -> Optional[bool]:
    """Whether ``s`` begins like a call (a tag, a fence holding JSON, ``{"name":``,
    ``{{"name":``, ``[{"name":``): True, False, or None while too short to tell."""
    c = s[:1]
    if c == "<":
        return True if s.startswith(OPEN) else (None if OPEN.startswith(s) else False)
    if c == "`":
        if len(s) < len(FENCE):
            return None if FENCE.startswith(s) else False
        m = _FENCE_HEAD.match(s)
        if m is None:
            return False
        if not m.group(2):  # the fence's first line has not ended
            return None if m.end() == len(s) else False
        rest = s[m.end():].lstrip(WS)
        return None if not rest else (opening(rest) if rest[0] in "{[" else False)
    if c == "{":
        return _name_key(s[2:] if s.startswith("{{") else s[1:])
    if c == "[":
        rest = s[1:].lstrip(WS)
        return None if not rest else (_name_key(rest[1:]) if rest[0] == "{" else False)
    return False


def calls_in(body: str, names: Sequence[str]) -> Optional[list]:
    """The calls a tag's or fence's body holds (one object, several one after another, a
    JSON list, an echo ``{{...}}``), or None when it holds anything else."""
    dec, out, i, s = json.JSONDecoder(), [], 0, body.strip(WS)
    while i < len(s):
        echo = s.startswith("{{", i)
        try:
            d, j = dec.raw_decode(s, i + 1 if echo else i)
        except ValueError:
            return None
        if echo:
            j = len(s) - len(s[j:].lstrip(WS))
            if not s.startswith("}", j):
                return None
            j += 1
        items = d if isinstance(d, list) and not echo else [d]
        calls = [as_call(x, names) for x in items]
        if not calls or any(c is None for c in calls):
            return None
        out += calls
        i = len(s) - len(s[j:].lstrip(WS + ","))
    return out or None


@dataclass
class Unit:
    """A closed call unit of the text: its source and the calls it holds."""

    text: str
    calls: list


def scan(s: str, names: Sequence[str], final: bool) -> tuple[list, int]:
    """(items, decided): the content pieces (str) and call units (``Unit``) of ``s[:decided]``,
    in order; the rest may still begin a call (held back). ``final``: nothing more comes,
    so everything is decided."""
    items: list = []
    pos = i = 0  # text before pos is in items; candidates before i are decided
    held = None
    while True:
        m = _CANDIDATE.search(s, i)
        if m is None:
            break
        i = m.start()
        verdict = opening(s[i:]) if names or s[i] == "<" else False  # without names only tags are calls
        if verdict is None and not final:
            held = i
            break
        if not verdict:
            i += 1
            continue
        got = _unit(s, i, names, final)
        if got is None:  # open: decided once it closes
            held = i
            break
        end, calls = got
        if calls is None:  # no call after all: content, and the scan goes on inside it
            i += 1
            continue
        if s[pos:i]:
            items.append(s[pos:i])
        items.append(Unit(s[i:end], calls))
        pos = i = end
    decided = len(s) if held is None else held
    if s[pos:decided]:
        items.append(s[pos:decided])
    return items, decided


def _unit(s: str, i: int, names: Sequence[str], final: bool):
    """(end, calls or None) of the unit that opens at ``s[i]``; None while it is open
    (never when ``final``)."""
    if s.startswith(OPEN, i) or s.startswith(FENCE, i):
        body = i + len(OPEN) if s.startswith(OPEN, i) else _FENCE_HEAD.match(s, i).end()
        close = CLOSE if s.startswith(OPEN, i) else FENCE
        j = s.find(close, body)
        if j < 0:
            return (len(s), calls_in(s[body:], names)) if final else None
        return j + len(close), calls_in(s[body:j], names)
    echo = s.startswith("{{", i)
    j = json_end(s, i + 1 if echo else i)
    if j < 0:
        return (len(s), None) if final else None
    if echo:  # {{...}}: the inner object, then the outer brace
        k = len(s) - len(s[j:].lstrip(WS))
        if k == len(s) and not final:
            return None
        if not s.startswith("}", k):
            return j, None  # no outer brace: the scan finds the inner object on its own
        j = k + 1
    return j, calls_in(s[i:j], names)


class ToolStream:
    """``push(piece)`` -> content safe to emit; ``calls`` grows as calls close, ``new`` the
    calls the last push (or ``flush``) completed. ``names``: the request's tools (empty:
    only tagged calls, of any name); ``parallel`` False: later calls stay content."""

    def __init__(self, names: Sequence[str] = (), parallel: bool = True):
        self.names, self.parallel = tuple(names), parallel
        self.buf = ""  # undecided text
        self.calls: list[ToolCall] = []
        self.new: list[ToolCall] = []
        self.ws = ""  # whitespace after the content emitted: dropped if a call comes next
        self.after_call = False  # a call was decided last: the whitespace after it is dropped

    def push(self, piece: str) -> str:
        self.buf += piece
        return self._emit(False)

    def flush(self) -> str:
        """The rest of the reply, all decided now."""
        out = self._emit(True)
        if not self.calls:  # a reply without calls is its text exactly
            out += self.ws
        self.ws = ""
        return out

    def _emit(self, final: bool) -> str:
        self.new = []
        items, decided = scan(self.buf, self.names, final)
        self.buf = self.buf[decided:]
        out = []
        for x in items:
            if isinstance(x, Unit):
                if not self.parallel and (self.calls or len(x.calls) > 1):
                    x = Unit(x.text, []) if self.calls else Unit(x.text, x.calls[:1])
                if x.calls:
                    self.calls += x.calls
                    self.new += x.calls
                    self.ws, self.after_call = "", True
                    continue
                x = x.text  # a call past the first, parallel_tool_calls false: content
            if self.after_call:
                x = x.lstrip(WS)
                if not x:
                    continue
                self.after_call = False
            body = x.rstrip(WS)
            if body:
                out.append(self.ws + body)
                self.ws = x[len(body):]
            else:
                self.ws += x
        return "".join(out)


def call_text(name: str, arguments: str) -> str:
    """A call in the tagged form (how earlier calls are written back into a prompt)."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def parse(text: str, names: Sequence[str] = (), parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply: what a ``ToolStream`` gives piece by piece."""
    s = ToolStream(names, parallel)
    content = s.push(text) + s.flush()
    return content, s.calls


__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolStream", "Unit", "as_call", "call_text", "calls_in", "json_end", "opening",
           "parse", "scan"]
