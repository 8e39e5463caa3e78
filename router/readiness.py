"""Ready means ready: whether the router can serve a request now.

The router is ready when at least one verifier replica answers its gRPC health check
SERVING for ``specmesh.v1.Verifier`` (a verifier serves only once its model is loaded)
and this router has read that replica's ``Info`` (its self and context drafters: what a
request's plan depends on, so a plan never depends on start-up order; a replica whose
Info could not be read is asked again at the next check).

``Readiness`` checks that on a thread of its own (every ``interval_s``, a quarter of it
while not ready) and tells its listeners when it changes: the router's server turns its
``specmesh.v1.Router`` health status SERVING / NOT_SERVING with it (once ready, only after
``down_after`` checks in a row found none: a verifier busy with a long forward may miss a
probe) (Kubernetes readiness
probes and ``AsyncClient.ready`` read that; the process's overall status "" stays
SERVING: it is alive). ``require()`` (each request) passes at once when ready, else
checks again for up to the replica set's ``wait_s`` (10 s; a loaded machine may answer a
probe late) and raises UNAVAILABLE with the reason (no verifier registered, none
serving yet, Info not read), so a request never waits long on a verifier that is still
loading.

Knows nothing about strategies or decoding: peers and a function that reads Info.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .replicas import Peer, ReplicaSet, Unavailable

log = logging.getLogger("specmesh.router")
VERIFIER_SERVICE = "specmesh.v1.Verifier"


def serving(peer: Peer, timeout_s: float = 1.0) -> bool:
    """Whether the replica answers its health check SERVING for the Verifier service."""
    try:
        r = health_pb2_grpc.HealthStub(peer.channel).Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                                          timeout=timeout_s, wait_for_ready=True)
    except (grpc.RpcError, ValueError):  # ValueError: its channel was closed (the replica left)
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Readiness:
    """``info_read(addresses) -> set``: of the serving replicas' addresses, those whose Info
    was read (reading the missing ones)."""

    def __init__(self, replicas: ReplicaSet, info_read: Callable[[Iterable[str]], set], interval_s: float = 1.0,
                 probe_timeout_s: float = 3.0, down_after: int = 3):
        self.replicas, self.info_read = replicas, info_read
        self.interval_s, self.probe_timeout_s, self.down_after = interval_s, probe_timeout_s, down_after
        self._misses = 0  # checks in a row that found no verifier serving, while ready
        self.grace_s = float(getattr(replicas, "wait_s", 0.0))
        self._ready = False
        self.reason = "the router has not checked its verifiers yet"
        self._listeners: list[Callable[[bool], None]] = []
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def ready(self) -> bool:
        return self._ready

    def check(self) -> bool:
        """Check now; returns (and publishes) whether the router is ready."""
        with self._check_lock:
            peers = list(self.replicas.peers)
            up = [p for p in peers if serving(p, self.probe_timeout_s)]
            if not peers:
                ok, why = False, "no verifier replica is registered"
            elif not up:
                ok, why = False, (f"no verifier replica is serving yet ({len(peers)} registered, none SERVING: "
                                  "loading the model?)")
            else:
                read = self.info_read([p.address for p in up])
                ok = bool(read)
                why = "" if ok else f"the Info of the serving verifier replicas {[p.address for p in up]} could " \
                                    "not be read"
            self._publish(ok, why)
            return ok

    def _publish(self, ok: bool, why: str) -> None:
        with self._lock:
            if self._ready and not ok:  # a busy replica may miss a probe: down after ``down_after`` in a row
                self._misses += 1
                if self._misses < self.down_after:
                    return
            self._misses = 0
            changed = ok != self._ready
            self._ready, self.reason = ok, why
            listeners = list(self._listeners) if changed else []
        if changed:
            log.info("router %s%s", "ready" if ok else "not ready: ", why)
        for fn in listeners:
            fn(ok)

    def watch(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(ready)`` now and on every change."""
        with self._lock:
            self._listeners.append(fn)
            now = self._ready
        fn(now)

    def require(self) -> None:
        """Pass when ready; else check again for up to ``grace_s`` (the replica set's
        ``wait_s``: a busy machine may answer a probe late), then UNAVAILABLE with the reason."""
        if self._ready:
            return
        end = time.monotonic() + self.grace_s
        while not self.check():
            if time.monotonic() >= end or self._stop.is_set():
                raise Unavailable(f"not ready: {self.reason}; retry shortly")
            self._stop.wait(0.25)

    def start(self) -> "Readiness":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specmesh-readiness", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # noqa: BLE001 - keep checking
                log.exception("readiness check failed")
            self._stop.wait(self.interval_s if self._ready else self.interval_s / 4)

    def stop(self) -> None:
        self._stop.set()
