"""The client SDK of the router: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    c = specmesh.Client("127.0.0.1:50051")
    r = c.generate("Write a haiku", strategy="external", drafter="prompt_lookup", max_new_tokens=64)
    print(r.text, r.stats.tau)
    s = c.stream("Tell me a story", temperature=0.7, seed=1)
    for piece in s:
        print(piece, end="", flush=True)
    print(s.result.stats.finish_reason)

Resume (on by default, ``resume=False`` turns it off): when a stream fails
with UNAVAILABLE after it started (the router process died or restarted), the
stream resumes by itself: it sends the same request again with
``GenerateRequest.resume`` (the tokens and the count of characters it already
delivered) to the next router address (``address`` may list several,
``"a:50051,b:50051"`` or a list, or be a DNS name with several records: the
channel balances over them), waiting for one to be ready, within the call's
deadline (DEADLINE_EXCEEDED when it passes) and ``resume_window_s`` (then the
UNAVAILABLE is raised), at most ``max_resumes`` times per stream. The router sends only
text the caller lacks, so the caller sees each character once; each resume is
logged (logger ``specmesh.client``) and counted (``Client.resumes``,
``Stream.resumes``, ``Result.stats.resumed_tokens``). Greedy output, and seeded
sampled output wherever two uninterrupted runs agree, is the uninterrupted run's
(docs/serving.md, "Failure model"). A call that fails before its first message
is not retried, nor is a reasoning request (the router cannot replay its
thinking phase).

TLS: pass ``root_certificates`` (PEM bytes or a path; ``tls=True`` alone uses
the system roots) and, for mutual TLS, ``private_key`` and
``certificate_chain``. A bearer ``token`` is sent as ``authorization: Bearer``.
``timeout`` (seconds) is the default deadline of each call; ``client_id`` (on the
client or per ``stream``/``generate`` call) is sent as ``x-specmesh-client``, the
key of the router's per-client session limit. Failures raise the
typed exceptions of ``specmesh.errors`` (``InvalidArgumentError`` naming the
field, ``UnauthenticatedError``, ``ResourceExhaustedError``,
``UnavailableError``, ``DeadlineExceededError``, ...).

This module knows nothing about models or the services' internals; it imports
grpc, the generated stubs and the proto -> stats conversion only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Optional, Sequence, Union

import grpc

from .errors import InvalidArgumentError, from_rpc_error
from .wire.channels import channel, channel_credentials
from .wire.choices import MAX_N, child_seed  # noqa: F401 - the SDK's names for them
from .wire.convert import RouterStats, messages_to_proto, stats_from_proto, unicode_path
from .v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
ROUTER_SERVICE = "specmesh.v1.Router"  # its health status: SERVING once a verifier serves behind it


def _health_answer(address: str, r) -> tuple[bool, str]:
    from grpc_health.v1 import health_pb2

    if r.status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    return False, f"router {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}"

def _children(n: int, kw: dict) -> list[dict]:
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {n!r}")
    if n > 1 and kw.get("seed") is None and (kw.get("temperature") or 0) > 0:
        import secrets

        kw = dict(kw, seed=secrets.randbits(63))  # one draw for the request, derived for each child
    return [dict(kw, seed=child_seed(kw["seed"], i)) if kw.get("seed") is not None else dict(kw)
            for i in range(n)]
RESUME_WINDOW_S = 60.0  # a lost stream waits at most this long for a router to resume on
MAX_RESUMES = 5  # resumes of one stream
READY_WAIT_S = 2.0  # with several addresses: wait this long for one before trying the next

log = logging.getLogger("specmesh.client")


@dataclass
class TokenLogprob:
    """One emitted token's log-probability (``logprobs=``): its id, text and bytes, and
    the ``top`` most likely tokens of its row as (token id, text, bytes, logprob)."""

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: list


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: RouterStats
    session_id: str = ""
    logprobs: Optional[list] = None  # ``TokenLogprob`` per token id, when asked for
    tool_calls: Optional[list] = None  # dicts of id, name, arguments (JSON text), when the model called tools

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def build_request(prompt: Optional[str] = None, *, messages: Optional[Sequence[dict]] = None, strategy: str = "",
                  drafter: str = "", max_new_tokens: Optional[int] = None, temperature: Optional[float] = None,
                  top_p: Optional[float] = None, top_k: Optional[int] = None, seed: Optional[int] = None,
                  acceptance: Optional[str] = None, acceptance_params: Optional[dict] = None,
                  draft_budget: Optional[int] = None,
                  raw_prompt: bool = False, conversation_id: str = "", reasoning: bool = False,
                  thinking_budget: Optional[int] = None, stop: Sequence[str] = (),
                  draft_ahead: str = "", presence_penalty: Optional[float] = None,
                  frequency_penalty: Optional[float] = None, repetition_penalty: Optional[float] = None,
                  logit_bias: Optional[dict] = None, min_p: Optional[float] = None, logprobs: Optional[int] = None,
                  json_schema=None, json_object: bool = False, regex: Optional[str] = None,
                  choice: Optional[Sequence[str]] = None, grammar: Optional[str] = None,
                  prediction: str = "", tools: Optional[Sequence[dict]] = None, tool_choice: str = "",
                  parallel_tool_calls: Optional[bool] = None, cache_salt: str = "") -> router_pb2.GenerateRequest:
    """A GenerateRequest; unset options take the router's defaults (the router validates).
    ``acceptance_params``: the rule's parameters by their SamplingParams names
    (typical_epsilon, typical_delta, lenience, accept_top_k, cd_alpha, cd_beta, cd_amateur, jsd_threshold).
    Logits processors (exact under every strategy): ``presence_penalty``, ``frequency_penalty``
    (OpenAI's), ``repetition_penalty`` (vLLM's), ``logit_bias`` ({token id: bias}), ``min_p``.
    ``logprobs``: 0 = each token's log-probability, 1..20 = and that many top tokens
    (``Result.logprobs``). Structured output, at most one of: ``json_schema`` (a dict or its
    JSON text), ``json_object``, ``regex``, ``choice`` (strings), ``grammar`` (Lark or GBNF).
    ``prediction``: the expected output (predicted outputs): drafted through a lookup drafter.
    ``tools``: functions the model may call (dicts of name, description, parameters: a JSON
    schema, strict, or OpenAI's ``{"type": "function", "function": {...}}``); ``tool_choice`` "auto",
    "none", "required" or "function:NAME"; calls come back in ``Result.tool_calls``.
    ``cache_salt``: the prefix cache's tenant (vLLM's): cached prefixes are reused among
    requests with the same salt only. An integer outside its field's 32-bit range, or text
    that is not Unicode (a lone UTF-16 surrogate), raises ``InvalidArgumentError`` naming the
    field, before anything is sent."""
    import json as _json

    _check_door(locals())
    sp = common_pb2.SamplingParams()
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                    ("repetition_penalty", repetition_penalty), ("min_p", min_p), ("logprobs", logprobs)):
        if v is not None:
            setattr(sp, name, v)
    for t, b in (logit_bias or {}).items():
        sp.logit_bias[int(t)] = float(b)
    kinds = [(k, v) for k, v in (("json_schema", json_schema), ("json_object", json_object or None),
                                  ("regex", regex), ("choice", choice), ("lark", grammar)) if v is not None]
    if len(kinds) > 1:
        raise ValueError(f"give one structured output, got {[k for k, _ in kinds]}")
    if kinds:
        kind, v = kinds[0]
        sp.grammar_kind = kind
        sp.grammar = "" if kind == "json_object" else v if isinstance(v, str) and kind != "choice" else \
            _json.dumps(v if kind != "choice" else list(v))
    if temperature is not None:
        sp.temperature = temperature
    if top_p is not None:
        sp.top_p = top_p
    if top_k is not None:
        sp.top_k = top_k
    if seed is not None:
        sp.seed = seed % (1 << 64)  # OpenAI's seed is a signed 64-bit integer: the same bits
    if acceptance is not None:
        sp.acceptance = acceptance
    for k, v in (acceptance_params or {}).items():
        try:
            setattr(sp, k, v)  # an unknown name raises AttributeError before anything is sent
        except (TypeError, ValueError) as e:  # a value of the wrong type: the field's refusal, not a crash
            raise InvalidArgumentError(f"sampling.{k}: {e} (got {v!r})") from None
    req = router_pb2.GenerateRequest(prompt=prompt or "", messages=messages_to_proto(messages), strategy=strategy,
                                     drafter=drafter, sampling=sp, raw_prompt=raw_prompt,
                                     conversation_id=conversation_id, reasoning=reasoning, draft_ahead=draft_ahead,
                                     prediction=prediction, cache_salt=cache_salt)
    if thinking_budget is not None:
        req.thinking_budget = thinking_budget
    req.stop.extend([stop] if isinstance(stop, str) else list(stop))  # the output ends before the first one
    for t in tools or []:
        f = t.get("function", t)
        params = f.get("parameters") or {"type": "object"}
        m = req.tools.add(name=str(f.get("name", "")), description=str(f.get("description") or ""),
                          parameters=params if isinstance(params, str) else _json.dumps(params))
        if f.get("strict") is not None:
            m.strict = bool(f["strict"])
    req.tool_choice = tool_choice
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    if draft_budget is not None:
        req.draft_budget = draft_budget
    return req


INT32 = (-(1 << 31), (1 << 31) - 1)
# build_request's integer arguments and the field the router names for each (proto int32 fields)
_INT32_ARGS = {"max_new_tokens": "max_new_tokens", "top_k": "sampling.top_k", "draft_budget": "draft_budget",
               "thinking_budget": "thinking_budget", "logprobs": "sampling.logprobs"}
_TEXT_ARGS = {"prompt": "prompt", "messages": "messages", "strategy": "strategy", "drafter": "drafter",
              "acceptance": "sampling.acceptance", "conversation_id": "conversation_id", "stop": "stop",
              "draft_ahead": "draft_ahead", "regex": "sampling.grammar", "grammar": "sampling.grammar",
              "json_schema": "sampling.grammar", "choice": "sampling.grammar", "prediction": "prediction",
              "tools": "tools", "tool_choice": "tool_choice", "cache_salt": "cache_salt"}


def _check_door(args: dict) -> None:
    """What the wire cannot carry, refused naming the field (the router judges the rest)."""
    for name, field in _INT32_ARGS.items():
        v = args.get(name)
        if v is not None and not isinstance(v, bool) and isinstance(v, int) and not INT32[0] <= v <= INT32[1]:
            raise InvalidArgumentError(f"{field}: {v} is outside the 32-bit integer range")
    for t in (args.get("logit_bias") or {}):
        try:
            ok = INT32[0] <= int(t) <= INT32[1]
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidArgumentError(f"sampling.logit_bias: key {t!r} is not a token id")
    for k, v in (args.get("acceptance_params") or {}).items():
        if isinstance(v, int) and not isinstance(v, bool) and not INT32[0] <= v <= INT32[1]:
            raise InvalidArgumentError(f"sampling.{k}: {v} is outside the 32-bit integer range")
    for name, field in _TEXT_ARGS.items():
        bad = unicode_path(args.get(name), name)
        if bad:
            raise InvalidArgumentError(f"{field}: not valid Unicode text at {bad} (a lone UTF-16 surrogate)")


def client_key(client_id: str) -> str:
    """``client_id`` as the ``x-specmesh-client`` header carries it: as given when it is short
    printable ASCII, else a digest of it (a header has a size limit, past which gRPC answers
    RESOURCE_EXHAUSTED, and takes printable ASCII only)."""
    if len(client_id) <= 128 and client_id.isascii() and client_id.isprintable():
        return client_id
    import hashlib

    return "sha256:" + hashlib.sha256(client_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def anticipate_request(conversation_id: str, messages: Sequence[dict], max_tokens: int = 0, next_turns: int = 0,
                       wait: bool = False, cache_salt: str = "") -> router_pb2.AnticipateRequest:
    return router_pb2.AnticipateRequest(conversation_id=conversation_id, messages=messages_to_proto(messages),
                                        max_tokens=max_tokens, next_turns=next_turns, wait=wait,
                                        cache_salt=cache_salt)


class _Collector:
    """Folds GenerateResponse messages into text deltas and the final Result."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.result: Optional[Result] = None
        self.logprobs: Optional[list] = None  # TokenLogprob of each token so far (when asked for)
        self.pending_logprobs: list = []  # of the last delta (the HTTP API streams them with its text)

    def feed(self, resp: router_pb2.GenerateResponse) -> str:
        if resp.HasField("final"):
            f = resp.final
            self.result = Result(f.text, list(f.token_ids), stats_from_proto(f.stats), f.session_id,
                                 self.logprobs[: len(f.token_ids)] if self.logprobs is not None else None,
                                 [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in f.tool_calls]
                                 or None)
            return ""
        self.token_ids += resp.delta.token_ids
        if len(resp.delta.logprobs):
            got = [TokenLogprob(m.token_id, m.token, bytes(m.token_bytes), m.logprob,
                                list(zip(m.top_ids, m.top_tokens, [bytes(b) for b in m.top_token_bytes],
                                         m.top_logprobs))) for m in resp.delta.logprobs]
            self.logprobs = (self.logprobs or []) + got
            self.pending_logprobs += got
        return resp.delta.text

    def take_logprobs(self) -> list:
        """The logprobs that arrived since the last call."""
        out, self.pending_logprobs = self.pending_logprobs, []
        return out

    @property
    def stats(self) -> Optional[RouterStats]:
        return self.result.stats if self.result else None


