"""Draft-ahead (decoupled speculation): the drafter drafts round r+1 while round r verifies.

While the verifier scores round r, ``AheadDrafter`` drafts round r+1 on its own
worker thread for the outcomes of round r that are likely (``assumed_outcomes``,
in this order):

- "all": every drafted token of the main path accepted, and the bonus token is the
  drafter's own next guess after it;
- "reject@k" for k = 0, 1, ...: the first k accepted, and the target's token at k
  is the drafter's second choice there (its best guess other than the rejected draft).

Each ahead round is exactly the call the drafter would get after that outcome:
``propose(DraftContext(session, assumed tokens, ...), budget)``, whose draws come
from ``seeding.draft_generator``, keyed by the committed length it assumes — so on
a hit the draft is the one drafting afresh would have drawn, token for token and
draw for draw. When the real outcome arrives, ``propose`` is answered from the
cache when an ahead round assumed exactly those committed tokens (the key is
(session, committed length, last token); the hit check compares every committed
token and the sampling); otherwise it drafts from the real outcome as before
(a miss, with its reason). An ahead round still being drafted for the real outcome
is waited for; the rest of the fan-out is cancelled, and a drafter that can stop
between tokens (``preemptible``: the draft LM) drops the round it is drafting at
once, so a miss costs the real round at most one draft step more than drafting
without overlap.

The cache is bounded: at most ``max_outcomes`` entries per session (each ahead
call replaces the last one's), ``max_sessions`` sessions (least recently used
dropped), and nothing older than ``ttl_s`` is used or kept. ``release`` cancels a
session's ahead work; an outcome already running finishes under the drafter's lock
and the session's drafter state is freed after it.

``OverlapPolicy`` is the budget policy's overlap half: whether to draft ahead this
round ("off", "on", or "auto": measured seconds per committed token with and
without overlap, and the hit rate; off where overlap does not pay).
``AHEAD_DEFAULT`` is the one switch for the default.

The verifier never sees any of this: it verifies whatever draft it is sent, so
output is unchanged (greedy: token for token; sampled: the same distribution).
Knows nothing about models, gRPC or acceptance rules.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from .types import DraftContext, InvalidArgument, SamplingParams, TokenTree

AHEAD_DEFAULT = "off"  # THE switch: the default overlap mode of the loop, `specmesh bench` and the router
MODES = ("off", "on", "auto")
GREEDY = SamplingParams(temperature=0.0)


def check_mode(mode: str, field_name: str = "draft_ahead") -> str:
    if mode not in MODES:
        raise InvalidArgument(field_name, f"must be one of {list(MODES)}, got {mode!r}")
    return mode


# ---------------------------------------------------------------- outcomes (pure)

def main_path(tree: TokenTree) -> list[int]:
    """The draft's main path: from the root, each node's first child (a chain: the chain)."""
    first: dict[int, int] = {}
    for i, p in enumerate(tree.parents):
        first.setdefault(p, i)
    out, node = [], -1
    while node in first:
        node = first[node]
        out.append(tree.tokens[node])
    return out


def assumed_outcomes(tokens: Sequence[int], tree: TokenTree, guess: Callable[[list[int], int], list[int]],
                     width: int = 1) -> Iterator[tuple[str, list[int]]]:
    """(kind, committed tokens after round r) for the likely outcomes, most useful first,
    lazily (``guess(tokens, n)``: the drafter's n best next tokens; each call may cost a
    drafter step, so the caller stops when the verify result arrives). ``width``: how many
    of the drafter's guesses each outcome is tried with (1: the bonus token is its best
    guess, a rejection's correction its second choice there; more widens the fan-out,
    rank by rank: every "all" and "reject@k" outcome with its r-th guess before any with
    its (r+1)-th)."""
    base, path = list(tokens), main_path(tree)
    seen: set[tuple[int, ...]] = set()
    known: dict[int, list[int]] = {}

    def alts(k: int) -> list[int]:  # guesses after the first k drafted tokens (k = len(path): the bonus)
        if k not in known:
            g = guess(base + path[:k], width + (k < len(path)))
            known[k] = [t for t in g if k == len(path) or t != path[k]][:width]
        return known[k]

    for rank in range(width):
        for k in [len(path)] + list(range(len(path))):
            a = alts(k)
            if rank < len(a) and tuple(path[:k]) + (a[rank],) not in seen:
                seen.add(tuple(path[:k]) + (a[rank],))
                yield ("all" if k == len(path) else f"reject@{k}"), base + path[:k] + [a[rank]]


def truncate(tree: TokenTree, budget: int) -> TokenTree:
    """The first ``budget`` nodes (parents come before children: still a tree; a chain's
    prefix is what a sequential drafter draws with the smaller budget)."""
    if len(tree) <= budget:
        return tree
    return TokenTree(list(tree.tokens[:budget]), list(tree.parents[:budget]),
                     None if tree.q_ids is None else list(tree.q_ids[:budget]),
                     None if tree.q_probs is None else list(tree.q_probs[:budget]), tree.source, tree.siblings)


def guess_next(drafter, ctx: DraftContext, n: int) -> list[int]:
    """The drafter's ``n`` best next tokens after ``ctx.tokens``, no randomness drawn: its
    own ``guess`` when it has one (the draft LM: top-n of its logits), else the root
    children of a greedy proposal."""
    own = getattr(drafter, "guess", None)
    if own is not None:
        return list(own(ctx, n))
    g = DraftContext(ctx.session_id, ctx.tokens, ctx.prompt_len, GREEDY, ctx.cache_id)
    tree = drafter.propose(g, n)
    return [t for t, p in zip(tree.tokens, tree.parents) if p == -1][:n]


# ---------------------------------------------------------------- the cache and its worker

@dataclass
class AheadInfo:
    """How a round's draft was obtained (returned with each propose).

    result: "hit" (from a drafted-ahead round), "miss" (drafted afresh) or "off" (no
    ahead round was asked for). reason (miss): "outcome" (no ahead round assumed this
    outcome), "unfinished" (its turn had not come when the result arrived), "expired"
    (older than the TTL), "error" (the ahead round failed), "none" (no ahead work).
    ahead_s: the drafter's seconds on ahead rounds for this round (overlapped with the
    verify); wasted: drafted-ahead tokens of outcomes that did not happen; outcomes:
    ahead rounds drafted; span: (start, end) perf_counter seconds of the ahead work;
    asked: perf_counter seconds when the ahead work was asked for."""

    result: str = "off"
    reason: str = ""
    ahead_s: float = 0.0
    wasted: int = 0
    outcomes: int = 0
    span: Optional[tuple[float, float]] = None
    asked: Optional[float] = None


@dataclass
class _Entry:
    tokens: tuple
    skey: tuple
    born: float
    kind: str
    tree: Optional[TokenTree] = None
    done: threading.Event = field(default_factory=threading.Event)
    wanted: bool = False  # the real outcome: drafted to the end even though the job is cancelled


class _Job:
    def __init__(self, gen: int, it: Iterator, ctx: DraftContext, budget: int):
        self.gen, self.it, self.ctx, self.budget = gen, it, ctx, budget
        self.drafted = 0
        self.first: Optional[_Entry] = None  # its first ahead round, once drafted whole (``first_round``)
        self.first_done = threading.Event()  # set when that round is drafted, or will not be


class _Session:
    def __init__(self, now: float):
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.gen = 0
        self.job: Optional[_Job] = None
        self.last: Optional[_Job] = None  # the latest ahead call's job, for ``first_round``
        self.queued = False
        self.released = False
        self.asked = False  # an ahead call since the last propose
        self.used = now
        self.ahead_s = 0.0
        self.span: Optional[list[float]] = None
        self.asked_at = time.perf_counter()
        self.error = False
        self.idle = threading.Event()  # no ahead job pending (``settle``)
        self.idle.set()


def _skey(s: SamplingParams, prompt_len: int, cache_id: str) -> tuple:
    return (s.temperature, s.top_k, s.top_p, s.seed, s.acceptance, prompt_len, cache_id)


class AheadDrafter:
    """The drafter contract plus ``propose_ahead`` over any token-only drafter (see the
    module docstring). ``lock`` guards every call into ``drafter`` (pass the lock the
    owner already uses for it; it is taken before ``run``) and ``run(fn, *args)`` makes
    each call (the drafter service passes its model thread's ``run``; default: a plain
    call). One worker thread drafts the ahead rounds of every session, one outcome at a
    time, round-robin between sessions."""

    def __init__(self, drafter, max_outcomes: int = 4, ttl_s: float = 30.0, max_sessions: int = 1024,
                 lock: Optional[threading.Lock] = None, clock: Callable[[], float] = time.monotonic,
                 run: Optional[Callable] = None, width: int = 1):
        self.width = width  # guesses per outcome (``assumed_outcomes``)
        self.run = run or (lambda fn, *a: fn(*a))
        self.drafter = drafter
        self.name = getattr(drafter, "name", "drafter")
        self.max_outcomes, self.ttl_s, self.max_sessions = max_outcomes, ttl_s, max_sessions
        self.lock = lock or threading.Lock()
        self.clock = clock
        self._sessions: "OrderedDict[str, _Session]" = OrderedDict()
        self._mu = threading.Lock()  # guards _sessions, the queue and every _Session's fields
        self._queue: deque = deque()
        self._wake = threading.Condition(self._mu)
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self.wasted_tokens = 0
        self.hits = self.misses = 0

    # ------------------------------------------------------------ contract
    def propose(self, ctx: DraftContext, budget: int) -> TokenTree:
        return self.propose_info(ctx, budget)[0]

    def propose_info(self, ctx: DraftContext, budget: int) -> tuple[TokenTree, AheadInfo]:
        """The round's draft: from the ahead cache on a hit, else drafted now (after the
        ahead round in flight, if any, finishes)."""
        now = self.clock()
        with self._mu:
            st = self._sessions.get(ctx.session_id)
            info = AheadInfo()
            entry, job_left = None, False
            if st is not None and st.asked:
                info.result = "miss"
                job_left = st.job is not None and st.job.drafted < self.max_outcomes
                entry = self._find(st, ctx)
                if entry is not None:
                    entry.wanted = True
                if st.job is not None:
                    st.job.first_done.set()
                st.gen += 1  # cancel the rest of the fan-out (a preemptible drafter stops within a token)
                st.job = None
                st.idle.set()
        if entry is not None:
            entry.done.wait()  # the ahead round of this very outcome is being drafted: it is ours
        with self._mu:
            if st is not None and st.asked:
                st.asked = False
                info.ahead_s, info.span = st.ahead_s, (tuple(st.span) if st.span else None)
                info.asked = st.asked_at
                info.outcomes = sum(1 for e in st.entries.values() if e.done.is_set())
                st.ahead_s, st.span = 0.0, None
                if entry is not None and entry.tree is not None and now - entry.born <= self.ttl_s:
                    info.result = "hit"
                elif entry is not None:
                    info.reason = "expired" if entry.tree is not None else "error"
                    entry = None
                elif st.error:
                    info.reason = "error"
                else:
                    info.reason = "unfinished" if job_left else "outcome"
                info.wasted = sum(len(e.tree) for e in st.entries.values() if e is not entry and e.tree is not None)
                st.entries.clear()
                st.error = False
                st.used = now
                self.wasted_tokens += info.wasted
            if info.result == "hit":
                self.hits += 1
            elif info.result == "miss":
                self.misses += 1
        if info.result == "hit":
            return truncate(entry.tree, budget), info
        with self.lock:
            return self.run(self.drafter.propose, ctx, budget), info

    def propose_ahead(self, ctx: DraftContext, tree: TokenTree, budget: int) -> bool:
        """Round r (``ctx``: its committed tokens; ``tree``: its draft, being verified) is
        in flight: draft round r+1 for its likely outcomes on the worker; returns at once
        (True: scheduled)."""
        if budget <= 0 or self.max_outcomes <= 0:
            return False
        now = self.clock()
        base = DraftContext(ctx.session_id, list(ctx.tokens), ctx.prompt_len, ctx.sampling, ctx.cache_id)

        def guess(tokens: list[int], n: int) -> list[int]:
            return guess_next(self.drafter, DraftContext(base.session_id, tokens, base.prompt_len, base.sampling,
                                                         base.cache_id), n)

        with self._mu:
            self._prune(now)
            st = self._sessions.get(ctx.session_id)
            if st is None:
                st = self._sessions[ctx.session_id] = _Session(now)
            self._sessions.move_to_end(ctx.session_id)
            while len(self._sessions) > self.max_sessions:
                _, old = self._sessions.popitem(last=False)
                self._drop(old)
            st.gen += 1
            st.entries.clear()
            st.asked, st.used, st.error, st.asked_at = True, now, False, time.perf_counter()
            st.ahead_s, st.span = 0.0, None
            if st.job is not None:
                st.job.first_done.set()
            st.job = st.last = _Job(st.gen, assumed_outcomes(base.tokens, tree, guess, self.width), base, budget)
            st.idle.clear()
            if not st.queued:
                st.queued = True
                self._queue.append((ctx.session_id, st))
            self._start()
            self._wake.notify()
        return True

    def first_round(self, session_id: str, timeout: Optional[float] = None) -> Optional[tuple[list[int], TokenTree,
                                                                                               "AheadInfo"]]:
        """Wait (up to ``timeout``) for the first ahead round of the session's latest
        ``propose_ahead`` — the "all accepted" outcome — and return (the committed tokens it
        assumes, its draft, its timing), or None where it was not drafted whole (no guess,
        cancelled, failed, released, timed out). The drafter service sends it back with the
        ProposeAhead answer, so a router whose round ended in that outcome needs no Propose."""
        with self._mu:
            st = self._sessions.get(session_id)
            job = st.last if st is not None else None
        if job is None or not job.first_done.wait(timeout):
            return None
        with self._mu:
            e = job.first
            if e is None or e.tree is None:
                return None
            span = tuple(st.span) if st.span else None
            return list(e.tokens), e.tree, AheadInfo("hit", "", (span[1] - span[0]) if span else 0.0, 0, 1, span,
                                                     st.asked_at)

    def release(self, session_id: str) -> None:
        self.forget(session_id)
        with self.lock:
            self.run(self.drafter.release, session_id)

    def finish(self, session_id: str, tokens: list[int], prompt_len: int) -> None:
        self.forget(session_id)
        with self.lock:
            self.run(self.drafter.finish, session_id, tokens, prompt_len)

    def forget(self, session_id: str) -> None:
        """Cancel the session's ahead work and drop its cache (not its drafter state: the
        owner releases that under ``lock``, after any ahead round in flight)."""
        with self._mu:
            st = self._sessions.pop(session_id, None)
            if st is not None:
                self._drop(st)

    def settle(self, session_id: str, timeout: Optional[float] = None) -> bool:
        """Wait until the session's ahead work is done (every outcome drafted, or cancelled):
        what a verify lasting at least as long as the drafter would see. False on timeout."""
        with self._mu:
            st = self._sessions.get(session_id)
        return True if st is None else st.idle.wait(timeout)

    def held(self) -> dict:
        """Sessions and entries held (for tests and Info)."""
        with self._mu:
            return {"sessions": len(self._sessions), "entries": sum(len(s.entries) for s in self._sessions.values())}

    def close(self) -> None:
        with self._mu:
            self._closed = True
            for st in self._sessions.values():
                self._drop(st)
            self._sessions.clear()
            self._wake.notify_all()

    # ------------------------------------------------------------ internals (under _mu)
    def _find(self, st: _Session, ctx: DraftContext) -> Optional[_Entry]:
        """The hit check: the ahead round keyed (committed length, last token) whose assumed
        committed tokens and sampling are exactly this round's."""
        e = st.entries.get((len(ctx.tokens), ctx.tokens[-1] if ctx.tokens else -1))
        if e is None or e.tokens != tuple(ctx.tokens) or e.skey != _skey(ctx.sampling, ctx.prompt_len, ctx.cache_id):
            return None
        return e

    def _ahead_context(self, job: "_Job", tokens: list[int]) -> DraftContext:
        """The context of an ahead round: exactly the call drafting after that outcome would
        make (round_seed None: derived from the assumed committed length, seeding.draft_generator)."""
        c = job.ctx
        return DraftContext(c.session_id, list(tokens), c.prompt_len, c.sampling, c.cache_id)

    def _stopper(self, st: _Session, job: "_Job", entry: _Entry) -> Callable[[], bool]:
        """Whether an ahead round being drafted is no longer needed: its job was cancelled
        (the real outcome arrived, the session was released or asked ahead again) and
        it is not the real outcome's round. Read without ``_mu`` (a stale read costs a
        token at most)."""
        return lambda: (job.gen != st.gen and not entry.wanted) or st.released or self._closed

    def _propose_ahead_round(self, ctx: DraftContext, budget: int, stop: Callable[[], bool]) -> TokenTree:
        if getattr(self.drafter, "preemptible", False):
            return self.drafter.propose(ctx, budget, stop=stop)
        return self.drafter.propose(ctx, budget)

    def _drop(self, st: _Session) -> None:
        st.released = True
        st.gen += 1
        for job in (st.job, st.last):
            if job is not None:
                job.first_done.set()
        st.job = None
        st.idle.set()
        for e in st.entries.values():
            e.done.set()
        st.entries.clear()

    def _prune(self, now: float) -> None:
        for sid in [sid for sid, s in self._sessions.items() if now - s.used > self.ttl_s]:
            self._drop(self._sessions.pop(sid))

    def _start(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name=f"draft-ahead-{self.name}", daemon=True)
            self._worker.start()

    def _loop(self) -> None:
        while True:
            with self._mu:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                sid, st = self._queue.popleft()
                st.queued = False
            self._step(sid, st)

    def _end_job(self, st: _Session, job: Optional[_Job]) -> None:
        if job is not None:
            job.first_done.set()
        if job is not None and st.job is job:
            st.job = None
        if st.job is None:
            st.idle.set()

    def _step(self, sid: str, st: _Session) -> None:
        """One outcome of the session's job: its guess and its ahead round."""
        with self.lock:
            with self._mu:
                job = st.job
                if job is None or st.released or job.gen != st.gen:
                    return  # cancelled: whoever cancelled it marked the session idle
                if job.drafted >= self.max_outcomes:
                    self._end_job(st, job)
                    return
            t0, nxt, entry = time.perf_counter(), None, None
            try:
                nxt = self.run(next, job.it, None)  # the outcome's guesses run the drafter too
                if nxt is not None:
                    kind, toks = nxt
                    entry = _Entry(tuple(toks), _skey(job.ctx.sampling, job.ctx.prompt_len, job.ctx.cache_id),
                                   self.clock(), kind)
                    with self._mu:
                        if job.gen != st.gen or st.released:
                            return
                        st.entries[(len(toks), toks[-1])] = entry
                    # draws keyed by len(toks), the committed length it assumes (seeding.py)
                    entry.tree = self.run(self._propose_ahead_round, self._ahead_context(job, toks), job.budget,
                                          self._stopper(st, job, entry))
            except Exception:  # noqa: BLE001 - a failed ahead round is a miss, never an error of the request
                with self._mu:
                    st.error = True
                    self._end_job(st, job)
                return
            finally:
                t1 = time.perf_counter()
                with self._mu:
                    st.ahead_s += t1 - t0
                    st.span = [t0, t1] if st.span is None else [st.span[0], t1]
                    if entry is not None:
                        entry.done.set()
                    if job.drafted == 0:  # the first outcome: drafted whole unless its job was cancelled
                        if entry is not None and entry.tree is not None and (job.gen == st.gen or entry.wanted):
                            job.first = entry
                        job.first_done.set()
            with self._mu:
                if nxt is None:
                    self._end_job(st, job)
                    return
                job.drafted += 1
                if job.drafted >= self.max_outcomes:
                    self._end_job(st, job)
                elif st.job is job and not st.released and not st.queued:
                    st.queued = True
                    self._queue.append((sid, st))
                    self._wake.notify()


