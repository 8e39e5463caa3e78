"""The router's periodic throughput line, as vLLM logs one: every ``interval_s``
seconds in which there was traffic, one INFO line on the ``specmesh.router``
logger with the prompt and generation throughput over that interval, the
requests running now and those finished in it::

    throughput: prompt 412.3 tok/s, generation 61.8 tok/s, running 2 reqs, finished 3 reqs (last 10.0 s)

Quiet when idle: an interval with no tokens, no finished request and nothing
running logs nothing. ``interval_s`` 0 turns it off (``ServeSettings.
log_stats_interval_s``, ``specmesh serve --log-stats-interval-s``).

``RouterObserver`` feeds it the facts it already has (``started`` with the
prompt's tokens when a generation starts, ``generated`` as each round's tokens
are handed on, ``ended`` when the request is over); ``line(now)`` computes the
interval's line from those counts and a clock, so it is tested without waiting.
It knows the router's counts only: nothing of the verifiers' KV usage (the
verifier's ``/metrics`` has its slots) nor of gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("specmesh.router")


class ThroughputLog:
    def __init__(self, interval_s: float, logger: logging.Logger = log,
                 clock: Callable[[], float] = time.monotonic):
        if not interval_s >= 0:
            raise ValueError(f"log_stats_interval_s must be >= 0, got {interval_s!r}")
        self.interval_s, self.logger, self.clock = float(interval_s), logger, clock
        self._lock = threading.Lock()
        self._prompt = self._generated = self._finished = 0
        self._running = 0
        self._since = clock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- facts, from RouterObserver (any thread)
    def started(self, prompt_tokens: int) -> None:
        with self._lock:
            self._running += 1
            self._prompt += int(prompt_tokens)

    def generated(self, n: int) -> None:
        with self._lock:
            self._generated += int(n)

    def ended(self) -> None:
        with self._lock:
            self._running -= 1
            self._finished += 1

    # ---- the line
    def line(self, now: Optional[float] = None) -> Optional[str]:
        """The line for the interval since the previous call (and start a new one), or
        None when it had no traffic."""
        now = self.clock() if now is None else now
        with self._lock:
            dt = max(now - self._since, 1e-9)
            prompt, gen, fin, running = self._prompt, self._generated, self._finished, self._running
            self._prompt = self._generated = self._finished = 0
            self._since = now
        if not (prompt or gen or fin or running):
            return None
        return (f"throughput: prompt {prompt / dt:.1f} tok/s, generation {gen / dt:.1f} tok/s, "
                f"running {running} reqs, finished {fin} reqs (last {dt:.1f} s)")

    # ---- the thread
    def start(self) -> "ThroughputLog":
        """Log every ``interval_s`` seconds from a daemon thread (nothing when 0)."""
        if self.interval_s > 0 and self._thread is None:
            self._since = self.clock()
            self._thread = threading.Thread(target=self._run, name="specmesh-throughput-log", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            msg = self.line()
            if msg:
                self.logger.info(msg)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