class _Resumable(_Collector):
    """What a resumable stream tracks: the request, its deadline, the text
    characters delivered, the resumes made; ``_next_try`` decides each retry."""

    def __init__(self, client: "_Base", request, timeout: Optional[float], metadata: tuple):
        super().__init__()
        self._client, self._request, self._metadata = client, request, metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._at = client._start_index()
        self.text_chars = 0  # characters delivered to the caller
        self.resumes = 0
        self._cancelled = False
        self._failed_tries = 0  # calls of the current resume that failed before a message

    def feed(self, resp) -> str:
        self._failed_tries = 0  # this call delivers: the next failure starts a new resume
        text = super().feed(resp)
        self.text_chars += len(text)
        return text

    def _left(self) -> Optional[float]:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _resume_request(self):
        req = router_pb2.GenerateRequest()
        req.CopyFrom(self._request)
        if self.token_ids or self.text_chars:
            req.resume.token_ids.extend(self.token_ids)
            req.resume.text_chars = self.text_chars
        return req

    def _may_resume(self, e: grpc.RpcError, got_message: bool) -> bool:
        return (self._client.resume and not self._cancelled and self.result is None
                and not (self._request.reasoning or self._request.strategy == "ssr")  # not replayable: router.core
                and e.code() == grpc.StatusCode.UNAVAILABLE and (got_message or self._failed_tries > 0))

    def _give_up(self, e: grpc.RpcError, why: str):
        log.warning("specmesh: not resuming the stream (%s): %s", why, e.details() if hasattr(e, "details") else e)
        return from_rpc_error(e)

    def _next_try(self, e: grpc.RpcError, got_message: bool) -> tuple[int, float, float]:
        """(address index, pause before it, seconds to wait for it to be ready) of the
        next try, or raises the error the caller gets."""
        if not self._may_resume(e, got_message):
            raise from_rpc_error(e)
        if got_message or self._failed_tries == 0:  # a new resume (after progress)
            if self.resumes >= self._client.max_resumes:
                raise self._give_up(e, f"{self.resumes} resumes already")
            self.resumes += 1
            self._client._count_resume()
            self._window_end = time.monotonic() + self._client.resume_window_s
        self._failed_tries += 1
        left = self._left()
        window = self._window_end - time.monotonic()
        if left is not None and left <= 0:
            raise from_rpc_error(_Deadline())
        if window <= 0:
            raise self._give_up(e, f"no router came back within {self._client.resume_window_s} s")
        n = len(self._client.addresses)
        self._at = (self._at + 1) % n  # several addresses: each try the next one
        wait = min(x for x in (left, window, READY_WAIT_S if n > 1 else None) if x is not None)
        pause = 0.0 if self._failed_tries == 1 else min(1.0, 0.05 * 2 ** self._failed_tries, wait)
        log.warning("specmesh: stream lost (%s: %s) after %d tokens; resuming on %s (resume %d of %d)",
                    e.code().name, e.details(), len(self.token_ids), self._client.addresses[self._at], self.resumes,
                    self._client.max_resumes)
        return self._at, pause, max(0.0, wait - pause)


