"""Every request field of OpenAI's chat and completions APIs, and what this server does with it.

The rule: no field is silently ignored. Each field of the two APIs (as the official
``openai`` client declares them: ``openai.types.chat.completion_create_params`` and
``openai.types.completion_create_params``), and each extra body field this server takes
(vLLM's extra sampling and structured-output fields, specmesh's own), is in ``CHAT`` or
``COMPLETIONS`` with one of:

- ``IMPLEMENTED``: the request means what OpenAI (or vLLM, for its extras) says;
- a refusal: a function of the value that returns why it is refused (HTTP 400 naming the
  field), or None where the value asks for nothing this server lacks (``n: 1``,
  ``store: false``, ``modalities: ["text"]``, ``service_tier: "auto"``, ...).

A field in neither table is refused as unknown (400 naming it): a client that sends a
field this server does not know gets told, instead of a response that quietly lacks it.
``check(fields, api)`` applies the table to a request body's fields (those it set).
``tests/services/test_openai_fields.py`` walks both tables with the official client.

This module knows nothing about the router or HTTP; it judges fields.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

IMPLEMENTED = "implemented"

Rule = Union[str, Callable[[Any], Optional[str]]]


def _refuse(why: str, ok: Callable[[Any], bool] = lambda v: v is None) -> Callable[[Any], Optional[str]]:
    """Refused with ``why`` unless ``ok(value)`` (default: the field is null)."""
    return lambda v: None if ok(v) else why


def _falsy(v) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


# the two APIs' common fields
_COMMON: dict[str, Rule] = {
    "model": IMPLEMENTED,  # the one served model (another name: 404 model_not_found)
    "max_tokens": IMPLEMENTED,
    "temperature": IMPLEMENTED,
    "top_p": IMPLEMENTED,
    "seed": IMPLEMENTED,
    "stop": IMPLEMENTED,
    "stream": IMPLEMENTED,
    "stream_options": IMPLEMENTED,  # include_usage, include_obfuscation
    "user": IMPLEMENTED,  # the end user: the router's per-client session key (max_sessions_per_client) and,
    # without a cache_salt, the request's tenant in the prefix cache
    "n": IMPLEMENTED,  # 1..8 choices, choice i seeded child_seed(seed, i)
    "presence_penalty": IMPLEMENTED,
    "frequency_penalty": IMPLEMENTED,
    "logit_bias": IMPLEMENTED,
    "logprobs": IMPLEMENTED,  # chat: bool; completions: 0..5
    # vLLM's extra sampling parameters
    "top_k": IMPLEMENTED,
    "min_p": IMPLEMENTED,
    "repetition_penalty": IMPLEMENTED,
    # specmesh's own extra fields
    "strategy": IMPLEMENTED,
    "drafter": IMPLEMENTED,
    "acceptance": IMPLEMENTED,
    "draft_budget": IMPLEMENTED,
    "conversation_id": IMPLEMENTED,
    # vLLM's prefix-cache tenant (requests share cached prefixes only with the same salt; without
    # one, the request's user is its tenant)
    "cache_salt": IMPLEMENTED,
}

CHAT: dict[str, Rule] = dict(_COMMON, **{
    "messages": IMPLEMENTED,
    "max_completion_tokens": IMPLEMENTED,
    "top_logprobs": IMPLEMENTED,
    "safety_identifier": IMPLEMENTED,  # like user: the per-client session key
    "metadata": _refuse("metadata is kept only with stored completions, and this server stores none", _falsy),
    "store": _refuse("this server stores no completions (store must be false)", _falsy),
    "modalities": _refuse("only text output is served (modalities must be [\"text\"])",
                          lambda v: v is None or list(v) == ["text"]),
    "audio": _refuse("audio output is not served"),
    "service_tier": _refuse("one tier is served: service_tier must be \"auto\" or \"default\"",
                            lambda v: v in (None, "auto", "default")),
    "reasoning_effort": _refuse("reasoning_effort is not supported (the served model has no reasoning levels)"),
    "verbosity": _refuse("verbosity is not supported (the served model has no verbosity levels)"),
    "web_search_options": _refuse("web search is not available on this server"),
    "prompt_cache_key": _refuse("prompt_cache_key is not supported (no keyed prompt cache on this server)",
                                _falsy),
    "prompt_cache_retention": _refuse("prompt_cache_retention is not supported (no keyed prompt cache on "
                                      "this server)"),
    "prompt_cache_options": _refuse("prompt_cache_options is not supported (no keyed prompt cache on this "
                                    "server)", _falsy),
    "moderation": _refuse("moderation is not available on this server"),
    "functions": _refuse("the deprecated functions field is not supported; send tools", _falsy),
    "function_call": _refuse("the deprecated function_call field is not supported; send tool_choice"),
    "response_format": IMPLEMENTED,  # text, json_object, json_schema
    "tools": IMPLEMENTED,  # rendered by the chat template, else a documented system message
    "tool_choice": IMPLEMENTED,  # none, auto, required, a named function (the last two by a grammar)
    "parallel_tool_calls": IMPLEMENTED,
    "prediction": IMPLEMENTED,  # {type: content}: drafted through a lookup drafter
    # vLLM's structured-output extras (and their newer form)
    "guided_json": IMPLEMENTED,
    "guided_regex": IMPLEMENTED,
    "guided_choice": IMPLEMENTED,
    "guided_grammar": IMPLEMENTED,
    "structured_outputs": IMPLEMENTED,
})

COMPLETIONS: dict[str, Rule] = dict(_COMMON, **{
    "prompt": IMPLEMENTED,
    "echo": _refuse("echo is not supported (the prompt's tokens are not scored)", _falsy),
    "suffix": _refuse("suffix (fill-in-the-middle) is not supported", _falsy),
    "best_of": _refuse("only best_of=1 is supported (use n for several completions)", lambda v: v in (None, 1)),
    "guided_json": IMPLEMENTED,
    "guided_regex": IMPLEMENTED,
    "guided_choice": IMPLEMENTED,
    "guided_grammar": IMPLEMENTED,
    "structured_outputs": IMPLEMENTED,
    "response_format": IMPLEMENTED,  # text, json_object, json_schema
})

TABLES = {"chat": CHAT, "completion": COMPLETIONS}


def rule_params() -> tuple[str, ...]:
    """The acceptance rules' parameters, taken as flat extra fields (``lenience``, ...)."""
    from ..v1 import common_pb2

    skip = {"temperature", "top_p", "top_k", "seed", "acceptance", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "min_p", "grammar", "grammar_kind", "logprobs"}
    return tuple(f for f in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name if f not in skip)


def check(fields: dict, api: str) -> None:
    """Raise ``ValueError(param, why)`` for the first field of ``fields`` (name -> value,
    those the body set) that is unknown or refused with its value."""
    table = TABLES[api]
    extra = set(rule_params())
    for name, value in fields.items():
        rule = table.get(name)
        if rule is None:
            if name in extra:
                continue
            other = "chat" if api == "completion" else "completion"
            where = " (a field of the chat API)" if name in TABLES[other] else ""
            raise FieldRefused(name, f"unknown parameter{where}; this server refuses what it does not know "
                               "rather than ignore it")
        if rule == IMPLEMENTED:
            continue
        why = rule(value)
        if why is not None:
            raise FieldRefused(name, why)


class FieldRefused(ValueError):
    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param, self.why = param, why


__all__ = ["CHAT", "COMPLETIONS", "IMPLEMENTED", "FieldRefused", "TABLES", "check", "rule_params"]
