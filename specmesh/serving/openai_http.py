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
  the output ends just before the first one, finish reason ``stop``), ``n`` (1 only), ``usage``;
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
- ``GET /health``: readiness, no token needed (like the gRPC health service): 200
  once a router serves requests (its ``specmesh.v1.Router`` health is SERVING: a
  verifier serves behind it), 503 with the reason before; while it is 503 every
  request is 503 ``service_unavailable`` too, with the same reason. ``GET /live``:
  200 while the process serves (liveness).

Errors have the OpenAI shape ``{"error": {"message", "type", "param",
"code"}}``: the router's INVALID_ARGUMENT is HTTP 400 ``invalid_request_error``
with ``param`` the OpenAI name of the field the router named
(``sampling.top_p`` -> ``top_p``, ``max_new_tokens`` -> ``max_tokens``, ...),
and so are malformed bodies and options this API does not offer (``n`` > 1,
``logprobs``, penalties, ``echo``, ...); a missing or wrong bearer token is 401
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
from ..v1 import common_pb2
from ..errors import (DeadlineExceededError, InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                      SpecmeshError, UnauthenticatedError, UnavailableError)

log = logging.getLogger("specmesh.serving.openai_http")

U64 = 1 << 64
READY_TTL_S = 1.0  # how long a router's SERVING answer is trusted before /health or a request asks again
READY_TIMEOUT_S = 2.0

# router field (named in its INVALID_ARGUMENT message) -> OpenAI request parameter
_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
           "sampling.seed": "seed", "sampling.acceptance": "acceptance", "strategy": "strategy",
           "drafter": "drafter", "draft_budget": "draft_budget", "conversation_id": "conversation_id",
           "messages": "messages", "request": None}
# the acceptance rules' parameters, taken as flat extra body fields like vLLM's extra sampling parameters
# (lenience, accept_top_k, typical_epsilon, cd_alpha, ...): every SamplingParams field not mapped above
_RULE_PARAMS = tuple(f for f in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
                     if f"sampling.{f}" not in _PARAMS)
_PARAMS.update({f"sampling.{f}": f for f in _RULE_PARAMS})


# ---------------------------------------------------------------- request bodies

class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    # unknown OpenAI fields (user, logit_bias, metadata, ...) are accepted and ignored, as vLLM does
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


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


