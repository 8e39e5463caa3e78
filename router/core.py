"""The router's logic: validate a generation request, pick its strategy, run the
draft–verify loop over the remote drafter and verifier, stream text deltas.

``Router.start(spec, ...)`` validates every field before anything changes
(INVALID_ARGUMENT naming the field) and returns a ``Generation``: an iterator of
``Delta`` events and one ``Final`` event. The generation runs
``specmesh.loop.speculative_generate`` with a ``RemoteVerifier`` (session
pinned to a replica; the loop re-prefills from the committed tokens it holds
when a replica loses the session or dies) and, for the ``external`` strategy, a
``RemoteDrafter`` (a dead drafter degrades the rounds to plain decoding, so
greedy output never changes). ``Generation.cancel()`` (client cancelled, or
deadline passed) stops it between rounds and releases the session on the
verifier and the drafter.

Strategies now: ``autoregressive``, ``external`` (drafter = prompt_lookup |
suffix | draft_lm), ``self`` (layerskip inside the verifier) and ``auto``
(external when the drafter is up, else autoregressive).

It knows nothing about protos or servers; tokenization goes through ``codec``
(``encode(prompt, messages, chat)``, ``decode(ids)``, ``stop_ids``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import grpc

from specmesh.loop import speculative_generate
from specmesh.serving.adapters import DOWN, Calls, Peer, RemoteDrafter, RemoteVerifier, ReplicaSet
from specmesh.serving.convert import RouterStats
from specmesh.serving.settings import ServeSettings
from specmesh.types import InvalidArgument, ResourceExhausted, SamplingParams

log = logging.getLogger("specmesh.router")

STRATEGIES = {
    "autoregressive": "plain decoding through the verifier (baseline and fallback)",
    "external": "a drafter service proposes, the verifier verifies (drafter: prompt_lookup | suffix | draft_lm)",
    "self": "layer-skip drafting with the target's own first layers inside the verifier (no drafter hop)",
    "auto": "external with the default drafter while the drafter service is up, else autoregressive",
}
EXTERNAL_DRAFTERS = ("prompt_lookup", "suffix", "draft_lm")
SELF_DRAFTERS = ("layerskip",)
ROLES = ("system", "user", "assistant")


@dataclass
class GenerateSpec:
    """A generation request in domain terms (what GenerateRequest carries)."""

    prompt: str = ""
    messages: Optional[list[dict]] = None
    strategy: str = ""
    drafter: str = ""
    max_new_tokens: Optional[int] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_budget: Optional[int] = None
    raw_prompt: bool = False


@dataclass
class Delta:
    token_ids: list[int]
    text: str


@dataclass
class Final:
    text: str
    token_ids: list[int]
    stats: RouterStats
    session_id: str


@dataclass
class Plan:
    ids: list[int]
    strategy: str
    reason: str
    drafter: Optional[str]  # external drafter name
    self_draft: Optional[str]  # in-verifier drafter name
    max_new_tokens: int
    budget: int
    sampling: SamplingParams


class TextStream:
    """Incremental detokenization: text of new tokens is decode(window + new) minus
    decode(window), emitted only when it does not end in an incomplete character
    (U+FFFD), so the concatenated deltas equal the final text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class Generation:
    """Iterator of Delta events then one Final; ``cancel()`` may come from any thread."""

    def __init__(self, events: Iterator, cancelled: threading.Event):
        self._events, self.cancelled = events, cancelled
        self._lock = threading.Lock()
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if self._done:
                raise StopIteration
            try:
                return next(self._events)
            except BaseException:
                self._done = True
                raise

    def cancel(self) -> None:
        """Stop between rounds and release the session (returns at once)."""
        if self._done:
            return
        self.cancelled.set()
        threading.Thread(target=self._close, name="specmesh-cancel", daemon=True).start()

    def _close(self) -> None:
        with self._lock:  # waits for a running round to end
            self._done = True
            self._events.close()


