"""``specmesh serve --ray [--config FILE]``: a local Ray cluster serving the app.

Starts Ray (dashboard on, bound to loopback unless ``--host`` says otherwise;
``RAY_ADDRESS`` joins an existing cluster instead, and then only this app is
deleted on exit), starts Serve, and deploys
the application *declaratively* through the dashboard's REST API — the path
``serve deploy`` and KubeRay take — so a later ``serve deploy`` of the same
file with a changed ``deployments:`` entry (say ``{name: Drafter,
num_replicas: 2}``) rescales that deployment in place. ``FILE`` is a Serve
config (``applications: [...]``) or a bare ``RayAppConfig``; settings flags
(``--model``, ``--dtype``, ``--router-port``, ...) override its ``settings``.
Prints the router's gRPC address and the dashboard URL once the app runs, and
stops Serve and Ray on Ctrl-C/SIGTERM.

``deploy``, ``wait_running`` and ``describe`` are what the tests use too.

This module knows nothing about decoding; it drives Ray and Serve.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time
from ..deploy.ray.config import specmesh_app, load_serve_config, validate_serve_config


def apply_overrides(config: dict, overrides: dict) -> dict:
    """A copy of the Serve config whose specmesh app has ``overrides`` in its settings."""
    config = copy.deepcopy(config)
    if overrides:
        app = specmesh_app(config)
        args = app.setdefault("args", {}) or {}
        app["args"] = args
        args["settings"] = dict(args.get("settings") or {}, **overrides)
        validate_serve_config(config)
    return config


def deploy(config: dict, dashboard_url: str) -> None:
    """PUT the Serve config to the dashboard (declarative, like ``serve deploy``)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    ServeSubmissionClient(url).deploy_applications(config)


def wait_running(name: str, timeout: float = 900.0, poll_s: float = 1.0, quiet: bool = True) -> None:
    """Block until the app is RUNNING; raise on DEPLOY_FAILED or timeout."""
    from ray import serve

    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        app = serve.status().applications.get(name)
        status = str(app.status.value if hasattr(app.status, "value") else app.status) if app else "NOT_STARTED"
        if status == "RUNNING":
            return
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {name} is {status}: {app.message}")
        if not quiet and status != last:
            print(f"specmesh: application {name}: {status}", file=sys.stderr, flush=True)
        last = status
        time.sleep(poll_s)
    raise TimeoutError(f"application {name} not RUNNING after {timeout} s")


def describe(name: str) -> dict:
    """The router replica's view: addresses of every replica, drafter calls per replica."""
    from ray import serve

    return serve.get_app_handle(name).describe.remote().result(timeout_s=60)


def metrics_banner(d: dict) -> list[str]:
    """Where the Ray mode's metrics are, from the router's ``describe()``: the router
    replica's Prometheus /metrics, and where the drafter and verifier replicas' are
    (each on a port of its own node, free unless ``metrics_port`` is set: their log
    lines say which) and the replicas' load in Ray's own metrics."""
    host = d["router"].rsplit(":", 1)[0]
    port = d.get("metrics_port")
    if port is None:
        return ["metrics   off (settings metrics: false): no replica serves /metrics; replica load: "
                "ray_specmesh_replica_load in the dashboard's Metrics view"]
    return [f"metrics   http://{host}:{port}/metrics (router)",
            "          drafter and verifier replicas: /metrics on a port of their node (free unless metrics_port "
            "is set; each replica's log line 'serving gRPC on ..., Prometheus /metrics on port N' in the "
            "dashboard's Serve logs); replica load: ray_specmesh_replica_load in the dashboard's Metrics view"]


def serve_ray(args) -> int:
    from specmesh.serving.settings import ServeSettings

    config = load_serve_config(getattr(args, "config", None))
    fields = set(ServeSettings.model_fields) - {"port"}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    config = apply_overrides(config, overrides)
    name = specmesh_app(config)["name"]
    host = overrides.get("host") or (specmesh_app(config).get("args") or {}).get("settings", {}).get("host",
                                                                                                       "127.0.0.1")
    import ray
    from ray import serve

    joined = bool(os.environ.get("RAY_ADDRESS"))  # an existing cluster: start nothing, stop only this app
    if joined:
        ctx = ray.init(log_to_driver=False)
    else:
        ctx = ray.init(include_dashboard=True, log_to_driver=False,
                       dashboard_host="0.0.0.0" if host in ("0.0.0.0", "::") else "127.0.0.1")
    stop = threading.Event()
    prev = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        http = dict(config.get("http_options") or {})
        http.setdefault("host", "127.0.0.1" if host not in ("0.0.0.0", "::") else host)
        serve.start(http_options=http)
        deploy(config, ctx.dashboard_url)
        wait_running(name, quiet=False)
        d = describe(name)
        print(f"router    {d['router']}", flush=True)
        print(f"drafters  {', '.join(d['drafters']) or '-'}", flush=True)
        print(f"verifiers {', '.join(d['verifiers'])}", flush=True)
        print(f"dashboard http://{ctx.dashboard_url}  (Serve tab: Router, Drafter, Verifier)", flush=True)
        for line in metrics_banner(d):
            print(line, flush=True)
        if d.get("openai_api"):
            print(f"openai    {d['openai_api']}  (OpenAI-compatible HTTP API)", flush=True)
        print(f'try: specmesh generate "Hello" --address {d["router"]}', flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
        try:
            serve.delete(name) if joined else serve.shutdown()
        finally:
            ray.shutdown()


def scale(config: dict, deployment: str, num_replicas: int, dashboard_url: str) -> dict:
    """Redeploy ``config`` with ``deployment`` overridden to ``num_replicas`` (an
    in-place update of that deployment only); returns the config sent."""
    config = copy.deepcopy(config)
    app = specmesh_app(config)
    entries = [d for d in app.get("deployments") or [] if d.get("name") != deployment]
    app["deployments"] = entries + [{"name": deployment, "num_replicas": num_replicas}]
    validate_serve_config(config)
    deploy(config, dashboard_url)
    return config
