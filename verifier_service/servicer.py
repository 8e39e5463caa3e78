"""Verifier servicer: Prefill / Verify / Decode / Release / Info over an ``EngineVerifier``.

Thin: it converts protos to domain requests, sends Verify calls (and each step
of a Decode stream: plain decoding ahead of the router) through the
dynamic batcher (one forward for concurrent sessions) and every other piece of
model work to the batcher's model thread (``VerifyBatcher.call``), and converts the results
back. Sessions, KV slots (LRU eviction, RESOURCE_EXHAUSTED when none can be
evicted), validation and acceptance all live in ``specmesh.verifier``; errors
become status codes in the interceptors. A self-draft method ("layerskip", or a
context-only drafter it hosts for external requests: ``verifier_drafters``) is
whatever the verifier has registered in ``self_drafters``.

It knows nothing about tokenizers, strategies or the router.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from specmesh.seeding import round_seed
from specmesh.wire import convert
from specmesh.wire.convert import check_session_id
from specmesh.serving.server import Service, time_left
from specmesh.serving.settings import MiB, ServeSettings
from specmesh.types import InvalidArgument, SelfDraft, VerifyRequest
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from .batcher import VerifyBatcher

class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier, batcher: VerifyBatcher):
        self.verifier = verifier
        self.batcher = batcher
        self.decode_steps = 0  # steps answered on Decode streams (Info)
        self.decode_abandoned = 0  # Decode streams whose caller went away (cancel, deadline) before they ended
        self._decoding: dict[str, int] = {}  # session -> its Decode handlers still running
        self._decode_cv = threading.Condition()

    def Prefill(self, request, context):
        sid = check_session_id(request.session_id)
        if request.fork_from:
            if len(request.tokens):
                raise InvalidArgument("tokens", "must be empty when fork_from is set")
            n = self.batcher.call(self.verifier.fork, check_session_id(request.fork_from), sid, request.fork_len)
            return verifier_pb2.PrefillResponse(cache_len=n)
        tokens = list(request.tokens)
        if not tokens:
            raise InvalidArgument("tokens", "must be non-empty (or fork_from set)")
        salt = convert.check_salt(request.cache_salt)
        if not hasattr(self.verifier, "prefill_need"):  # a verifier without chunked prefill: in one forward
            n = self.batcher.call(self.verifier.prefill, sid, tokens, salt)
            return verifier_pb2.PrefillResponse(cache_len=n)
        # through the batcher: a long prompt goes in chunks between the streams' rounds, from its cached prefix
        try:
            res = self.batcher.verify(VerifyRequest(sid, 0, tokens, cache_salt=salt), timeout=time_left(context),
                                      alive=context.is_active)
        except InvalidArgument as e:
            raise InvalidArgument("tokens", str(e).split(": ", 1)[-1]) if e.field == "append_tokens" else e
        return verifier_pb2.PrefillResponse(cache_len=res.cache_len)

    def Verify(self, request, context):
        t0 = time.perf_counter()
        check_session_id(request.session_id)
        res = self.batcher.verify(convert.verify_request_from_proto(request), timeout=time_left(context),
                                 alive=context.is_active)
        return convert.verify_result_to_proto(res, (time.perf_counter() - t0) * 1e3)

    def Decode(self, requests, context):
        """Decoding ahead of the router (``Verifier/Decode``): each step is the Verify
        the router would send next (without a draft, or with the stream's self-draft
        budget), through the same batcher, so its tokens are that round's; streamed as
        it is decided. Its messages are read as they come, on a thread of the stream's
        own: the first opens the stream and grants its first ``max_steps``; later ones
        grant more and may change the self-draft budget from the next step; the verifier
        never decodes past its grants. Ends when the caller has closed its side with
        every granted step decoded, after a stop token, when the generation's tokens
        are all produced, or when the caller cancels (checked before every step)."""
        inbox: "queue.SimpleQueue" = queue.SimpleQueue()  # the caller's messages, as they arrive
        threading.Thread(target=_read_into, args=(requests, inbox), daemon=True, name="decode-grants").start()
        request = inbox.get()
        if request is None:
            raise InvalidArgument("request", "the stream closed before its first DecodeRequest")
        if isinstance(request, BaseException):
            raise request
        check_session_id(request.session_id)
        if request.max_steps < 1:
            raise InvalidArgument("max_steps", f"must be >= 1, got {request.max_steps}")
        sid, stops = request.session_id, set(request.stop_ids)
        keep, append = request.sync.keep_len, list(request.sync.append_tokens)
        sampling = convert.sampling_from_proto(request.sampling)  # checked once, every step's
        salt = convert.check_salt(request.cache_salt)
        draft = _self_draft(request)
        left = request.tokens_left if request.tokens_left > 0 else None  # caps the draft near the end
        granted, closed = request.max_steps, False
        ended = threading.Event()  # set when this handler ends of itself
        context.add_callback(lambda: ended.is_set() or self._abandoned())  # on every end of the call
        with self._decode_cv:
            self._decoding[sid] = self._decoding.get(sid, 0) + 1
        try:
            while True:
                while not closed:  # what the caller sent: waited for only when no step is granted
                    try:
                        more = inbox.get(block=granted == 0)
                    except queue.Empty:
                        break
                    if more is None:  # closed its side (or went away)
                        closed = True
                    elif isinstance(more, BaseException):
                        raise more
                    else:
                        granted += _grant(more)
                        if more.HasField("self_draft"):
                            draft = _self_draft(more)
                if granted == 0 or (left is not None and left <= 0) or not context.is_active():
                    return  # nothing granted, the generation's tokens all produced, or the caller gone
                t0 = time.perf_counter()
                n = keep + len(append)  # the committed length, the pending token included
                sd = draft
                if sd is not None and left is not None and sd.budget > left - 1:
                    sd = SelfDraft(sd.method, left - 1) if left > 1 else None
                step = VerifyRequest(sid, keep, append, sampling=sampling, round_seed=round_seed(sampling.seed, n),
                                     self_draft=sd, want_entropy=request.want_entropy,
                                     prompt_len=request.prompt_len if request.HasField("prompt_len") else -1,
                                     jump_forward=request.jump_forward, cache_salt=salt)
                res = self.batcher.verify(step, timeout=time_left(context), alive=context.is_active)
                granted -= 1
                with self._decode_cv:
                    self.decode_steps += 1
                yield convert.verify_result_to_proto(res, (time.perf_counter() - t0) * 1e3)
                if res.next_token in stops or stops.intersection(res.accepted):
                    return
                keep, append = n + len(res.accepted), [res.next_token]
                if left is not None:
                    left -= len(res.accepted) + 1
        finally:
            ended.set()
            with self._decode_cv:
                self._decoding[sid] -= 1
                if not self._decoding[sid]:
                    del self._decoding[sid]
                self._decode_cv.notify_all()

    def _abandoned(self) -> None:
        """A Decode stream's caller went away while its handler ran: counted the moment
        gRPC learns it (the handler stops before its next step)."""
        with self._decode_cv:
            self.decode_abandoned += 1

    def Release(self, request, context):
        sid = check_session_id(request.session_id)
        # a Decode stream the caller cancelled may still finish the step it decoded ahead: let it end
        # first, so nothing of the session runs (or is counted) after its Release
        t = time_left(context)
        with self._decode_cv:
            self._decode_cv.wait_for(lambda: sid not in self._decoding, timeout=5.0 if t is None else min(t, 5.0))
        held = self.verifier.slot_of(sid) is not None
        self.batcher.call(self.verifier.release, sid)
        self.batcher.forget(sid)
        return common_pb2.ReleaseResponse(released=held)

    def Info(self, request, context):
        d = self.verifier.info()
        fields = verifier_pb2.VerifierInfo.DESCRIPTOR.fields_by_name
        m = verifier_pb2.VerifierInfo(**{k: v for k, v in d.items() if k in fields})
        m.max_tree_nodes = self.verifier.max_tree_nodes
        b = self.batcher.info()
        m.batches, m.batched_requests, m.max_batch_seen = b["batches"], b["batched_requests"], b["max_batch_seen"]
        m.decode_steps = self.decode_steps
        m.prefill_steps = b.get("prefill_steps", 0)
        return m


def _read_into(requests, inbox) -> None:
    """A Decode stream's messages into ``inbox`` as they arrive, then None (the caller
    closed its side or the call ended); an error the request side raised (a message
    over the size limit) is passed on for the handler to raise."""
    try:
        for m in requests:
            inbox.put(m)
    except grpc.RpcError:
        pass
    except Exception as e:  # noqa: BLE001 - raised by the handler, whose status the caller gets
        inbox.put(e)
    inbox.put(None)


def _self_draft(m):
    """A DecodeRequest's self-draft budget as the steps' SelfDraft (None: no draft)."""
    if not m.HasField("self_draft") or m.self_draft.budget == 0:
        return None
    if m.self_draft.budget < 0:
        raise InvalidArgument("self_draft.budget", f"must be >= 0, got {m.self_draft.budget}")
    return SelfDraft(m.self_draft.method, m.self_draft.budget)


def _grant(more) -> int:
    """The steps a later DecodeRequest grants (it sets max_steps >= 0 and self_draft, no
    other field, and at least one of them)."""
    others = [f.name for f, _ in more.ListFields() if f.name not in ("max_steps", "self_draft")]
    if others:
        raise InvalidArgument("DecodeRequest", f"a later message sets only max_steps and self_draft; it set {others}")
    if more.max_steps < 0 or (more.max_steps == 0 and not more.HasField("self_draft")):
        raise InvalidArgument("max_steps", f"a grant must be >= 1, got {more.max_steps}")
    return more.max_steps


def verifier_service(settings: ServeSettings, verifier=None, thread=None) -> tuple[Service, VerifyBatcher]:
    """The Verifier service over ``verifier`` (default: a Runtime from ``settings`` on
    ``settings.device``, with the self drafters, loaded on the process's model thread,
    where every forward then runs) and its batcher (stop it after the server). A
    ``verifier`` of the caller's runs on ``thread`` (the ``ModelThread`` it was loaded
    on; None: a thread of the batcher's own)."""
    if verifier is None:
        from specmesh.runtime import Runtime
        from specmesh.serving import limits
        from specmesh.threads import model_thread

        thread = model_thread(settings.model_threads("verifier"))
        seq = limits.resolve(settings, limits.model_context(settings.model)).max_seq_len  # the model's, by default
        rt = thread.run(Runtime, settings.model, dtype=settings.dtype, n_slots=settings.n_slots,
                        max_seq_len=seq, draft_model=settings.draft_model,
                        layerskip_exit=settings.layerskip_exit, quiet=True, device=settings.device,
                        cuda_graphs=settings.cuda_graphs)
        verifier = rt.verifier
    verifier.max_tree_nodes = settings.max_tree_nodes
    if settings.verifier_drafters and hasattr(verifier, "host_context_drafters") and not verifier.context_drafters:
        from specmesh.drafters import make_drafter

        verifier.host_context_drafters({d: make_drafter(d) for d in settings.verifier_drafters})
    if hasattr(verifier, "configure_prefix_cache"):  # refused here, at start-up, when the budget is too small
        run = thread.run if thread is not None else (lambda f, *a: f(*a))
        run(verifier.configure_prefix_cache, settings.prefix_cache, int(settings.prefix_cache_mib * MiB),
            settings.prefix_block)
    batcher = VerifyBatcher(verifier, settings.batch_window_ms, settings.max_batch, thread=thread,
                            prefill_chunk=settings.prefill_chunk, stall_ratio=settings.prefill_stall_ratio)
    svc = Service(verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
                  verifier_pb2_grpc.add_VerifierServicer_to_server, VerifierServicer(verifier, batcher))
    return svc, batcher