class Router:
    def __init__(self, settings: ServeSettings, codec, replicas: ReplicaSet, drafter: Optional[Peer],
                 vocab_size: int, token: Optional[str] = None):
        self.s, self.codec, self.replicas, self.drafter = settings, codec, replicas, drafter
        self.vocab_size, self.token = vocab_size, token
        self._clients: dict[str, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ validation
    def _strategy(self, spec: GenerateSpec) -> tuple[str, str, Optional[str], Optional[str]]:
        name = spec.strategy or ("external" if spec.drafter else self.s.default_strategy)
        reason = "requested" if spec.strategy else "default"
        if name not in STRATEGIES:
            raise InvalidArgument("strategy", f"unknown strategy {spec.strategy!r}; known: {sorted(STRATEGIES)}")
        if name == "auto":
            up = self.drafter is not None and self.drafter.health.available()
            name, reason = ("external", "auto: drafter up") if up else ("autoregressive", "auto: no drafter up")
        if name == "self":
            if spec.drafter not in ("",) + SELF_DRAFTERS:
                raise InvalidArgument("drafter", f"the self strategy drafts with {list(SELF_DRAFTERS)}, "
                                      f"got {spec.drafter!r}")
            return name, reason, None, spec.drafter or SELF_DRAFTERS[0]
        if name == "external":
            d = spec.drafter or self.s.default_drafter
            if d not in EXTERNAL_DRAFTERS:
                raise InvalidArgument("drafter", f"unknown drafter {d!r}; known: {list(EXTERNAL_DRAFTERS)}")
            if self.drafter is None:
                raise InvalidArgument("strategy", "external needs a drafter service and this router has none")
            return name, reason, d, None
        if spec.drafter and spec.strategy == "autoregressive":
            raise InvalidArgument("drafter", "strategy 'autoregressive' takes no drafter")
        return name, reason, None, None

    def _prompt_ids(self, spec: GenerateSpec) -> list[int]:
        if spec.prompt and spec.messages:
            raise InvalidArgument("prompt", "give prompt or messages, not both")
        if not spec.prompt and not spec.messages:
            raise InvalidArgument("prompt", "is empty (give prompt or messages)")
        limit = self.s.max_prompt_tokens
        for i, m in enumerate(spec.messages or []):
            if m.get("role") not in ROLES:
                raise InvalidArgument("messages", f"entry {i} has role {m.get('role')!r}; use one of {list(ROLES)}")
        chars = len(spec.prompt) + sum(len(m.get("content", "")) for m in spec.messages or [])
        if chars > 32 * limit:  # cheap guard before tokenizing
            raise InvalidArgument("prompt", f"{chars} characters is far over max_prompt_tokens {limit}")
        ids = self.codec.encode(spec.prompt or None, spec.messages, chat=not spec.raw_prompt)
        if not ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        if len(ids) > limit:
            raise InvalidArgument("prompt", f"{len(ids)} tokens exceed max_prompt_tokens {limit}")
        return ids

    def plan(self, spec: GenerateSpec) -> Plan:
        """Validate every field (INVALID_ARGUMENT naming it); nothing changes."""
        strategy, reason, drafter, self_draft = self._strategy(spec)
        n = self.s.default_max_new_tokens if spec.max_new_tokens is None else spec.max_new_tokens
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument("max_new_tokens", f"must be a positive integer, got {n!r}")
        if n > self.s.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"{n} exceeds the limit {self.s.max_new_tokens}")
        budget = self.s.draft_budget if spec.draft_budget is None else spec.draft_budget
        if not 1 <= budget <= self.s.max_tree_nodes:
            raise InvalidArgument("draft_budget", f"must be in [1, {self.s.max_tree_nodes}], got {budget}")
        ids = self._prompt_ids(spec)
        if len(ids) + n + 1 > self.s.max_seq_len:
            raise InvalidArgument("max_new_tokens", f"prompt ({len(ids)} tokens) + {n} new tokens exceed the "
                                  f"context of {self.s.max_seq_len} tokens")
        return Plan(ids, strategy, reason, drafter, self_draft, n, budget, spec.sampling)

    # ------------------------------------------------------------ generation
    def start(self, spec: GenerateSpec, client: str = "", deadline: Optional[float] = None) -> Generation:
        plan = self.plan(spec)
        cancelled = threading.Event()
        return Generation(self._events(plan, client, deadline, cancelled), cancelled)

    def _acquire(self, client: str) -> None:
        with self._lock:
            n = self._clients.get(client, 0)
            if n >= self.s.max_sessions_per_client:
                raise ResourceExhausted(f"client {client!r} has {n} active generations "
                                        f"(max_sessions_per_client {self.s.max_sessions_per_client})")
            self._clients[client] = n + 1

    def _release(self, client: str) -> None:
        with self._lock:
            self._clients[client] -= 1
            if not self._clients[client]:
                del self._clients[client]

    def _drafter_error(self, e: Exception):
        code = e.code() if isinstance(e, grpc.RpcError) else None
        log.warning("drafter failed (%s); falling back to plain decoding", code or type(e).__name__)
        return None if code in DOWN else False  # an unexpected error disables the drafter for this request

    def _events(self, plan: Plan, client: str, deadline: Optional[float],
                cancelled: threading.Event) -> Iterator[Union[Delta, Final]]:
        self._acquire(client)
        try:
            sid = uuid.uuid4().hex
            calls = Calls(self.token, self.s.verifier_timeout_s, deadline, cancelled)
            verifier = RemoteVerifier(self.replicas, self.vocab_size, calls, self.s.verifier_retry_s)
            drafter = RemoteDrafter(self.drafter, plan.drafter, calls, self.s.drafter_timeout_s) \
                if plan.drafter else None
            stats = RouterStats(strategy=plan.strategy, strategy_reason=plan.reason,
                                drafter=plan.drafter or plan.self_draft or "")
            text = TextStream(self.codec.decode)
            out_ids: list[int] = []
            pieces: list[str] = []
            rounds = speculative_generate(drafter, verifier, plan.ids, plan.sampling, plan.max_new_tokens,
                                          self.codec.stop_ids, sid, plan.budget, stats, plan.self_draft,
                                          self._drafter_error, self.s.max_new_tokens)
            try:
                for chunk in rounds:
                    out_ids += chunk
                    pieces.append(text.push(chunk))
                    yield Delta(chunk, pieces[-1])
                    if cancelled.is_set():
                        return
            finally:
                rounds.close()  # the loop's own finally releases verifier and drafter sessions
            tail = text.flush()
            if tail:
                pieces.append(tail)
                yield Delta([], tail)
            stats.network_s = verifier.network_s + (drafter.network_s if drafter else 0.0)
            stats.fallbacks += drafter.skipped if drafter else 0  # rounds undrafted while the drafter was down
            stats.verifier, stats.reprefills = verifier.address, verifier.reprefills
            yield Final("".join(pieces), out_ids, stats, sid)
        finally:
            self._release(client)

    # ------------------------------------------------------------ listing
    def strategies(self) -> list[dict]:
        up = self.drafter is not None and self.drafter.health.available()
        avail = {"autoregressive": True, "external": up, "self": True, "auto": True}
        drafters = {"external": list(EXTERNAL_DRAFTERS), "self": list(SELF_DRAFTERS),
                    "auto": [self.s.default_drafter], "autoregressive": []}
        return [{"name": k, "description": v, "drafters": drafters[k], "available": avail[k]}
                for k, v in STRATEGIES.items()]

    def close(self) -> None:
        self.replicas.close()
        if self.drafter is not None:
            self.drafter.channel.close()


def monotonic_deadline(time_remaining: Optional[float]) -> Optional[float]:
    return None if time_remaining is None else time.monotonic() + time_remaining