def _check_common(b: _Body) -> None:
    if b.n is not None and b.n != 1:
        raise bad("n", f"only n=1 is supported, got {b.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(b, name)
        if v not in (None, 0, 0.0):
            raise bad(name, "penalties are not supported (speculative decoding keeps the target's distribution)")


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    return stops


def build_job(b: _Body, kind: str, served_model: str) -> Job:
    _check_common(b)
    if b.model and b.model != served_model:
        raise ApiError(404, f"The model `{b.model}` does not exist; this server serves `{served_model}`.",
                       "invalid_request_error", "model", "model_not_found")
    params = {"prompt": "messages" if kind == "chat" else "prompt"}
    max_new = b.max_tokens
    params["max_new_tokens"] = "max_tokens"
    kw: dict[str, Any] = {}
    if kind == "chat":
        assert isinstance(b, ChatBody)
        if b.logprobs or b.top_logprobs:
            raise bad("logprobs", "logprobs are not supported")
        if b.max_completion_tokens is not None:
            if b.max_tokens is not None and b.max_tokens != b.max_completion_tokens:
                raise bad("max_completion_tokens", "differs from max_tokens; give one")
            max_new, params["max_new_tokens"] = b.max_completion_tokens, "max_completion_tokens"
        if not b.messages:
            raise bad("messages", "must be a non-empty list")
        kw["messages"] = [{"role": m.role, "content": m.text()} for m in b.messages]
    else:
        assert isinstance(b, CompletionBody)
        if b.echo:
            raise bad("echo", "echo is not supported")
        if b.suffix:
            raise bad("suffix", "suffix is not supported")
        if b.best_of not in (None, 1):
            raise bad("best_of", "only best_of=1 is supported")
        if b.logprobs:
            raise bad("logprobs", "logprobs are not supported")
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
    rule = {k: v for k, v in (b.model_extra or {}).items() if k in _RULE_PARAMS and v is not None}
    if rule:
        kw["acceptance_params"] = rule
    stops = _stops(b.stop)
    kw["stop"] = stops  # the router applies them (finish_reason "stop", its stats count the kept tokens)
    include_usage = bool(b.stream_options and b.stream_options.include_usage)
    return Job(kind, served_model, kw, stops, bool(b.stream), include_usage, params, drawn)


# ---------------------------------------------------------------- one generation

class Run:
    """The text pieces of one SDK stream (the router has applied the stop strings)."""

    def __init__(self, stream):
        self.s = stream
        self.acc = ""

    async def pieces(self):
        agen = self.s.__aiter__()
        done = False
        try:
            async for piece in agen:
                self.acc += piece
                if piece:
                    yield piece
            done = True
        finally:
            if not done:
                self.s.cancel()  # the HTTP client went away, or an error: free the router's session
            await agen.aclose()

    @property
    def text(self) -> str:
        return self.acc

    def finish_reason(self) -> str:
        return "length" if self.s.result.stats.finish_reason == "length" else "stop"


class Api:
    """The routes' logic over an ``AsyncClient`` to the router."""

    def __init__(self, client: AsyncClient, model: str, token: Optional[str] = None):
        self.client, self.model = client, model
        self._expected = f"Bearer {token}".encode() if token else None
        self.created = int(time.time())
        self._ready_until = 0.0

    async def ready(self) -> tuple[bool, str]:
        """Whether a router serves (``AsyncClient.ready``), remembered for ``READY_TTL_S`` once
        it does (a front whose router goes down learns it from its next request's error)."""
        now = time.monotonic()
        if self._ready_until > now:
            return True, ""
        ok, why = await self.client.ready(timeout=READY_TIMEOUT_S)
        if ok:
            self._ready_until = now + READY_TTL_S
        return ok, why

    async def require_ready(self) -> None:
        """HTTP 503 with the reason while no router serves (ready means ready)."""
        ok, why = await self.ready()
        if not ok:
            raise ApiError(503, f"not ready: no router serves requests yet ({why or 'none answered'}); retry shortly",
                           "server_error", None, "service_unavailable")

    def check_auth(self, request: Request) -> None:
        if self._expected is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, self._expected):
            raise ApiError(401, "missing or invalid bearer token", "invalid_request_error", None, "invalid_api_key")

    # ------------------------------------------------------------ results
    def _usage(self, job: Job, run: Run) -> dict:
        st = run.s.result.stats
        prompt, completion = st.prompt_tokens, st.new_tokens
        # as OpenAI and vLLM report them: the prompt tokens the verifier's prefix cache held
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}

    def _stats(self, job: Job, run: Run) -> dict:
        r = run.s.result
        d: dict[str, Any] = dict(r.stats.to_dict(), session_id=r.session_id)
        if job.drawn_seed is not None:
            d["seed"] = job.drawn_seed
        return d

    def _body(self, job: Job, rid: str, created: int, run: Run) -> dict:
        fr = run.finish_reason()
        if job.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": run.text}, "logprobs": None,
                      "finish_reason": fr}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": run.text, "logprobs": None, "finish_reason": fr}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [choice],
                "usage": self._usage(job, run), "system_fingerprint": None, "specmesh": self._stats(job, run)}

    def _chunk(self, job: Job, rid: str, created: int, text: Optional[str], finish: Optional[str] = None,
               first: bool = False) -> dict:
        if job.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": job.model, "choices": [choice],
                "system_fingerprint": None}

    # ------------------------------------------------------------ generate
    async def generate(self, job: Job, peer: str):
        rid = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        stream = self.client.stream(client_id=peer, **job.kwargs)
        run = Run(stream)
        pieces = run.pieces()
        try:  # the router validates when the call starts: its errors become HTTP statuses here
            first = await pieces.__anext__()
        except StopAsyncIteration:
            first = None
        except SpecmeshError as e:
            await pieces.aclose()
            raise from_specmesh(e, job.params) from None
        except BaseException:
            await pieces.aclose()
            raise
        if not job.stream:
            try:
                async for _ in pieces:
                    pass
            except SpecmeshError as e:
                raise from_specmesh(e, job.params) from None
            return JSONResponse(self._body(job, rid, created, run))

        async def events():
            try:
                if job.kind == "chat":
                    yield _sse(self._chunk(job, rid, created, "", first=True))
                if first:
                    yield _sse(self._chunk(job, rid, created, first))
                async for piece in pieces:
                    yield _sse(self._chunk(job, rid, created, piece))
                last = self._chunk(job, rid, created, None if job.kind == "chat" else "", run.finish_reason())
                last["specmesh"] = self._stats(job, run)
                if job.include_usage:
                    yield _sse(last)
                    yield _sse({"id": rid, "object": last["object"], "created": created, "model": job.model,
                                "choices": [], "usage": self._usage(job, run), "system_fingerprint": None})
                else:
                    yield _sse(last)
                yield "data: [DONE]\n\n"
            except SpecmeshError as e:
                yield _sse(from_specmesh(e, job.params).body())
                yield "data: [DONE]\n\n"
            finally:
                await pieces.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(obj: dict) -> str:
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
    async def health():  # readiness: 503 until a router serves (a verifier behind it)
        ok, why = await api.ready()
        if not ok:
            return JSONResponse({"status": "not ready", "message": f"no router serves requests yet: {why}",
                                 "resumes": api.client.resumes}, status_code=503)
        return {"status": "ok", "resumes": api.client.resumes}

    @app.get("/live")
    async def live():  # liveness: the process serves HTTP
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_auth(request)
        return {"object": "list", "data": [{"id": api.model, "object": "model", "created": api.created,
                                            "owned_by": "specmesh", "root": api.model}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        api.check_auth(request)
        await api.require_ready()
        return await api.generate(build_job(body, "chat", api.model), _peer(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        api.check_auth(request)
        await api.require_ready()
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
