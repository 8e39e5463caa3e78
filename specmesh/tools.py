"""Tool calling (OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``), as text.

The wire format is the one Qwen2.5's and Hermes' chat templates use: a call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the assistant's
text, a tool's result comes back as a ``tool`` message. A chat template that renders
tools itself gets them (``tools=`` of ``apply_chat_template``); for one that does not
(SmolLM2's), ``fallback_messages`` renders them the documented way: a system message
listing the tools as JSON schemas and saying the format above, earlier assistant calls
written in it, and tool results as user turns inside ``<tool_response>`` tags.

- ``check_tools`` validates the request's tools and choice (INVALID_ARGUMENT naming
  ``tools`` or ``tool_choice``: an unknown function named is refused);
- ``grammar(tools, choice, parallel)``: for ``required`` and a named function, a Lark
  grammar (llguidance, with each tool's parameters as an inline JSON schema) that only
  admits calls, so every call parses and its arguments hold the tool's schema; None for
  ``auto`` (the model chooses) and ``none``;
- ``parse(text, names)`` -> (content, calls): the calls in the output (``ToolCall``: id,
  name, arguments as JSON text) and the text around them; a block that does not parse
  stays content. A reply that is nothing but one untagged call object of a tool in
  ``names``, bare or in a Markdown code fence (```` ```json\n{"name": "multiply",
  "arguments": {...}}\n``` ````), is that call: Qwen2.5-Coder-1.5B-Instruct answers a
  tool request that way instead of with the tags (``scripts/agent_loop.py``);
- ``ToolStream``: the same, incrementally, for streams: text that may begin a call is
  held back (a reply that may be an untagged call: until it ends), each call is returned
  once its block closes.

Knows nothing about models, tokenizers, gRPC or HTTP.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .types import InvalidArgument

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # JSON schema text


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def check_tools(tools: Sequence[Tool], choice: str) -> None:
    names = [t.name for t in tools]
    for i, t in enumerate(tools):
        if not t.name or len(t.name) > 64 or not all(c.isalnum() or c in "_-" for c in t.name):
            raise InvalidArgument("tools", f"tool {i}: a function name is 1-64 letters, digits, _ or -, "
                                  f"got {t.name!r}")
        try:
            schema = json.loads(t.parameters or "{}")
        except ValueError as e:
            raise InvalidArgument("tools", f"tool {t.name!r}: parameters are not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("tools", f"tool {t.name!r}: parameters must be a JSON schema object")
    if len(set(names)) != len(names):
        raise InvalidArgument("tools", "function names must be distinct")
    if choice not in ("", "auto", "none", "required") and not choice.startswith("function:"):
        raise InvalidArgument("tool_choice", f"must be none, auto, required or a function, got {choice!r}")
    if choice and choice != "none" and not tools:
        raise InvalidArgument("tool_choice", f"{choice!r} needs tools")
    if choice.startswith("function:") and choice[9:] not in names:
        raise InvalidArgument("tool_choice", f"names the function {choice[9:]!r}, which is not among the tools "
                              f"{names}")


def _schema(t: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": t.name},
                                             "arguments": json.loads(t.parameters or '{"type": "object"}')},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar(tools: Sequence[Tool], choice: str, parallel: bool = True) -> Optional[str]:
    """The Lark grammar that only admits calls (``required``, ``function:NAME``), else None."""
    if choice == "required":
        chosen = list(tools)
    elif choice.startswith("function:"):
        chosen = [t for t in tools if t.name == choice[9:]]
    else:
        return None
    alts = " | ".join(f"c{i}" for i in range(len(chosen)))
    rules = [f"start: call{'+' if parallel and choice == 'required' else ''}",
             f'call: "{OPEN}\\n" ({alts}) "\\n{CLOSE}"']
    rules += [f"c{i}: %json {json.dumps(_schema(t))}" for i, t in enumerate(chosen)]
    return "\n".join(rules)


def system_prompt(tools: Sequence[Tool]) -> str:
    specs = "\n".join(json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                                   "parameters": json.loads(t.parameters)}})
                      for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed as JSON "
            f"schemas inside <tools></tools>:\n<tools>\n{specs}\n</tools>\nTo call a function, answer with a JSON "
            f"object of its name and arguments inside tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{CLOSE}")


def call_text(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def fallback_messages(messages: Sequence[dict], tools: Sequence[Tool]) -> list[dict]:
    """Messages for a template without tools: the tools in a system message, calls and
    results as text (the module docstring)."""
    out: list[dict] = []
    sys = system_prompt(tools) if tools else ""
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if sys:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys}
        else:
            out.insert(0, {"role": "system", "content": sys})
    return out


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages for a template that renders tools (Hugging Face's tool-use format)."""
    out = []
    for m in messages:
        d = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            d["tool_calls"] = [{"type": "function", "id": c.get("id", ""), "function": {
                "name": c["name"], "arguments": _loads(c["arguments"])}} for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            d["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            d["name"] = m["name"]
        out.append(d)
    return out


def _loads(s: str):
    try:
        return json.loads(s or "{}")
    except ValueError:
        return s


def _call(block: str) -> Optional[ToolCall]:
    try:
        d = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        return None
    args = d.get("arguments", d.get("parameters", {}))
    return ToolCall(d["name"], args if isinstance(args, str) else json.dumps(args))


FENCES = ("```json", "```")


def bare_call(text: str, names: Sequence[str]) -> Optional[ToolCall]:
    """The call that ``text`` is when it is nothing but one untagged call object
    (``{"name": ..., "arguments": {...}}``, bare or in a code fence) of a tool in ``names``."""
    body = text.strip()
    for f in FENCES:
        if body.startswith(f) and body.endswith("```") and len(body) >= len(f) + 3:
            body = body[len(f):-3].strip()
            break
    if not body.startswith("{"):
        return None
    try:
        d = json.loads(body)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("name") not in names or not set(d) <= {"name", "arguments", "parameters"}:
        return None
    args = d.get("arguments", d.get("parameters", {}))
    return ToolCall(d["name"], json.dumps(args)) if isinstance(args, dict) else None


def _may_be_bare(text: str) -> bool:
    """Whether ``text`` may begin a reply that is an untagged call (held back in a stream)."""
    t = text.lstrip()
    return not t or t.startswith("{") or t.startswith("```") or "```".startswith(t)


def parse(text: str, names: Sequence[str] = ()) -> tuple[str, list[ToolCall]]:
    s = ToolStream(names)
    content = s.push(text) + s.flush()
    return content, s.calls


class ToolStream:
    """``push(piece)`` -> content safe to emit; ``calls`` grows as call blocks close.
    ``names``: the request's tools, whose untagged calls are recognised (empty: tags only)."""

    def __init__(self, names: Sequence[str] = ()):
        self.buf = ""
        self.calls: list[ToolCall] = []
        self.new: list[ToolCall] = []  # calls completed by the last push (or by flush)
        self.names = tuple(names)
        self.emitted = False  # content was emitted: the reply is no untagged call

    def push(self, piece: str) -> str:
        self.buf += piece
        self.new = []
        if self.names and not self.emitted and not self.calls and OPEN not in self.buf and _may_be_bare(self.buf):
            return ""  # may be an untagged call: held until the reply ends (flush)
        text = self._push()
        self.emitted = self.emitted or bool(text.strip())
        return text

    def _push(self) -> str:
        out = []
        while True:
            i = self.buf.find(OPEN)
            if i < 0:
                keep = _partial(self.buf, OPEN)
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(CLOSE, i)
            if j < 0:
                out.append(self.buf[:i])
                self.buf = self.buf[i:]
                break
            call = _call(self.buf[i + len(OPEN): j])
            if call is None:  # not a call: the block is content
                out.append(self.buf[: j + len(CLOSE)])
            else:
                out.append(self.buf[:i])
                self.calls.append(call)
                self.new.append(call)
            self.buf = self.buf[j + len(CLOSE):]
        text = "".join(out)
        return text.strip("\n") if self.calls and not text.strip() else text

    def flush(self) -> str:
        """The rest of the reply: "" when it was one untagged call (then in ``calls`` and ``new``)."""
        out, self.buf = self.buf, ""
        self.new = []
        call = bare_call(out, self.names) if self.names and not self.emitted and not self.calls else None
        if call is not None:
            self.calls.append(call)
            self.new.append(call)
            return ""
        return out


def _partial(s: str, tag: str) -> int:
    """Characters at the end of ``s`` that begin ``tag``."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:n]):
            return n
    return 0


__all__ = ["Tool", "ToolCall", "ToolStream", "bare_call", "check_tools", "fallback_messages", "grammar", "parse",
           "system_prompt", "template_messages"]
