"""Drafter servicer: Propose / Release / Info over a ``DrafterHost``.

Thin: converts protos to the host's arguments and the draft tree back.
Validation and session state live in ``host``; errors become status codes in
the interceptors. ``drafter_service(settings)`` builds the host with the core
drafters (prompt_lookup, suffix, the cache drafter and, loaded on first use,
adaptive_lookup with the target's embedding table and draft_lm, on
``settings.device``) and, when the model has a trained block drafter, ``block`` /
``block_tree`` (loaded at start, on ``settings.device``), which read the
target's hidden features sent with each Propose. ``Seed`` adds
texts to a draft cache. ``ProposeAhead`` drafts the next round of a token-only
drafter's session while the router verifies this one (``host.propose_ahead``,
``specmesh.ahead``); the next ``Propose`` answers from it on a hit and says so. With
``return_first`` it answers once the first ahead round ("all accepted") is drafted and
carries it, so the router uses it without a Propose when that outcome happens.

It knows nothing about the verifier, strategies or tokenizers.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from specmesh.wire import convert
from specmesh.wire.convert import check_session_id
from specmesh.serving.server import Service, time_left
from specmesh.serving.settings import ServeSettings
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

from .host import DrafterHost

FIRST_WAIT_S = 10.0  # ProposeAhead(return_first): the longest a handler waits for the first ahead round


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, host: DrafterHost, max_waiting: int = 16):
        """``max_waiting``: ProposeAhead handlers that may wait for their first ahead round
        at once (the rest answer at once without it), so waiting handlers never take the
        threads a Propose needs (``drafter_service`` passes half the handler threads)."""
        self.host = host
        self._waiting = threading.BoundedSemaphore(max(1, max_waiting))

    def Propose(self, request, context):
        t0 = time.perf_counter()
        sampling = convert.sampling_from_proto(request.sampling)
        feats = convert.features_from_proto(request.features) if request.HasField("features") else None
        tree, held, draft_ms, ahead = self.host.propose_info(
            check_session_id(request.session_id), request.drafter, request.sync.keep_len,
            list(request.sync.append_tokens), request.prompt_len, sampling, request.budget, request.cache_id, feats)
        return drafter_pb2.ProposeResponse(tree=convert.tree_to_proto(tree), held_len=held, draft_ms=draft_ms,
                                           server_ms=(time.perf_counter() - t0) * 1e3, source=tree.source,
                                           ahead=convert.ahead_to_proto(ahead))

    def ProposeAhead(self, request, context):
        t0 = time.perf_counter()
        held = self.host.propose_ahead(
            check_session_id(request.session_id), request.drafter, request.sync.keep_len,
            list(request.sync.append_tokens), request.prompt_len, convert.sampling_from_proto(request.sampling),
            convert.tree_from_proto(request.tree), request.budget, request.cache_id)
        resp = drafter_pb2.ProposeAheadResponse(held_len=held)
        if request.return_first and self._waiting.acquire(blocking=False):
            try:  # wait for the "all accepted" round (bounded by the call's deadline)
                left = time_left(context)
                first = self.host.first_round(request.session_id, request.drafter, held,
                                              FIRST_WAIT_S if left is None else max(0.0, min(FIRST_WAIT_S, left - 0.05)))
            finally:
                self._waiting.release()
            if first is not None:
                assumed, tree, info = first
                resp.first_assumed.extend(assumed)
                resp.first_tree.CopyFrom(convert.tree_to_proto(tree))
                resp.first.CopyFrom(convert.ahead_to_proto(info))
        resp.server_ms = (time.perf_counter() - t0) * 1e3
        return resp

    def Release(self, request, context):
        released = self.host.release(check_session_id(request.session_id), request.finished,
                                     request.sync.keep_len, list(request.sync.append_tokens), request.prompt_len)
        return common_pb2.ReleaseResponse(released=released)

    def Info(self, request, context):
        d = self.host.info()
        feats = [drafter_pb2.FeatureDrafter(**f) for f in d.pop("feature_drafters")]
        return drafter_pb2.DrafterInfo(**d, feature_drafters=feats)

    def Seed(self, request, context):
        texts, tokens = self.host.seed(request.cache_id, [list(t.tokens) for t in request.texts], request.ttl_s,
                                       request.replace)
        return drafter_pb2.SeedResponse(texts=texts, tokens=tokens)


def default_factories(settings: ServeSettings) -> dict:
    from specmesh.drafters import CacheDrafter, PromptLookupDrafter, SuffixDrafter
    from specmesh.types import InvalidArgument

    def draft_lm():
        from specmesh.drafters.model_drafters import DraftLMDrafter
        from specmesh.runtime import default_draft_model, make_draft_engine
        from specmesh.serving import limits

        path = settings.draft_model or str(default_draft_model(settings.model))
        seq = limits.resolve(settings, limits.model_context(settings.model)).max_seq_len  # the target's context
        return DraftLMDrafter(make_draft_engine(path, settings.dtype, settings.n_slots, seq, settings.device,
                                                settings.cuda_graphs, settings.draft_head_rows))

    def adaptive_lookup():
        from specmesh.drafters.adaptive_lookup import AdaptiveLookupDrafter, embedding_table
        from specmesh.models.loading import ModelNotFound, load_config, resolve_model

        try:  # the target's input embedding table, read alone from its safetensors
            return AdaptiveLookupDrafter(embeddings=embedding_table(settings.model))
        except (ModelNotFound, InvalidArgument, OSError):
            cfg = load_config(resolve_model(settings.model, quiet=True))
            return AdaptiveLookupDrafter(vocab_size=int(cfg["vocab_size"]))  # hashed bag-of-tokens sketch

    out = {"prompt_lookup": PromptLookupDrafter, "suffix": SuffixDrafter, "draft_lm": draft_lm,
           "adaptive_lookup": adaptive_lookup, "cache": CacheDrafter}
    out.update(block_factories(settings))
    return out


def block_factories(settings: ServeSettings) -> dict:
    """``block`` and ``block_tree`` (chain and tree of one model, sharing its weights) when
    the model has a trained block drafter (``runtime.block_drafter_path``), on
    ``settings.device``; the target's embeddings, final norm and head are read alone from
    the same model alias's safetensors. Empty without a checkpoint."""
    from specmesh.runtime import block_drafter_path

    ckpt = block_drafter_path(settings.model)
    if ckpt is None:
        return {}
    made: dict = {}

    def make(tree: bool):
        def build():
            if "chain" not in made:
                from specmesh.blockdraft.serve import BlockFeatureDrafter, target_head_state
                from specmesh.engine.device import resolve_device

                made["chain"] = BlockFeatureDrafter.from_checkpoint(
                    ckpt, target_head_state(settings.model), device=resolve_device(settings.device))
            return made["chain"].twin(True) if tree else made["chain"]
        return build

    return {"block": make(False), "block_tree": make(True)}


