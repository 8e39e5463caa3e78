"""Verifier service(s), a drafter service and a router in this process, each on a
free loopback port: what ``specmesh bench-strategies`` measures through and what the
tests build their stacks with (``tests/support.py``).

Imports nothing heavy at module level (``specmesh.cli.bench.strategies`` subclasses it
and the CLI parser imports that).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


class LocalStack:
    """Router + drafter service + verifier service(s), in process, on loopback.

    ``verifiers``: one Verifier service per entry, each over a verifier object or a
    zero-argument factory (a class, a function) called here, in order.
    ``codec``: the router's ids <-> text codec (a ``Runtime``, a ``TextCodec``, a test codec).
    ``vocab_size``: the drafter service's vocabulary (None: read from ``settings().model``).
    ``settings``: called as ``settings()`` for the verifier and drafter services and as
    ``settings(**router_settings, drafter_address=..., verifier_addresses=[...])`` for the
    router; default ``load_settings`` (pass a ``functools.partial`` with the overrides).
    ``drafters``: the drafter service's factories (None: every registered drafter).
    ``metrics``: instrument every service with its Prometheus metrics and serve each on a
    free port (``ports``: router, verifier (the first), drafter, then verifier1, ...).
    ``thread``: the ``specmesh.threads.ModelThread`` the verifiers were (or their factories
    are) loaded on, where their forwards then run (None: one per batcher; a model loaded on
    one thread and run on another is slower, ``specmesh.threads``).

    Attributes: ``s`` / ``rs`` (services' / router's settings), ``verifiers``,
    ``batchers``, ``vservers``, ``vsvcs`` (the Verifier services; one each per verifier; ``verifier``, ``batcher`` and
    ``vserver`` name the first), ``dsvc``, ``dserver``, ``host`` (the drafter host),
    ``rsvc``, ``router``, ``rserver``, ``address`` (the router's), ``stub`` (a Router stub
    on a channel opened on first use). ``close()`` stops the servers, then the batchers,
    the router and the metrics servers.
    """

    def __init__(self, verifiers: Sequence[Any], codec: Any, vocab_size: Optional[int] = None, *,
                 settings: Optional[Callable[..., Any]] = None, router_settings: Optional[dict] = None,
                 drafters: Optional[dict] = None, metrics: bool = False, thread: Any = None):
        from specmesh.drafter_service.servicer import drafter_service
        from specmesh.router.servicer import router_service
        from specmesh.verifier_service.servicer import verifier_service

        from ..serving.server import build_server

        if settings is None:
            from ..serving.settings import load_settings as settings
        self._channel = None
        self._metrics: list = []
        self.s = settings()
        self.verifiers, self.batchers, self.vservers, self.vsvcs, vmetrics = [], [], [], [], []
        for v in verifiers:
            if isinstance(v, type) or (callable(v) and not hasattr(v, "verify_batch")):
                v = thread.run(v) if thread is not None else v()  # a factory
            svc, batcher = verifier_service(self.s, v, thread)
            self.verifiers.append(v)
            self.vsvcs.append(svc)
            self.batchers.append(batcher)
            if metrics:
                vmetrics.append(self._instrument("verifier", svc))
            self.vservers.append(build_server(self.s, [svc], 0))
        self.dsvc = drafter_service(self.s, vocab_size=vocab_size, factories=drafters)
        dmetrics = self._instrument("drafter", self.dsvc) if metrics else None
        self.dserver = build_server(self.s, [self.dsvc], 0)
        self.rs = settings(**(router_settings or {}), drafter_address=self.dserver.address,
                           verifier_addresses=[x.address for x in self.vservers])
        self.rsvc, self.router = router_service(self.rs, codec)
        rmetrics = self._instrument("router", self.rsvc, self.router) if metrics else None
        self.rserver = build_server(self.rs, [self.rsvc], 0)
        self.ports: dict[str, int] = {}
        if metrics:
            named = [("router", rmetrics), ("verifier", vmetrics[0]), ("drafter", dmetrics)]
            named += [(f"verifier{i}", m) for i, m in enumerate(vmetrics[1:], 1)]
            self.ports = {k: m.serve(0) for k, m in named}
            self._metrics = [m for _, m in named]
        self.address = self.rserver.address

    def _instrument(self, kind: str, svc, router=None):
        from ..observability.wiring import instrument

        return instrument(kind, svc, router)

    # ---------------------------------------------------------------- the first of each
    @property
    def verifier(self):
        return self.verifiers[0]

    @property
    def batcher(self):
        return self.batchers[0]

    @property
    def vserver(self):
        return self.vservers[0]

    @property
    def host(self):
        """The drafter service's DrafterHost."""
        return self.dsvc.servicer.host

    @property
    def stub(self):
        """A Router stub on a plaintext channel to ``address`` (opened on first use)."""
        import grpc

        from ..v1 import router_pb2_grpc

        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
            self._stub = router_pb2_grpc.RouterStub(self._channel)
        return self._stub

    # ---------------------------------------------------------------- peers' Info
    def verifier_info(self, i: int = 0, timeout: float = 5):
        import grpc

        from ..v1 import verifier_pb2, verifier_pb2_grpc

        with grpc.insecure_channel(self.vservers[i].address) as ch:
            return verifier_pb2_grpc.VerifierStub(ch).Info(verifier_pb2.VerifierInfoRequest(), timeout=timeout)

    def drafter_info(self, timeout: float = 5):
        import grpc

        from ..v1 import drafter_pb2, drafter_pb2_grpc

        with grpc.insecure_channel(self.dserver.address) as ch:
            return drafter_pb2_grpc.DrafterStub(ch).Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout)

    # ---------------------------------------------------------------- shutdown
    def stop_servers(self) -> None:
        """Close the stub's channel and stop the router, drafter and verifier servers."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for srv in [self.rserver, self.dserver] + self.vservers:
            srv.server.stop(0)

    def shutdown(self) -> None:
        """After ``stop_servers``: the batchers, the router, the metrics servers."""
        for b in self.batchers:
            b.stop()
        self.router.close()
        for m in self._metrics:
            m.stop()

    def close(self) -> None:
        self.stop_servers()
        self.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
