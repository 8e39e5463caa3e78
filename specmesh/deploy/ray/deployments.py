"""The three Serve deployments: each replica runs the existing gRPC server of its role.

- ``DrafterReplica`` / ``VerifierReplica`` build the same servicers as
  ``specmesh serve drafter|verifier`` (``specmesh.drafter_service`` /
  ``specmesh.verifier_service``), start the gRPC server on a free port inside
  the replica (health, reflection, auth and TLS included), and announce the
  address to the registry while they live.
- ``RouterReplica`` (the application's ingress) runs the unchanged router core
  and Router servicer on ``settings.router_port``, with a ``ReplicaSet`` of
  verifiers (session affinity) and a ``DrafterPool`` (free balancing) from
  ``specmesh.router.replicas`` that a thread keeps in step with the registry.
  Its HTTP route answers a JSON description (addresses of every replica,
  drafter calls per replica); Serve handles can call ``describe()`` too.
  Built without the ``OpenAI`` deployment it serves the OpenAI-compatible HTTP
  API itself, as ``specmesh serve router`` does.
- ``OpenAIReplica`` serves the OpenAI-compatible HTTP API (``serving.openai_http``)
  on ``settings.http_port`` (default here 8001: Serve's proxy holds 8000), unless
  ``settings.http`` is false; like the gRPC server it bypasses Serve's proxy. It
  reaches the router replicas it reads from the registry (followed as they
  change) through the SDK, which resumes a stream whose router replica died, and
  announces its URL there (the router's ``describe()`` lists it).

Verifier (and GPU drafter) replicas run on the device ``RayAppConfig.device``
names for their deployment; the config has asked Ray for their GPUs.
Like ``specmesh serve``, each replica sets up tracing from the ``OTEL_*``
variables and serves Prometheus ``/metrics`` (on a free port unless
``metrics_port`` is set: replicas share nodes). Every replica reports its
load (active sessions) for ``autoscale.load_policy`` — and as the Ray metric
``specmesh_replica_load{deployment, replica}`` — and answers Serve's
health checks by calling its own gRPC health service.

This module knows nothing about decoding: it wires existing services into Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import grpc
import ray
from ray import serve

from .config import RAY_HTTP_PORT, RayAppConfig
from .registry import Heartbeat, RegistryReader

log = logging.getLogger("specmesh.deploy.ray")


def advertise(cfg: RayAppConfig, host: str, port: int) -> str:
    """The address other replicas dial: ``advertise_host``, else the bind host
    when it is a specific address, else this node's IP."""
    h = cfg.advertise_host or (ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host)
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


