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

This module knows nothing about gRPC, protos or how results are accepted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Optional

from specmesh.threads import ModelThread
from specmesh.types import VerifyRequest, VerifyResult


class VerifyBatcher:
    """``thread``: the model thread the forwards run on (None: one of its own, stopped
    with the batcher)."""

    def __init__(self, verifier, window_ms: float = 5.0, max_batch: int = 8, recent_s: float = 1.0,
                 thread: Optional[ModelThread] = None):
        self.verifier = verifier
        self.window = window_ms / 1e3
        self.max_batch = max(1, max_batch)
        self.recent_s = recent_s
        self._queue: deque[tuple[VerifyRequest, Future, Optional[Callable]]] = deque()
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
            self._queue.append((req, fut, alive))
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
        return {"batches": self.batches, "batched_requests": self.requests, "max_batch_seen": self.max_batch_seen}

    # ------------------------------------------------------------ on the model thread
    def _expected(self) -> int:
        cutoff = time.monotonic() - self.recent_s
        for sid in [s for s, t in self._recent.items() if t < cutoff]:
            del self._recent[sid]
        return len(self._recent)

    def _take(self, batch: list, sids: set) -> None:
        """Move queued requests of sessions not yet in ``batch`` into it (FIFO)."""
        later = []
        while self._queue and len(batch) < self.max_batch:
            item = self._queue.popleft()
            if item[0].session_id in sids:
                later.append(item)  # a second request of a session waits for the next forward
            else:
                batch.append(item)
                sids.add(item[0].session_id)
        self._queue.extendleft(reversed(later))

    def _collect(self) -> list:
        with self._cv:
            batch: list = []
            sids: set = set()
            self._take(batch, sids)
            deadline = time.monotonic() + self.window
            while batch and len(batch) < self.max_batch and len(batch) < self._expected() and not self._stopped:
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
        gone = [(r, f) for r, f, alive in batch if alive is not None and not alive()]
        batch = [(r, f) for r, f, alive in batch if alive is None or alive()]
        for _, fut in gone:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(CancelledError("the caller went away"))
        if not batch:
            return
        try:
            results = self.verifier.verify_batch([r for r, _ in batch])
        except Exception as e:  # noqa: BLE001 - delivered to every caller of the batch
            results = [e] * len(batch)
        self.batches += 1
        self.requests += len(batch)
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        for (_, fut), res in zip(batch, results):
            if fut.set_running_or_notify_cancel():
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)
