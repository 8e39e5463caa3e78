"""Session state of the drafter service: committed tokens synced by delta.

``DrafterHost`` keeps, per session, the committed token list the caller sent
(truncate to ``keep_len``, append the new tokens: rollback costs nothing on the
wire), a bounded number of sessions (least recently used evicted), and builds
the core drafters by name on first use (``prompt_lookup``, ``suffix``,
``adaptive_lookup``, ``cache``, ``draft_lm``). ``seed`` adds texts to the cache
drafter's per-conversation caches (proactive anticipation, SSR early answers).
Drafters that condition on the target's hidden states (the registry's
``needs_features``: the block drafter's ``block`` / ``block_tree``) also get the
session's feature rows synced by delta (``FeatureRows``; the drafter checks them,
``BlockFeatureDrafter.check_features``, before any state changes).
Every drafter call (build, propose, seed, finish, release) runs through ``run``:
in the service, the process's model thread (``specmesh.threads``), so a draft
model loads and runs on one thread only. Every input is validated before any state changes; a
``keep_len`` beyond what it holds raises ``SessionLost`` (the caller resends
from 0). Each drafter runs under its own lock (the draft LM's KV slots are not
thread-safe).

It knows nothing about gRPC, the verifier or acceptance rules.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specmesh.ahead import AheadDrafter, AheadInfo
from specmesh.drafters import registry
from specmesh.drafters.base import Drafter
from specmesh.types import DraftContext, FeatureRows, InvalidArgument, SamplingParams, SessionLost, TokenTree


CACHE_DRAFTER = "cache"
MAX_CACHE_ID = 128
MAX_SEED_TOKENS = 65536


@dataclass
class _Session:
    tokens: list[int]
    prompt_len: int
    drafter: str


class DrafterHost:
    def __init__(self, factories: dict[str, Callable[[], Drafter]], vocab_size: int, max_sessions: int = 1024,
                 max_tree_nodes: int = 64, run: Optional[Callable] = None):
        self.factories = dict(factories)
        self.run = run or (lambda fn, *a, **kw: fn(*a, **kw))  # where drafter work runs (a ModelThread.run)
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self.max_tree_nodes = max_tree_nodes
        self.proposals = 0
        self._drafters: dict[str, Drafter] = {}
        self._locks = {name: threading.Lock() for name in self.factories}
        self._sessions: "OrderedDict[str, _Session]" = OrderedDict()
        self._lock = threading.Lock()
        self._ahead: dict[str, AheadDrafter] = {}  # draft-ahead caches, made by the first ProposeAhead
        self.ahead_options: dict = {}  # their AheadDrafter options (width, max_outcomes, ttl_s)
        self.draft_model = ""  # the real draft model draft_lm runs, loaded and measured (load_draft_model)
        self.draft_speed = (0.0, 0.0)  # its ms per prompt token prefilled and per token drafted

    @property
    def names(self) -> list[str]:
        return sorted(self.factories)

    def _drafter(self, name: str) -> Drafter:
        d = self._drafters.get(name)  # built: no lock (its lock may be held by a draft-ahead round, which
        if d is not None:  # the call asking for it may have come to cancel)
            return d
        with self._locks[name]:
            d = self._drafters.get(name)
            if d is None:
                d = self._drafters[name] = self.run(self.factories[name])
            return d

    def _tokens(self, held: list[int], keep_len: int, append: Sequence[int], field: str = "sync") -> list[int]:
        if keep_len < 0:
            raise InvalidArgument(f"{field}.keep_len", f"must be >= 0, got {keep_len}")
        for t in append:
            if t < 0 or t >= self.vocab_size:
                raise InvalidArgument(f"{field}.append_tokens", f"token id {t} outside [0, {self.vocab_size})")
        if keep_len > len(held):
            raise SessionLost(f"drafter holds {len(held)} tokens < keep_len {keep_len}; resend with keep_len=0")
        return held[:keep_len] + list(append)

    def _synced(self, session_id: str, keep_len: int, append: Sequence[int], prompt_len: int):
        """(the session or None, its tokens after the delta), validated; changes nothing
        (the caller holds ``_lock``)."""
        s = self._sessions.get(session_id)
        tokens = self._tokens(s.tokens if s else [], keep_len, append)
        if not tokens:
            raise InvalidArgument("sync.append_tokens", "the session holds no tokens")
        if not 0 <= prompt_len <= len(tokens):
            raise InvalidArgument("prompt_len", f"must be in [0, {len(tokens)}], got {prompt_len}")
        return s, tokens

    def needs_features(self, name: str) -> bool:
        return name in self.factories and registry.needs_features(name, "external")

    def preload(self, names: Sequence[str]) -> None:
        """Build these hosted drafters now (a draft LM's load should not be charged to the
        first request's deadline); unknown names are ignored."""
        for name in names:
            if name in self.factories:
                self._drafter(name)

    def load_draft_model(self, model: str) -> None:
        """Build ``draft_lm`` now and measure its speed (``DraftLMDrafter.measure_speed``, on
        the model thread); Info then names ``model`` as the real draft model it runs."""
        d = self._drafter("draft_lm")
        measure = getattr(d, "measure_speed", None)
        if measure is not None:
            with self._locks["draft_lm"]:
                self.draft_speed = tuple(self.run(measure))
        self.draft_model = model

    def feature_drafters(self) -> list[dict]:
        """The hosted drafters that need features, and which (builds them on first use)."""
        out = []
        for name in self.names:
            if self.needs_features(name):
                d = self._drafter(name)
                out.append({"drafter": name, "layers": list(d.feature_layers), "dim": d.feature_dim,
                            "context_window": d.context_window})
        return out

    def propose(self, session_id: str, drafter: str, keep_len: int, append: Sequence[int], prompt_len: int,
                sampling: SamplingParams, budget: int, cache_id: str = "",
                features: Optional[FeatureRows] = None) -> tuple[TokenTree, int, float]:
        """Sync the session and draft; returns (tree, tokens held, draft ms). ``cache_id``
        names the draft cache the "cache" drafter reads; ``features`` is the delta of the
        session's hidden features (feature drafters only)."""
        return self.propose_info(session_id, drafter, keep_len, append, prompt_len, sampling, budget, cache_id,
                                 features)[:3]

    def propose_info(self, session_id: str, drafter: str, keep_len: int, append: Sequence[int], prompt_len: int,
                     sampling: SamplingParams, budget: int, cache_id: str = "",
                     features: Optional[FeatureRows] = None) -> tuple[TokenTree, int, float, AheadInfo]:
        """``propose``, plus how the draft was obtained: from a drafted-ahead round
        (``propose_ahead``) or not (``ahead.AheadInfo``)."""
        if drafter not in self.factories:
            raise InvalidArgument("drafter", f"unknown drafter {drafter!r}; available: {self.names}")
        if len(cache_id.encode()) > MAX_CACHE_ID:
            raise InvalidArgument("cache_id", f"longer than {MAX_CACHE_ID} bytes")
        if not 0 <= budget <= self.max_tree_nodes:
            raise InvalidArgument("budget", f"must be in [0, {self.max_tree_nodes}], got {budget}")
        fd = self._drafter(drafter) if self.needs_features(drafter) else None  # built before any session change
        if features is not None and fd is None:
            raise InvalidArgument("features", f"drafter {drafter!r} takes no features")
        with self._lock:
            s, tokens = self._synced(session_id, keep_len, append, prompt_len)
            if fd is not None:
                with self._locks[drafter]:
                    fd.check_features(session_id, features, keep_len, len(tokens))
            # ---- valid: change state
            evicted = []
            if s is not None and s.drafter != drafter:
                evicted.append((session_id, s.drafter))
            self._sessions[session_id] = _Session(tokens, prompt_len, drafter)
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                sid, old = self._sessions.popitem(last=False)
                evicted.append((sid, old.drafter))
            self.proposals += 1
        for sid, name in evicted:
            self._release_in(name, sid, None)
        d = self._drafter(drafter)
        t0 = time.perf_counter()
        ahead = self._ahead.get(drafter)
        if ahead is not None and fd is None:  # its lock and the model thread are taken inside
            tree, info = ahead.propose_info(DraftContext(session_id, tokens, prompt_len, sampling, cache_id), budget)
            return tree, len(tokens), (time.perf_counter() - t0) * 1e3, info
        with self._locks[drafter]:
            tree = self.run(self._propose_in, d, fd, features, keep_len,
                            DraftContext(session_id, tokens, prompt_len, sampling, cache_id), budget)
        return tree, len(tokens), (time.perf_counter() - t0) * 1e3, AheadInfo()

    def propose_ahead(self, session_id: str, drafter: str, keep_len: int, append: Sequence[int], prompt_len: int,
                      sampling: SamplingParams, tree: TokenTree, budget: int, cache_id: str = "") -> int:
        """Round r (the session synced like ``propose``; ``tree`` its draft) is being
        verified: draft round r+1 ahead for its likely outcomes (``specmesh.ahead``) and
        return at once with the tokens held. Token-only drafters."""
        if drafter not in self.factories:
            raise InvalidArgument("drafter", f"unknown drafter {drafter!r}; available: {self.names}")
        if self.needs_features(drafter):
            raise InvalidArgument("drafter", f"{drafter!r} needs the target's hidden features: no draft-ahead")
        if len(cache_id.encode()) > MAX_CACHE_ID:
            raise InvalidArgument("cache_id", f"longer than {MAX_CACHE_ID} bytes")
        if not 1 <= budget <= self.max_tree_nodes:
            raise InvalidArgument("budget", f"must be in [1, {self.max_tree_nodes}], got {budget}")
        if len(tree) > self.max_tree_nodes:
            raise InvalidArgument("tree", f"{len(tree)} nodes exceed max_tree_nodes {self.max_tree_nodes}")
        if len(tree.parents) != len(tree.tokens):
            raise InvalidArgument("tree.parents", f"{len(tree.parents)} parents for {len(tree.tokens)} tokens")
        for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument("tree.tokens", f"token id {t} outside [0, {self.vocab_size})")
            if not -1 <= p < i:
                raise InvalidArgument("tree.parents", f"node {i} has parent {p}: must be in [-1, {i})")
        d = self._drafter(drafter)
        with self._lock:
            s, tokens = self._synced(session_id, keep_len, append, prompt_len)
            if s is not None and s.drafter != drafter:
                raise InvalidArgument("drafter", f"session {session_id!r} drafts with {s.drafter!r}")
            # ---- valid: change state
            self._sessions[session_id] = _Session(tokens, prompt_len, drafter)
            self._sessions.move_to_end(session_id)
            ahead = self._ahead.get(drafter)
            if ahead is None:
                ahead = self._ahead[drafter] = AheadDrafter(  # drafter work where the host runs it (run)
                    d, lock=self._locks[drafter], run=self.run, max_sessions=self.max_sessions,
                    **self.ahead_options)
        ahead.propose_ahead(DraftContext(session_id, tokens, prompt_len, sampling, cache_id), tree, budget)
        return len(tokens)

    def first_round(self, session_id: str, drafter: str, held: int, timeout: float):
        """After ``propose_ahead``: the session's first ahead round ("all accepted"), as
        (the tokens it assumes after the ``held`` ones, its draft, its ``AheadInfo``), once
        drafted (waits up to ``timeout`` s); None where it was not."""
        ahead = self._ahead.get(drafter)
        got = ahead.first_round(session_id, timeout) if ahead is not None else None
        if got is None:
            return None
        tokens, tree, info = got
        return tokens[held:], tree, info

    @staticmethod
    def _propose_in(d: Drafter, fd, features, keep_len: int, ctx: DraftContext, budget: int) -> TokenTree:
        if fd is not None:
            fd.sync_features(ctx.session_id, features, keep_len)
        return d.propose(ctx, budget)

    def seed(self, cache_id: str, texts: Sequence[Sequence[int]], ttl_s: float = 0.0,
             replace: bool = False) -> tuple[int, int]:
        """Add token texts to a draft cache of the "cache" drafter; returns (texts, tokens) held."""
        if CACHE_DRAFTER not in self.factories:
            raise InvalidArgument("cache_id", "this drafter service has no cache drafter")
        if not cache_id or len(cache_id.encode()) > MAX_CACHE_ID:
            raise InvalidArgument("cache_id", f"must be non-empty and at most {MAX_CACHE_ID} bytes")
        if ttl_s < 0:
            raise InvalidArgument("ttl_s", f"must be >= 0, got {ttl_s}")
        total = 0
        for i, t in enumerate(texts):
            total += len(t)
            for x in t:
                if x < 0 or x >= self.vocab_size:
                    raise InvalidArgument("texts", f"text {i} has token id {x} outside [0, {self.vocab_size})")
        if total > MAX_SEED_TOKENS:
            raise InvalidArgument("texts", f"{total} tokens exceed the limit {MAX_SEED_TOKENS} per call")
        d = self._drafter(CACHE_DRAFTER)
        with self._locks[CACHE_DRAFTER]:
            return self.run(d.seed, cache_id, texts, ttl_s or None, replace)

    def release(self, session_id: str, finished: bool = False, keep_len: int = 0, append: Sequence[int] = (),
                prompt_len: int = 0) -> bool:
        """Forget the session; when ``finished``, the drafter first absorbs the
        final tokens (held tokens synced by the final delta)."""
        with self._lock:
            s = self._sessions.get(session_id)
            final = None
            if s is not None and finished:
                final = self._tokens(s.tokens, keep_len, append)
                if not 0 <= prompt_len <= len(final):
                    raise InvalidArgument("prompt_len", f"must be in [0, {len(final)}], got {prompt_len}")
            self._sessions.pop(session_id, None)
        if s is not None:
            self._release_in(s.drafter, session_id, (final, prompt_len) if final is not None else None)
        return s is not None

    def _release_in(self, name: str, session_id: str, final: Optional[tuple[list[int], int]]) -> None:
        d = self._drafters.get(name)
        if d is None:
            return
        if name in self._ahead:  # cancel its ahead work; the drafter state goes after any round in flight
            self._ahead[name].forget(session_id)
        with self._locks[name]:
            if final is not None:
                self.run(d.finish, session_id, final[0], final[1])
            else:
                self.run(d.release, session_id)

    def reset(self, names: Sequence[str]) -> None:
        """Drop the named drafters (rebuilt on next use): forgets what they learned
        across sessions, e.g. suffix decoding's global tree (benchmarks use it so
        repeated prompts do not draft from each other's outputs)."""
        for name in names:
            if name in self._locks:
                with self._locks[name]:
                    self._drafters.pop(name, None)
                ahead = self._ahead.pop(name, None)
                if ahead is not None:
                    ahead.close()

    def info(self) -> dict:
        with self._lock:
            ids = list(self._sessions)
        return {"drafters": self.names, "sessions": len(ids), "session_ids": ids[:1000],
                "max_sessions": self.max_sessions, "proposals": self.proposals, "vocab_size": self.vocab_size,
                "max_tree_nodes": self.max_tree_nodes, "feature_drafters": self.feature_drafters(),
                "draft_model": self.draft_model, "draft_prefill_ms": self.draft_speed[0],
                "draft_token_ms": self.draft_speed[1]}
