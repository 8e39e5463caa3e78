"""The OpenAI API's request bodies, translated into SDK calls (``build_job``), and its errors.

- the bodies (pydantic): ``ChatBody`` / ``CompletionBody``; every field a body sets is
  judged by ``openai_fields.check`` (implemented, or refused naming it);
- ``build_job(body, kind, model)``: the ``Job`` (SDK keyword arguments, stop strings,
  streaming, ``n``, logprobs, the end user as the per-client key, and the map from the
  router's field names to the request's, so an INVALID_ARGUMENT names the field the
  caller sent): temperature 1.0 when omitted and a random seed for a sampled request
  without one (OpenAI's defaults), messages (``developer`` is system; tool calls and
  tool results), tools, penalties, ``logit_bias``, ``min_p``, the structured output
  (``openai_outputs.grammar_of``) and the prediction;
- ``ApiError`` / ``bad`` / ``from_specmesh``: OpenAI-shaped errors (the router's
  INVALID_ARGUMENT is a 400 naming the request's parameter).

This module knows nothing about HTTP servers, the router or models: it reshapes bodies.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..errors import (DeadlineExceededError, InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                      SpecmeshError, UnauthenticatedError, UnavailableError)
from ..wire.convert import MAX_SALT, unicode_path
from . import openai_fields
from .openai_outputs import MAX_COMPLETION_LOGPROBS, MAX_N, MAX_TOP_LOGPROBS, FieldError, grammar_of

U64 = 1 << 64
INT32_MAX = (1 << 31) - 1
# integer fields the gRPC request carries as int32 (the rule parameters' integers are checked too)
_INT32_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "draft_budget", "n", "logprobs", "top_logprobs")

# router field (named in its INVALID_ARGUMENT message) -> OpenAI request parameter
_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
           "sampling.seed": "seed", "sampling.acceptance": "acceptance", "strategy": "strategy",
           "drafter": "drafter", "draft_budget": "draft_budget", "conversation_id": "conversation_id",
           "messages": "messages", "request": None, "sampling.presence_penalty": "presence_penalty",
           "sampling.frequency_penalty": "frequency_penalty", "sampling.repetition_penalty": "repetition_penalty",
           "sampling.logit_bias": "logit_bias", "sampling.min_p": "min_p", "sampling.logprobs": "logprobs",
           "prediction": "prediction", "tools": "tools", "tool_choice": "tool_choice"}
# the acceptance rules' parameters, taken as flat extra body fields like vLLM's extra sampling parameters
# (lenience, accept_top_k, typical_epsilon, cd_alpha, ...)
_RULE_PARAMS = openai_fields.rule_params()
_PARAMS.update({f"sampling.{f}": f for f in _RULE_PARAMS})


# ---------------------------------------------------------------- request bodies

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Optional[bool] = False
    include_obfuscation: Optional[bool] = False  # a random ``obfuscation`` field on every chunk


class _Body(BaseModel):
    # every field the body sets is judged by ``openai_fields.check``: implemented, or refused naming it
    model_config = ConfigDict(extra="allow")

    model: str = ""
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    # specmesh extras (extra_body)
    strategy: str = ""
    drafter: str = ""
    acceptance: Optional[str] = None
    top_k: Optional[int] = None
    draft_budget: Optional[int] = None
    conversation_id: str = ""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # refusal, audio, ...: a 400 naming them

    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None  # an assistant turn's calls
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    safety_identifier: Optional[str] = None


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None


# ---------------------------------------------------------------- errors

class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` and the ``error`` object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(param: Optional[str], message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, "invalid_request_error", param, code)


def from_specmesh(e: SpecmeshError, params: dict) -> ApiError:
    """The HTTP error of a failed router call (``params``: router field -> this request's parameter)."""
    if isinstance(e, InvalidArgumentError):
        f = e.field
        param = params.get(f, _PARAMS.get(f, f or None))
        why = e.reason if f else e.details
        return bad(param, why)
    if isinstance(e, UnauthenticatedError):
        return ApiError(401, "missing or invalid bearer token", "invalid_request_error", None, "invalid_api_key")
    if isinstance(e, ResourceExhaustedError):
        return ApiError(429, e.details, "rate_limit_error", None, "rate_limit_exceeded")
    if isinstance(e, UnavailableError):
        return ApiError(503, e.details, "server_error", None, "service_unavailable")
    if isinstance(e, DeadlineExceededError):
        return ApiError(504, e.details, "server_error", None, "timeout")
    if isinstance(e, NotFoundError):
        return ApiError(404, e.details, "invalid_request_error", None, "not_found")
    return ApiError(500, f"{e.code}: {e.details}", "server_error", None, "internal_error")


def _loc_param(loc) -> Optional[str]:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not out:
            out = str(p)
        elif p in ("str", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]", "none", "function-after"):
            continue  # pydantic's union-branch names
        else:
            out += f".{p}"
    return out or None


# ---------------------------------------------------------------- the request, translated

@dataclass
class Job:
    """One request as the SDK call it becomes, plus what the HTTP layer does itself."""

    kind: str                      # "chat" | "completion"
    model: str
    kwargs: dict                   # SDK keyword arguments (build_request)
    stops: list[str]
    stream: bool
    include_usage: bool
    params: dict = field(default_factory=dict)  # router field -> request parameter
    drawn_seed: Optional[int] = None
    n: int = 1
    top: int = -1  # logprobs: -1 none, else the top tokens per position
    client: str = ""  # the end user (``user`` / ``safety_identifier``): the router's per-client key
    obfuscate: bool = False  # stream_options.include_obfuscation


def _check_common(b: _Body, kind: str) -> None:
    """Every field the body set is implemented or refused (``openai_fields``)."""
    fields = {k: getattr(b, k) for k in b.model_fields_set if k not in (b.model_extra or {})}
    fields.update(b.model_extra or {})
    if isinstance(fields.get("stream_options"), BaseModel):
        fields["stream_options"] = fields["stream_options"].model_dump(exclude_unset=True)
    try:
        openai_fields.check(fields, kind)
    except openai_fields.FieldRefused as e:
        raise bad(e.param, e.why, "unsupported_parameter" if "unknown" not in e.why else "unknown_parameter") \
            from None


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    return stops


def _check_wire(b: _Body) -> None:
    """What the router's gRPC request cannot carry, refused naming the field: text that is not
    Unicode (a lone UTF-16 surrogate, which JSON's \\ud800 escapes carry) anywhere in the
    body, and integers outside 32 bits (protobuf's int32, which cannot hold them)."""
    data = b.model_dump(mode="python")
    where = unicode_path(data)
    if where:
        raise bad(where, "not valid Unicode text (a lone UTF-16 surrogate)")
    for name in _INT32_FIELDS + tuple(_RULE_PARAMS):
        v = data.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and not -INT32_MAX - 1 <= v <= INT32_MAX:
            raise bad(name, f"{v} is outside the 32-bit integer range")


def build_job(b: _Body, kind: str, served_model: str) -> Job:
    _check_common(b, kind)
    _check_wire(b)
    if b.model and b.model != served_model:
        raise ApiError(404, f"The model `{b.model}` does not exist; this server serves `{served_model}`.",
                       "invalid_request_error", "model", "model_not_found")
    params = {"prompt": "messages" if kind == "chat" else "prompt"}
    max_new = b.max_tokens
    params["max_new_tokens"] = "max_tokens"
    kw: dict[str, Any] = {}
    fields = dict(b.model_extra or {})
    top = -1
    if kind == "chat":
        assert isinstance(b, ChatBody)
        if b.top_logprobs is not None:
            if not b.logprobs:
                raise bad("top_logprobs", "needs logprobs: true")
            if not 0 <= b.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {b.top_logprobs}")
        if b.logprobs:
            top = b.top_logprobs or 0
            params["sampling.logprobs"] = "top_logprobs" if b.top_logprobs else "logprobs"
        if b.max_completion_tokens is not None:
            if b.max_tokens is not None and b.max_tokens != b.max_completion_tokens:
                raise bad("max_completion_tokens", "differs from max_tokens; give one")
            max_new, params["max_new_tokens"] = b.max_completion_tokens, "max_completion_tokens"
        if not b.messages:
            raise bad("messages", "must be a non-empty list")
        # "developer" is OpenAI's newer name of the system role
        kw["messages"] = [_message(m) for m in b.messages]
        _tools(fields, kw)
        if "tools" in kw:  # the tools' grammar, unless a structured output of the request's own comes below
            params["sampling.grammar"] = params["sampling.grammar_kind"] = "tools"
    else:
        assert isinstance(b, CompletionBody)
        if b.logprobs is not None:
            if not 0 <= b.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise bad("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {b.logprobs}")
            top = b.logprobs
        prompt = b.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise bad("prompt", "give one prompt string (token id prompts and batches are not supported)")
            prompt = prompt[0]
        kw["prompt"] = prompt
        kw["raw_prompt"] = True  # the completions API continues the text as it is
    temperature = 1.0 if b.temperature is None else b.temperature  # OpenAI's default
    kw.update(temperature=temperature, max_new_tokens=max_new, top_p=b.top_p, top_k=b.top_k,
              strategy=b.strategy, drafter=b.drafter, acceptance=b.acceptance, draft_budget=b.draft_budget,
              conversation_id=b.conversation_id)
    drawn = None
    if b.seed is not None:
        kw["seed"] = b.seed % U64
    elif temperature > 0:  # OpenAI samples differently on every call without a seed
        drawn = kw["seed"] = secrets.randbits(63)
    rule = {k: v for k, v in fields.items() if k in _RULE_PARAMS and v is not None}
    if rule:
        kw["acceptance_params"] = rule
    _processors(b, fields, kw, params)
    if top >= 0:
        kw["logprobs"] = top
    n = 1 if b.n is None else b.n
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {n}")
    stops = _stops(b.stop)
    kw["stop"] = stops  # the router applies them (finish_reason "stop", its stats count the kept tokens)
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    user = b.user or getattr(b, "safety_identifier", None) or ""
    salt = fields.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt.encode()) > MAX_SALT):
        raise bad("cache_salt", f"must be a string of at most {MAX_SALT} bytes")
    # the prefix cache's tenant: the salt, else the end user, by a digest (any length; a request naming
    # neither shares the cache)
    kw["cache_salt"] = salt if salt is not None else (
        "user:" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:40] if user else "")
    params["cache_salt"] = "cache_salt" if salt is not None else "user"
    return Job(kind, served_model, kw, stops, bool(b.stream), include_usage, params, drawn, n=n, top=top,
               client=f"user:{user}" if user else "",
               obfuscate=bool(b.stream_options and b.stream_options.include_obfuscation))