class Stream(_Resumable):
    """Iterate for text deltas; ``result`` / ``stats`` are set after the last one.
    Resumes by itself after a lost router (module docstring)."""

    def __init__(self, client: "Client", request, timeout: Optional[float], metadata: tuple):
        super().__init__(client, request, timeout, metadata)
        self._lock = threading.Lock()
        self._call = client._call(self._at, request, timeout, metadata)

    def __iter__(self) -> Iterator[str]:
        while True:
            got = False
            try:
                for resp in self._call:
                    got = True
                    text = self.feed(resp)
                    if text:
                        yield text
                return
            except grpc.RpcError as e:
                at, pause, wait = self._next_try(e, got)
            time.sleep(pause)
            try:
                grpc.channel_ready_future(self._client._channel_at(at)).result(timeout=wait)
            except grpc.FutureTimeoutError:
                pass  # the call below fails at once (UNAVAILABLE: the next try) or passes the deadline
            with self._lock:
                if self._cancelled:
                    raise from_rpc_error(_Cancelled())
                left = self._left()
                self._call = self._client._call(at, self._resume_request(), left, self._metadata)

    def cancel(self) -> None:
        """Cancel the call; the router frees the session."""
        with self._lock:
            self._cancelled = True
            self._call.cancel()


class AsyncStream(_Resumable):
    def __init__(self, client: "AsyncClient", request, timeout: Optional[float], metadata: tuple):
        super().__init__(client, request, timeout, metadata)
        self._call = client._call(self._at, request, timeout, metadata)

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            got = False
            try:
                async for resp in self._call:
                    got = True
                    text = self.feed(resp)
                    if text:
                        yield text
                return
            except grpc.RpcError as e:
                at, pause, wait = self._next_try(e, got)
            await asyncio.sleep(pause)
            try:
                await asyncio.wait_for(self._client._channel_at(at).channel_ready(), wait)
            except asyncio.TimeoutError:
                pass
            if self._cancelled:
                raise from_rpc_error(_Cancelled())
            self._call = self._client._call(at, self._resume_request(), self._left(), self._metadata)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


