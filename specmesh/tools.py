"""Tool calling (OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``): prompts and grammars.

The wire format is the Hermes one Qwen2.5's chat template uses: a call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the assistant's
text, a tool's result comes back as a ``tool`` message. The untagged forms models write
instead (fenced or bare JSON, lists, the template echo) are parsed too
(``specmesh.tool_parse``, re-exported here).

- ``check_tools`` validates the request's tools and choice (INVALID_ARGUMENT naming
  ``tools`` or ``tool_choice``): names, schemas, ``strict`` (OpenAI's rules: every object
  of a strict function's parameters has ``additionalProperties: false`` and requires all
  its properties), an unknown function named is refused;
- ``grammar(tools, choice, parallel, fmt)``: the Lark grammar (llguidance) the output is
  decoded under. ``required`` / a named function: only a JSON list of calls (the form
  ``TOOLS_NOTE`` asks for; one call, or as many as the model writes when parallel), each
  ``{"name": ..., "arguments": ...}`` with the tool's schema. ``auto``: a
  *triggered* grammar, free text until the model opens a call of one of the tools (an
  object whose first key is ``"name"``, with a tool's name: bare, fenced, in a list, in a
  tag or echoed in double braces, as ``tool_parse`` reads calls), from there on the call's
  arguments are held to that tool's schema, and after it the text is free again
  (parallel) or may open no other call. An object naming a function that is not a tool
  is no call of the request: free text, and content;
  ``none``: no grammar. A function's arguments are enforced exactly when it is
  ``strict``, and leniently otherwise (schema keywords llguidance cannot enforce are
  ignored, as OpenAI does not promise non-strict arguments; a non-strict schema nothing
  can satisfy leaves its arguments any JSON object, ``Tool.enforced``);
- ``ToolFormat``: how a tokenizer spells the tags: text, or one special token each
  (Qwen2.5's ``<tool_call>`` is token 151657: its bytes are not the text ``<tool_call>``,
  so the grammar names it by id where free text may hold it);
- ``tools_template(template)``: a chat template that renders tools, with Qwen2.5's tool
  instructions fixed where they mislead the model: its example call has doubled braces
  (``{{"name": ...}}``, which the model copies) and ``TOOLS_NOTE`` added (several calls as
  a JSON list, no made-up values, no call where none fits), and ``RESULTS_ASK`` after the
  last tool result of a conversation that ends in them (an answer from them, not the same
  calls again);
  ``system_prompt`` / ``fallback_messages``: the same for a template without tools
  (SmolLM2's), earlier calls written as tags and tool results as user turns in
  ``<tool_response>`` tags; ``template_messages``: Hugging Face's tool-use message format.

Knows nothing about models, tokenizers, gRPC or HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

from .tool_parse import CLOSE, OPEN, ToolCall, ToolStream, call_text, parse  # noqa: F401 (re-exported)
from .types import InvalidArgument


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'  # JSON schema text
    strict: Optional[bool] = None  # OpenAI's function.strict (None: not given)
    # the grammar holds its arguments to its schema; False (set by the router): a schema that is
    # not strict and that no output can satisfy (an integer whose enum lists strings): its
    # arguments are any JSON object, as OpenAI does not promise non-strict arguments
    enforced: bool = True


@dataclass(frozen=True)
class ToolFormat:
    """The call tags as the served tokenizer spells them: ``open_id`` / ``close_id`` are the
    tags' token ids where each is one special token, else None (text)."""

    open_id: Optional[int] = None
    close_id: Optional[int] = None


TEXT_TAGS = ToolFormat()

# What the tools' instructions add to the template's (and to ours, for a template without tools). Measured
# on BFCL with Qwen2.5-Coder-1.5B (docs/serving.md, "Tools"): asked for calls in tags, it writes one fenced
# JSON call and never two (0 of 8 parallel items); asked for a JSON list, it writes every call the question
# needs (6 of 8); told to use only values the user gave, it calls a function that does not fit less often.
TOOLS_NOTE = ('Answer with a JSON list of the calls, one object per call (the same function with different '
              'arguments counts as several calls):\n[{"name": <function-name>, "arguments": <args-json-object>}, '
              '...] Use only argument values the user gave; never make one up. If the user did not give a value a '
              'call needs, or no function does what the user asks, do not call any function: answer in plain text.')
# after the last tool result, when the conversation ends in them (an agent loop: without it the model called
# the same functions again, or ended its turn empty, at the second request); the system prompt stays the same
# every turn, so the conversation stays a cached prefix
RESULTS_ASK = "Those are the results of the calls. Answer my question from all the results above, in plain text."
_QWEN_EXAMPLE = '<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call>'
_FIXED_EXAMPLE = '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
_QWEN_TOOL_END = ("{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
                  "            {{- '<|im_end|>\\n' }}")


