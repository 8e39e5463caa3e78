"""The router's strategy plumbing: which strategy a request gets, and how each
one's drafter, verifier and rounds are put together over the remote services.

- ``resolve`` validates the strategy/drafter fields and, for ``auto``, asks
  ``specmesh.strategies.auto.choose`` with the request's features (prompt
  length, turns, copy cues, reasoning, a ready anticipation, drafter health,
  layer-skip calibration, whether the verifiers have the trained block drafter)
  and the session's live stats. A ``self`` request without a drafter gets
  the block drafter's tree ``block_tree`` (``auto.BLOCK_SELF``; else its chain) when every
  verifier replica lists it in ``Verifier/Info``
  ``self_drafters`` (looked up lazily, cached ``SELF_INFO_TTL_S``), else
  ``layerskip``; ``default_drafters()`` says what each strategy defaults to
  (``ListStrategies``).
- ``Run`` (from ``Strategies.prepare``) owns one generation's adapters:
  ``external`` (a remote drafter; trees depth-capped by the target's entropy
  under adaptive budgets), ``self`` (in-verifier drafting), ``proactive`` (the
  conversation's draft cache, and its warm KV session when the anticipation
  left one), ``ssr`` and any request with reasoning on (the two-phase driver of
  ``specmesh.strategies.ssr``; SSR adds side branches on separate verifier
  sessions and seeds a per-request cache on the drafter service).
  ``Run.finish`` fills the cache/warm stats, feeds the session book (EMA of τ
  and measured speedup per session and strategy) and, with
  ``auto_anticipate``, queues the finished turn's anticipation.
- An ``external`` drafter that needs the target's hidden features (the
  registry's ``needs_features``: ``block``, ``block_tree``) gets a ``FeatureLog``
  shared by the generation's ``RemoteVerifier`` (asks for the layers the drafter
  service lists in ``DrafterInfo.feature_drafters``, looked up lazily and cached
  like the verifiers' self drafters) and ``RemoteDrafter`` (forwards the rows).
- ``RemoteBackend`` is the proactive worker's backend over the services.

Every real request enters the anticipation ``Gate`` for its whole life, so idle
work stops at its next round. Knows nothing about protos or servers.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence

from specmesh.ahead import OverlapPolicy
from specmesh.drafters import registry
from specmesh.seqs import common_prefix_len
from specmesh.loop import AdaptiveBudget, BudgetPolicy, LoopOptions, VerifyCosts, speculative_generate
from specmesh.wire import convert
from specmesh.strategies import auto
from specmesh.strategies.adapt import CacheMeter, ResumePrefix, TreeBudget
from specmesh.strategies.proactive import Anticipator, Config, Gate, cache_id
from specmesh.strategies.ssr import ThinkFormat, reasoning_generate
from specmesh.types import InvalidArgument

from .adapters import (Calls, DrafterFacts, FeatureLog, RemoteDrafter, RemoteVerifier, drafter_facts, prefill_session,
                       release_session, seed_cache, verifier_drafter_names)
from .replicas import Peer, ReplicaSet

log = logging.getLogger("specmesh.router")

STRATEGIES = {
    "autoregressive": "plain decoding through the verifier (baseline and fallback)",
    "external": "a drafter service proposes, the verifier verifies (drafter: " + " | ".join(registry.EXTERNAL)
                + "; block and block_tree are the trained block drafter on the drafter service, fed the target's "
                  "hidden features through the router). " + registry.DRAFT_LM_NOTE,
    "self": "drafting inside the verifier with the target's own hidden states (no drafter hop): block_tree "
            "(the trained block drafter's tree; default when the verifier has it: 1.50-1.65x plain in bf16 on "
            "open writing / chat), block (its chain: 1.32-1.45x there), or layerskip (the target's first "
            "layers; untrained, <= 0.96x: the default only without a block drafter). A request with acceptance "
            "divergence that names no drafter gets specialist (the verifier's domain specialist) instead, whether "
            "it names self, auto or no strategy",
    "proactive": "drafts from the conversation's anticipation cache (replies pre-generated while it was idle) "
                 "and continues its warm KV; needs conversation_id",
    "ssr": "reasoning: early answers from partial thinking seed a cache that drafts the final answer",
    "auto": "picks one of the above from the request's features and the session's measured speedups: "
            "suffix decoding where the answer reuses the prompt or conversation, self block_tree on fresh text "
            "when the verifier has the trained block drafter, else the draft LM where the drafter service runs a "
            "real draft model (the target's paired one), kept where it measures faster, speculation off where a "
            "choice measured a slowdown "
            "(the router's default strategy unless --default-strategy says otherwise; acceptance divergence: "
            "self specialist)",
}
EXTERNAL_DRAFTERS = registry.EXTERNAL  # what an `external` request may name
FEATURE_DRAFTERS = registry.EXTERNAL_FEATURES  # of those, the ones fed the target's hidden features
CHEAP_DRAFTERS = registry.FREE  # drafts cost next to nothing: full length, capped by entropy
SELF_DRAFTERS = registry.SELF  # block*: the trained block drafter, when the verifier has it
FUSED = registry.FUSED  # self drafters whose draft comes out of the last verify forward
# an external drafter's rounds go on a Decode stream from the 3rd without a draft in a row: drafting has
# stopped (its budget policy turned it off), not paused for a round (a lookup that found nothing), so the
# step decoded ahead that a switch back to drafting drops is rare
DECODE_AFTER = 3
# ... and the verifier decodes at most this many steps past what the router read on a stream of theirs
# (adapters.DecodeStream grants more as the router reads, so the stream never stops for it): where the
# verifier outruns the router, a switch back to drafting drops no more. (Until 2026-12-06 a stream ran 8
# steps and the next was opened: under load each new stream's first step missed the batch the others
# were in, 16 streams of self:block_tree ran 11.6 sessions a forward against 13.3 with unbounded streams.)
DECODE_LEAD = 8
DRAFTER_TIMEOUT_S = 2.0  # a drafter call's deadline unless drafter_timeout_s says otherwise (plus a draft LM's work)
THINK_DRAFTER = "suffix"  # drafts the thinking of ssr requests (and their side branches)
SSR_CACHE_TTL_S = 300.0
SELF_INFO_TTL_S = 30.0  # how long the verifiers' self-drafter list is trusted
SELF_INFO_RETRY_S = 2.0  # after a look-up that no replica answered
SELF_INFO_TIMEOUT_S = 2.0


def default_self_drafter(available) -> str:
    """The ``self`` strategy's drafter when a request names none: the trained block
    drafter where the verifiers have it (its tree, ``auto.BLOCK_SELF``, measured
    fastest; its chain where only that is listed), else layer-skip (always there, but
    untrained it does not pay)."""
    for name in (auto.BLOCK_SELF, "block_tree", "block"):
        if name in available:
            return name
    return "layerskip"


def tenant_key(cache_salt: str) -> str:
    """The prefix cache's key of a request's tenant (``GenerateRequest.cache_salt``): a
    digest, so the verifiers hold no client's salt (a user id, say) and every key has one
    size; "" for none (the shared cache)."""
    if not cache_salt:
        return ""
    return hashlib.sha256(b"specmesh-cache-salt\0" + cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def scoped_conversation(conversation_id: str, cache_salt: str) -> str:
    """A conversation id as the router keys it: its tenant's own (two tenants naming the same
    id share no anticipation, warm KV, draft cache or measurements); unchanged without a salt."""
    if not conversation_id or not cache_salt:
        return conversation_id
    return "t:" + hashlib.sha256(f"{tenant_key(cache_salt)}/{conversation_id}".encode("utf-8", "surrogatepass")
                                 ).hexdigest()[:40]


def jump_forward(plan) -> bool:
    """A grammar's forced tokens are free drafts for every strategy but plain decoding
    asked for by name (the baseline); auto's plain decoding keeps them."""
    return plan.strategy != "autoregressive" or plan.reason.startswith("auto")


