"""The OpenAI-compatible HTTP API in front of the router (FastAPI + uvicorn).

Endpoints, as vLLM, SGLang and TGI offer them, so the official ``openai``
client (or any OpenAI-compatible client) works unchanged:

- ``GET /v1/models``: the one served model (``settings.model``);
- ``POST /v1/chat/completions`` (``messages``, rendered with the chat template)
  and ``POST /v1/completions`` (``prompt``, tokenized as is), streaming
  (server-sent events, ``stream: true``, ``stream_options.include_usage``) or
  not; ``temperature`` (OpenAI's default 1.0 when omitted), ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``seed`` (a random one when a
  sampled request gives none, reported back), ``stop`` (strings, applied by the router:
  the output ends just before the first one, finish reason ``stop``), ``n`` (1..8
  choices, one SDK stream each, seeded ``child_seed(seed, i)``; usage summed), ``usage``,
  ``logprobs`` / ``top_logprobs``, penalties, ``logit_bias``, structured outputs and
  predicted outputs (``openai_outputs``); every other field is implemented or refused
  naming it (``openai_fields``);
- extra body fields, the way vLLM takes extra sampling parameters (the
  ``openai`` client sends them with ``extra_body={...}``): ``strategy``,
  ``drafter``, ``acceptance`` (``exact`` or an opt-in rule: ``typical``, ``lenient``,
  ``topk``, ``contrastive``, ``divergence``) with its parameters as flat fields
  (``lenience``, ``accept_top_k``, ``typical_epsilon``, ``cd_alpha``, ... : the
  ``SamplingParams`` fields), ``top_k``,
  ``draft_budget``, ``conversation_id``;
- every response carries the speculation stats as an extra field
  ``"specmesh": {tau, accepted_tokens, drafted_tokens, strategy, drafter,
  lossy, ...}`` (the router's ``GenerationStats``, plus ``session_id``); a
  stream carries it on its final chunk (the one with ``finish_reason``);
- ``GET /health``: 200 while the process serves (no token needed, like the
  gRPC health service).

Errors have the OpenAI shape ``{"error": {"message", "type", "param",
"code"}}``: the router's INVALID_ARGUMENT is HTTP 400 ``invalid_request_error``
with ``param`` the OpenAI name of the field the router named
(``sampling.top_p`` -> ``top_p``, ``max_new_tokens`` -> ``max_tokens``, ...),
and so are malformed bodies and the fields ``openai_fields`` refuses (``echo``,
``audio``, ``tools`` for now, unknown fields, ...); a missing or wrong bearer token is 401
(when the server has a token); RESOURCE_EXHAUSTED 429; UNAVAILABLE 503;
DEADLINE_EXCEEDED 504. An error after a stream has started arrives as a last
``data: {"error": ...}`` event.

Every request goes to the router's gRPC ``Generate`` through
``specmesh.client.AsyncClient``: the router stays the only place that
validates, plans and decodes, and records the metrics (TTFT, inter-token and
end-to-end latency, spec-decode counters) for HTTP and gRPC requests alike.
The bearer token, TLS (``tls_cert`` / ``tls_key``, and ``tls_client_ca`` for
client certificates) are the router's settings; the HTTP peer's address is
forwarded as the router's per-client session key.

``start_http(settings, router_address)`` binds ``host:http_port`` (0 =
a free port) and runs uvicorn in a thread of the caller's process: the router's
(``specmesh serve router`` alone), or a process of its own, ``run_front``
(``specmesh serve openai --router-addresses a,b``; under ``specmesh serve`` the
fourth supervised process, on Kubernetes and in the Ray app its own deployment).
Either way it reaches the router(s) through the SDK, which resumes a stream whose
router died (``specmesh.client``), so an HTTP stream outlives a router restart
and its caller sees each character once. ``/health`` reports the SDK's resume
count.

This module knows nothing about models, tokenizers, decoding or the router's
internals: it speaks the SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..client import AsyncClient
from ..tools import ToolStream
from . import openai_fields
from .openai_outputs import (MAX_COMPLETION_LOGPROBS, MAX_N, MAX_TOP_LOGPROBS, FieldError, chat_logprobs, child_seed,
                             completion_logprobs, grammar_of)
from ..errors import (DeadlineExceededError, InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                      SpecmeshError, UnauthenticatedError, UnavailableError)

log = logging.getLogger("specmesh.serving.openai_http")

U64 = 1 << 64

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
        why = e.details.split(":", 1)[1].strip() if f else e.details
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


def build_job(b: _Body, kind: str, served_model: str) -> Job:
    _check_common(b, kind)
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


def _tools(fields: dict, kw: dict) -> None:
    """tools / tool_choice / parallel_tool_calls as SDK arguments (the router validates the rest)."""
    tools = fields.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                  and isinstance(t.get("function"), dict) for t in tools):
            raise bad("tools", "a list of {\"type\": \"function\", \"function\": {name, description, parameters}}")
        kw["tools"] = [t["function"] for t in tools]
    choice = fields.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
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
            if not all(isinstance(x, dict) and x.get("type") == "text" for x in c):
                raise bad("prediction", "content parts must be text parts")
            c = "".join(x.get("text", "") for x in c)
        if not isinstance(c, str):
            raise bad("prediction", "content must be a string or text parts")
        kw["prediction"] = c


# ---------------------------------------------------------------- one generation

class Run:
    """One choice: the text pieces of one SDK stream (the router has applied the stop
    strings), with the logprobs that came with them."""

    def __init__(self, stream, index: int = 0):
        self.s, self.index = stream, index
        self.acc = ""
        self.logprobs: list = []  # every token's, as they came

    async def pieces(self):
        """(text, logprobs since the last piece) as they come; held-back text comes later."""
        agen = self.s.__aiter__()
        done = False
        try:
            async for piece in agen:
                self.acc += piece
                lps = self.s.take_logprobs()
                self.logprobs += lps
                if piece:
                    yield piece, lps
                elif lps:
                    yield "", lps
            done = True
        finally:
            if not done:
                self.s.cancel()  # the HTTP client went away, or an error: free the router's session
            await agen.aclose()

    @property
    def text(self) -> str:
        return self.acc

    def finish_reason(self) -> str:
        fr = self.s.result.stats.finish_reason
        return fr if fr in ("length", "tool_calls") else "stop"


def _calls(calls, start: int = 0) -> list:
    """OpenAI's tool_calls (with ``index`` from ``start`` for stream deltas when start >= 0)."""
    out = []
    for k, c in enumerate(calls):
        d = {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        if start >= 0:
            d["index"] = start + k
        out.append(d)
    return out


class Api:
    """The routes' logic over an ``AsyncClient`` to the router."""

    def __init__(self, client: AsyncClient, model: str, token: Optional[str] = None):
        self.client, self.model = client, model
        self._expected = f"Bearer {token}".encode() if token else None
        self.created = int(time.time())

    def check_auth(self, request: Request) -> None:
        if self._expected is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, self._expected):
            raise ApiError(401, "missing or invalid bearer token", "invalid_request_error", None, "invalid_api_key")

    # ------------------------------------------------------------ results
    def _usage(self, job: Job, runs: list) -> dict:
        sts = [r.s.result.stats for r in runs]
        prompt, completion = sts[0].prompt_tokens, sum(st.new_tokens for st in sts)
        u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
        if "prediction" in job.kwargs:
            u["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(st.accepted_prediction_tokens for st in sts),
                "rejected_prediction_tokens": sum(st.rejected_prediction_tokens for st in sts)}
        return u

    def _stats(self, job: Job, runs: list) -> dict:
        def one(run):
            r = run.s.result
            return dict(r.stats.to_dict(), session_id=r.session_id)

        d: dict[str, Any] = one(runs[0])
        if job.drawn_seed is not None:
            d["seed"] = job.drawn_seed
        if len(runs) > 1:
            d["choices"] = [one(r) for r in runs]
        return d

    def _logprobs(self, job: Job, lps: list, offset: int = 0) -> Optional[dict]:
        if job.top < 0:
            return None
        return chat_logprobs(lps, job.top) if job.kind == "chat" else completion_logprobs(lps, job.top, offset)

    def _body(self, job: Job, rid: str, created: int, runs: list) -> dict:
        choices = []
        for run in runs:
            fr = run.finish_reason()
            lp = self._logprobs(job, run.logprobs)
            if job.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": run.s.result.text}
                calls = run.s.result.tool_calls
                if calls:
                    msg["tool_calls"] = _calls(calls, -1)
                    msg["content"] = run.s.result.text or None
                choices.append({"index": run.index, "message": msg, "logprobs": lp, "finish_reason": fr})
            else:
                choices.append({"index": run.index, "text": run.text, "logprobs": lp, "finish_reason": fr})
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": choices,
                "usage": self._usage(job, runs), "system_fingerprint": None, "specmesh": self._stats(job, runs)}

    def _chunk(self, job: Job, rid: str, created: int, text: Optional[str], finish: Optional[str] = None,
               first: bool = False, index: int = 0, logprobs: Optional[dict] = None) -> dict:
        if job.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [choice],
                "system_fingerprint": None}

    # ------------------------------------------------------------ generate
    def _kwargs(self, job: Job, i: int) -> dict:
        kw = dict(job.kwargs)
        if i and "seed" in kw:
            kw["seed"] = child_seed(kw["seed"], i)  # each choice its own draws, reproducible from the request's
        return kw

    async def generate(self, job: Job, peer: str):
        rid = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        runs = [Run(self.client.stream(client_id=job.client or peer, **self._kwargs(job, i)), i)
                for i in range(job.n)]
        gens = [r.pieces() for r in runs]
        firsts: list = []
        try:  # the router validates when a call starts: its errors become HTTP statuses here
            for g in gens:
                try:
                    firsts.append(await g.__anext__())
                except StopAsyncIteration:
                    firsts.append(None)
        except SpecmeshError as e:
            for g in gens:
                await g.aclose()
            raise from_specmesh(e, job.params) from None
        except BaseException:
            for g in gens:
                await g.aclose()
            raise
        if not job.stream:
            try:
                await asyncio.gather(*[_drain(g) for g in gens])
            except SpecmeshError as e:
                raise from_specmesh(e, job.params) from None
            finally:
                for g in gens:
                    await g.aclose()
            return JSONResponse(self._body(job, rid, created, runs))

        async def events():
            sent = [0] * len(runs)  # characters of each choice sent (completions' text_offset)
            tools = job.kind == "chat" and bool(job.kwargs.get("tools")) and job.kwargs.get("tool_choice") != "none"
            parsers = [ToolStream() for _ in runs] if tools else None

            def chunk(i, piece, lps):
                out = ""
                if parsers is not None:  # text that may begin a call is held back; a closed call is a delta
                    p = parsers[i]
                    piece = p.push(piece)
                    for call in p.new:
                        c = self._chunk(job, rid, created, None, index=i)
                        c["choices"][0]["delta"]["tool_calls"] = _calls(
                            [{"id": call.id, "name": call.name, "arguments": call.arguments}],
                            len(p.calls) - len(p.new) + p.new.index(call))
                        out += _sse(c, job.obfuscate)
                    if not piece and not lps:
                        return out
                c = self._chunk(job, rid, created, piece, index=i,
                                logprobs=self._logprobs(job, lps, sent[i]) if lps else None)
                sent[i] += len(piece)
                return _sse(c, job.obfuscate) + out

            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, g):
                try:
                    async for item in g:
                        await queue.put((i, item))
                    await queue.put((i, None))
                except BaseException as e:  # noqa: BLE001 - delivered to the event loop below
                    await queue.put((i, e))

            tasks = []
            try:
                for i in range(len(runs)):
                    if job.kind == "chat":
                        yield _sse(self._chunk(job, rid, created, "", first=True, index=i), job.obfuscate)
                    if firsts[i] is not None:
                        yield chunk(i, *firsts[i])
                tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens) if firsts[i] is not None]
                left = len(tasks)
                while left:
                    i, item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        left -= 1
                        continue
                    yield chunk(i, *item)
                stats = self._stats(job, runs)
                for run in runs:
                    if parsers is not None and parsers[run.index].buf:  # held back, and no call after all
                        yield _sse(self._chunk(job, rid, created, parsers[run.index].flush(), index=run.index),
                                   job.obfuscate)
                    last = self._chunk(job, rid, created, None if job.kind == "chat" else "", run.finish_reason(),
                                       index=run.index)
                    if run.index == len(runs) - 1:
                        last["specmesh"] = stats
                    yield _sse(last, job.obfuscate)
                if job.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk" if job.kind == "chat" else
                                "text_completion", "created": created, "model": job.model, "choices": [],
                                "usage": self._usage(job, runs), "system_fingerprint": None}, job.obfuscate)
                yield "data: [DONE]\n\n"
            except SpecmeshError as e:
                yield _sse(from_specmesh(e, job.params).body())
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                for g in gens:
                    await g.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _drain(g) -> None:
    async for _ in g:
        pass