def _jinja(text: str) -> str:
    """``text`` inside a double-quoted Jinja string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def check_tools(tools: Sequence[Tool], choice: str) -> None:
    names = [t.name for t in tools]
    for i, t in enumerate(tools):
        if not t.name or len(t.name) > 64 or not all(c.isalnum() or c in "_-" for c in t.name):
            raise InvalidArgument("tools", f"tool {i}: a function name is 1-64 letters, digits, _ or -, "
                                  f"got {t.name!r}")
        schema = parameters(t)
        if t.strict:
            why = strict_problem(schema)
            if why:
                raise InvalidArgument("tools", f"tool {t.name!r} is strict, but its parameters are not a strict "
                                      f"schema: {why} (OpenAI's rule; or send strict: false)")
    if len(set(names)) != len(names):
        raise InvalidArgument("tools", "function names must be distinct")
    if choice not in ("", "auto", "none", "required") and not choice.startswith("function:"):
        raise InvalidArgument("tool_choice", f"must be none, auto, required or a function, got {choice!r}")
    if choice and choice != "none" and not tools:
        raise InvalidArgument("tool_choice", f"{choice!r} needs tools")
    if choice.startswith("function:") and choice[9:] not in names:
        raise InvalidArgument("tool_choice", f"names the function {choice[9:]!r}, which is not among the tools "
                              f"{names}")


def parameters(t: Tool) -> dict:
    """The tool's parameters as a JSON schema object (INVALID_ARGUMENT ``tools`` when not)."""
    try:
        schema = json.loads(t.parameters or "{}")
    except ValueError as e:
        raise InvalidArgument("tools", f"tool {t.name!r}: parameters are not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument("tools", f"tool {t.name!r}: parameters must be a JSON schema object")
    return schema


def strict_problem(schema: dict, where: str = "parameters") -> Optional[str]:
    """What keeps ``schema`` from being strict as OpenAI defines it, else None: every object
    says ``additionalProperties: false`` and lists all its properties in ``required``."""
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"{where} must set additionalProperties to false"
        props = schema.get("properties") or {}
        missing = [k for k in props if k not in (schema.get("required") or [])]
        if missing:
            return f"{where}: every property must be required, {missing} are not"
        for k, sub in props.items():
            if isinstance(sub, dict) and (why := strict_problem(sub, f"{where}.{k}")):
                return why
    for key in ("items", "additionalItems"):
        if isinstance(schema.get(key), dict) and (why := strict_problem(schema[key], f"{where}.{key}")):
            return why
    for key in ("anyOf", "oneOf", "allOf"):
        for j, sub in enumerate(schema.get(key) or []):
            if isinstance(sub, dict) and (why := strict_problem(sub, f"{where}.{key}[{j}]")):
                return why
    for key in ("$defs", "definitions"):
        for k, sub in (schema.get(key) or {}).items():
            if isinstance(sub, dict) and (why := strict_problem(sub, f"{where}.{key}.{k}")):
                return why
    return None


def arguments_schema(t: Tool, forced: bool) -> dict:
    """The tool's parameters with llguidance's options: the JSON separators the model writes
    (forced calls: fixed ``", "`` and ``": "``, so they are free drafts; a call the model
    opened itself: any whitespace, as it chose), exact when strict, else lenient."""
    opts = {"lenient": not t.strict, "whitespace_flexible": not forced}
    if forced:
        opts.update(item_separator=", ", key_separator=": ")
    return dict(parameters(t) if t.enforced else {"type": "object"}, **{"x-guidance": opts})


NAME_OPEN = '{"name": "'  # a forced call's opening


def _lit(s: str) -> str:
    return json.dumps(s)


def grammar(tools: Sequence[Tool], choice: str, parallel: bool = True, fmt: ToolFormat = TEXT_TAGS,
            answer: Optional[dict] = None) -> Optional[str]:
    """The Lark grammar (llguidance) of the output under ``choice`` (module docstring); None
    for ``none`` (and without tools). ``answer``: the JSON schema of the request's own
    structured output under ``auto``: the output is then that JSON or a list of calls (from
    the first token: a reply in free text could be neither)."""
    if choice == "none" or not tools:
        return None
    if choice.startswith("function:"):
        chosen = [t for t in tools if t.name == choice[9:]]
    else:
        chosen = list(tools)
    forced = choice == "required" or choice.startswith("function:") or answer is not None
    rules = ["%llguidance {}"]
    # one rule per tool: its arguments; forced, the rest of its call after the name's opening quote
    for i, t in enumerate(chosen):
        rules.append(f"a{i}: %json {json.dumps(arguments_schema(t, forced))}")
        if forced:
            rest = _lit(t.name + '", "arguments": ')
            rules.append(f"b{i}: {rest} a{i} {_lit('}')}")
    body = " | ".join(f"b{i}" for i in range(len(chosen)))
    if forced:
        # a JSON list of calls, as TOOLS_NOTE asks for: after each call the model itself writes ", " for
        # another or "]" to end (parallel), or the list holds one
        calls = '"[" call (", " call)* "]"' if parallel and not choice.startswith("function:") else '"[" call "]"'
        rules += [f"start: {calls}" if answer is None else f"start: answer | {calls}",
                  f"call: {_lit(NAME_OPEN)} ({body})"]
        if answer is not None:
            rules.append(f"answer: %json {json.dumps({'x-guidance': {'whitespace_flexible': False}, **answer})}")
        return "\n".join(rules)
    # auto: free text until a call of one of the tools opens, i.e. its name is written as the first key of an
    # object (lazy: the shortest text ending in that); then its arguments hold the tool's schema
    names = "|".join(t.name for t in chosen)  # 1-64 letters, digits, _ or -: nothing to escape
    rules += ['ARGS_KEY: /\\s*,\\s*"(arguments|parameters)"\\s*:\\s*/', "OBJ_END: /\\s*\\}/",
              "TEXT: /(.|\\n)*/"]
    for i, t in enumerate(chosen):
        rules.append(f'o{i}[lazy]: TEXT /\\{{\\s*"name"\\s*:\\s*"{t.name}"/')
    rules.append("call: " + " | ".join(f"o{i} ARGS_KEY a{i} OBJ_END" for i in range(len(chosen))))
    # the tags, where the tokenizer has them as special tokens (free text cannot spell those)
    tags = [f"<[{x}]>" for x in (fmt.open_id, fmt.close_id) if x is not None]
    if parallel:
        rules.append("start: seg* TEXT")
        rules.append("seg: call" + "".join(f" | TEXT {x}" for x in tags))
    else:  # after the one call, text that opens no other
        rules.append('AFTER: /(?s:.*)/ & ~/(?s:.*)\\{\\s*"name"\\s*:\\s*"(' + names + ')"(?s:.*)/')
        if tags:
            rules += ["start: tag* TEXT | tag* call tag_after* AFTER",
                      "tag: " + " | ".join(f"TEXT {x}" for x in tags),
                      "tag_after: " + " | ".join(f"AFTER {x}" for x in tags)]
        else:
            rules.append("start: TEXT | call AFTER")
    return "\n".join(rules)


def system_prompt(tools: Sequence[Tool]) -> str:
    """The tools' instructions for a template without tools."""
    specs = "\n".join(json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                                   "parameters": json.loads(t.parameters)}})
                      for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed as JSON "
            f"schemas inside <tools></tools>:\n<tools>\n{specs}\n</tools>\nTo call a function, answer with a JSON "
            f"object of its name and arguments inside tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{CLOSE}\n\n{TOOLS_NOTE}")