def split_addresses(address: Union[str, Sequence[str]]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]`` (one DNS name stays one:
    its channel balances over the name's records)."""
    items = address.split(",") if isinstance(address, str) else list(address)
    out = [a.strip() for a in items if a and a.strip()]
    if not out:
        raise ValueError("address: no router address given")
    return out


class _Base:
    def __init__(self, address: Union[str, Sequence[str]] = DEFAULT_ADDRESS, token: Optional[str] = None,
                 root_certificates=None, timeout: Optional[float] = None, *, private_key=None,
                 certificate_chain=None, tls: Optional[bool] = None, client_id: Optional[str] = None,
                 options: Sequence = (), resume: bool = True, max_resumes: int = MAX_RESUMES,
                 resume_window_s: float = RESUME_WINDOW_S):
        self.addresses = split_addresses(address)
        self.address, self.timeout = ",".join(self.addresses), timeout
        self.resume, self.max_resumes, self.resume_window_s = resume, max_resumes, resume_window_s
        self.resumes = 0  # streams resumed after a lost router (all streams of this client)
        self._count_lock = threading.Lock()
        self._next = 0
        # round_robin over a DNS name's records (a dead one is skipped); a single address is unaffected
        lb = [("grpc.lb_policy_name", "round_robin")]
        if tls is None:
            tls = root_certificates is not None or certificate_chain is not None
        self._creds = channel_credentials(root_certificates, private_key, certificate_chain) if tls else None
        self._options = lb + list(options)
        md = []
        if token:
            md.append(("authorization", f"Bearer {token}"))
        self._auth = tuple(md)
        if client_id:
            md.append(("x-specmesh-client", client_key(client_id)))
        self._metadata = tuple(md)

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _md(self, client_id: Optional[str]) -> tuple:
        """Call metadata; a per-call ``client_id`` replaces the client's own (the key of
        the router's max_sessions_per_client, e.g. the HTTP peer behind a front end)."""
        return self._metadata if not client_id else self._auth + (("x-specmesh-client", client_key(client_id)),)

    def _count_resume(self) -> None:
        with self._count_lock:
            self.resumes += 1

    def _start_index(self) -> int:
        """The address a new stream starts on (rotating over the addresses)."""
        with self._count_lock:
            i, self._next = self._next, (self._next + 1) % len(self.addresses)
            return i


class Client(_Base):
    """Blocking client of the Router service (see module docstring)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._channels = [channel(a, self._creds, options=self._options) for a in self.addresses]
        self._stubs = [router_pb2_grpc.RouterStub(c) for c in self._channels]
        self._channel, self._stub = self._channels[0], self._stubs[0]

    def _channel_at(self, i: int):
        return self._channels[i]

    def _call(self, i: int, request, timeout: Optional[float], metadata: tuple):
        return self._stubs[i].Generate(request, timeout=timeout, metadata=metadata)

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
               client_id: Optional[str] = None, **kw) -> Stream:
        """Start a generation; iterate the returned Stream for text deltas."""
        return Stream(self, build_request(prompt, **kw), self._timeout(timeout), self._md(client_id))

    def generate(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kw) -> Result:
        """Run a generation to the end: Result(text, token_ids, stats)."""
        s = self.stream(prompt, timeout=timeout, **kw)
        for _ in s:
            pass
        if s.result is None:
            raise from_rpc_error(_NoFinal())
        return s.result

    def ready(self, timeout: float = 2.0) -> tuple[bool, str]:
        """(whether a router serves requests now, why not): the first router address whose
        health status for ``specmesh.v1.Router`` is SERVING (a router is NOT_SERVING until
        a verifier serves behind it)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        why = []
        for a, ch in zip(self.addresses, self._channels):
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE),
                                                         timeout=timeout)
            except grpc.RpcError as e:
                why.append(f"router {a}: {e.code().name}")
                continue
            ok, reason = _health_answer(a, r)
            if ok:
                return True, ""
            why.append(reason)
        return False, "; ".join(why)

    def generate_n(self, prompt: Optional[str] = None, *, n: int, timeout: Optional[float] = None,
                   **kw) -> list[Result]:
        """``n`` generations of one request (as the OpenAI API's ``n``), concurrently: the
        same prompt (the verifiers' prefix cache, where present, shares its KV), generation
        i seeded ``child_seed(seed, i)``. Results in order."""
        from concurrent.futures import ThreadPoolExecutor

        kids = _children(n, kw)
        with ThreadPoolExecutor(len(kids)) as pool:
            return list(pool.map(lambda k: self.generate(prompt, timeout=timeout, **k), kids))

    def list_strategies(self, timeout: Optional[float] = None) -> router_pb2.ListStrategiesResponse:
        try:
            return self._stub.ListStrategies(router_pb2.ListStrategiesRequest(), timeout=self._timeout(timeout),
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def anticipate(self, conversation_id: str, messages: Sequence[dict], *, max_tokens: int = 0, next_turns: int = 0,
                   wait: bool = False, timeout: Optional[float] = None,
                   cache_salt: str = "") -> router_pb2.AnticipateResponse:
        """Let the router prepare the conversation's next turn while it is idle
        (``wait``: return when that is done); ``cache_salt``: the conversation's tenant, as its
        requests send it."""
        try:
            return self._stub.Anticipate(anticipate_request(conversation_id, messages, max_tokens, next_turns, wait,
                                                            cache_salt),
                                         timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def get_anticipation(self, conversation_id: str, timeout: Optional[float] = None,
                         cache_salt: str = "") -> router_pb2.AnticipateResponse:
        try:
            return self._stub.GetAnticipation(router_pb2.GetAnticipationRequest(conversation_id=conversation_id,
                                                                                cache_salt=cache_salt),
                                              timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio) with the same API; ``stream`` returns an async iterator."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._conn: Optional[tuple] = None  # (addresses, channels, stubs), made in the running event loop
        self._old: list = []  # channels of addresses left behind (``set_addresses``), closed with the client

    def _connection(self) -> tuple:
        conn = self._conn
        if conn is None or conn[0] is not self.addresses:  # first use, or new addresses
            chans = [channel(a, self._creds, aio=True, options=self._options) for a in self.addresses]
            conn = self._conn = (self.addresses, chans, [router_pb2_grpc.RouterStub(c) for c in chans])
        return conn

    def _channel_at(self, i: int):
        chans = self._connection()[1]
        return chans[i % len(chans)]

    def _get_stub(self):
        return self._connection()[2][0]

    def set_addresses(self, address: Union[str, Sequence[str]]) -> None:
        """Point this client at other router addresses (a front following a registry):
        new streams, and the resumes of streams in flight, use them. Safe from another
        thread: the channels are made in the event loop on next use; the old ones stay
        open for the calls still on them until ``close``."""
        conn = self._conn
        if conn is not None and conn[0] is self.addresses:
            self._old += conn[1]
        self.addresses = split_addresses(address)
        self.address = ",".join(self.addresses)

    def _call(self, i: int, request, timeout: Optional[float], metadata: tuple):
        stubs = self._connection()[2]
        return stubs[i % len(stubs)].Generate(request, timeout=timeout, metadata=metadata)

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
               client_id: Optional[str] = None, **kw) -> AsyncStream:
        return AsyncStream(self, build_request(prompt, **kw), self._timeout(timeout), self._md(client_id))

    async def generate(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kw) -> Result:
        s = self.stream(prompt, timeout=timeout, **kw)
        async for _ in s:
            pass
        if s.result is None:
            raise from_rpc_error(_NoFinal())
        return s.result

    async def ready(self, timeout: float = 2.0) -> tuple[bool, str]:
        """``Client.ready`` over this client's channels."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        addresses, chans, _ = self._connection()
        why = []
        for a, ch in zip(addresses, chans):
            try:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=ROUTER_SERVICE), timeout=timeout)
            except grpc.RpcError as e:
                why.append(f"router {a}: {e.code().name}")
                continue
            ok, reason = _health_answer(a, r)
            if ok:
                return True, ""
            why.append(reason)
        return False, "; ".join(why)

    async def generate_n(self, prompt: Optional[str] = None, *, n: int, timeout: Optional[float] = None,
                         **kw) -> list[Result]:
        """``Client.generate_n``, on the event loop."""
        return list(await asyncio.gather(*[self.generate(prompt, timeout=timeout, **k) for k in _children(n, kw)]))

    async def list_strategies(self, timeout: Optional[float] = None) -> router_pb2.ListStrategiesResponse:
        try:
            return await self._get_stub().ListStrategies(router_pb2.ListStrategiesRequest(),
                                                         timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def anticipate(self, conversation_id: str, messages: Sequence[dict], *, max_tokens: int = 0,
                         next_turns: int = 0, wait: bool = False, timeout: Optional[float] = None,
                         cache_salt: str = "") -> router_pb2.AnticipateResponse:
        try:
            return await self._get_stub().Anticipate(
                anticipate_request(conversation_id, messages, max_tokens, next_turns, wait, cache_salt),
                timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        for c in (self._conn[1] if self._conn else []) + self._old:
            await c.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class _Deadline:
    """The call's deadline passed while waiting for a router to resume on."""

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "the deadline passed while the stream waited for a router to resume on"


class _Cancelled:
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "the stream was cancelled"


class _NoFinal:
    """A stream that ended without its final message (a protocol error)."""

    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return "the stream ended without a final message"


__all__ = ["AsyncClient", "AsyncStream", "Client", "Result", "Stream", "build_request"]