def _sse(obj: dict, obfuscate: bool = False) -> str:
    if obfuscate:  # stream_options.include_obfuscation: random padding that hides the chunks' lengths
        obj = dict(obj, obfuscation=secrets.token_urlsafe(secrets.randbelow(24) + 1))
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _peer(request: Request) -> str:
    c = request.client
    return f"http:{c.host}" if c is not None else "http"


def create_app(api: Api) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await api.client.close()  # its grpc.aio channel lives in this event loop

    app = FastAPI(title="specmesh OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        param = _loc_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return bad(None, f"the body is not valid JSON: {first.get('msg')}").response()
        return bad(param, str(first.get("msg", "invalid value"))).response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "resumes": api.client.resumes}

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_auth(request)
        return {"object": "list", "data": [{"id": api.model, "object": "model", "created": api.created,
                                            "owned_by": "specmesh", "root": api.model}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        api.check_auth(request)
        return await api.generate(build_job(body, "chat", api.model), _peer(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        api.check_auth(request)
        return await api.generate(build_job(body, "completion", api.model), _peer(request))

    return app


# ---------------------------------------------------------------- the server thread

class HttpServer:
    """uvicorn serving ``app`` on an already bound socket, in a daemon thread."""

    def __init__(self, app, sock: socket.socket, tls: bool, ssl_kw: dict, url: str):
        import uvicorn

        self.sock, self.tls, self.url = sock, tls, url
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5, **ssl_kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="specmesh-openai-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "HttpServer":
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the OpenAI HTTP server stopped while starting (see the log above)")
            if time.monotonic() > end:
                raise RuntimeError(f"the OpenAI HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        try:
            self.sock.close()
        except OSError:
            pass


def _bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def start_http(s, router_address: str, port: Optional[int] = None) -> HttpServer:
    """Serve the OpenAI API for the router at ``router_address`` on ``s.host``:``port``
    (default ``s.http_port``; 0 = a free port). ``s`` is the router's ``ServeSettings``:
    its token guards the HTTP API too, its ``tls_cert``/``tls_key`` (and ``tls_client_ca``)
    make it HTTPS, and the client reaching the router over gRPC trusts ``peer_ca`` (else
    ``tls_cert``, a self-signed certificate) and shows ``peer_cert`` when the router asks
    for client certificates. Raises ``OSError`` when the port cannot be bound."""
    token = s.token()
    tls = s.tls_cert is not None
    client_kw: dict[str, Any] = {}
    if tls:
        client_kw = dict(tls=True, root_certificates=str(s.peer_ca or s.tls_cert))
        if s.tls_client_ca is not None:
            if s.peer_cert is None:
                raise ValueError("http: the router requires client certificates (tls_client_ca); set peer_cert and "
                                 "peer_key for its OpenAI HTTP front, or http: false")
            client_kw.update(certificate_chain=str(s.peer_cert), private_key=str(s.peer_key))
    client = AsyncClient(router_address, token=token, timeout=s.http_timeout_s, resume_window_s=s.resume_window_s,
                         **client_kw)
    api = Api(client, s.model, token)
    app = create_app(api)
    sock = _bind(s.host, s.http_port if port is None else port)
    ssl_kw: dict[str, Any] = {}
    if tls:
        ssl_kw = dict(ssl_certfile=str(s.tls_cert), ssl_keyfile=str(s.tls_key))
        if s.tls_client_ca is not None:
            ssl_kw.update(ssl_ca_certs=str(s.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
    host = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls else 'http'}://{host}:{sock.getsockname()[1]}/v1"

    server = HttpServer(app, sock, tls, ssl_kw, url)
    server.api = api  # its client follows the routers as they come and go (``AsyncClient.set_addresses``)
    return server.start()


def run_front(s) -> int:
    """``specmesh serve openai``: the OpenAI HTTP API as a process of its own, in front
    of the routers at ``s.router_targets()`` (resumed across them), on ``s.host``:
    ``--port`` (else ``http_port``), until SIGTERM/SIGINT. Prints its ``listening on``
    line (the supervisor's readiness mark)."""
    import signal

    targets = s.router_targets()
    http = start_http(s, ",".join(targets), s.port if s.port is not None else s.http_port)
    auth = "token" if s.token() else "no auth"
    print(f"specmesh openai listening on {http.url} ({'tls' if http.tls else 'insecure'}, {auth}; routers "
          f"{','.join(targets)})", flush=True)
    stop = threading.Event()
    prev = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5) and http.thread.is_alive():
            pass
    finally:
        http.stop()
        for sig, h in prev.items():
            signal.signal(sig, h)
    return 0 if stop.is_set() else 1


__all__ = ["Api", "ApiError", "HttpServer", "build_job", "create_app", "run_front", "start_http"]
