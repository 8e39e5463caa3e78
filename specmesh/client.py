"""The client SDK of the router: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    c = specmesh.Client("127.0.0.1:50051")
    r = c.generate("Write a haiku", strategy="external", drafter="prompt_lookup", max_new_tokens=64)
    print(r.text, r.stats.tau)
    s = c.stream("Tell me a story", temperature=0.7, seed=1)
    for piece in s:
        print(piece, end="", flush=True)
    print(s.result.stats.finish_reason)

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

from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Optional, Sequence

import grpc

from .errors import from_rpc_error
from .serving.channels import channel, channel_credentials
from .serving.convert import RouterStats, messages_to_proto, stats_from_proto
from .v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: RouterStats
    session_id: str = ""

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def build_request(prompt: Optional[str] = None, *, messages: Optional[Sequence[dict]] = None, strategy: str = "",
                  drafter: str = "", max_new_tokens: Optional[int] = None, temperature: Optional[float] = None,
                  top_p: Optional[float] = None, top_k: Optional[int] = None, seed: Optional[int] = None,
                  acceptance: Optional[str] = None, acceptance_params: Optional[dict] = None,
                  draft_budget: Optional[int] = None,
                  raw_prompt: bool = False, conversation_id: str = "", reasoning: bool = False,
                  thinking_budget: Optional[int] = None, stop: Sequence[str] = ()) -> router_pb2.GenerateRequest:
    """A GenerateRequest; unset options take the router's defaults (the router validates).
    ``acceptance_params``: the rule's parameters by their SamplingParams names
    (typical_epsilon, typical_delta, lenience, accept_top_k, cd_alpha, cd_beta, cd_amateur, jsd_threshold)."""
    sp = common_pb2.SamplingParams()
    if temperature is not None:
        sp.temperature = temperature
    if top_p is not None:
        sp.top_p = top_p
    if top_k is not None:
        sp.top_k = top_k
    if seed is not None:
        sp.seed = seed
    if acceptance is not None:
        sp.acceptance = acceptance
    for k, v in (acceptance_params or {}).items():
        setattr(sp, k, v)  # an unknown name raises AttributeError before anything is sent
    req = router_pb2.GenerateRequest(prompt=prompt or "", messages=messages_to_proto(messages), strategy=strategy,
                                     drafter=drafter, sampling=sp, raw_prompt=raw_prompt,
                                     conversation_id=conversation_id, reasoning=reasoning)
    if thinking_budget is not None:
        req.thinking_budget = thinking_budget
    req.stop.extend([stop] if isinstance(stop, str) else list(stop))  # the output ends before the first one
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    if draft_budget is not None:
        req.draft_budget = draft_budget
    return req


def anticipate_request(conversation_id: str, messages: Sequence[dict], max_tokens: int = 0, next_turns: int = 0,
                       wait: bool = False) -> router_pb2.AnticipateRequest:
    return router_pb2.AnticipateRequest(conversation_id=conversation_id, messages=messages_to_proto(messages),
                                        max_tokens=max_tokens, next_turns=next_turns, wait=wait)


class _Collector:
    """Folds GenerateResponse messages into text deltas and the final Result."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.result: Optional[Result] = None

    def feed(self, resp: router_pb2.GenerateResponse) -> str:
        if resp.HasField("final"):
            f = resp.final
            self.result = Result(f.text, list(f.token_ids), stats_from_proto(f.stats), f.session_id)
            return ""
        self.token_ids += resp.delta.token_ids
        return resp.delta.text

    @property
    def stats(self) -> Optional[RouterStats]:
        return self.result.stats if self.result else None


class Stream(_Collector):
    """Iterate for text deltas; ``result`` / ``stats`` are set after the last one."""

    def __init__(self, call):
        super().__init__()
        self._call = call

    def __iter__(self) -> Iterator[str]:
        try:
            for resp in self._call:
                text = self.feed(resp)
                if text:
                    yield text
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def cancel(self) -> None:
        """Cancel the call; the router frees the session."""
        self._call.cancel()


class AsyncStream(_Collector):
    def __init__(self, call):
        super().__init__()
        self._call = call

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for resp in self._call:
                text = self.feed(resp)
                if text:
                    yield text
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def cancel(self) -> None:
        self._call.cancel()