class _Replica:
    role = ""

    def _setup(self, config: dict) -> None:
        from specmesh.threads import model_thread

        self.cfg = RayAppConfig.model_validate(config)
        self.s = self.cfg.serve_settings(self.role)  # this role's device filled in
        # the replica's model work (load, every forward) on one thread with the role's torch threads
        # (specmesh.threads: Serve runs replica methods on threads of its own)
        model_thread(self.cfg.spec(self.role).threads())
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.registry = self.cfg.registry or f"specmesh-{ctx.app_name}"
        self.running = None
        self.heartbeat: Optional[Heartbeat] = None
        self._health = None
        self._cleanup = []
        self.metrics = None
        self.metrics_port = None
        from ray.util.metrics import Gauge

        # the replica's load in Ray's own metrics (the dashboard's Metrics view, Prometheus on the
        # nodes' metrics export port as ray_specmesh_replica_load), one series per replica
        self._load_gauge = Gauge("specmesh_replica_load", description="active sessions + calls in flight of one "
                                 "specmesh replica (what the autoscaler sums)", tag_keys=("deployment", "replica"))
        self._load_tags = {"deployment": ctx.deployment, "replica": self.replica_id}

    def _observe(self, svc, router=None) -> None:
        """Tracing from the OTEL_* variables and Prometheus metrics, as ``specmesh serve`` does."""
        try:
            from specmesh.observability import tracing
            from specmesh.observability.wiring import instrument
        except ImportError:  # a tree without the observability package
            return
        tracing.setup_from_env(f"specmesh-{self.role}")
        self._cleanup.append(tracing.shutdown)
        if self.s.metrics:
            self.metrics = instrument(self.role, svc, router)

    def _serve(self, services, port: int) -> None:
        from specmesh.serving.server import build_server

        self.running = build_server(self.s, services, port)
        self.address = advertise(self.cfg, self.s.host, self.running.port)
        if self.metrics is not None:  # several replicas may share a node: a free port unless one is set
            self.metrics_port = self.metrics.serve(self.s.metrics_port or 0, self.s.host)
            self._cleanup.append(self.metrics.stop)
        self.heartbeat = Heartbeat(self.registry, self.cfg.ttl_s, self.role, self.replica_id, self.address,
                                   self.cfg.heartbeat_s)
        log.info("%s replica %s serving gRPC on %s%s", self.role, self.replica_id, self.address,
                 f", Prometheus /metrics on port {self.metrics_port}" if self.metrics_port is not None else "")

    # ---- Serve hooks
    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising gets the replica replaced."""
        if self.running is None:
            raise RuntimeError("gRPC server not running")
        self._report_load()  # Serve calls this every health_check_period_s, autoscaled or not
        if self.running.tls:
            return  # a plaintext probe cannot reach a TLS server; the process being alive has to do
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self._health is None:
            local = "127.0.0.1" if self.s.host in ("0.0.0.0", "::") else self.s.host
            self._health = grpc.insecure_channel(f"[{local}]:{self.running.port}" if ":" in local
                                                 else f"{local}:{self.running.port}")
        r = health_pb2_grpc.HealthStub(self._health).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        if r.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"gRPC health is {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")

    def record_autoscaling_stats(self) -> dict:
        return {"load": self._report_load()}

    def _report_load(self) -> float:
        load = float(self.load())
        self._load_gauge.set(load, tags=self._load_tags)
        return load

    def load(self) -> float:
        return 0.0

    def info(self) -> dict:
        return {"role": self.role, "replica_id": self.replica_id, "address": getattr(self, "address", ""),
                "metrics_port": self.metrics_port,
                "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "load": self.load()}

    def __del__(self):
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if getattr(self, "running", None) is not None:
            self.running.stop(self.s.drain_s)
            self.running = None
        for fn in getattr(self, "_cleanup", []):
            try:
                fn()
            except Exception:  # noqa: BLE001 - shutting down; free what else can be freed
                log.exception("cleanup failed")
        self._cleanup = []


@serve.deployment(name="Drafter")
class DrafterReplica(_Replica):
    role = "drafter"

    def __init__(self, config: dict):
        from specmesh.drafter_service.servicer import drafter_service

        self._setup(config)
        svc = drafter_service(self.s)
        self.host = svc.servicer.host
        self._observe(svc)
        self._serve([svc], 0)

    def load(self) -> float:
        return float(self.host.info()["sessions"])

    def info(self) -> dict:
        return dict(super().info(), proposals=self.host.proposals)


@serve.deployment(name="Verifier")
class VerifierReplica(_Replica):
    role = "verifier"

    def __init__(self, config: dict):
        from specmesh.verifier_service.servicer import verifier_service

        self._setup(config)
        svc, batcher = verifier_service(self.s)
        self.verifier = svc.servicer.verifier
        self._cleanup.append(batcher.stop)
        self._observe(svc)
        self._serve([svc], 0)

    def load(self) -> float:
        return float(len(self.verifier.info()["sessions"]))


@serve.deployment(name="Router")
class RouterReplica(_Replica):
    role = "router"

    def __init__(self, config: dict, drafter=None, verifier=None, openai=None):
        from specmesh.router.servicer import dynamic_router

        self._setup(config)
        self.handles = {"drafter": drafter, "verifier": verifier, "openai": openai}  # Serve handles (app graph)
        svc, self.router, self.verifiers, self.drafters = dynamic_router(self.s)
        self._cleanup.append(self.router.close)
        self.reader = RegistryReader(self.registry, self.cfg.ttl_s)
        self._stop = threading.Event()
        self.snapshot: dict = {}
        end = time.monotonic() + self.cfg.startup_timeout_s
        while not self._refresh() and time.monotonic() < end:
            time.sleep(self.cfg.refresh_s)  # the first verifier is still loading its model
        if not self.verifiers.peers:
            raise RuntimeError(f"no verifier replica registered within {self.cfg.startup_timeout_s} s")
        threading.Thread(target=self._follow, name="specmesh-registry", daemon=True).start()
        self._observe(svc, self.router)
        self._serve([svc], self.s.router_port)
        self.http_url = ""
        if self.s.http and openai is None:  # no OpenAI deployment: the API beside the gRPC server
            from specmesh.serving.openai_http import start_http

            port = self.s.http_port if "http_port" in self.cfg.settings else RAY_HTTP_PORT
            try:
                http = start_http(self.s, self.running.address, port=port)
            except OSError as e:  # the gRPC API is up; say why the HTTP one is not
                log.warning("router replica %s: no OpenAI HTTP API on port %s: %s (set settings.http_port)",
                            self.replica_id, port, e)
            else:
                self._cleanup.insert(0, http.stop)
                h = self.address.rsplit(":", 1)[0]
                self.http_url = f"{'https' if http.tls else 'http'}://{h}:{http.port}/v1"

    def _refresh(self) -> bool:
        snap = self.reader.snapshot()
        if snap is None:
            return False
        self.snapshot = snap
        self.verifiers.set_addresses(snap.get("verifier", {}).values())
        self.drafters.set_addresses(snap.get("drafter", {}).values())
        return bool(self.verifiers.peers)

    def _follow(self) -> None:
        while not self._stop.wait(self.cfg.refresh_s):
            try:
                self._refresh()
            except Exception:  # noqa: BLE001 - keep following; the next read may work
                log.exception("registry refresh failed")

    def load(self) -> float:
        return float(sum(self.router._clients.values()))

    def describe(self) -> dict:
        """Addresses of every replica the router knows, and drafter calls per replica."""
        fronts = sorted(((self.reader.snapshot() or self.snapshot).get("openai") or {}).values())
        return {"router": self.address, "router_replica": self.replica_id, "metrics_port": self.metrics_port,
                "openai_api": self.http_url or (fronts[0] if fronts else ""), "openai_apis": fronts,
                "registry": self.snapshot,
                "verifiers": self.verifiers.addresses, "drafters": self.drafters.addresses,
                "drafter_calls": dict(self.drafters.calls), "drafter_failovers": self.drafters.failovers}

    async def __call__(self, request) -> dict:
        return self.describe()


@serve.deployment(name="OpenAI")
class OpenAIReplica(_Replica):
    """The OpenAI HTTP API in front of the router replicas (module docstring)."""

    role = "openai"

    def __init__(self, config: dict):
        from specmesh.serving.openai_http import start_http

        self._setup(config)
        self.reader = RegistryReader(self.registry, self.cfg.ttl_s)
        end = time.monotonic() + self.cfg.startup_timeout_s
        while not self._routers() and time.monotonic() < end:
            time.sleep(self.cfg.refresh_s)  # the router replica is still starting
        self.routers = self._routers()
        if not self.routers:
            raise RuntimeError(f"no router replica registered within {self.cfg.startup_timeout_s} s")
        port = self.s.http_port if "http_port" in self.cfg.settings else RAY_HTTP_PORT
        self.http = start_http(self.s, ",".join(self.routers), port=port)
        self._cleanup.insert(0, self.http.stop)
        self.address = f"{'https' if self.http.tls else 'http'}://{advertise(self.cfg, self.s.host, self.http.port)}/v1"
        self.heartbeat = Heartbeat(self.registry, self.cfg.ttl_s, self.role, self.replica_id, self.address,
                                   self.cfg.heartbeat_s)
        self._stop = threading.Event()
        threading.Thread(target=self._follow, name="specmesh-registry", daemon=True).start()
        log.info("openai replica %s serving %s in front of %s", self.replica_id, self.address, self.routers)

    def _routers(self) -> list[str]:
        snap = self.reader.snapshot()
        return sorted((snap or {}).get("router", {}).values())

    def _follow(self) -> None:
        while not self._stop.wait(self.cfg.refresh_s):
            try:
                now = self._routers()
                if now and now != self.routers:
                    self.routers = now
                    self.http.api.client.set_addresses(now)  # in-flight streams resume on them too
            except Exception:  # noqa: BLE001 - keep following; the next read may work
                log.exception("registry refresh failed")

    def check_health(self) -> None:
        if not self.http.thread.is_alive():
            raise RuntimeError("the OpenAI HTTP server stopped")

    def info(self) -> dict:
        return dict(super().info(), routers=self.routers, resumes=self.http.api.client.resumes)

    def __del__(self):
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        super().__del__()

    def __del__(self):
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
        super().__del__()
