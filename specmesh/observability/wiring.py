"""Attach metrics to a built service: ``instrument(kind, service, router=None)``.

``kind`` is ``router``, ``verifier`` or ``drafter``; ``service`` the
``serving.server.Service`` its factory returned (for the router also the
``Router``). The metrics become ``service.observer`` (fed by the server
interceptor that ``build_server`` adds), the router's ``RouterObserver`` gets
them for the per-round metrics, and the verifier's/drafter's state is read at
scrape time. Call it before ``build_server``; serve the returned metrics with
``.serve(port, host)``.

This module only wires objects; it computes nothing.
"""

from __future__ import annotations

from .metrics import DrafterMetrics, RouterMetrics, ServiceMetrics, VerifierMetrics

KINDS = ("router", "verifier", "drafter")


def instrument(kind: str, service, router=None) -> ServiceMetrics:
    if kind == "router":
        m = RouterMetrics()
        if router is None:
            raise ValueError("instrument('router', ...) needs the Router")
        router.observer.metrics = m
    elif kind == "verifier":
        m = VerifierMetrics(getattr(service.servicer, "verifier", None))
    elif kind == "drafter":
        m = DrafterMetrics(getattr(service.servicer, "host", None))
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    service.observer = m
    return m
