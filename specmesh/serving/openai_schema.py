"""The OpenAI front's API as an OpenAPI 3.0 document, served at ``GET /openapi.json``.

``openapi(model)`` describes what the front really takes and answers: the chat and
completions request bodies field by field (types, ranges, enums; the fields this
server refuses are absent, and ``additionalProperties: false`` says an unknown field is
a 400), the specmesh and vLLM extra fields, and the responses: 200 (JSON, or server-sent
events with ``stream: true``), and the errors, each ``{"error": {message, type, param,
code}}`` with ``param`` the field at fault. The fuzzing tests generate requests from it
(schemathesis: ``tests/services/test_fuzz_http.py``, ``scripts/fuzz.py``).

Knows nothing about the router or models: the one served model's name is the caller's.
"""

from __future__ import annotations

from ..drafters import registry
from ..types import ACCEPTANCE_RULES, CD_AMATEURS
from ..wire.choices import MAX_N
from ..wire.convert import MAX_SALT, MAX_SESSION_ID

# the router's strategies (router/strategies.py STRATEGIES; tests/services/test_fuzz_http.py checks the two agree)
STRATEGIES = ("autoregressive", "external", "self", "proactive", "ssr", "auto")
DRAFTERS = tuple(dict.fromkeys(registry.EXTERNAL + registry.SELF + ("cache",)))
INT32_MAX = (1 << 31) - 1

_STR = {"type": "string"}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STR}}
_TEXT = {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]}


def _num(lo=None, hi=None, exclusive_lo: bool = False) -> dict:
    d: dict = {"type": "number", "nullable": True}
    if lo is not None:
        d["minimum"] = lo
        if exclusive_lo:
            d["exclusiveMinimum"] = True
    if hi is not None:
        d["maximum"] = hi
    return d


def _int(lo=None, hi=INT32_MAX) -> dict:
    d: dict = {"type": "integer", "nullable": True, "maximum": hi}
    if lo is not None:
        d["minimum"] = lo
    return d


def _enum(values, nullable: bool = False) -> dict:
    return {"type": "string", "enum": list(values), "nullable": nullable}


MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {
        "role": _enum(("system", "developer", "user", "assistant", "tool")),
        "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}], "nullable": True},
        "name": {"type": "string", "pattern": r"^[^\s<|\\/>]{1,64}$",
                 "description": "the participant (written before the turn's text where the template has no place "
                                "for it)"},
        "tool_calls": {"type": "array", "items": {
            "type": "object", "required": ["function"], "additionalProperties": False,
            "properties": {"id": _STR, "type": _enum(("function",)),
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "additionalProperties": False,
                                        "properties": {"name": _STR, "arguments": _STR}}}}},
        "tool_call_id": _STR,
    },
}
TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {"type": _enum(("function",)), "function": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _STR,
                           "parameters": {"type": "object"}, "strict": {"type": "boolean", "nullable": True}}}}}
RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "additionalProperties": False,
     "properties": {"type": _enum(("text", "json_object"))}},
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
     "properties": {"type": _enum(("json_schema",)), "json_schema": {
         "type": "object", "required": ["name"],
         "properties": {"name": _STR, "schema": {"type": "object"}, "strict": {"type": "boolean"},
                        "description": _STR}}}}]}

