"""The router's gRPC adapters of the core contracts, used by its draft–verify loop.

- ``RemoteDrafter`` implements the drafter contract (``propose`` / ``release`` /
  ``finish``) over the Drafter service. It remembers what the service holds for
  its session and sends only the delta (keep_len = common prefix, append the
  rest); when the service lost the session (FAILED_PRECONDITION) it resends
  everything once. A call failing with UNAVAILABLE or DEADLINE_EXCEEDED marks
  the drafter unhealthy (``PeerHealth``): the exception reaches the loop, which
  falls back to plain decoding for that round, and further rounds skip drafting
  (empty draft, no RPC) until the backoff has passed; then the next round
  probes the drafter again. With draft-ahead (``propose_ahead``, token-only
  drafters) it sends ``ProposeAhead`` without waiting before each Verify and
  collects the answer at the next ``propose``. The answer carries the first ahead
  round ("all accepted" with the drafter's guess of the bonus token): when the
  verify ended in exactly that outcome and the answer is in, the round is used as it
  is, with no Propose; otherwise the Propose (sent without waiting for a pending
  answer) says whether the draft came from another drafted-ahead round
  (``propose_info``: ``ahead.AheadInfo``, its span placed on this process's clock).
- ``RemoteVerifier`` implements the ``Verifier`` protocol over one of several
  Verifier replicas (``replicas.ReplicaSet``): the session is pinned to a
  replica (least-loaded or rendezvous hash). FAILED_PRECONDITION becomes
  ``SessionLost`` (the loop re-prefills from its committed tokens); UNAVAILABLE
  marks the replica down, re-pins the session (to another replica when there
  is one) and raises ``SessionLost`` too, and a re-prefill that meets
  UNAVAILABLE is retried with a short backoff for up to ``retry_s`` (a
  restarting replica). Rounds without a draft (plain decoding from its second
  round; an external drafter's once drafting has stopped for a few rounds:
  ``decode_ahead``), and a self drafter's drafted or not (``decode_self``: the
  stream carries the budget), are read from one ``Verifier/Decode`` stream: the
  verifier decodes the next round while the router handles this one, granted
  steps as they are read (``DecodeStream``: at most ``decode_lead`` ahead, where a
  switch back to external drafting drops them); a round with an external draft
  ends the stream, and a stream that fails or ends hands the round back to a
  Verify call.
- ``FeatureLog`` (one per generation whose external drafter needs the target's
  hidden features): the router's copy of the committed positions' features. The
  ``RemoteVerifier`` asks for them with every Verify (``feature_layers``) and
  stores the rows each response carries (a re-prefill rewrites them from 0);
  the ``RemoteDrafter`` forwards each row once to the drafter service, like the
  tokens by delta, and when the service does not know the session (a new or
  restarted replica: FAILED_PRECONDITION) it re-seeds it with the committed
  tokens and the last ``context_window`` rows. The router stays the source of
  truth: a lost drafter replica loses nothing.
- Both measure network time: RPC wall time minus the server's handler time.
- One-off calls of the strategy runner, in domain terms: ``seed_cache``,
  ``prefill_session`` (also a fork of another session's KV prefix),
  ``release_session``, ``verifier_drafter_names``, ``drafter_facts`` (the drafter
  service's feature drafters, real draft model and its measured speed);
  ``drafter_failure`` classifies a drafter call's exception (down or broken).

This module knows nothing about tokenizers, strategies or how servers are built.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import grpc

from specmesh.ahead import AheadInfo, main_path, truncate
from specmesh.drafters.registry import FREE
from specmesh.seqs import common_prefix_len
from specmesh.wire import convert
from specmesh.types import FEATURE_DTYPE, DraftContext, FeatureRows, SessionLost, TokenTree, VerifyRequest, \
    VerifyResult
from specmesh.v1 import drafter_pb2, verifier_pb2

from .replicas import Peer, ReplicaSet

log = logging.getLogger("specmesh.router")
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RELEASE_TIMEOUT_S = 2.0


class CancelFlag(threading.Event):
    """A generation's cancel flag: an Event whose ``set()`` also runs the hooks that
    calls in flight registered (``on_set``), so a call that would otherwise run on
    (a Decode stream the verifier decodes ahead on) is cancelled when the generation
    is, not when the round waiting on it comes back."""

    def __init__(self):
        super().__init__()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._hook_lock = threading.Lock()
        self._next = 0

    def on_set(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` when the flag is set (at once if it is); returns the function
        that removes it."""
        with self._hook_lock:
            if not self.is_set():
                key, self._next = self._next, self._next + 1
                self._hooks[key] = fn
                return lambda: self._drop(key)
        fn()
        return lambda: None

    def _drop(self, key: int) -> None:
        with self._hook_lock:
            self._hooks.pop(key, None)

    def set(self) -> None:
        with self._hook_lock:
            super().set()
            hooks, self._hooks = list(self._hooks.values()), {}
        for fn in hooks:
            fn()