def _message(m: ChatMessage) -> dict:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                           for c in m.tool_calls]
    return d


TOOL_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def _tools(fields: dict, kw: dict) -> None:
    """tools / tool_choice / parallel_tool_calls as SDK arguments (the router validates the rest)."""
    tools = fields.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                  and isinstance(t.get("function"), dict) for t in tools):
            raise bad("tools", "a list of {\"type\": \"function\", \"function\": {name, description, parameters, "
                      "strict}}")
        for i, t in enumerate(tools):  # a field of a tool this server would not use is refused, not dropped
            extra = sorted(set(t) - {"type", "function"}) + sorted(set(t["function"]) - TOOL_FUNCTION_FIELDS)
            if extra:
                raise bad("tools", f"tool {i}: unknown field(s) {extra}; a tool is {{type, function: {{"
                          f"{', '.join(sorted(TOOL_FUNCTION_FIELDS))}}}}}")
            strict = t["function"].get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad("tools", f"tool {i}: strict must be true, false or null")
        kw["tools"] = [t["function"] for t in tools]
    choice = fields.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise bad("tool_choice", "an object names a function: {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}")
            choice = f"function:{name}"
        elif choice not in ("none", "auto", "required"):
            raise bad("tool_choice", f"must be none, auto, required or a function, got {choice!r}")
        kw["tool_choice"] = choice
    ptc = fields.get("parallel_tool_calls")
    if ptc is not None:
        if not isinstance(ptc, bool):
            raise bad("parallel_tool_calls", "must be true or false")
        kw["parallel_tool_calls"] = ptc