# ---------------------------------------------------------------- policy

class OverlapPolicy:
    """Whether a round drafts ahead (the budget policy's overlap half).

    ``mode``: "on", "off", or "auto": measure seconds per committed token of rounds with
    overlap and without (EMAs of seconds and tokens, ``ema``) and the hit rate of the
    ahead rounds; start on, run ``probe`` rounds each way, then keep the faster and re-probe
    the other for ``probe`` rounds every ``every`` rounds. Share one object across requests
    (per drafter) so what was measured carries over; thread-safe."""

    def __init__(self, mode: str = AHEAD_DEFAULT, probe: int = 8, every: int = 64, ema: float = 0.2):
        self.mode = check_mode(mode)
        self.probe, self.every, self.ema = probe, every, ema
        self._spt = {True: None, False: None}  # on/off -> (EMA seconds, EMA tokens)
        self._n = {True: 0, False: 0}
        self._hits = self._asked = 0.0
        self._round = 0
        self._lock = threading.Lock()

    def on(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        with self._lock:
            self._round += 1
            if self._n[True] < self.probe:
                return True
            if self._n[False] < self.probe:
                return False
            best = self.faster()
            if self._round % self.every < self.probe:  # re-probe the other mode
                return not best
            return best

    def faster(self) -> bool:
        a, b = self.seconds_per_token(True), self.seconds_per_token(False)
        return a is not None and (b is None or a <= b)

    def seconds_per_token(self, overlapped: bool) -> Optional[float]:
        v = self._spt[overlapped]
        return v[0] / v[1] if v is not None and v[1] > 0 else None

    @property
    def hit_rate(self) -> Optional[float]:
        return self._hits / self._asked if self._asked else None

    def observe(self, overlapped: bool, seconds: float, tokens: int, result: str = "") -> None:
        """One round: whether it drafted ahead, its wall seconds (draft + verify) and the
        tokens it committed; ``result`` of its draft ("hit" / "miss" / "off")."""
        if seconds <= 0:
            return
        w = self.ema
        with self._lock:
            old = self._spt[overlapped]
            self._spt[overlapped] = (seconds, tokens) if old is None else \
                ((1 - w) * old[0] + w * seconds, (1 - w) * old[1] + w * tokens)
            self._n[overlapped] += 1
            if result in ("hit", "miss"):
                self._asked = (1 - w) * self._asked + w
                self._hits = (1 - w) * self._hits + w * (result == "hit")
