"""The router with replicas found in DNS: the plain-gRPC mode on Kubernetes.

``python -m specmesh.deploy.k8s_discovery --verifiers NAME:PORT --drafters NAME:PORT``
runs the router like ``specmesh serve router`` (same settings: flags here,
``SPECMESH_*`` variables, ``--config`` YAML; same health, reflection, auth,
TLS, metrics, tracing and OpenAI-compatible HTTP API), except that its verifier and drafter replicas are
not a fixed list: every ``--interval`` seconds it resolves the two names
(Kubernetes headless Services, which list the *ready* pods) and updates a
``ReplicaSet`` (sessions stay pinned to their verifier pod) and a
``DrafterPool`` (sessions spread round-robin over drafter pods; a pod that goes
away hands its sessions to another, resynced from the router's tokens), both
from ``specmesh.router.replicas``. So a
HorizontalPodAutoscaler can scale drafters and verifiers independently.

This module knows nothing about decoding; it resolves names and wires the router.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from typing import Callable, Optional

log = logging.getLogger("specmesh.deploy.k8s_discovery")


def resolve(target: str, lookup: Callable = socket.getaddrinfo) -> list[str]:
    """``host:port`` (or ``dns:///host:port``) -> sorted ``ip:port`` of every
    address the name has; [] when it does not resolve (e.g. no ready pod)."""
    target = target.removeprefix("dns:///").removeprefix("dns:")
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {target!r}")
    try:
        infos = lookup(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class DnsFollower:
    """Re-resolve the names every ``interval_s`` and update the sets."""

    def __init__(self, verifiers_target: str, drafters_target: Optional[str], verifiers, drafters,
                 interval_s: float = 2.0):
        self.vt, self.dt, self.verifiers, self.drafters = verifiers_target, drafters_target, verifiers, drafters
        self.interval_s = interval_s
        self._stop = threading.Event()

    def refresh(self) -> None:
        self.verifiers.set_addresses(resolve(self.vt))
        if self.dt:
            self.drafters.set_addresses(resolve(self.dt))

    def start(self) -> "DnsFollower":
        self.refresh()
        threading.Thread(target=self._run, name="specmesh-dns", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - keep following
                log.exception("DNS refresh failed")

    def stop(self) -> None:
        self._stop.set()


def main(argv=None) -> int:
    from specmesh.router.servicer import dynamic_router
    from specmesh.cli.serve import add_settings_flags, settings_from_args
    from specmesh.serving.server import build_server, serve_until_signal

    ap = argparse.ArgumentParser(prog="python -m specmesh.deploy.k8s_discovery", description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifiers", required=True, help="DNS name:port listing the verifier pods")
    ap.add_argument("--drafters", default="none", help="DNS name:port listing the drafter pods ('none': no drafter)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between DNS refreshes")
    ap.add_argument("--log-level", default="INFO")
    add_settings_flags(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = settings_from_args(args)
    try:
        from specmesh.observability import tracing
        from specmesh.observability.wiring import instrument
    except ImportError:  # a tree without the observability package
        tracing = instrument = None
    if tracing is not None:
        tracing.setup_from_env("specmesh-router")
    svc, router, verifiers, drafters = dynamic_router(s)
    drafters_target = None if args.drafters.lower() == "none" else args.drafters
    follower = DnsFollower(args.verifiers, drafters_target, verifiers, drafters, args.interval).start()
    metrics = instrument("router", svc, router) if instrument is not None and s.metrics else None
    running = build_server(s, [svc], s.port_of("router"))
    if metrics is not None:
        metrics.serve(s.metrics_port_of("router"), s.host)
    print(f"specmesh router listening on {running.address}; verifiers from {args.verifiers} "
          f"({len(verifiers.peers)} now), drafters from {args.drafters} ({len(drafters.members)} now)", flush=True)
    http = None
    if s.http:  # the OpenAI-compatible HTTP API, as `specmesh serve router` serves it
        from specmesh.serving.openai_http import start_http

        http = start_http(s, running.address)
        print(f"specmesh router OpenAI API on {http.url}", flush=True)
    try:
        serve_until_signal(running, s.drain_s)
    finally:
        if http is not None:
            http.stop()
        follower.stop()
        router.close()
        if metrics is not None:
            metrics.stop()
        if tracing is not None:
            tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
