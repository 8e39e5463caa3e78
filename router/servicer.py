"""Router servicer: Generate (server streaming), ListStrategies, Anticipate.

Thin: converts GenerateRequest to a ``GenerateSpec``, starts the generation in
``router.core``, streams its events as GenerateResponse messages, and cancels
it (freeing the session's KV slot and drafter state) when the call ends early:
client cancel or deadline. Anticipate / GetAnticipation queue and report a
conversation's idle-time anticipation (proactive strategy).
``router_service(settings)`` wires the router to its drafter and verifier
replicas at fixed addresses, ``dynamic_router(settings)`` to replica sets
whose members change at run time (``replicas``).

It knows nothing about models, KV caches or acceptance rules.
"""

from __future__ import annotations

from typing import Optional

import grpc

from specmesh.wire import convert
from specmesh.serving.server import Service, peer_channel, time_left
from specmesh.serving.settings import ServeSettings
from specmesh.v1 import router_pb2, router_pb2_grpc

from .core import Delta, GenerateSpec, Resume, Router, monotonic_deadline
from .replicas import DrafterPool, ReplicaSet, drafter_peer


def spec_from_proto(m: router_pb2.GenerateRequest) -> GenerateSpec:
    return GenerateSpec(
        prompt=m.prompt, messages=convert.messages_from_proto(m.messages), strategy=m.strategy, drafter=m.drafter,
        max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else None,
        sampling=convert.sampling_from_proto(m.sampling),
        draft_budget=m.draft_budget if m.HasField("draft_budget") else None, raw_prompt=m.raw_prompt,
        conversation_id=m.conversation_id, reasoning=m.reasoning,
        thinking_budget=m.thinking_budget if m.HasField("thinking_budget") else None, stop=tuple(m.stop),
        resume=Resume(list(m.resume.token_ids), m.resume.text_chars, m.resume.session_id)
        if m.HasField("resume") else None, draft_ahead=m.draft_ahead, prediction=m.prediction,
        tools=convert.tools_from_proto(m.tools), tool_choice=m.tool_choice,
        parallel_tool_calls=m.parallel_tool_calls if m.HasField("parallel_tool_calls") else True,
        cache_salt=m.cache_salt)


def logprobs_to_proto(lps) -> list:
    from specmesh.v1 import common_pb2

    return [common_pb2.TokenLogprob(token_id=x.token_id, logprob=x.logprob, top_ids=[t for t, _ in x.top],
                                    top_logprobs=[v for _, v in x.top], token=x.token, token_bytes=x.token_bytes,
                                    top_tokens=list(x.top_tokens), top_token_bytes=list(x.top_token_bytes))
            for x in lps]


def event_to_proto(ev) -> router_pb2.GenerateResponse:
    if isinstance(ev, Delta):
        d = router_pb2.TokenDelta(token_ids=ev.token_ids, text=ev.text)
        if ev.logprobs:
            d.logprobs.extend(logprobs_to_proto(ev.logprobs))
        return router_pb2.GenerateResponse(delta=d)
    from specmesh.v1 import common_pb2

    return router_pb2.GenerateResponse(final=router_pb2.GenerateFinal(
        text=ev.text, token_ids=ev.token_ids, stats=convert.stats_to_proto(ev.stats), session_id=ev.session_id,
        tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in ev.tool_calls]))


def anticipation_to_proto(d: dict) -> router_pb2.AnticipateResponse:
    return router_pb2.AnticipateResponse(accepted=d["accepted"], detail=d["detail"], state=d["state"],
                                         predicted_turns=d["predicted_turns"], texts=d["texts"], tokens=d["tokens"],
                                         preemptions=d["preemptions"], warm=d["warm"])


def client_of(context) -> str:
    """Who counts against max_sessions_per_client: the x-specmesh-client header, else the peer host."""
    md = dict(context.invocation_metadata() or ())
    if md.get("x-specmesh-client"):
        return str(md["x-specmesh-client"])
    return context.peer().rsplit(":", 1)[0]


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router):
        self.router = router

    def Generate(self, request, context):
        gen = self.router.start(spec_from_proto(request), client_of(context),
                                monotonic_deadline(time_left(context)))
        context.add_callback(gen.cancel)  # fires on every end; a finished generation ignores it
        for ev in gen:
            yield event_to_proto(ev)

    def Anticipate(self, request, context):
        d = self.router.anticipate(request.conversation_id, convert.messages_from_proto(request.messages) or [],
                                   request.max_tokens, request.next_turns, request.wait, time_left(context),
                                   request.cache_salt)
        return anticipation_to_proto(d)

    def GetAnticipation(self, request, context):
        d = self.router.anticipation(request.conversation_id, request.cache_salt)
        if d is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"conversation_id: no anticipation for "
                          f"{request.conversation_id!r}")
        return anticipation_to_proto(d)

    def ListStrategies(self, request, context):
        return router_pb2.ListStrategiesResponse(
            strategies=[router_pb2.StrategyInfo(**d) for d in self.router.strategies()],
            default_strategy=self.router.s.default_strategy, default_drafter=self.router.s.default_drafter)


def _service(router: Router) -> Service:
    return Service(router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
                   router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(router), readiness=router.readiness)


def _codec(settings: ServeSettings, codec):
    if codec is None:
        from .codec import TextCodec

        codec = TextCodec.from_model(settings.model)
    return codec


def router_service(settings: ServeSettings, codec=None) -> tuple[Service, Router]:
    """The Router service over the static replica addresses of ``settings``;
    ``codec`` defaults to the tokenizer of ``settings.model``."""
    codec = _codec(settings, codec)
    replicas = ReplicaSet(lambda a: peer_channel(settings, a), settings.verifier_targets(), settings.replica_choice,
                          block_size=settings.prefix_block)
    target: Optional[str] = settings.drafter_target()
    drafter = None
    if target:
        drafter = drafter_peer(target, peer_channel(settings, target), settings.drafter_backoff_s,
                               settings.drafter_backoff_max_s)
    router = Router(settings, codec, replicas, drafter, codec.vocab_size, settings.token(), _context(settings))
    return _service(router), router


def _context(settings: ServeSettings):
    """The served model's context length, read where a limit defaults from it
    (``serving.limits``); None where every limit is set (the model's config is not read)."""
    if settings.max_seq_len is not None:
        return None
    from specmesh.serving.limits import model_context

    return model_context(settings.model)


def dynamic_router(settings: ServeSettings, codec=None) -> tuple[Service, Router, ReplicaSet, DrafterPool]:
    """The Router service over an empty ``ReplicaSet`` and ``DrafterPool`` whose
    members follow ``set_addresses`` (the Ray router replica, Kubernetes DNS
    discovery). Returns (service, router, verifiers, drafters)."""
    codec = _codec(settings, codec)
    mk = lambda a: peer_channel(settings, a)  # noqa: E731
    verifiers = ReplicaSet(mk, choice=settings.replica_choice, wait_s=min(30.0, settings.verifier_retry_s),
                           block_size=settings.prefix_block)
    drafters = DrafterPool(mk, settings.drafter_backoff_s, settings.drafter_backoff_max_s)
    router = Router(settings, codec, verifiers, drafters.peer, codec.vocab_size, settings.token(), _context(settings))
    return _service(router), router, verifiers, drafters
