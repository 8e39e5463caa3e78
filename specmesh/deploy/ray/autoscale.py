"""Autoscaling policy for the drafter and verifier deployments.

gRPC calls go straight to the replicas' own servers, so Serve's built-in
signal (requests through Serve handles and proxies) stays at zero. Instead
each replica reports ``{"load": active sessions + calls in flight}`` from
``record_autoscaling_stats``, and ``load_policy`` asks for
``sum(load) / target_ongoing_requests`` replicas (Serve then applies
min/max_replicas and the up/downscale delays). No report yet: keep the
current count.

This module knows nothing about gRPC or models.
"""

from typing import Any, Dict, Tuple


def load_policy(ctx) -> Tuple[float, Dict[str, Any]]:
    metrics = (ctx.aggregated_metrics or {}).get("load")
    if not metrics:
        return ctx.target_num_replicas, {}
    target = ctx.config.get_target_ongoing_requests() if ctx.config else 4.0
    return max(sum(metrics.values()) / target, 0.0), {}
