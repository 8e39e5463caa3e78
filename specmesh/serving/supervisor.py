"""Supervision of the services that ``specmesh serve`` runs as child processes.

``Supervisor`` starts each service (a command line), relays its output with a
``[name]`` prefix, notices when it is listening (its ``listening on`` line) and,
when a service that had come up dies, restarts it on the same port while the
others keep serving. The router is built for this: a dead drafter makes it
decode plainly until the drafter answers again (then it resends the session's
tokens), a dead verifier makes it re-prefill from its committed tokens, so a
stream in flight finishes with the same tokens.

Restart policy (``RestartPolicy``), the convention of Kubernetes'
CrashLoopBackOff: the delay doubles with each consecutive crash from
``backoff_s`` up to ``max_backoff_s``; a service that stayed up ``stable_s``
starts afresh. A service that dies before it ever came up (a bad model path, a
taken port) is a configuration error, not a crash: the supervisor stops
everything and reports it, as it does after ``max_failed_starts`` restarts in a
row that never came up.

Each restart is logged and counted: ``specmesh_service_restarts_total{service}``
and ``specmesh_service_up{service}`` on the supervisor's own ``/metrics``.

This module knows processes, ports and metrics; nothing about models, gRPC or
the services' settings (the caller builds the command lines and environment).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from prometheus_client import Counter, Gauge

from ..observability.metrics import ServiceMetrics

READY_MARK = "listening on"


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next crash waits backoff_s again
    max_failed_starts: int = 5  # restarts in a row that never came up: give up

    def delay(self, crashes: int) -> float:
        """Wait before restart number ``crashes`` (1 = the first crash in a row)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, crashes - 1))


class SupervisorMetrics(ServiceMetrics):
    def __init__(self, services, registry=None):
        super().__init__(registry)
        self.restarts = Counter("specmesh_service_restarts_total", "Restarts of a service by `specmesh serve`",
                                ["service"], registry=self.registry)
        self.up = Gauge("specmesh_service_up", "1 while the service's process runs and listens", ["service"],
                        registry=self.registry)
        for s in services:  # export zeros from the start: a rate() needs the series before the first restart
            self.restarts.labels(s)
            self.up.labels(s).set(0)


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: Optional[subprocess.Popen] = None
    ready: threading.Event = field(default_factory=threading.Event)
    up: bool = False  # this process has listened
    came_up: bool = False  # listened at least once (a later death is a crash, not a config error)
    started_at: float = 0.0
    crashes: int = 0  # consecutive crashes (reset after stable_s up)
    failed_starts: int = 0  # consecutive restarts that died before listening
    restarts: int = 0
    restart_at: Optional[float] = None  # waiting to be restarted at this time
    pump: Optional[threading.Thread] = None  # reads this process's output (``Supervisor._pump``)


class Supervisor:
    """Runs ``services`` (name -> command line) and keeps them running."""

    def __init__(self, services: dict[str, list[str]], env: dict, policy: RestartPolicy = RestartPolicy(),
                 metrics: Optional[SupervisorMetrics] = None, out=None, clock: Callable[[], float] = time.monotonic):
        self.children = {name: Child(name, cmd) for name, cmd in services.items()}
        self.env, self.policy, self.metrics, self.clock = env, policy, metrics, clock
        self.out = out or sys.stderr
        self._lock = threading.Lock()

    # ------------------------------------------------------------ output

    def log(self, msg: str) -> None:
        with self._lock:
            self.out.write(f"specmesh: {msg}\n")
            self.out.flush()

    def _pump(self, c: Child, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if READY_MARK in line and c.proc is proc:
                c.ready.set()
            with self._lock:
                self.out.write(f"[{c.name}] {line}")
                self.out.flush()

    # ------------------------------------------------------------ lifecycle

    def _spawn(self, c: Child) -> None:
        c.ready.clear()
        c.up = False
        c.proc = subprocess.Popen(c.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  bufsize=1)
        c.started_at, c.restart_at = self.clock(), None
        self.log(f"started {c.name} (pid {c.proc.pid})")
        c.pump = threading.Thread(target=self._pump, args=(c, c.proc), daemon=True, name=f"pump-{c.name}")
        c.pump.start()

    def start(self) -> None:
        for c in self.children.values():
            self._spawn(c)

    def pid(self, name: str) -> Optional[int]:
        p = self.children[name].proc
        return p.pid if p is not None and p.poll() is None else None

    def all_ready(self) -> bool:
        return all(c.proc is not None and c.ready.is_set() for c in self.children.values())

    def poll(self) -> Optional[str]:
        """One supervision step: note services that came up, restart due ones,
        schedule dead ones. Returns why everything must stop, or None."""
        now = self.clock()
        for c in self.children.values():
            if c.proc is None:
                if c.restart_at is not None and now >= c.restart_at:
                    c.restarts += 1
                    self.log(f"restarting {c.name} (restart {c.restarts})")
                    if self.metrics:
                        self.metrics.restarts.labels(c.name).inc()
                    self._spawn(c)
                continue
            code = c.proc.poll()
            if code is None:
                if c.ready.is_set() and not c.up:
                    c.up = True
                    if c.restarts:
                        self.log(f"{c.name} is back (pid {c.proc.pid}, restart {c.restarts})")
                    c.came_up, c.failed_starts = True, 0
                    if self.metrics:
                        self.metrics.up.labels(c.name).set(1)
                continue
            # the process exited: its last lines (a "listening on" among them) are read before it is judged
            if c.pump is not None:
                c.pump.join(timeout=5.0)
            if self.metrics:
                self.metrics.up.labels(c.name).set(0)
            was_ready, c.up = c.ready.is_set(), False
            c.proc = None
            c.came_up = c.came_up or was_ready
            if not c.came_up:
                return f"{c.name} exited with code {code} before it was listening; stopping the others"
            if was_ready:
                c.failed_starts = 0
            else:
                c.failed_starts += 1
                if c.failed_starts >= self.policy.max_failed_starts:
                    return (f"{c.name} exited with code {code}; {c.failed_starts} restarts in a row never came up; "
                            f"stopping the others")
            if now - c.started_at >= self.policy.stable_s:
                c.crashes = 0
            c.crashes += 1
            delay = self.policy.delay(c.crashes)
            c.restart_at = now + delay
            self.log(f"{c.name} exited with code {code}; restarting it in {delay:.1f} s (the others keep serving)")
        return None

    def stop(self, order: list[str], grace_s: float) -> None:
        """SIGTERM in ``order`` (the router first: it drains its streams), then
        wait up to ``grace_s`` for all and kill what is left."""
        for name in order:
            p = self.children[name].proc
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for c in self.children.values():
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