def tools_template(template: str) -> Optional[str]:
    """A chat template that renders tools, its tool instructions fixed where they mislead the
    model (module docstring); None when it has none of the lines this knows."""
    if _QWEN_EXAMPLE not in template:
        return None
    out = template.replace(_QWEN_EXAMPLE, _FIXED_EXAMPLE + "\\n\\n" + _jinja(TOOLS_NOTE))
    ask = _QWEN_TOOL_END.replace("{{- '<|im_end|>", "{%- if loop.last %}{{- '\\n" + RESULTS_ASK + "' }}{%- endif %}"
                                 "{{- '<|im_end|>")
    return out.replace(_QWEN_TOOL_END, ask)


def fallback_messages(messages: Sequence[dict], tools: Sequence[Tool]) -> list[dict]:
    """Messages for a template without tools: the tools in a system message, calls and
    results as text (the module docstring)."""
    out: list[dict] = []
    sys = system_prompt(tools) if tools else ""
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif role == "tool":
            ask = f"\n{RESULTS_ASK}" if i == len(messages) - 1 else ""
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>{ask}"})
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


__all__ = ["RESULTS_ASK", "TOOLS_NOTE", "TEXT_TAGS", "Tool", "ToolCall", "ToolFormat", "ToolStream", "arguments_schema",
           "check_tools", "fallback_messages", "grammar", "parameters", "parse", "strict_problem", "system_prompt",
           "template_messages", "tools_template"]