def drafter_timeout(s) -> float:
    """A drafter call's deadline: ``drafter_timeout_s``, else ``DRAFTER_TIMEOUT_S`` (to which a
    real draft model's calls add their measured work: ``adapters.DraftSpeed``)."""
    return s.drafter_timeout_s if s.drafter_timeout_s is not None else DRAFTER_TIMEOUT_S


def _drafter_up(parts: Collaborators) -> bool:
    return parts.drafter is not None and parts.drafter.health.available()


@dataclass
class Resolved:
    strategy: str
    reason: str
    drafter: Optional[str]
    self_draft: Optional[str]


@dataclass(frozen=True)
class Collaborators:
    """What the strategy runner works with (the router builds it): the router's
    settings, its text codec, the verifier replicas, the drafter service's peer
    (None: no drafter service), the vocabulary size and the peers' bearer token."""

    s: object  # ServeSettings
    codec: object
    replicas: ReplicaSet
    drafter: Optional[Peer]
    vocab_size: int
    token: Optional[str] = None


class RemoteBackend:
    """``proactive.Backend`` over the router's services (runs in the worker thread)."""

    def __init__(self, parts: Collaborators):
        self.parts = parts
        self.stop_ids = list(parts.codec.stop_ids)
        self._where: dict[str, object] = {}  # warm session -> replica peer

    def _calls(self) -> Calls:
        return Calls(self.parts.token, self.parts.s.verifier_timeout_s)

    def encode(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        if generation_prompt:
            return list(self.parts.codec.encode(None, messages))
        return list(self.parts.codec.chat_ids(messages, add_generation_prompt=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.parts.codec.decode(list(ids))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, session_id: str,
                 cache_salt: str = "") -> Iterator[list[int]]:
        r = self.parts
        calls = self._calls()
        verifier = RemoteVerifier(r.replicas, r.vocab_size, calls, r.s.verifier_retry_s)
        verifier.cache_salt = cache_salt  # idle work is cached for the conversation's tenant only
        drafter = RemoteDrafter(r.drafter, "prompt_lookup", calls, drafter_timeout(r.s)) if _drafter_up(r) else None
        return speculative_generate(drafter, verifier, prompt_ids, max_new_tokens=max_new_tokens,
                                    stop_ids=self.stop_ids, session_id=session_id, budget=AdaptiveBudget(8))

    def seed(self, cache: str, texts: list[list[int]], ttl_s: float, replace: bool) -> None:
        seed_cache(self.parts.drafter, cache, texts, ttl_s, replace, self._calls(), drafter_timeout(self.parts.s) * 5)

    def warm(self, session_id: str, tokens: list[int], cache_salt: str = "") -> Optional[str]:
        r = self.parts
        if len(tokens) >= r.s.max_seq_len:
            return None
        peer = r.replicas.pin(session_id)
        r.replicas.unpin(peer)  # the next turn's generation pins it (RemoteVerifier.prefer)
        try:
            prefill_session(peer, session_id, self._calls(), r.s.verifier_timeout_s, tokens, cache_salt=cache_salt)
        except Exception as e:  # noqa: BLE001 - warming is an optimisation
            log.info("warming %s failed: %s", session_id, e)
            return None
        self._where[session_id] = peer
        return peer.address

    def forget(self, session_id: str) -> None:
        self._where.pop(session_id, None)

    def release(self, session_id: str) -> None:
        peer = self._where.pop(session_id, None)
        if peer is not None:
            release_session(peer, session_id, self._calls())


@dataclass
class Run:
    """One generation's adapters (built by ``Strategies.prepare``)."""

    owner: "Strategies"
    plan: object
    sid: str
    verifier: RemoteVerifier  # the raw adapters: network time, replica, re-prefills
    drafter: Optional[RemoteDrafter]
    loop_verifier: object
    loop_drafter: object
    policy: Callable[[], BudgetPolicy]
    meter: Optional[CacheMeter] = None
    resumed: Optional[ResumePrefix] = None
    side: list = field(default_factory=list)  # SSR side-branch adapters (network time)
    policies: list = field(default_factory=list)  # adaptive budget policies made (one per phase)
    entered: bool = False
    predicted: Optional[object] = None  # the PredictionDrafter of a request with a predicted output

    def rounds(self, stats, on_drafter_error, round_scope=None, on_logprobs=None) -> Iterator[list[int]]:
        p, s = self.plan, self.owner.parts.s
        stop_ids = self.owner.parts.codec.stop_ids
        if not p.reasoning:
            return speculative_generate(self.loop_drafter, self.loop_verifier, p.ids + list(p.resume), LoopOptions(
                resumed=len(p.resume),  # a resumed request (router.core): its delivered output, prefilled
                sampling=p.sampling, max_new_tokens=p.max_new_tokens, stop_ids=stop_ids, session_id=self.sid,
                budget=self.policy(), self_draft=p.self_draft, on_drafter_error=on_drafter_error,
                max_new_limit=s.max_new_tokens, round_scope=round_scope, draft_ahead=self.owner.overlap(p),
                draft_first=p.strategy == "proactive" or bool(p.prediction),  # cached / predicted text at once
                on_logprobs=on_logprobs, jump_forward=jump_forward(p),
                # auto: one-hot drafts, so a seeded output is plain sampling's whatever auto picks and measures
                one_hot_drafts=p.reason.startswith("auto")), stats=stats)
        fmt = self.owner.think_format()
        kw = {}
        if p.strategy == "ssr":
            cid = f"ssr:{self.sid}"
            kw = dict(side_answer=self._side_answer, seed=lambda texts: self.owner.seed(cid, texts, SSR_CACHE_TTL_S),
                      fractions=s.ssr_fraction_list())
        return reasoning_generate(self.loop_verifier, p.ids, fmt, sampling=p.sampling, max_new_tokens=p.max_new_tokens,
                                  thinking_budget=p.thinking_budget, stop_ids=stop_ids, session_id=self.sid,
                                  drafter=self.loop_drafter if p.strategy != "ssr" else self._think_drafter(),
                                  answer_drafter=self.loop_drafter, budget=self.policy, stats=stats,
                                  self_draft=p.self_draft, on_drafter_error=on_drafter_error,
                                  max_new_limit=s.max_new_tokens, round_scope=round_scope, **kw)

    def _think_drafter(self):
        r = self.owner.parts
        d = RemoteDrafter(r.drafter, THINK_DRAFTER, self.verifier.calls, drafter_timeout(r.s))
        self.side.append(d)
        return d

    def _side_answer(self, context: list[int], shared: int, main_session: str) -> list[int]:
        """One SSR side branch: fork the main session's KV prefix on its replica (no
        re-prefill; the main KV is untouched), decode the short answer, release."""
        r = self.owner.parts
        calls = self.verifier.calls
        v = RemoteVerifier(r.replicas, r.vocab_size, calls, r.s.verifier_retry_s)
        v.cache_salt = self.verifier.cache_salt
        d = RemoteDrafter(r.drafter, THINK_DRAFTER, calls, drafter_timeout(r.s))
        self.side += [v, d]
        sid = f"{main_session}-side-{len(self.side)}"
        loop_v = v
        main = self.verifier.peer
        if main is not None and v.prefer(main.address):
            try:
                n = prefill_session(main, sid, calls, calls.timeout(), fork_from=main_session, fork_len=shared)
                loop_v = ResumePrefix(v, n)
            except Exception as e:  # noqa: BLE001 - no fork: the branch prefills its context itself
                log.info("fork of %s failed (%s); side branch prefills", main_session, e)
        out: list[int] = []
        for chunk in speculative_generate(d, loop_v, context, max_new_tokens=r.s.ssr_side_tokens,
                                          stop_ids=r.codec.stop_ids, session_id=sid, budget=AdaptiveBudget(8)):
            out += chunk
        return out

    def network_s(self) -> float:
        return self.verifier.network_s + (self.drafter.network_s if self.drafter else 0.0) + \
            sum(a.network_s for a in self.side)

    def finish(self, stats, text: str, cancelled: bool) -> None:
        """Stats only the strategy knows; session book; auto-anticipation."""
        p = self.plan
        if self.meter is not None:
            self.meter.fill(stats)
        if self.predicted is not None:
            stats.accepted_prediction_tokens = self.predicted.accepted
            stats.rejected_prediction_tokens = self.predicted.rejected
        if self.resumed is not None:
            stats.warm_prefix_tokens = self.resumed.used
        why = drafted_nothing(p, stats, self.policies)
        if why:
            stats.strategy_reason = f"{stats.strategy_reason}; drafted nothing: {why}"
        self.owner.learn(p, stats, self.policies[-1].alpha if self.policies else None)
        r = self.owner.parts
        if r.s.auto_anticipate and p.conversation_id and p.messages and not cancelled and _drafter_up(r):
            try:
                self.owner.anticipator().submit(p.conversation_id,
                                                p.messages + [{"role": "assistant", "content": text}],
                                                cache_salt=p.cache_salt)
            except InvalidArgument as e:
                log.info("auto-anticipation skipped: %s", e)

    def close(self) -> None:
        if self.entered:
            self.entered = False
            self.owner.gate.exit()


def drafted_nothing(plan, stats, policies: list) -> str:
    """Why a generation that ran a drafter drafted no token ("" where it drafted some, ran
    none, or was too short to draft): the budget policy's last reason to stay off, or that
    the drafter itself proposed nothing where the policy asked."""
    if stats.drafted_tokens or not (plan.drafter or plan.self_draft) or stats.rounds < 2:
        return ""
    asked = sum(getattr(p, "asked", 0) for p in policies)
    if asked:
        return f"the drafter proposed no tokens in the {asked} rounds it was asked for a draft"
    if policies and policies[-1].off_why:
        return policies[-1].off_why
    return "no round asked for a draft"


class Strategies:
    """Strategy choice and plumbing for one ``Router`` (see module docstring)."""

    def __init__(self, parts: Collaborators):
        self.parts = parts
        self.gate = Gate()
        self.book = auto.SessionBook()
        self.verify_costs = VerifyCosts()  # the verifiers' cost per scored draft token, shared by all requests
        self._overlap: dict[str, OverlapPolicy] = {}  # drafter -> draft-ahead policy (``overlap``)
        self._anticipator: Optional[Anticipator] = None
        self._fmt: Optional[ThinkFormat] = None
        self._calibration = None
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()
        self._self_drafters: frozenset = frozenset()
        self._context_drafters: frozenset = frozenset()  # context-only drafters every verifier replica runs
        self._self_until = 0.0
        self.info_answered: set = set()  # verifier replicas that answered the last Info look-up
        self._drafter_facts: Optional[DrafterFacts] = None  # the drafter service's Info, as last answered
        self._feature_until = 0.0
        self._tree_schedule = None  # (loaded,) the block drafter checkpoint's entropy-switched tree budgets

    # ------------------------------------------------------------ shared pieces
    def tree_schedule(self):
        """The block drafter checkpoint's ``tree_schedule.json`` (``loop.TreeSchedule``), read
        once from where the verifiers and the drafter service find the checkpoint
        (``runtime.block_drafter_path``: ``SPECMESH_BLOCK_DRAFTER`` or the bundled one); None
        when it has none (the tree then drafts its full budget where that pays)."""
        if self._tree_schedule is None:
            from specmesh.blockdraft.serve import load_schedule
            from specmesh.runtime import block_drafter_path

            try:
                self._tree_schedule = (load_schedule(block_drafter_path(self.parts.s.model)),)
            except (OSError, ValueError, KeyError) as e:
                log.warning("tree schedule not loaded: %s", e)
                self._tree_schedule = (None,)
        return self._tree_schedule[0]

    def overlap(self, plan) -> Optional[OverlapPolicy]:
        """The draft-ahead policy of an ``external`` request with a token-only drafter (one
        per drafter, shared by all requests: what it measured carries over; settings
        ``draft_ahead``); None for the others (no draft-ahead)."""
        mode = getattr(plan, "draft_ahead", "") or self.parts.s.draft_ahead
        if mode == "off" or plan.strategy != "external" or plan.drafter not in registry.CONTEXT_ONLY:
            return None
        with self._lock:
            pol = self._overlap.get(plan.drafter)
            if pol is None or pol.mode != mode:
                pol = self._overlap[plan.drafter] = OverlapPolicy(mode)
            return pol

    def think_format(self) -> ThinkFormat:
        if self._fmt is None:
            tok = self.parts.codec.tokenizer
            self._fmt = ThinkFormat.from_encode(lambda t: tok.encode(t, add_special_tokens=False))
        return self._fmt

    def anticipator(self) -> Anticipator:
        with self._lock:
            if self._anticipator is None:
                s = self.parts.s
                cfg = Config(next_turns=s.anticipate_next_turns, reply_tokens=s.anticipate_reply_tokens,
                             token_budget=s.anticipate_tokens, ttl_s=s.anticipate_ttl_s,
                             max_conversations=s.anticipate_max_conversations, max_warm=s.anticipate_max_warm,
                             warm=s.anticipate_max_warm > 0)
                self._anticipator = Anticipator(RemoteBackend(self.parts), self.gate, cfg).start()
            return self._anticipator

    def anticipation_ready(self, conversation_id: str) -> bool:
        return bool(conversation_id) and self._anticipator is not None and self._anticipator.ready(conversation_id)

    def layerskip_speedup(self) -> Optional[float]:
        if self._calibration is None:
            from specmesh.drafters.calibration import load_calibration, speedup_of

            from specmesh.models.loading import ModelNotFound, resolve_model
            from specmesh.runtime import resolve_dtype

            s = self.parts.s
            dtype = s.dtype
            if dtype == "auto":
                # the router may run where the model's files are not (its verifiers load
                # them): no local weights, no calibration to read
                try:
                    dtype = resolve_dtype(dtype, resolve_model(s.model, quiet=True), s.device)
                except ModelNotFound:
                    dtype = None
            rec = load_calibration(s.model, dtype) if dtype else None
            self._calibration = (speedup_of(rec, s.layerskip_exit),)
        return self._calibration[0]

    def self_drafters(self) -> frozenset:
        """Self drafters every verifier replica that answered offers (``Verifier/Info``
        ``self_drafters``; the intersection, since a session may land on any replica).
        Cached for SELF_INFO_TTL_S; when no replica answers, the last known set is kept
        (empty before the first answer) and the look-up retried after SELF_INFO_RETRY_S."""
        return self._verifier_drafters()[0]

    def context_drafters(self) -> frozenset:
        """The context-only drafters every verifier replica that answered runs for external
        requests (``Verifier/Info`` ``context_drafters``), looked up with ``self_drafters``."""
        return self._verifier_drafters()[1]

    def _verifier_drafters(self, force: bool = False) -> tuple[frozenset, frozenset]:
        now = time.monotonic()
        with self._info_lock:
            if now < self._self_until and not force:
                return self._self_drafters, self._context_drafters
            r = self.parts
            found, missed, answered = None, False, set()
            for peer in r.replicas.peers:
                if not peer.health.available():
                    continue
                names = verifier_drafter_names(peer, Calls(r.token), min(SELF_INFO_TIMEOUT_S, r.s.verifier_timeout_s))
                if names is None:
                    missed = True
                    continue
                answered.add(peer.address)
                found = names if found is None else (found[0] & names[0], found[1] & names[1])
            self.info_answered = answered
            if found is None:
                self._self_until = now + SELF_INFO_RETRY_S
            else:  # a replica that did not answer is asked again soon: a plan never rests on a missed Info
                (self._self_drafters, self._context_drafters) = found
                self._self_until = now + (SELF_INFO_RETRY_S if missed else SELF_INFO_TTL_S)
            return self._self_drafters, self._context_drafters

    def info_read(self, addresses) -> set:
        """Of the verifier replicas at ``addresses`` (those serving), the ones whose Info this
        router has read; a replica not read yet is asked now (``Readiness``)."""
        addresses = set(addresses)
        if not addresses <= self.info_answered:
            self._verifier_drafters(force=True)
        return addresses & self.info_answered

    def hosted_drafters(self) -> frozenset:
        """The external drafters this router has the verifiers draft: those every replica
        that answered Info runs (``context_drafters``), none where the router setting
        ``context_drafters`` is "drafter"."""
        return self.context_drafters() if self.parts.s.context_drafters == "verifier" else frozenset()

    def in_verifier(self, drafter: Optional[str]) -> bool:
        """Whether an external request's ``drafter`` runs in the verifiers (``hosted_drafters``)."""
        return bool(drafter) and drafter in self.hosted_drafters()

    def drafter_facts(self) -> Optional[DrafterFacts]:
        """The drafter service's Info (``adapters.DrafterFacts``); None while it has not
        answered. Cached like ``self_drafters``; the last answer is kept while it is down."""
        now = time.monotonic()
        with self._info_lock:
            r = self.parts
            if now < self._feature_until or r.drafter is None:
                return self._drafter_facts
            found = drafter_facts(r.drafter, Calls(r.token), min(SELF_INFO_TIMEOUT_S * 5, drafter_timeout(r.s) * 5))
            if found is None:
                self._feature_until = now + SELF_INFO_RETRY_S
                return self._drafter_facts
            self._drafter_facts = found
            self._feature_until = now + SELF_INFO_TTL_S
            return self._drafter_facts

    def feature_drafters(self) -> Optional[dict]:
        """name -> (layers, dim, context_window) of the drafter service's drafters that
        need features (``DrafterInfo.feature_drafters``); None while the service has not
        answered."""
        facts = self.drafter_facts()
        return None if facts is None else facts.feature_drafters

    def draft_model(self) -> str:
        """The real draft model the drafter service runs as ``draft_lm`` (``DrafterInfo.draft_model``:
        the target's paired draft model or the one it was given, loaded and measured), "" where
        there is none (the stand-in layer subset), no drafter service, or no answer yet."""
        facts = self.drafter_facts()
        return facts.draft_model if facts is not None else ""

    def default_drafters(self) -> dict[str, str]:
        """strategy -> the drafter a request without one gets ("" = none, or chosen per request)."""
        return {"autoregressive": "", "external": self.parts.s.default_drafter,
                "self": default_self_drafter(self.self_drafters()), "proactive": "cache", "ssr": "cache", "auto": ""}

    def seed(self, cache: str, texts: list[list[int]], ttl_s: float, replace: bool = False) -> None:
        RemoteBackend(self.parts).seed(cache, texts, ttl_s, replace)

    def close(self) -> None:
        if self._anticipator is not None:
            self._anticipator.stop()

    # ------------------------------------------------------------ choice
    def check(self, spec) -> None:
        """Field checks that need no tokenizer (strategy and drafter names)."""
        name = spec.strategy or ("external" if spec.drafter else self.parts.s.default_strategy)
        if name not in STRATEGIES:
            raise InvalidArgument("strategy", f"unknown strategy {spec.strategy!r}; known: {sorted(STRATEGIES)}")
        if len(spec.conversation_id.encode()) > convert.MAX_SESSION_ID:
            raise InvalidArgument("conversation_id", f"longer than {convert.MAX_SESSION_ID} bytes")
        if name == "proactive" and not spec.conversation_id:
            raise InvalidArgument("conversation_id", "the proactive strategy needs a conversation_id")
        if spec.thinking_budget is not None and not spec.thinking_budget >= 1:
            raise InvalidArgument("thinking_budget", f"must be >= 1, got {spec.thinking_budget}")

    def resolve(self, spec, ids: list[int], reasoning: bool) -> Resolved:
        r = self.parts
        name = spec.strategy or ("external" if spec.drafter else r.s.default_strategy)
        reason = "requested" if spec.strategy else "default"
        if getattr(spec, "prediction", ""):
            # the predicted output drafts in the router (a lookup over it: no hop); an external drafter the
            # request names drafts where the output leaves the prediction
            if name in ("auto", "external") and not spec.drafter:
                return Resolved("external", f"{reason}; the predicted output drafts (a lookup drafter)", None, None)
            if name != "external":
                raise InvalidArgument("prediction", f"the {name} strategy does not draft from a prediction; send it "
                                      "with strategy external or auto (the default), or without a prediction")
        if spec.sampling.acceptance == "divergence" and not spec.drafter and spec.strategy in ("", "self", "auto"):
            # divergence verifies the specialist's own drafts: no other drafter can serve it
            return Resolved("self", f"{reason}; acceptance divergence drafts with the specialist", None, "specialist")
        if name == "auto":
            msgs = spec.messages or []
            text = spec.prompt or "\n".join(m.get("content", "") for m in msgs)
            up = _drafter_up(r)
            grammar = ""
            if spec.sampling.constrained:
                tools = getattr(spec, "tools", None) and getattr(spec, "tool_choice", "") != "none"
                grammar = "tool calls" if tools else spec.sampling.grammar_kind
            f = auto.features_from(ids, text, max(1, len(msgs)), reasoning,
                                   self.anticipation_ready(spec.conversation_id), up,
                                   self.layerskip_speedup(), block_drafter=auto.BLOCK_SELF in self.self_drafters(),
                                   in_verifier=self.hosted_drafters(), draft_model=self.draft_model() if up else "",
                                   grammar=grammar)
            if not spec.sampling.greedy and f.layerskip_speedup is not None:
                # layer-skip drafts sampled tokens with their distribution (rejection sampling); auto drafts
                # one-hot only, so that a seeded output does not depend on its choice or the draft sizes
                f = replace(f, layerskip_speedup=None)
            key = self.session_key(spec.conversation_id)
            c = auto.choose(f, self.book.get(key))
            if c.switched_from:
                self.book.skip(key, c.switched_from)
            if grammar and "jump-forward" not in c.reason:  # any choice of auto drafts the forced tokens too
                c = replace(c, reason=f"{c.reason}; grammar-forced tokens drafted free (jump-forward)")
            if c.strategy == "external" and self.in_verifier(c.drafter):
                return Resolved(c.strategy, f"{c.reason}; {c.drafter} drafted in the verifier", None, c.drafter)
            return Resolved(c.strategy, c.reason, c.drafter if c.strategy in ("external", "proactive", "ssr") else None,
                            c.drafter if c.strategy == "self" else None)
        if name == "self":
            if spec.drafter not in ("",) + SELF_DRAFTERS:
                raise InvalidArgument("drafter", f"the self strategy drafts with {list(SELF_DRAFTERS)}, "
                                      f"got {spec.drafter!r}")
            have = self.self_drafters()
            if spec.drafter and have and spec.drafter not in have:
                raise InvalidArgument("drafter", f"the verifiers have the self drafters {sorted(have)}, not "
                                      f"{spec.drafter!r} (block and block_tree need the trained block drafter)")
            if spec.drafter:
                return Resolved(name, reason, None, spec.drafter)
            d = default_self_drafter(have)
            why = "the verifiers have the trained block drafter" if d != "layerskip" else "no block drafter loaded"
            return Resolved(name, f"{reason}; default self drafter {d} ({why})", None, d)
        if name in ("external", "proactive", "ssr"):
            if name == "external":
                d = spec.drafter or r.s.default_drafter
                if d not in EXTERNAL_DRAFTERS:
                    raise InvalidArgument("drafter", f"unknown drafter {d!r}; known: {list(EXTERNAL_DRAFTERS)}")
                if d in FEATURE_DRAFTERS and r.drafter is not None:
                    have = self.feature_drafters()
                    if have is not None and d not in have:
                        raise InvalidArgument("drafter", f"the drafter service does not host {d!r} (it needs the "
                                              f"trained block drafter's checkpoint); it hosts {sorted(have)} of "
                                              f"{list(FEATURE_DRAFTERS)}")
            else:
                if spec.drafter not in ("", "cache"):
                    raise InvalidArgument("drafter", f"the {name} strategy drafts from its cache, got {spec.drafter!r}")
                d = "cache"
            if name == "external" and self.in_verifier(d) and getattr(spec, "prediction", ""):
                # the prediction drafts in the router, the named drafter beside it where the output leaves
                # the prediction: both here (a drafter in the verifier would draft instead of the prediction)
                return Resolved(name, f"{reason}; {d} drafts in the router beside the prediction", d, None)
            if name == "external" and self.in_verifier(d):  # no hop a round: as a self drafter's rounds
                return Resolved(name, f"{reason}; {d} drafted in the verifier", None, d)
            if r.drafter is None:
                raise InvalidArgument("strategy", f"{name} needs a drafter service and this router has none")
            return Resolved(name, reason, d, None)
        if spec.drafter and spec.strategy == "autoregressive":
            raise InvalidArgument("drafter", "strategy 'autoregressive' takes no drafter")
        return Resolved(name, reason, None, None)

    def session_key(self, conversation_id: str, client: str = "") -> str:
        return f"conv:{conversation_id}" if conversation_id else f"client:{client}"

    # ------------------------------------------------------------ one generation
    def prepare(self, plan, sid: str, calls: Calls) -> Run:
        r = self.parts
        features = None
        if plan.drafter in FEATURE_DRAFTERS and plan.strategy == "external":
            spec = (self.feature_drafters() or {}).get(plan.drafter)
            if spec is not None:  # else the service never answered: its Propose fails, the rounds decode plainly
                features = FeatureLog(*spec)
        # rounds without a draft: the verifier decodes ahead on a Decode stream (adapters.RemoteVerifier), from
        # plain decoding's second round, a self drafter's from its second round, drafted or not (the stream
        # carries its budget: the verifier drafts in its own turn), and once an external drafter's rounds came
        # without a draft a few in a row (a lookup that finds nothing for one round is no reason to open one);
        # not for a fused self drafter, whose state is the last forward's, nor reasoning requests
        plain = plan.strategy == "autoregressive" and not plan.drafter and not plan.self_draft
        streams = r.s.decode_stream and not plan.reasoning and features is None and plan.self_draft not in FUSED
        verifier = RemoteVerifier(r.replicas, r.vocab_size, calls, r.s.verifier_retry_s, features=features,
                                  # the tokens it may still yield: a resumed request's delivered ones count,
                                  # and its prefill of all but the last one (loop prefill_resumed) yields none
                                  decode_ahead=max(0, plan.max_new_tokens - len(plan.resume) + bool(plan.resume))
                                  if streams else 0,
                                  stop_ids=r.codec.stop_ids,
                                  decode_after=1 if plain or plan.self_draft else DECODE_AFTER,
                                  decode_lead=0 if plain else DECODE_LEAD, decode_self=plan.self_draft or None)
        verifier.conversation = plan.conversation_id  # routing: a conversation stays on its replica
        verifier.cache_salt = plan.cache_salt  # the prefix cache's tenant of every call
        drafter, loop_v, meter, resumed = None, verifier, None, None
        # the draft size follows the measured costs (AdaptiveBudget: drafting shrinks or stops where it
        # does not pay, alone or under load) unless the request pinned draft_budget, or samples (a fixed
        # budget keeps a seeded sampled run's draws reproducible: docs/design.md "Seeds")
        adaptive = plan.strategy in ("proactive", "ssr") or plan.reason.startswith("auto") or (
            not plan.budget_pinned and plan.sampling.greedy)
        key = self.session_key(plan.conversation_id, plan.client)
        # the session's own acceptance, else None: the drafter's across sessions (``VerifyCosts.prior_alpha``)
        alpha0 = self.book.initial_alpha(key, auto.label(plan.strategy, plan.drafter or plan.self_draft or ""), None)

        local = None  # a context-only drafter run here, beside a prediction, instead of in the verifiers
        if plan.drafter and plan.prediction and plan.strategy == "external" and self.in_verifier(plan.drafter):
            from specmesh.drafters import make_drafter

            local = make_drafter(plan.drafter, **({"vocab_size": r.vocab_size} if plan.drafter == "adaptive_lookup"
                                                  else {}))
        elif plan.drafter:
            cid = ""
            if plan.strategy == "proactive":
                cid = cache_id(plan.conversation_id)
            elif plan.strategy == "ssr":
                cid = f"ssr:{sid}"
            # the draft LM's deadline follows its measured speed unless drafter_timeout_s is set
            facts = self.drafter_facts() if plan.drafter == "draft_lm" and r.s.drafter_timeout_s is None else None
            drafter = RemoteDrafter(r.drafter, plan.drafter, calls, drafter_timeout(r.s), cache_id=cid,
                                    speed=facts.draft_speed if facts is not None else None,
                                    features=features)
        loop_d = drafter
        predicted = None
        if plan.prediction:
            from specmesh.drafters.prediction import PredictionDrafter

            loop_d = predicted = PredictionDrafter(plan.prediction, fallback=drafter or local)
        if plan.strategy in ("proactive", "ssr") and loop_d is not None:
            loop_d = meter = CacheMeter(loop_d)  # outermost: counts what the verifier is sent
        if plan.strategy == "proactive" and self._anticipator is not None:
            warm_sid, warm_toks, address = self._anticipator.claim_warm(plan.conversation_id)
            if warm_sid:
                backend = self._anticipator.backend
                n = min(common_prefix_len(warm_toks, plan.ids), len(plan.ids) - 1)
                if n > 0 and verifier.prefer(address):
                    backend.forget(warm_sid)  # this generation releases it
                    sid = warm_sid
                    loop_v = resumed = ResumePrefix(verifier, n)
                else:
                    backend.release(warm_sid)
        policies: list = []

        def policy() -> BudgetPolicy:  # one per phase; the draft size follows the phase's entropy
            if predicted is not None and not plan.budget_pinned:  # a prediction is drafted whole, up to the cap
                return BudgetPolicy(r.s.max_tree_nodes)
            if not adaptive:
                return BudgetPolicy(plan.budget)
            # draft length by the cost model where drafting costs (model drafters); n-gram, suffix and cache
            # drafts are nearly free and bound themselves: full length, capped by entropy
            # (block drafters: per-round cost, see AdaptiveBudget.for_drafter); the verifiers' cost per scored
            # token is learned across requests
            # load: the generations decoding on a verifier replica now (this one's among them once pinned)
            pol = TreeBudget.for_drafter(plan.drafter or plan.self_draft, plan.budget, costs=self.verify_costs,
                                         alpha0=alpha0,
                                         fixed_length=(plan.drafter or plan.self_draft) in CHEAP_DRAFTERS,
                                         schedule=self.tree_schedule(), load=r.replicas.sessions_per_replica())
            policies.append(pol)
            return pol

        run = Run(self, plan, sid, verifier, drafter, loop_v, loop_d, policy, meter, resumed,
                  policies=policies, predicted=predicted)
        self.gate.enter()
        run.entered = True
        return run

    def learn(self, plan, stats, alpha: Optional[float] = None) -> None:
        key = self.session_key(plan.conversation_id, plan.client)
        if plan.strategy == "autoregressive":
            self.book.record_ar(stats.new_tokens, stats.total_s, stats.ttft_s)
        sp = auto.measured_speedup(stats.new_tokens, stats.total_s, stats.ttft_s, self.book.ar_token_s,
                                   stats.verify_s, stats.rounds, stats.drafted_tokens)
        if stats.new_tokens < auto.MIN_MEASURED_TOKENS:
            sp = None  # a short reply's few rounds say little: it must not switch a drafter off for the session
        self.book.record(key, auto.label(plan.strategy, plan.drafter or plan.self_draft or ""), stats.tau, sp, alpha)

    # ------------------------------------------------------------ anticipation API
    def anticipate(self, conversation_id: str, messages: list[dict], max_tokens: int = 0, next_turns: int = 0,
                   wait: bool = False, timeout: Optional[float] = None, cache_salt: str = "") -> dict:
        """``conversation_id`` as scoped by its tenant (``scoped_conversation``); ``cache_salt`` its
        tenant key (``tenant_key``)."""
        if self.parts.drafter is None:
            raise InvalidArgument("conversation_id", "anticipation needs a drafter service and this router has none")
        if len(conversation_id.encode()) > convert.MAX_SESSION_ID:
            raise InvalidArgument("conversation_id", f"longer than {convert.MAX_SESSION_ID} bytes")
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant"):
                raise InvalidArgument("messages", f"entry {i} has role {m.get('role')!r}")
        limit = self.parts.s.max_prompt_tokens
        if messages and len(self.parts.codec.encode(None, messages)) > limit:
            raise InvalidArgument("messages", f"the conversation exceeds max_prompt_tokens {limit}")
        e = self.anticipator().submit(conversation_id, messages, max_tokens, next_turns, cache_salt)
        if wait:
            e.done.wait(timeout)
        return dict(e.summary(), accepted=True)

    def anticipation(self, conversation_id: str) -> Optional[dict]:
        e = self._anticipator.get(conversation_id) if self._anticipator is not None else None
        return None if e is None else dict(e.summary(), accepted=True)
