"""Build and run a gRPC server around one or more servicers.

``build_server`` adds the standard services every specmesh server has
(``grpc.health.v1`` health checking, SERVING per service, or following the
service's ``readiness`` (the router's: NOT_SERVING until a verifier serves), and server
reflection), the interceptors (tracing and metrics, bearer-token auth, size
limit, error mapping),
message-size options and TLS (server certificate, optional client CA for mutual
TLS), binds ``host:port`` (loopback by default; port 0 picks a free one) and
starts it; its handler threads never run OpenMP teams of their own (model work
belongs on the process's model thread, ``specmesh.threads``). ``serve_until_signal``
blocks until SIGTERM/SIGINT, then drains:
health turns NOT_SERVING, new calls are refused, in-flight calls get
``drain_s`` to finish.

``peer_channel`` builds the router's channels to the drafter and verifiers
from the ``peer_*`` settings (see ``channels``), with the client interceptor
that propagates trace context (``observability.rpc``).

This module knows nothing about what the servicers do.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..observability.rpc import ServerInterceptor, intercept
from ..wire.channels import channel, channel_credentials
from .interceptors import AuthInterceptor, ErrorInterceptor
from .settings import ServeSettings

log = logging.getLogger("specmesh.serving")


@dataclass
class Service:
    """A servicer and how to add it: ``add(servicer, server)``; ``name`` is the
    full service name (``specmesh.v1.Verifier``)."""

    name: str
    add: Callable
    servicer: object
    observer: object = None  # metrics fed by the server interceptor (observability.wiring.instrument)
    # ``watch(fn)`` calls fn(ready) now and on each change: the service's health status follows it
    # (the router's: a verifier serving; the overall status "" stays SERVING while the process serves)
    readiness: object = None


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    address: str
    health: health.HealthServicer
    services: list[str] = field(default_factory=list)
    tls: bool = False

    def stop(self, grace: Optional[float] = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, give in-flight calls ``grace`` s."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def time_left(context) -> Optional[float]:
    """Seconds until the call's deadline, or None when it has none (gRPC then
    reports an enormous number that would overflow a timed wait)."""
    t = context.time_remaining()
    return None if t is None or t > 1e6 else max(0.0, t)


def _read(p) -> Optional[bytes]:
    return Path(p).read_bytes() if p else None


def grpc_options(s: ServeSettings) -> list[tuple[str, int]]:
    # gRPC's own hard cap sits above max_message_bytes so the interceptor can
    # answer INVALID_ARGUMENT naming the request instead of RESOURCE_EXHAUSTED.
    cap = max(2 * s.max_message_bytes, s.max_message_bytes + (1 << 20))
    return [("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", cap),
            ("grpc.so_reuseport", 0)]


def server_credentials(s: ServeSettings) -> Optional[grpc.ServerCredentials]:
    if s.tls_cert is None:
        return None
    ca = _read(s.tls_client_ca)
    return grpc.ssl_server_credentials([(_read(s.tls_key), _read(s.tls_cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def build_server(s: ServeSettings, services: Sequence[Service], port: int, host: Optional[str] = None,
                 token: Optional[str] = ...) -> RunningServer:
    """Create, bind and start a server. ``token`` defaults to ``s.token()``."""
    token = s.token() if token is ... else token
    observer = next((svc.observer for svc in services if svc.observer is not None), None)
    pool = futures.ThreadPoolExecutor(max_workers=s.workers, thread_name_prefix="specmesh-grpc",
                                      initializer=_handler_thread)
    server = grpc.server(pool,
                         interceptors=[ServerInterceptor(observer), AuthInterceptor(token),
                                       ErrorInterceptor(s.max_message_bytes)],
                         options=grpc_options(s))
    hs = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [svc.name for svc in services]
    for svc in services:
        svc.add(svc.servicer, server)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    host = host or s.host
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    creds = server_credentials(s)
    bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    if not bound:
        raise OSError(f"could not bind {bind}")
    server.start()
    for name in names + [""]:
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    for svc in services:
        if svc.readiness is not None:
            svc.readiness.watch(lambda ok, name=svc.name: hs.set(
                name, health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING))
    addr_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    address = f"[{addr_host}]:{bound}" if ":" in addr_host else f"{addr_host}:{bound}"
    return RunningServer(server, bound, address, hs, names, creds is not None)


def _handler_thread() -> None:
    """A handler thread runs no model: where torch is loaded, it never opens an OpenMP
    region of its own (``specmesh.threads``: a second team throttles the model thread's)."""
    import sys

    if "torch" in sys.modules:
        from ..threads import serial_thread

        serial_thread()


def serve_until_signal(running: RunningServer, drain_s: float, on_ready: Optional[Callable] = None) -> None:
    """Block until SIGTERM or SIGINT, then drain and stop (main thread only)."""
    stop = threading.Event()
    prev = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_ready:
            on_ready()
        while not stop.wait(0.5):
            pass
        log.info("draining %s (grace %.1fs)", running.address, drain_s)
        running.stop(drain_s)
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)


# ---------------------------------------------------------------- client side

def peer_channel(s: ServeSettings, target: str) -> grpc.Channel:
    """Router -> drafter/verifier channel from the peer_* settings."""
    creds = None
    if s.peer_ca or s.peer_cert:
        creds = channel_credentials(s.peer_ca, s.peer_key, s.peer_cert)
    return intercept(channel(target, creds, max(2 * s.max_message_bytes, 8 << 20)), target)
