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
- ``GET /openapi.json``: this API as an OpenAPI 3.0 document (``openai_schema``), no
  token needed;
- ``GET /health``: readiness, no token needed (like the gRPC health service): 200
  once a router serves requests (its ``specmesh.v1.Router`` health is SERVING: a
  verifier serves behind it), 503 with the reason before; while it is 503 every
  request is 503 ``service_unavailable`` too, with the same reason. ``GET /live``:
  200 while the process serves (liveness);
- ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the verifier's
  prefix cache held (as OpenAI and vLLM report them).

Errors have the OpenAI shape ``{"error": {"message", "type", "param",
"code"}}``: the router's INVALID_ARGUMENT is HTTP 400 ``invalid_request_error``
with ``param`` the OpenAI name of the field the router named
(``sampling.top_p`` -> ``top_p``, ``max_new_tokens`` -> ``max_tokens``, ...),
and so are malformed bodies and the fields ``openai_fields`` refuses (``echo``,
``audio``, unknown fields, ...); a missing or wrong bearer token is 401
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

The request bodies and their translation into SDK calls are ``openai_request``; the
field table ``openai_fields``; logprobs, structured outputs and ``n`` ``openai_outputs``.
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
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..client import AsyncClient
from ..errors import SpecmeshError
from ..tools import ToolStream
from .openai_outputs import chat_logprobs, child_seed, completion_logprobs
from .openai_request import (ApiError, ChatBody, CompletionBody, Job, _loc_param, bad, build_job,  # noqa: F401
                             from_specmesh)

log = logging.getLogger("specmesh.serving.openai_http")
READY_TTL_S = 1.0  # how long a router's SERVING answer is trusted before /health or a request asks again
READY_TIMEOUT_S = 2.0

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
    def _usage(self, job: Job, runs: list) -> dict:
        sts = [r.s.result.stats for r in runs]
        prompt, completion = sts[0].prompt_tokens, sum(st.new_tokens for st in sts)
        # as OpenAI and vLLM report them: the prompt tokens the verifier's prefix cache held
        u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion,
                             "prompt_tokens_details": {"cached_tokens": sts[0].cached_tokens}}
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
        try:  # the SDK refuses what the wire cannot carry before anything is sent
            runs = [Run(self.client.stream(client_id=job.client or peer, **self._kwargs(job, i)), i)
                    for i in range(job.n)]
        except SpecmeshError as e:
            raise from_specmesh(e, job.params) from None
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
            tasks = [asyncio.ensure_future(_drain(g)) for g in gens]
            try:
                await asyncio.gather(*tasks)
            except SpecmeshError as e:
                raise from_specmesh(e, job.params) from None
            finally:  # one choice failed: the others stop (a generator another task iterates cannot be closed)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for g in gens:
                    await g.aclose()
            return JSONResponse(self._body(job, rid, created, runs))

        async def events():
            sent = [0] * len(runs)  # characters of each choice sent (completions' text_offset)
            tools = job.kind == "chat" and bool(job.kwargs.get("tools")) and job.kwargs.get("tool_choice") != "none"
            names = [t.get("name") for t in job.kwargs.get("tools") or []]
            parallel = job.kwargs.get("parallel_tool_calls") is not False
            parsers = [ToolStream(names, parallel) for _ in runs] if tools else None

            def calls_out(i, p):  # the calls the parser completed last, as tool_calls deltas
                out = ""
                for call in p.new:
                    c = self._chunk(job, rid, created, None, index=i)
                    c["choices"][0]["delta"]["tool_calls"] = _calls(
                        [{"id": call.id, "name": call.name, "arguments": call.arguments}],
                        len(p.calls) - len(p.new) + p.new.index(call))
                    out += _sse(c, job.obfuscate)
                return out

            def chunk(i, piece, lps):
                out = ""
                if parsers is not None:  # text that may begin a call is held back; a closed call is a delta
                    p = parsers[i]
                    piece = p.push(piece)
                    out = calls_out(i, p)
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
                    if parsers is not None:  # what was held back: calls, or content
                        p = parsers[run.index]
                        rest = p.flush()
                        if rest:
                            yield _sse(self._chunk(job, rid, created, rest, index=run.index), job.obfuscate)
                        deltas = calls_out(run.index, p)
                        if deltas:
                            yield deltas
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
                await asyncio.gather(*tasks, return_exceptions=True)  # stopped before their generators close
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
            return bad("body", f"the body is not valid JSON: {first.get('msg')}").response()
        return bad(param or "body", str(first.get("msg", "invalid value"))).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, e: StarletteHTTPException):  # the framework's own: a body it cannot
        # read (not UTF-8, not the declared type), an unknown path or method: OpenAI-shaped too
        if e.status_code == 400:
            return bad("body", f"the body could not be read: {e.detail}").response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, str(e.detail), "invalid_request_error", None, code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):  # a bug: still an OpenAI-shaped error, logged
        log.error("request failed", exc_info=e)
        return ApiError(500, f"internal error ({type(e).__name__})", "server_error", None,
                        "internal_error").response()

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

    @app.get("/openapi.json")
    async def schema():  # the API as OpenAPI 3.0 (what the fuzzing tests generate requests from)
        from .openai_schema import openapi

        return openapi(api.model)

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