class GenerationCancelled(Exception):
    """A call of a generation that was cancelled ended because of it: the generation
    stops here (nothing is sent to a caller who has gone)."""


class Calls:
    """Per-generation call settings: auth metadata, timeouts and an optional
    absolute deadline (``time.monotonic()`` based) and cancel flag (``CancelFlag``:
    setting it cancels the calls that registered with ``on_cancel``)."""

    def __init__(self, token: Optional[str] = None, timeout_s: float = 30.0, deadline: Optional[float] = None,
                 cancelled: Optional[CancelFlag] = None):
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s, self.deadline = timeout_s, deadline
        self.cancelled = cancelled if cancelled is not None else CancelFlag()

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` runs when the generation is cancelled (at once if it was); returns its remover."""
        return self.cancelled.on_set(fn)

    def timeout(self, cap: Optional[float] = None) -> float:
        t = min(self.timeout_s, cap or self.timeout_s)
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline exceeded")
            t = min(t, left)
        return t


# ---------------------------------------------------------------- features

class FeatureError(RuntimeError):
    """The verifier did not return the features a drafter needs (a verifier that
    predates them, or rows that do not connect): drafting stops for the request."""


class FeatureLog:
    """The committed positions' hidden features of one generation, as the verifier
    returned them: ``n`` rows of ``dim`` bf16 values (positions [0, n)); ``layers``,
    ``dim`` and ``window`` are what the drafter asked for (``DrafterInfo.feature_drafters``)."""

    def __init__(self, layers: Sequence[int], dim: int, window: int):
        self.layers, self.dim, self.window = tuple(layers), dim, window
        self.row_bytes = dim * 2
        self.data = bytearray()
        self.rewritten: Optional[int] = None  # lowest position rewritten since the drafter was last sent rows
        self.error: Optional[str] = None

    @property
    def n(self) -> int:
        return len(self.data) // self.row_bytes

    def put(self, f: Optional[FeatureRows], cache_len: int) -> None:
        """Store a verify response's rows (positions [f.start, f.end), which must end at
        ``cache_len`` and start at or before what is held)."""
        if f is None:
            self.error = "the verifier returned no features (it predates them?)"
            return
        if (f.dtype != FEATURE_DTYPE or tuple(f.layers) != self.layers or f.dim != self.dim
                or len(f.data) != f.rows * self.row_bytes or f.start > self.n or f.end != cache_len):
            self.error = (f"the verifier's features do not fit: start {f.start} rows {f.rows} dim {f.dim} "
                          f"layers {list(f.layers)} {f.dtype} (held {self.n} rows, cache_len {cache_len})")
            return
        if f.start < self.n:
            self.rewritten = f.start if self.rewritten is None else min(self.rewritten, f.start)
        del self.data[f.start * self.row_bytes:]
        self.data += f.data

    def rows(self, start: int) -> FeatureRows:
        """Rows [start, n) for the drafter."""
        return FeatureRows(start, self.n - start, self.dim, self.layers, FEATURE_DTYPE,
                           bytes(self.data[start * self.row_bytes:]))


# ---------------------------------------------------------------- drafter

class RemoteDrafter:
    """The drafter contract over the Drafter service (one instance per generation)."""

    def __init__(self, peer: Peer, drafter: str, calls: Calls, timeout_s: float = 2.0, cache_id: str = "",
                 features: Optional[FeatureLog] = None, speed: Optional[DraftSpeed] = None):
        """``timeout_s``: a call's deadline; with ``speed`` (a draft model's measured speed)
        its base, to which the call's work at that speed is added (``DraftSpeed.deadline_s``)."""
        self.peer, self.name, self.calls, self.timeout_s = peer, drafter, calls, timeout_s
        self.speed = speed
        # its drafts run a model (not a lookup): a Decode stream decoding ahead on the same CPUs meanwhile
        # slows them several times over (``RemoteVerifier.drafting``)
        self.computes = drafter not in FREE
        self.cache_id = cache_id  # draft cache the "cache" drafter reads
        self.features = features  # the generation's hidden features, for a drafter that needs them
        self._held: dict[str, list[int]] = {}  # session -> tokens the service holds
        self._held_rows: dict[str, int] = {}  # session -> feature rows the service holds (positions [.., n))
        self.network_s = 0.0
        self.skipped = 0  # rounds without drafting while the drafter was down
        self.feature_bytes = 0  # feature bytes sent to the drafter service
        self._ahead: dict[str, tuple] = {}  # session -> (ProposeAhead future, tokens sent, perf_counter sent)

    def _deadline(self, sent: int, budget: int) -> float:
        """This call's deadline (seconds): ``timeout_s``, or with a measured ``speed`` what
        its ``sent`` tokens to prefill and ``budget`` to draft need (capped by the generation's)."""
        t = self.timeout_s if self.speed is None else self.speed.deadline_s(self.timeout_s, sent, budget)
        return self.calls.timeout(t)

    def _feature_delta(self, sid: str, keep: int) -> Optional[FeatureRows]:
        log = self.features
        if log is None:
            return None
        if log.error is not None:
            raise FeatureError(log.error)
        window_start = max(0, log.n - log.window)  # the drafter reads no row before it
        if keep == 0:  # a full (re)seed: the last window
            return log.rows(window_start)
        start = self._held_rows.get(sid, 0)
        if log.rewritten is not None:  # a re-prefill rewrote rows the drafter holds
            start = min(start, log.rewritten)
        return log.rows(min(max(start, window_start), log.n))  # never more than a window

    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        return self.propose_info(ctx, budget)[0]

    def propose_ahead(self, ctx: DraftContext, tree: TokenTree, budget: int) -> bool:
        """Ask the service to draft the next round ahead while this one verifies
        (``Drafter/ProposeAhead``, sent without waiting: its answer is collected by the
        next ``propose``). Token-only drafters; False when not sent."""
        if self.features is not None or not self.peer.health.available():
            return False
        sid, tokens = ctx.session_id, ctx.tokens
        self._collect_ahead(sid)
        held = self._held.pop(sid, [])  # unknown until the call is answered
        keep = common_prefix_len(held, tokens)
        req = drafter_pb2.ProposeAheadRequest(
            session_id=sid, drafter=self.name, sync=convert.sync_to_proto(keep, tokens[keep:]),
            prompt_len=ctx.prompt_len, sampling=convert.sampling_to_proto(ctx.sampling), budget=budget,
            cache_id=ctx.cache_id or self.cache_id, tree=convert.tree_to_proto(tree), return_first=True)
        fut = self.peer.stub.ProposeAhead.future(req, timeout=self._deadline(len(tokens) - keep, budget),
                                                 metadata=self.calls.metadata)
        self._ahead[sid] = (fut, list(tokens), time.perf_counter(), main_path(tree))
        return True

    def _first_round(self, ctx: DraftContext, budget: int) -> Optional[tuple[TokenTree, AheadInfo]]:
        """The round after an ahead call, when it ended in the outcome the service drafts
        first ("all accepted": round r's main path accepted, then a bonus token) and the
        ProposeAhead answer, which carries that round, is in: use it when the bonus token
        is the one it guessed — no Propose, a hop less (a "hit", reason "first"). None: ask
        the service with a Propose as before (which finds any other drafted-ahead round)."""
        pending = self._ahead.get(ctx.session_id)
        if pending is None:
            return None
        fut, sent_tokens, sent, path = pending
        n = len(sent_tokens) + len(path)
        if len(ctx.tokens) != n + 1 or ctx.tokens[:n] != sent_tokens + path or not fut.done():
            return None  # not that outcome, or its round still drafting: a Propose waits for it there if the
            # guessed bonus token was right, and cancels it at once if not (waiting here would wait it out)
        self._ahead.pop(ctx.session_id)
        resp = self._ahead_answer(fut)
        if resp is None:
            return None
        self._held[ctx.session_id] = sent_tokens  # what the service holds (the ahead call's sync)
        if list(resp.first_assumed) != ctx.tokens[len(sent_tokens):] or not resp.first_tree.tokens:
            return None
        tree = convert.tree_from_proto(resp.first_tree)
        info = convert.ahead_from_proto(resp.first, sent)
        info.result, info.reason = "hit", "first"
        return truncate(tree, budget), info

    def _collect_ahead(self, sid: str, wait: bool = True) -> Optional[float]:
        """Wait for the session's ProposeAhead answer; on success the service holds its
        tokens. Returns when it was sent, or None when there was none or it failed (the
        next Propose then resends from 0). ``wait`` False (a Propose of an outcome the
        answer does not carry): an answer still pending is not waited for — it waits for
        the first ahead round, which this Propose cancels — and the service is taken to
        hold the tokens it synced (its sync ran when the call arrived, a verify ago;
        were it not so, the Propose meets FAILED_PRECONDITION and resends from 0)."""
        pending = self._ahead.pop(sid, None)
        if pending is None:
            return None
        fut, tokens, sent, _ = pending
        if not wait and not fut.done():
            self._held[sid] = tokens
            fut.add_done_callback(self._ahead_answered)
            return sent
        if self._ahead_answer(fut) is None:
            return None
        self._held[sid] = tokens
        return sent

    def _ahead_answer(self, fut):
        """A ProposeAhead call's answer (waited for), or None where it failed: a drafter
        found down is marked so, and the next round drafts afresh."""
        try:
            return fut.result()
        except grpc.RpcError as e:
            if e.code() in DOWN:
                self.peer.health.failed()
            log.info("ProposeAhead failed (%s); the next round drafts afresh", e.code())
            return None

    def _ahead_answered(self, fut) -> None:
        """The done-callback of an answer nobody waits for."""
        try:
            self._ahead_answer(fut)
        except Exception:  # noqa: BLE001 - cancelled or closed: nothing to record
            pass

    def propose_info(self, ctx: DraftContext, budget: int) -> tuple[TokenTree, Optional[AheadInfo]]:
        """``propose``, and how the service obtained the draft (``ahead.AheadInfo``: from
        a drafted-ahead round or not; None when no call was made)."""
        if self.peer.health.available():
            first = self._first_round(ctx, budget)
            if first is not None:
                return first
        asked = self._collect_ahead(ctx.session_id, wait=False)
        if not self.peer.health.available():
            self.skipped += 1
            return TokenTree(), None
        sid, tokens = ctx.session_id, ctx.tokens
        held = self._held.pop(sid, [])  # unknown until this call succeeds
        keep = common_prefix_len(held, tokens)
        if keep == 0:
            self._held_rows.pop(sid, None)
        while True:
            feats = self._feature_delta(sid, keep)
            req = drafter_pb2.ProposeRequest(
                session_id=sid, drafter=self.name, sync=convert.sync_to_proto(keep, tokens[keep:]),
                prompt_len=ctx.prompt_len, sampling=convert.sampling_to_proto(ctx.sampling), budget=budget,
                cache_id=ctx.cache_id or self.cache_id)
            if feats is not None:
                req.features.CopyFrom(convert.features_to_proto(feats))
            t0 = time.perf_counter()
            try:
                resp = self.peer.stub.Propose(req, timeout=self._deadline(len(tokens) - keep, budget),
                                              metadata=self.calls.metadata)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and keep > 0:
                    keep = 0  # the drafter lost the session: resend everything once
                    continue
                if e.code() in DOWN:
                    self.peer.health.failed()
                raise
        self.network_s += max(0.0, time.perf_counter() - t0 - resp.server_ms / 1e3)
        self.peer.health.ok()
        self._held[sid] = list(tokens)
        if feats is not None:
            self._held_rows[sid] = feats.end
            self.feature_bytes += len(feats.data)
            self.features.rewritten = None
        tree = convert.tree_from_proto(resp.tree)
        tree.source = resp.source
        return tree, convert.ahead_from_proto(resp.ahead, asked)

    def _release(self, session_id: str, finished: bool, tokens: Sequence[int] = (), prompt_len: int = 0) -> None:
        self._collect_ahead(session_id)
        held = self._held.pop(session_id, None)
        self._held_rows.pop(session_id, None)
        if held is None or not self.peer.health.available():
            return  # the service never held it, lost it or is down; its LRU frees leftovers
        keep = common_prefix_len(held, list(tokens)) if finished else 0
        req = drafter_pb2.DrafterReleaseRequest(session_id=session_id, finished=finished, prompt_len=prompt_len,
                                                sync=convert.sync_to_proto(keep, list(tokens)[keep:]))
        self.peer.stub.Release(req, timeout=RELEASE_TIMEOUT_S, metadata=self.calls.metadata)

    def release(self, session_id: str) -> None:
        self._release(session_id, False)

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        # a cancelled generation is released, not learned from
        self._release(session_id, not self.calls.cancelled.is_set(), tokens, prompt_len)


# ---------------------------------------------------------------- verifier

class DecodeStream:
    """One ``Verifier/Decode`` call, read step by step. The first request grants
    ``min(total, lead)`` steps; each read that leaves no more than ``lead // 2``
    granted but unread grants up to ``lead`` again, so the verifier never decodes more
    than ``lead`` steps past this reader and, while the reader keeps up, never waits
    for a grant (``lead`` 0: all ``total`` at once). With every step granted the
    request side is closed. ``key``: what the stream's next step answers (the caller's)."""

    def __init__(self, stub, first, total: int, lead: int, key, timeout: Optional[float] = None, metadata=None,
                 calls: Optional[Calls] = None):
        """``calls``: the generation's; cancelling it cancels this stream at once (the
        verifier stops decoding ahead for a caller who has gone)."""
        self.total, self.lead, self.key = total, lead, key
        self.budget = first.self_draft.budget if first.HasField("self_draft") else 0  # the last one sent
        self.method = first.self_draft.method  # the self drafter ("": none)
        self.granted = min(total, lead) if lead else total
        self.read = 0
        first.max_steps = self.granted
        self._requests: "queue.SimpleQueue" = queue.SimpleQueue()  # drained by the channel's own thread
        self._requests.put(first)
        if self.granted >= total:
            self._requests.put(None)
        self.call = stub.Decode(iter(self._requests.get, None), timeout=timeout, metadata=metadata)
        self._unhook = lambda: None  # set before on_cancel: a generation cancelled already cancels at once
        self._unhook = calls.on_cancel(self.cancel) if calls is not None else self._unhook

    def __next__(self):
        resp = next(self.call)
        self.read += 1
        unread = self.granted - self.read
        if self.granted < self.total and unread <= self.lead // 2:
            n = min(self.total - self.granted, self.lead - unread)
            self.granted += n
            self._requests.put(verifier_pb2.DecodeRequest(max_steps=n))
            if self.granted >= self.total:
                self._requests.put(None)
        return resp

    def set_budget(self, budget: int) -> None:
        """The self drafter's budget from the next step the verifier starts (the steps it
        decoded ahead keep theirs)."""
        if budget != self.budget and self.granted < self.total:  # else the request side is closed: the
            self.budget = budget  # last steps keep the budget they have
            self._requests.put(verifier_pb2.DecodeRequest(
                self_draft=verifier_pb2.SelfDraft(method=self.method, budget=budget)))

    def cancel(self) -> None:
        self._unhook()
        self.call.cancel()
        self._requests.put(None)  # ends the request iterator the channel's thread waits on


class RemoteVerifier:
    """The Verifier protocol over a ``ReplicaSet`` (one instance per generation)."""

    def __init__(self, replicas: ReplicaSet, vocab_size: int, calls: Calls, retry_s: float = 15.0,
                 features: Optional[FeatureLog] = None, decode_ahead: int = 0, stop_ids: Sequence[int] = (),
                 decode_after: int = 1, decode_lead: int = 0, decode_self: Optional[str] = None):
        """``decode_ahead`` > 0: a generation of at most that many tokens whose rounds
        without a draft may be read from a ``Verifier/Decode`` stream (the verifier
        decodes ahead of this loop, the hop is off the critical path), once
        ``decode_after`` such rounds come in a row (1: plain decoding, from its second
        round; more where drafting stops and starts: each switch back to drafting
        drops the steps the verifier decoded ahead); ``stop_ids`` end that stream.
        ``decode_lead`` > 0: the verifier decodes at most that many steps past what
        this loop read (``DecodeStream`` grants more as it reads), which bounds what a
        switch drops where the verifier outruns this loop; 0: a stream is granted all
        its steps at once (plain decoding: nothing to drop). ``decode_self``: the
        generation's self drafter, whose rounds go on the stream too, drafted or not
        (the stream carries the budget; the verifier drafts in its turn, so a round
        with a draft needs nothing from this loop either). ``decode_ahead`` 0: every
        round is a Verify call."""
        self.replicas, self.vocab_size, self.calls, self.retry_s = replicas, vocab_size, calls, retry_s
        self.features = features  # ask for hidden features with every verify and keep them here
        self.peer: Optional[Peer] = None
        self.network_s = 0.0
        self.reprefills = 0
        self.address = ""  # replica of the last successful verify
        self._calls = 0
        self._touched: list[Peer] = []
        self.decode_left = decode_ahead  # tokens the generation may still yield (a stream decodes no more)
        self.decode_after = max(1, decode_after)
        self.decode_lead = max(0, decode_lead)
        self.decode_self = decode_self
        self._plain_run = 0  # rounds without a draft in a row, this one included
        self.stop_ids = list(stop_ids)
        self._stream: Optional[DecodeStream] = None
        self.conversation = ""  # the generation's conversation id (routing: it stays on its replica)
        self.cache_salt = ""  # the generation's prefix-cache tenant key (sent with every call)
        self._kv: list[int] = []  # the tokens the replica's KV holds (recorded for routing when it ends)

    def _pin(self, session_id: str, avoid: Sequence[Peer] = (), tokens: Sequence[int] = ()) -> Peer:
        self.peer = self.replicas.pin(session_id, self.peer, avoid, tokens, self.conversation)
        if self.peer not in self._touched:
            self._touched.append(self.peer)
        return self.peer

    def prefer(self, address: str) -> bool:
        """Pin this generation to the replica at ``address`` (one holding a warm KV
        for its session) before the first call; False when there is no such replica."""
        if self.peer is not None:
            return self.peer.address == address
        for p in self.replicas.peers:
            if p.address == address:
                with self.replicas._lock:
                    p.load += 1
                self.peer = p
                self._touched.append(p)
                return True
        return False

    def verify(self, req: VerifyRequest) -> VerifyResult:
        plain = self._plain(req)
        self._plain_run = self._plain_run + 1 if plain else 0
        if plain and self.decode_left > 0 and (self._stream is not None or self._plain_run >= self.decode_after):
            res = self._decoded(req)
            if res is not None:
                self.decode_left -= len(res.accepted) + 1
                self._held(req, res)
                return res
        else:
            self._end_stream()
        res = self._verify(req)
        self.decode_left -= len(res.accepted) + 1  # the tokens this round yields
        self._held(req, res)
        return res

    def _held(self, req: VerifyRequest, res: VerifyResult) -> None:
        """The tokens the replica's KV holds after this round."""
        kv = self._kv
        del kv[req.keep_len:]
        kv.extend(req.append_tokens)
        kv.extend(res.accepted)

    def _verify(self, req: VerifyRequest) -> VerifyResult:
        peer = self.peer or self._pin(req.session_id, tokens=req.append_tokens if req.keep_len == 0 else ())
        if req.keep_len == 0 and self._calls:
            self.reprefills += 1
        self._calls += 1
        msg = convert.verify_request_to_proto(req)
        msg.cache_salt = self.cache_salt
        if self.features is not None:
            msg.feature_layers[:] = self.features.layers
        give_up, wait = time.monotonic() + self.retry_s, 0.05
        while True:
            t0 = time.perf_counter()
            try:
                resp = peer.stub.Verify(msg, timeout=self.calls.timeout(), metadata=self.calls.metadata)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise SessionLost(e.details()) from None
                if e.code() != grpc.StatusCode.UNAVAILABLE or self.calls.cancelled.is_set():
                    raise
                peer.health.failed()
                peer = self._pin(req.session_id, avoid=[peer], tokens=self._kv[:req.keep_len] + req.append_tokens)
                if req.keep_len > 0:  # the KV may be gone: rebuild from the committed tokens
                    raise SessionLost(f"verifier unavailable ({e.details()}); re-prefill") from None
                if time.monotonic() + wait > give_up:
                    raise
                time.sleep(wait)
                wait = min(2 * wait, 0.5)
        res = self._answered(peer, t0, resp)
        if self.features is not None:
            self.features.put(res.features, res.cache_len)
        return res

    def _plain(self, req: VerifyRequest) -> bool:
        """A round a Decode step answers: no draft from this loop (none, or the
        generation's self drafter's), nothing else asked for, and not the first round of
        the session on its replica (that one pins it and prefills)."""
        own = req.self_draft is None or (self.decode_self is not None and req.self_draft.method == self.decode_self)
        return (self.peer is not None and req.keep_len > 0 and not len(req.tree) and own
                and not req.feature_layers and self.features is None)

    def _decoded(self, req: VerifyRequest) -> Optional[VerifyResult]:
        """This plain round's result from the session's Decode stream (opened here when
        there is none or when the stream's next step is not this round); None where the
        stream failed or ended early: the round goes as a Verify call, which handles a
        lost session or replica as it always does."""
        key = (req.keep_len, tuple(req.append_tokens), req.want_entropy)
        budget = req.self_draft.budget if req.self_draft is not None else 0
        if self._stream is not None and self._stream.key != key:
            self._end_stream()
        if self._stream is None:
            msg = verifier_pb2.DecodeRequest(
                session_id=req.session_id, sync=convert.sync_to_proto(req.keep_len, req.append_tokens),
                sampling=convert.sampling_to_proto(req.sampling), stop_ids=self.stop_ids,
                want_entropy=req.want_entropy, jump_forward=req.jump_forward, cache_salt=self.cache_salt)
            if req.prompt_len >= 0:
                msg.prompt_len = req.prompt_len
            if self.decode_self is not None:  # drafts capped near the end as the loop caps them
                msg.self_draft.method, msg.self_draft.budget = self.decode_self, budget
                msg.tokens_left = self.decode_left
            self._stream = DecodeStream(self.peer.stub, msg, self.decode_left, self.decode_lead, key,
                                        timeout=self.calls.timeout(), metadata=self.calls.metadata, calls=self.calls)
        else:
            self._stream.set_budget(budget)  # from the next step the verifier starts (a step it decoded ahead
            # keeps the budget it had: with greedy acceptance the tokens are the same either way, and a
            # sampled request's budget is fixed)
        t0 = time.perf_counter()
        try:
            resp = next(self._stream)
        except StopIteration:  # a stop token ended it (the loop ended there too), or it ran every step
            self._end_stream()
            return None
        except grpc.RpcError as e:
            self._end_stream()
            if self.calls.cancelled.is_set():  # cancelled with the generation: no Verify call after it
                raise GenerationCancelled("the generation was cancelled") from None
            # the Verify call of this round answers with authority (or the error)
            self.decode_left = 0  # and every later round: no stream re-opened per round
            log.info("Decode stream failed (%s); plain rounds go as Verify calls", e.code())
            return None
        self._stream.key = (req.keep_len + len(req.append_tokens) + len(resp.accepted), (resp.next_token,),
                            req.want_entropy)
        self._calls += 1
        # the wait for a step decided while this loop was busy is ~0: only what exceeds the step counts
        res = self._answered(self.peer, t0, resp)
        res.source = "decode_stream"
        return res

    def _answered(self, peer: Peer, t0: float, resp) -> VerifyResult:
        """A verify answer from ``peer`` (asked at ``t0``): the replica is healthy, the wire
        time (the wait beyond the server's own time) is counted, the result converted."""
        peer.health.ok()
        self.address = peer.address
        self.network_s += max(0.0, time.perf_counter() - t0 - resp.server_ms / 1e3)
        return convert.verify_result_from_proto(resp)

    def drafting(self) -> None:
        """The loop is about to ask a drafter that computes for this round's draft: the
        Decode stream's steps ahead are no longer this session's next rounds (a drafted
        round is a Verify call) and the verifier decoding them would take the CPUs the
        draft needs, so the stream ends now rather than at the verify."""
        self._end_stream()

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    def release(self, session_id: str) -> None:
        """Free the session on every replica it touched (best effort: a dead
        replica holds nothing worth freeing)."""
        self._end_stream()
        if self.peer is not None:
            if self._kv and hasattr(self.replicas, "record"):
                self.replicas.record(self.peer.address, self._kv, self.conversation)
            self.replicas.unpin(self.peer)
            self.peer = None
        self._kv = []
        touched, self._touched = self._touched, []
        for p in touched:
            try:
                p.stub.Release(verifier_pb2.VerifierReleaseRequest(session_id=session_id),
                               timeout=RELEASE_TIMEOUT_S, metadata=self.calls.metadata)
            except grpc.RpcError:
                pass

    def info(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        peer = self.peer or self.replicas.peers[0]
        m = peer.stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=self.calls.timeout(),
                           metadata=self.calls.metadata)
        return MessageToDict(m, preserving_proto_field_name=True)


# ---------------------------------------------------------------- one-off calls (the strategy runner's)

def seed_cache(peer: Peer, cache_id: str, texts: Sequence[Sequence[int]], ttl_s: float, replace: bool,
               calls: Calls, timeout_s: float) -> None:
    """Seed (or replace) a draft cache on the drafter service (``Drafter/Seed``)."""
    req = drafter_pb2.SeedRequest(cache_id=cache_id, texts=[drafter_pb2.TokenList(tokens=list(t)) for t in texts],
                                  ttl_s=ttl_s, replace=replace)
    peer.stub.Seed(req, timeout=timeout_s, metadata=calls.metadata)


def prefill_session(peer: Peer, session_id: str, calls: Calls, timeout_s: float, tokens: Sequence[int] = (),
                    fork_from: str = "", fork_len: int = 0, cache_salt: str = "") -> int:
    """Open ``session_id`` on a verifier replica with ``tokens`` prefilled (its prefix cache
    blocks under ``cache_salt``), or as a fork of ``fork_from``'s first ``fork_len`` KV
    positions; returns its cache length."""
    req = verifier_pb2.PrefillRequest(session_id=session_id, tokens=list(tokens), fork_from=fork_from,
                                      fork_len=fork_len, cache_salt=cache_salt)
    return peer.stub.Prefill(req, timeout=timeout_s, metadata=calls.metadata).cache_len


def release_session(peer: Peer, session_id: str, calls: Calls) -> None:
    peer.stub.Release(verifier_pb2.VerifierReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S,
                      metadata=calls.metadata)


def verifier_drafter_names(peer: Peer, calls: Calls, timeout_s: float) -> Optional[tuple[frozenset, frozenset]]:
    """The in-verifier drafters a replica offers (``Verifier/Info``): its self drafters and
    the context-only drafters it runs for external requests; None when it does not answer."""
    try:
        m = peer.stub.Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout_s, metadata=calls.metadata)
    except grpc.RpcError as e:
        log.info("Info of verifier %s failed (%s); self drafters unknown there", peer.address, e.code())
        return None
    return frozenset(m.self_drafters), frozenset(m.context_drafters)


@dataclass(frozen=True)
class DrafterFacts:
    """What the drafter service's Info says the router needs: its drafters that need hidden
    features, name -> (layers, dim, context_window); the real draft model ``draft_lm`` runs
    ("" : the stand-in) and that model's measured speed (``DraftSpeed``, None: not measured)."""

    feature_drafters: dict
    draft_model: str = ""
    draft_speed: Optional["DraftSpeed"] = None


@dataclass(frozen=True)
class DraftSpeed:
    """A draft model's measured milliseconds per prompt token prefilled and per token drafted."""

    prefill_ms: float
    token_ms: float

    def deadline_s(self, base_s: float, prefill_tokens: int, budget: int, slack: float = 4.0) -> float:
        """A call's deadline: ``base_s`` plus ``slack`` times the call's work at this speed
        (the tokens it syncs, prefilled, and the budget drafted): a first Propose of a long
        prompt gets the time to prefill it; a busy machine, ``slack`` times the measured."""
        return base_s + slack * (prefill_tokens * self.prefill_ms + budget * self.token_ms) / 1e3


def drafter_facts(peer: Peer, calls: Calls, timeout_s: float) -> Optional[DrafterFacts]:
    """The drafter service's ``DrafterFacts`` (``Drafter/Info``); None when it does not answer."""
    try:
        m = peer.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s, metadata=calls.metadata)
    except grpc.RpcError as e:
        log.info("Info of the drafter service failed (%s); its feature drafters and draft model unknown", e.code())
        return None
    speed = DraftSpeed(m.draft_prefill_ms, m.draft_token_ms) if m.draft_token_ms > 0 else None
    return DrafterFacts({f.drafter: (tuple(f.layers), f.dim, f.context_window) for f in m.feature_drafters},
                        m.draft_model, speed)


def drafter_failure(e: BaseException) -> tuple[str, bool]:
    """(what failed, whether the drafter is down) for an exception a drafter call raised:
    down (UNAVAILABLE, DEADLINE_EXCEEDED) is retried after a backoff; anything else
    disables the drafter for the rest of the generation."""
    code = e.code() if isinstance(e, grpc.RpcError) else None
    return (code.name if code is not None else type(e).__name__), code in DOWN