class _Base:
    def __init__(self, address: str = DEFAULT_ADDRESS, token: Optional[str] = None, root_certificates=None,
                 timeout: Optional[float] = None, *, private_key=None, certificate_chain=None,
                 tls: Optional[bool] = None, client_id: Optional[str] = None, options: Sequence = ()):
        self.address, self.timeout = address, timeout
        if tls is None:
            tls = root_certificates is not None or certificate_chain is not None
        self._creds = channel_credentials(root_certificates, private_key, certificate_chain) if tls else None
        self._options = list(options)
        md = []
        if token:
            md.append(("authorization", f"Bearer {token}"))
        self._auth = tuple(md)
        if client_id:
            md.append(("x-specmesh-client", client_id))
        self._metadata = tuple(md)

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _md(self, client_id: Optional[str]) -> tuple:
        """Call metadata; a per-call ``client_id`` replaces the client's own (the key of
        the router's max_sessions_per_client, e.g. the HTTP peer behind a front end)."""
        return self._metadata if not client_id else self._auth + (("x-specmesh-client", client_id),)


class Client(_Base):
    """Blocking client of the Router service (see module docstring)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._channel = channel(self.address, self._creds, options=self._options)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
               client_id: Optional[str] = None, **kw) -> Stream:
        """Start a generation; iterate the returned Stream for text deltas."""
        call = self._stub.Generate(build_request(prompt, **kw), timeout=self._timeout(timeout),
                                   metadata=self._md(client_id))
        return Stream(call)

    def generate(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kw) -> Result:
        """Run a generation to the end: Result(text, token_ids, stats)."""
        s = self.stream(prompt, timeout=timeout, **kw)
        for _ in s:
            pass
        if s.result is None:
            raise from_rpc_error(_NoFinal())
        return s.result

    def list_strategies(self, timeout: Optional[float] = None) -> router_pb2.ListStrategiesResponse:
        try:
            return self._stub.ListStrategies(router_pb2.ListStrategiesRequest(), timeout=self._timeout(timeout),
                                             metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def anticipate(self, conversation_id: str, messages: Sequence[dict], *, max_tokens: int = 0, next_turns: int = 0,
                   wait: bool = False, timeout: Optional[float] = None) -> router_pb2.AnticipateResponse:
        """Let the router prepare the conversation's next turn while it is idle
        (``wait``: return when that is done)."""
        try:
            return self._stub.Anticipate(anticipate_request(conversation_id, messages, max_tokens, next_turns, wait),
                                         timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def get_anticipation(self, conversation_id: str, timeout: Optional[float] = None) -> router_pb2.AnticipateResponse:
        try:
            return self._stub.GetAnticipation(router_pb2.GetAnticipationRequest(conversation_id=conversation_id),
                                              timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio) with the same API; ``stream`` returns an async iterator."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._channel = None
        self._stub = None

    def _get_stub(self):
        if self._stub is None:  # created inside the running event loop
            self._channel = channel(self.address, self._creds, aio=True, options=self._options)
            self._stub = router_pb2_grpc.RouterStub(self._channel)
        return self._stub

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None,
               client_id: Optional[str] = None, **kw) -> AsyncStream:
        call = self._get_stub().Generate(build_request(prompt, **kw), timeout=self._timeout(timeout),
                                         metadata=self._md(client_id))
        return AsyncStream(call)

    async def generate(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kw) -> Result:
        s = self.stream(prompt, timeout=timeout, **kw)
        async for _ in s:
            pass
        if s.result is None:
            raise from_rpc_error(_NoFinal())
        return s.result

    async def list_strategies(self, timeout: Optional[float] = None) -> router_pb2.ListStrategiesResponse:
        try:
            return await self._get_stub().ListStrategies(router_pb2.ListStrategiesRequest(),
                                                         timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def anticipate(self, conversation_id: str, messages: Sequence[dict], *, max_tokens: int = 0,
                         next_turns: int = 0, wait: bool = False,
                         timeout: Optional[float] = None) -> router_pb2.AnticipateResponse:
        try:
            return await self._get_stub().Anticipate(
                anticipate_request(conversation_id, messages, max_tokens, next_turns, wait),
                timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class _NoFinal:
    """A stream that ended without its final message (a protocol error)."""

    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return "the stream ended without a final message"


__all__ = ["AsyncClient", "AsyncStream", "Client", "Result", "Stream", "build_request"]