# fields both APIs take
COMMON = {
    "max_tokens": _int(1),
    "temperature": dict(_num(0), description="below 1e-5: greedy decoding (vLLM's floor)"),
    "top_p": _num(0, 1, exclusive_lo=True),
    "seed": {"type": "integer", "nullable": True, "description": "any integer, taken mod 2^64"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                       {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1,
                                                                    "maxLength": 256}}], "nullable": True},
    "n": _int(1, MAX_N),
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {"type": "object", "nullable": True, "additionalProperties": False,
                       "properties": {"include_usage": {"type": "boolean"},
                                      "include_obfuscation": {"type": "boolean"}}},
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, 10, exclusive_lo=True),
    "min_p": _num(0, 1),
    "top_k": _int(0),
    "logit_bias": {"type": "object", "nullable": True, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "user": {"type": "string", "nullable": True,
             "description": "the end user: the per-client session key and, without cache_salt, the prefix "
                            "cache's tenant"},
    "cache_salt": {"type": "string", "maxLength": MAX_SALT,
                   "description": "the prefix cache's tenant (vLLM's): cached prefixes are shared only among "
                                  "requests with the same salt"},
    "strategy": _enum(STRATEGIES),
    "drafter": _enum(DRAFTERS),
    "acceptance": _enum(ACCEPTANCE_RULES, nullable=True),
    "draft_budget": _int(1),
    "conversation_id": {"type": "string", "maxLength": MAX_SESSION_ID},
    # the acceptance rules' parameters (flat, as vLLM takes extra sampling parameters)
    "typical_epsilon": _num(0, exclusive_lo=True), "typical_delta": _num(0), "lenience": _num(0, 1, True),
    "accept_top_k": _int(1), "cd_alpha": _num(0, 1), "cd_beta": _num(0), "cd_amateur": _enum(CD_AMATEURS),
    "jsd_threshold": _num(0, 1),
    # structured output: one of response_format, guided_* and structured_outputs
    "response_format": dict(RESPONSE_FORMAT, nullable=True),
    "guided_json": {"type": "object", "nullable": True},
    "guided_regex": {"type": "string", "nullable": True, "maxLength": 262144},
    "guided_choice": {"type": "array", "nullable": True, "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "guided_grammar": {"type": "string", "nullable": True, "maxLength": 262144},
    "structured_outputs": {"type": "object", "nullable": True, "maxProperties": 1, "additionalProperties": False,
                           "properties": {"json": {"type": "object"}, "regex": _STR,
                                          "choice": {"type": "array", "items": _STR}, "grammar": _STR}},
}
CHAT = dict(COMMON, **{
    "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
    "max_completion_tokens": _int(1),
    "logprobs": {"type": "boolean", "nullable": True},
    "top_logprobs": _int(0, 20),
    "safety_identifier": {"type": "string", "nullable": True},
    "tools": {"type": "array", "nullable": True, "items": TOOL},
    "tool_choice": {"oneOf": [_enum(("none", "auto", "required")),
                              {"type": "object", "required": ["type", "function"],
                               "properties": {"type": _enum(("function",)),
                                              "function": {"type": "object", "required": ["name"],
                                                           "properties": {"name": _STR}}}}], "nullable": True},
    "parallel_tool_calls": {"type": "boolean", "nullable": True},
    "prediction": {"type": "object", "nullable": True, "required": ["type", "content"], "additionalProperties": False,
                   "properties": {"type": _enum(("content",)), "content": _TEXT}},
    "store": {"type": "boolean", "enum": [False], "nullable": True},
})
COMPLETIONS = dict(COMMON, **{
    "prompt": {"oneOf": [_STR, {"type": "array", "minItems": 1, "maxItems": 1, "items": _STR}]},
    "logprobs": _int(0, 5),
    "echo": {"type": "boolean", "enum": [False], "nullable": True},
    "suffix": {"type": "string", "enum": [""], "nullable": True},
    "best_of": _int(1, 1),
})

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": _STR, "type": _STR, "param": {"type": "string", "nullable": True},
                   "code": {"type": "string", "nullable": True}}}}}
ERRORS = {"400": "a field is refused: param names it", "401": "a missing or wrong bearer token",
          "404": "another model (param: model)", "429": "too many concurrent streams for this client",
          "503": "no router serves yet, or the router's verifiers are unavailable", "504": "the deadline passed"}


def _generate(name: str, body: dict, required: list[str], what: str) -> dict:
    return {"post": {
        "operationId": name, "summary": what,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["model"] + required, "additionalProperties": False,
            "properties": body}}}},
        "responses": dict({"200": {"description": "the completion (JSON), or server-sent events when stream is "
                                                  "true (an error after the stream began: a last error event)",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": _STR}}}},
                          **{code: {"description": why, "content": {"application/json": {"schema": ERROR}}}
                             for code, why in ERRORS.items()})}}


def openapi(model: str) -> dict:
    """The OpenAPI document of the front serving ``model``."""
    ok = {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}}
    model_field = {"model": {"type": "string", "enum": [model]}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "specmesh OpenAI-compatible API", "version": "1",
                 "description": "OpenAI's chat and completions APIs in front of specmesh's router (docs/serving.md)"},
        "paths": {
            "/v1/chat/completions": _generate("chat", dict(model_field, **CHAT), ["messages"],
                                              "a chat completion (messages rendered with the chat template)"),
            "/v1/completions": _generate("completions", dict(model_field, **COMPLETIONS), ["prompt"],
                                         "a completion of a raw prompt"),
            "/v1/models": {"get": {"operationId": "models", "summary": "the served model", "responses": ok}},
            "/health": {"get": {"operationId": "health", "summary": "readiness (503 until a router serves)",
                                "responses": dict(ok, **{"503": {"description": "not ready"}})}},
            "/live": {"get": {"operationId": "live", "summary": "liveness", "responses": ok}},
        },
    }


__all__ = ["CHAT", "COMPLETIONS", "STRATEGIES", "openapi"]