def _processors(b: _Body, fields: dict, kw: dict, params: dict) -> None:
    """Penalties, logit_bias, min_p, the structured output and the prediction, as SDK arguments."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(b, name) is not None:
            kw[name] = getattr(b, name)
    for name in ("repetition_penalty", "min_p"):
        v = fields.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, f"must be a number, got {v!r}")
            kw[name] = float(v)
    lb = fields.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise bad("logit_bias", "must be an object mapping token ids to biases")
        bias = {}
        for k, v in lb.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise bad("logit_bias", f"key {k!r} is not a token id") from None
            if not 0 <= t <= INT32_MAX:
                raise bad("logit_bias", f"key {k!r} is not a token id")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad("logit_bias", f"bias of token {k} must be a number, got {v!r}")
            bias[t] = float(v)
        kw["logit_bias"] = bias
    try:
        g = grammar_of(fields)
    except FieldError as e:
        raise bad(e.param, e.why) from None
    if g is not None:
        params["sampling.grammar"] = params["sampling.grammar_kind"] = g[0]
        kw.update(g[1])
    pred = fields.get("prediction")
    if pred is not None:
        if not isinstance(pred, dict) or pred.get("type") != "content":
            raise bad("prediction", "must be {\"type\": \"content\", \"content\": ...}")
        c = pred.get("content")
        if isinstance(c, list):  # content parts
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text", ""), str)
                       for x in c):
                raise bad("prediction", "content parts must be text parts ({\"type\": \"text\", \"text\": ...})")
            c = "".join(x.get("text", "") for x in c)
        if not isinstance(c, str):
            raise bad("prediction", "content must be a string or text parts")
        kw["prediction"] = c


__all__ = ["ApiError", "ChatBody", "CompletionBody", "Job", "bad", "build_job", "from_specmesh"]
