"""Dynamic batching of verify requests from many sessions into one forward.

Handler threads call ``VerifyBatcher.verify(req)``; the process's model thread
(``specmesh.threads.ModelThread``, which also loaded the model and runs every
other piece of model work: prefill, fork, release) collects queued requests of
*different* sessions and runs them as one ``EngineVerifier.verify_batch`` call
(one ragged forward). ``call(fn)`` runs any other model work there, in order. Rule: take what is
queued (at most one request per session, at most ``max_batch``); while the
batch is smaller than the number of sessions seen within the last
``recent_s`` seconds (the ones likely to send a request soon), wait up to
``window_ms`` for more. A lone session therefore never waits, and requests that
queue up during a forward all go into the next one. ``verify_batch`` returns a
result or an exception per request, so one bad request fails only itself, and a
batched result equals the unbatched one. A request whose caller has gone
(``alive()`` false: cancelled or past its deadline) is dropped unrun.

Chunked prefill (``prefill_chunk`` > 0): a request with a long prompt (or a long uncached
suffix: the verifier's ``prefill_need`` says how many tokens it would compute) is run in
steps of at most ``prefill_chunk`` tokens a forward, interleaved with the other sessions'
rounds: each forward takes the running streams' requests first (they fill ``max_batch``;
a prefill does not count against it, so streams never starve one) and gives the prompts
what is left of a token budget, oldest first; the verifier commits that many tokens and
answers ``Partial``, whose ``rest`` goes back to the front of the queue with the same
caller. While streams are running the budget is also held to what keeps a forward within
``stall_ratio`` times the streams' own forward, from a line fitted to the measured
forwards (``loop.ForwardCosts``: seconds = a + b rows), so a long prompt never stalls the
streams by more than that factor; before a fit, ``MIN_CHUNK`` and twice it in turn. A
chunked result equals the unchunked one (the verifier's steps are the same tokens in
the same positions).

Admission (a verifier with a session pool): a request that starts a session (no slot
yet) runs only when a slot can take it without evicting a running stream: a free slot, or
an idle session's (not mid-prefill, not seen within ``recent_s``, not in the forward).
Otherwise it waits in the queue, first in line, until a session ends or goes idle, as
vLLM's and llama.cpp's servers queue requests beyond their slots: more concurrent
requests than slots are served in turn, never refused for the slots and never by evicting
a stream that would then re-prefill its whole context.

This module knows nothing about gRPC, protos or how results are accepted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Optional

from specmesh.loop import ForwardCosts
from specmesh.threads import ModelThread
from specmesh.types import VerifyRequest, VerifyResult

PREFILL_MIN = 16  # appended tokens above which a request is a prefill: outside max_batch, under the token budget
ADMIT_WAIT_S = 0.005  # a forward whose every request waits for a slot: the model thread waits this long
MIN_CHUNK = 16  # a prefill's tokens a forward while streams run and the forward's cost line is not known yet


class _Job:
    """A queued request: its future, its caller's liveness and the tokens its earlier
    steps (a chunked prefill) found in the prefix cache."""

    __slots__ = ("req", "fut", "alive", "cached")

    def __init__(self, req: VerifyRequest, fut: Future, alive: Optional[Callable], cached: int = 0):
        self.req, self.fut, self.alive, self.cached = req, fut, alive, cached

    @property
    def prefill(self) -> bool:
        return len(self.req.append_tokens) > PREFILL_MIN


class VerifyBatcher:
    """``thread``: the model thread the forwards run on (None: one of its own, stopped
    with the batcher)."""

    def __init__(self, verifier, window_ms: float = 5.0, max_batch: int = 8, recent_s: float = 1.0,
                 thread: Optional[ModelThread] = None, prefill_chunk: int = 0, stall_ratio: float = 2.0):
        """``prefill_chunk``: a prefill's tokens a forward at most (0: a prompt in one
        forward); ``stall_ratio``: while streams run, a forward with a prefill step costs at
        most this many times their own (0: no such bound)."""
        self.verifier = verifier
        self.window = window_ms / 1e3
        self.max_batch = max(1, max_batch)
        self.recent_s = recent_s
        self.prefill_chunk = max(0, int(prefill_chunk))
        self.stall_ratio = float(stall_ratio)
        self.costs = ForwardCosts()  # this verifier's forward: seconds against scored rows
        self.prefill_steps = 0  # chunked prefills' steps that left work for a later forward
        self._explore = False
        self._queue: deque[_Job] = deque()
        self._recent: dict[str, float] = {}  # session id -> last submit (monotonic)
        self._cv = threading.Condition()
        self._stopped = False
        self._scheduled = False  # a drain job is queued on (or running on) the model thread
        self.batches = 0
        self.requests = 0
        self.max_batch_seen = 0
        self._own_thread = thread is None
        self.thread = thread if thread is not None else ModelThread("specmesh-verify-batcher")

    # ------------------------------------------------------------ public
    def submit(self, req: VerifyRequest, alive: Optional[Callable[[], bool]] = None) -> Future:
        """Queue ``req``; ``alive()`` false when its turn comes (the caller gave up:
        cancelled, deadline) drops it unrun, so a stale request cannot recreate a
        session its caller already released."""
        fut: Future = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("batcher stopped")
            self._queue.append(_Job(req, fut, alive))
            self._recent[req.session_id] = time.monotonic()
            self._cv.notify()
            schedule, self._scheduled = not self._scheduled, True
        if schedule:
            self.thread.submit(self._drain)
        return fut

    def verify(self, req: VerifyRequest, timeout: Optional[float] = None,
               alive: Optional[Callable[[], bool]] = None) -> VerifyResult:
        """Verify through the batcher; raises the request's own exception."""
        return self.submit(req, alive).result(timeout)

    def call(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        """Any other model work (prefill, fork, release) on the model thread, in order."""
        return self.thread.run(fn, *args, **kw)

    def forget(self, session_id: str) -> None:
        """The session ended: stop expecting requests from it."""
        with self._cv:
            self._recent.pop(session_id, None)

    def stop(self) -> None:
        """Refuse new requests; those queued are still run (the model thread drains
        them), then a thread of the batcher's own ends."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._own_thread:
            self.thread.stop()

    def info(self) -> dict:
        return {"batches": self.batches, "batched_requests": self.requests, "max_batch_seen": self.max_batch_seen,
                "prefill_steps": self.prefill_steps}

    # ------------------------------------------------------------ on the model thread
    def _expected(self) -> int:
        cutoff = time.monotonic() - self.recent_s
        for sid in [s for s, t in self._recent.items() if t < cutoff]:
            del self._recent[sid]
        return len(self._recent)

    def _take(self, batch: list, sids: set) -> None:
        """Move queued requests of sessions not yet in ``batch`` into it (FIFO): streams'
        requests up to ``max_batch``, prefills (with chunking on) besides them."""
        later = []
        streams = sum(1 for j in batch if not (self.prefill_chunk and j.prefill))
        for _ in range(len(self._queue)):
            job = self._queue.popleft()
            counts = not (self.prefill_chunk and job.prefill)
            if job.req.session_id in sids or (counts and streams >= self.max_batch):
                later.append(job)  # a second request of a session waits for the next forward
            else:
                batch.append(job)
                sids.add(job.req.session_id)
                streams += counts
        self._queue.extendleft(reversed(later))

    def _full(self, batch: list) -> bool:
        return sum(1 for j in batch if not (self.prefill_chunk and j.prefill)) >= self.max_batch

    def _collect(self) -> list:
        with self._cv:
            batch: list = []
            sids: set = set()
            self._take(batch, sids)
            deadline = time.monotonic() + self.window
            while batch and not self._full(batch) and len(batch) < self._expected() and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
                self._take(batch, sids)
            return batch

    def _drain(self) -> None:
        """One forward of what is queued; queued again behind the model thread's other
        jobs while requests remain (so a prefill is never starved by a busy batcher)."""
        try:
            self._forward(self._collect())
        finally:
            with self._cv:
                again = bool(self._queue)
                self._scheduled = again
            if again:
                self.thread.submit(self._drain)

    def _forward(self, batch: list) -> None:
        gone = [j for j in batch if j.alive is not None and not j.alive()]
        batch = [j for j in batch if j.alive is None or j.alive()]
        for j in gone:
            if j.req.first_keep_len is not None and hasattr(self.verifier, "abandon"):
                self.verifier.abandon(j.req.session_id)  # a chunked prefill stops half way
            if j.fut.set_running_or_notify_cancel():
                j.fut.set_exception(CancelledError("the caller went away"))
        wait = self._admit(batch)
        if wait:
            batch = [j for j in batch if j not in wait]
            with self._cv:
                self._queue.extendleft(reversed(wait))  # first in line when a slot frees
                if not batch:  # nothing else to run: give a session time to end, not a spin
                    self._cv.wait(max(self.window, ADMIT_WAIT_S))
        limits, defer = self._plan(batch)
        if defer:
            batch = [j for j in batch if j not in defer]
            with self._cv:
                self._queue.extendleft(reversed(defer))  # first in the next forward
        if not batch:
            return
        try:
            if not limits:
                results = self.verifier.verify_batch([j.req for j in batch])
            else:
                results = self.verifier.verify_batch([j.req for j in batch], [limits.get(id(j)) for j in batch])
        except Exception as e:  # noqa: BLE001 - delivered to every caller of the batch
            results = [e] * len(batch)
        self.batches += 1
        self.requests += len(batch)
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        observed, rest = False, []
        for j, res in zip(batch, results):
            if not observed and not isinstance(res, BaseException) and getattr(res, "batch_rows", 0):
                self.costs.observe(res.batch_rows, res.verify_ms / 1e3)
                observed = True
            if hasattr(res, "rest"):  # a chunked prefill's step: the rest goes on in a later forward
                self.prefill_steps += 1
                rest.append(_Job(res.rest, j.fut, j.alive, j.cached + res.cached_tokens))
                continue
            if j.fut.set_running_or_notify_cancel():
                if isinstance(res, BaseException):
                    j.fut.set_exception(res)
                else:
                    if j.cached:
                        res.cached_tokens += j.cached
                    j.fut.set_result(res)
        if rest:
            with self._cv:
                self._queue.extendleft(reversed(rest))

    def _admit(self, batch: list) -> list:
        """The jobs of ``batch`` that start a session no slot can take now (see the module
        docstring), oldest first admitted."""
        pool = getattr(self.verifier, "pool", None)
        if pool is None:
            return []
        new = [j for j in batch if j.req.keep_len == 0 and pool.slots.get(j.req.session_id) is None]
        if not new:
            return []
        with self._cv:
            self._expected()  # drops the sessions idle for recent_s
            active = set(self._recent)
        in_batch = {j.req.session_id for j in batch}
        room = len(pool.free) + sum(1 for sid in pool.slots if sid not in pool.pinned and sid not in pool.busy
                                    and sid not in in_batch and sid not in active)
        return new[room:] if room < len(new) else []

    def _plan(self, batch: list) -> tuple[Optional[dict], list]:
        """The forward's prefill budget: (job id -> the tokens it may compute, or None
        where no job has more than it may; the jobs left for a later forward)."""
        if not self.prefill_chunk:
            return None, []
        streams = [j for j in batch if not j.prefill]
        budget = self._budget(streams)
        limits, defer, cut = {}, [], False
        need_of = getattr(self.verifier, "prefill_need", None)
        for j in batch:
            if not j.prefill:
                continue
            need = need_of(j.req) if need_of is not None else len(j.req.append_tokens) - 1
            if need > 0 and budget <= 0:
                defer.append(j)
                continue
            limits[id(j)] = max(1, budget)
            cut |= need > limits[id(j)]
            budget -= min(need, budget)
        return (limits if cut else None), defer

    def _budget(self, streams: list) -> int:
        """Prefill tokens this forward may compute: ``prefill_chunk``, and while streams run
        at most what keeps the forward within ``stall_ratio`` times theirs."""
        if not streams or self.stall_ratio <= 0:
            return self.prefill_chunk
        fit = self.costs.fit()
        if fit is None:  # MIN_CHUNK and twice it in turn: forwards of two sizes give the line its slope
            self._explore = not self._explore
            return min(self.prefill_chunk, MIN_CHUNK * (1 + self._explore))
        a, b = fit
        if b <= 0:
            return self.prefill_chunk
        rows = sum(len(j.req.append_tokens) + len(j.req.tree) + (j.req.self_draft.budget if j.req.self_draft else 0)
                   for j in streams)
        return max(1, min(self.prefill_chunk, int((self.stall_ratio - 1) * (a + b * rows) / b + 1e-6)))