def preload_draft_lm(settings: ServeSettings) -> bool:
    """``settings.preload_draft_lm``; None: when the draft LM is a model of its own (the
    target's paired draft model, or ``draft_model`` set), not the cheap layer subset."""
    if settings.preload_draft_lm is not None:
        return settings.preload_draft_lm
    return bool(draft_model_name(settings))


def draft_model_name(settings: ServeSettings) -> str:
    """The draft LM's name: ``draft_model``, else the target's paired draft model, else
    "" (the stand-in: a layer subset of the target)."""
    from specmesh.models.loading import PAIRED_DRAFT_MODELS

    return settings.draft_model or PAIRED_DRAFT_MODELS.get(settings.model.lower(), "")


def drafter_service(settings: ServeSettings, vocab_size: Optional[int] = None,
                    factories: Optional[dict] = None) -> Service:
    if vocab_size is None:
        from specmesh.models.loading import load_config, resolve_model

        vocab_size = int(load_config(resolve_model(settings.model, quiet=True))["vocab_size"])
    run = None
    if factories is None:  # the service's own drafters: built and run on the process's model thread
        from specmesh.threads import model_thread

        run = model_thread(settings.model_threads("drafter")).run
    host = DrafterHost(factories or default_factories(settings), vocab_size, settings.max_drafter_sessions,
                       settings.max_tree_nodes, run=run)
    host.ahead_options = dict(width=settings.draft_ahead_width, max_outcomes=settings.draft_ahead_outcomes,
                              ttl_s=settings.draft_ahead_ttl_s)
    host.feature_drafters()  # load the block drafter now: its first Info and Propose would wait for it
    if preload_draft_lm(settings) and "draft_lm" in host.factories:
        # and a real draft LM (loading it can take longer than a drafter call's deadline), measured: Info names it,
        # so the router's auto strategy tries it, and gives its speed, which the router's deadline follows
        host.load_draft_model(draft_model_name(settings))
    return Service(drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
                   drafter_pb2_grpc.add_DrafterServicer_to_server, DrafterServicer(host, settings.workers // 2))
