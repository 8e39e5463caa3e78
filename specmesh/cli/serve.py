"""``specmesh serve`` and ``specmesh generate``.

- ``specmesh serve drafter|verifier|router --port N [settings flags]`` runs one
  service in this process until SIGTERM/SIGINT (then drains and stops). The
  router alone also serves the OpenAI-compatible HTTP API (``serving.openai_http``)
  on ``--http-port`` (default 8000; ``--http false``: off); ``specmesh serve openai
  --port N --router-addresses a,b`` serves it as a process of its own, in front of
  the routers (a stream whose router dies is resumed on the next).
- ``specmesh serve`` (no service) starts all three, and the OpenAI HTTP front as
  a fourth (unless ``--http false``), as separate processes on
  loopback (ports from the settings; 0 = free ports), passes the resolved
  settings to them through ``SPECMESH_*`` variables, prints the addresses once
  all are listening, restarts one that dies (``supervisor.Supervisor``: backoff,
  logged, counted) while the others keep serving, and stops them all on
  Ctrl-C/SIGTERM.
- ``specmesh generate "prompt" --address ... --strategy ...`` streams the text
  to stdout, then prints the stats to stderr (``--json``: the stats as one JSON
  object alone on stdout, the text on stderr). A request naming no strategy gets
  the router's default (``auto`` unless ``serve --default-strategy`` says otherwise).
- ``serve --port`` applies to a single service; with all three it is refused
  (each has its own ``--<service>-port``).

This module only parses arguments and wires the pieces; it knows nothing about
models or decoding.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

SERVICES = ("drafter", "verifier", "router")


def model_dtype(s) -> str:
    """The served model's dtype as resolved (``--dtype auto``), with the int8 path of int4."""
    from specmesh.models.loading import resolve_model
    from specmesh.runtime import resolve_dtype

    dtype = resolve_dtype(s.dtype, resolve_model(s.model, quiet=True), s.torch_device())
    if dtype != "int4":
        return f"dtype {dtype}"
    from specmesh.engine import qmatmul

    k = qmatmul.load()
    return f"dtype int4, int8 path {k.isa if k is not None else 'none'}"


# ---------------------------------------------------------------- settings flags (no pydantic import: --help stays fast)

_FLAGS = [
    # (flag, field, type, help); each flag's default and variable (SPECMESH_<FIELD>) are shown from the
    # settings when the help is printed (SettingsFormatter), its group is GROUP_OF[field]
    ("--host", "host", str, "bind address"),
    ("--model", "model", str, "model alias, .gguf file or Hugging Face directory (verifier, drafter, router "
     "tokenizer)"),
    ("--dtype", "dtype", str, "auto | fp32 | bf16 | int8 | int4 (verifier and draft LM; auto: int4 for a GGUF on a "
                              "CPU with the int8 kernels, else bf16)"),
    ("--device", "device", str, "verifier and draft LM: auto | cpu | cuda | cuda:N"),
    ("--cuda-graphs", "cuda_graphs", str, "on CUDA, replay CUDA graphs for small forwards: true | false | "
     "invariant (one bucket shape for every forward: bf16 greedy identity)"),
    ("--n-slots", "n_slots", int, "KV slots of the verifier (and of the draft LM)"),
    ("--prefix-cache", "prefix_cache", str, "reuse the KV of earlier requests' common prefixes: true | false"),
    ("--prefix-cache-mib", "prefix_cache_mib", float, "the prefix cache's budget in MiB"),
    ("--prefix-block", "prefix_block", int, "tokens per prefix-cache block"),
    ("--prefill-chunk", "prefill_chunk", int, "a prompt's tokens per forward at most, between the running "
     "streams' rounds (0 = a prompt in one forward)"),
    ("--prefill-stall-ratio", "prefill_stall_ratio", float, "while streams run, a forward with a prefill chunk "
     "costs at most this many times theirs (0 = off)"),
    ("--max-seq-len", "max_seq_len", int, "KV positions per slot: the longest prompt + reply (verifier, draft "
     "LM; the router's limits follow it; unset: the model's context, at most 8192)"),
    ("--draft-model", "draft_model", str, "the draft LM's alias or directory (unset: the target's paired draft "
     "model, else a subset of its layers)"),
    ("--draft-head-rows", "draft_head_rows", int, "the draft LM's head keeps the first N token ids (and the added "
     "tokens) where its vocabulary is at least 2N; 0 = the whole head"),
    ("--preload-draft-lm", "preload_draft_lm", str, "load the draft LM at start: true | false (unset: when it "
     "is a model of its own)"),
    ("--drafter-address", "drafter_address", str, "drafter host:port ('': host:drafter-port, 'none': no drafter)"),
    ("--drafter-timeout-s", "drafter_timeout_s", float, "deadline of one drafter call (unset: 2 s, plus for the "
     "draft LM 4x its measured time for the call's tokens)"),
    ("--draft-ahead", "draft_ahead", str, "external token-only drafters draft the next round while the verifier "
     "verifies this one: off | on | auto (measured)"),
    ("--decode-stream", "decode_stream", str, "rounds without a draft and self drafters' rounds read their "
     "tokens from a Verifier/Decode stream, the verifier decoding ahead: true | false"),
    ("--context-drafters", "context_drafters", str, "where an external request's context-only drafter "
     "(prompt_lookup, suffix) runs: verifier (in the verifiers' own turn, no hop a round, where they host it) | "
     "drafter (the drafter service)"),
    ("--verifier-drafters", "verifier_drafters", str, "comma-separated context-only drafters the verifier runs "
     "for external requests ('' = none)"),
    ("--verifier-addresses", "verifier_addresses", str, "comma-separated verifier host:port list ('': "
     "host:verifier-port)"),
    ("--replica-choice", "replica_choice", str, "a new session's verifier replica: prefix (by cached prefix and "
     "conversation, unless much busier) | least_loaded | hash"),
    ("--router-addresses", "router_addresses", str, "comma-separated router host:port list (or one DNS name with "
     "several records); a stream whose router dies is resumed on the next ('': host:router-port)"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "limit on prompt tokens, after the chat template; a longer "
     "prompt is INVALID_ARGUMENT / HTTP 400 (unset: what the context leaves a reply, max-seq-len - 2)"),
    ("--max-new-tokens-limit", "max_new_tokens", int, "cap on a request's max_new_tokens, refused above it "
     "(unset: none but the context: a request for more than its prompt leaves is refused)"),
    ("--default-strategy", "default_strategy", str, "the strategy of requests that name none: auto | "
     "autoregressive | external | self | proactive | ssr"),
    ("--default-drafter", "default_drafter", str, "the drafter of external requests that name none"),
    ("--max-sessions-per-client", "max_sessions_per_client", int, "concurrent streams per client"),
    ("--max-message-bytes", "max_message_bytes", int, "largest request accepted"),
    ("--batch-window-ms", "batch_window_ms", float, "how long a forward waits for the other active sessions' "
     "requests (a lone session never waits)"),
    ("--max-batch", "max_batch", int, "most sessions in one forward"),
    ("--workers", "workers", int, "gRPC handler threads per server"),
    ("--cpus", "cpus", str, "CPUs per service, which also sets its torch threads: verifier=0-1,drafter=1,router=0 "
     "(all three) or 0-1 (this service); '' = every CPU, shared (docs/serving.md, \"Placement\")"),
    ("--tls-cert", "tls_cert", str, "server certificate (PEM); enables TLS"),
    ("--tls-key", "tls_key", str, "server private key (PEM)"),
    ("--tls-client-ca", "tls_client_ca", str, "require client certificates signed by this CA (mTLS)"),
    ("--peer-ca", "peer_ca", str, "CA of the drafter/verifier certificates"),
    ("--peer-cert", "peer_cert", str, "client certificate for mTLS to drafter/verifier"),
    ("--peer-key", "peer_key", str, "client key for mTLS to drafter/verifier"),
    ("--auth-token-file", "auth_token_file", str, "bearer token file (or the variable SPECMESH_AUTH_TOKEN)"),
    ("--drain-s", "drain_s", float, "grace period on SIGTERM"),
    ("--metrics", "metrics", str, "serve Prometheus /metrics over HTTP: true | false"),
    ("--metrics-port", "metrics_port", int, "/metrics port of a single service (0 = any free port; unset: "
     "<service>-metrics-port)"),
    ("--log-stats-interval-s", "log_stats_interval_s", float, "log a throughput line (prompt and generation "
     "tok/s, running requests) every this many seconds when there was traffic (0 = off)"),
    ("--http", "http", str, "serve the OpenAI-compatible HTTP API: true | false"),
    ("--http-port", "http_port", int, "port of the OpenAI HTTP API (0 = any free port)"),
    ("--http-timeout-s", "http_timeout_s", float, "deadline of each generation (504 when it passes; unset: none)"),
    ("--resume-window-s", "resume_window_s", float, "how long a stream whose router died waits for one to resume "
     "on (then 503)"),
]

# the --help groups, by the service a setting configures (the rest: common)
GROUPS = ("common", "router", "verifier", "drafter", "OpenAI front")
GROUP_OF = {
    **dict.fromkeys(("router_port", "router_metrics_port", "drafter_address", "verifier_addresses", "replica_choice",
                     "default_strategy", "default_drafter", "draft_ahead", "decode_stream", "context_drafters",
                     "drafter_timeout_s", "max_prompt_tokens", "max_new_tokens", "max_sessions_per_client",
                     "peer_ca", "peer_cert", "peer_key", "log_stats_interval_s"), "router"),
    **dict.fromkeys(("verifier_port", "verifier_metrics_port", "n_slots", "max_seq_len", "batch_window_ms",
                     "max_batch", "verifier_drafters", "cuda_graphs",
                     # issue 59's prefix cache and chunked prefill
                     "prefix_cache", "prefix_cache_mib", "prefix_block", "prefill_chunk", "prefill_stall_ratio"),
                    "verifier"),
    **dict.fromkeys(("drafter_port", "drafter_metrics_port", "draft_model", "draft_head_rows", "preload_draft_lm"),
                    "drafter"),
    **dict.fromkeys(("router_addresses", "http", "http_port", "http_timeout_s", "resume_window_s"), "OpenAI front"),
}
GROUP_HELP = {
    "common": "every service (each flag is also the variable SPECMESH_<FIELD>, shown with its default)",
    "router": "the router: strategies, drafter calls and the request limits it enforces",
    "verifier": "the verifier: KV slots, batching and the drafters it runs itself",
    "drafter": "the drafter service: the draft LM",
    "OpenAI front": "the OpenAI-compatible HTTP API (`serve openai`, or the router's own with --http)",
}


class SettingsFormatter:
    """``helpfmt.Formatter`` for the settings flags: their defaults are read from
    ``ServeSettings`` when the help is printed (the flags default to SUPPRESS)."""

    @staticmethod
    def default_of(action) -> "str | None":
        from ..serving.settings import ServeSettings
        from .helpfmt import show

        f = ServeSettings.model_fields.get(action.dest)
        if f is None:
            return None
        v = f.get_default(call_default_factory=True)
        env = f"SPECMESH_{action.dest.upper()}"
        if v is None:  # unset: the help says what that means where it means more than "off"
            return env if "unset" in (action.help or "") else f"unset by default; {env}"
        return f"default: {show(v)}; {env}"


def _groups(p: argparse.ArgumentParser) -> dict:
    """The parser's argument groups by name (made once, in GROUPS order)."""
    have = {g.title: g for g in p._action_groups}
    return {name: have.get(name) or p.add_argument_group(name, GROUP_HELP.get(name)) for name in GROUPS}


def add_settings_flags(p: argparse.ArgumentParser, port: bool = True) -> None:
    g = _groups(p)
    g["common"].add_argument("--config", default=argparse.SUPPRESS, metavar="CONFIG",
                             help="YAML settings file (or the variable SPECMESH_CONFIG)")
    if port:
        g["common"].add_argument("--port", type=int, default=argparse.SUPPRESS, metavar="PORT",
                                 help="port of a single service (0 = any; unset: its --<service>-port); with all "
                                      "three it is refused: use --router-port, --drafter-port, --verifier-port")
    for flag, dest, typ, hlp in _FLAGS:
        g[GROUP_OF.get(dest, "common")].add_argument(flag, dest=dest, type=typ, default=argparse.SUPPRESS, help=hlp)


def settings_from_args(args: argparse.Namespace):
    from ..serving.settings import ServeSettings, load_settings

    fields = set(ServeSettings.model_fields)
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return load_settings(getattr(args, "config", None), **overrides)


def register(sub) -> None:
    from .helpfmt import Formatter

    fmt = type("ServeFormatter", (Formatter,), {"defaults": staticmethod(SettingsFormatter.default_of)})
    p = sub.add_parser("serve", help="run the gRPC services (one, or all three as processes)", formatter_class=fmt,
                       description="Run the gRPC services: one (drafter | verifier | router | openai), or all three "
                                   "and the OpenAI HTTP front as processes. Every setting comes from (highest "
                                   "first) its flag, the variable SPECMESH_<FIELD>, the --config YAML, its default.")
    p.add_argument("service", nargs="?", choices=SERVICES + ("openai",),
                   help="the service to run (default: all three, and the OpenAI HTTP front as a fourth process); "
                        "openai: the OpenAI HTTP API alone, in front of --router-addresses")
    add_settings_flags(p)
    g = _groups(p)
    for svc in SERVICES:
        g[svc].add_argument(f"--{svc}-port", dest=f"{svc}_port", type=int, default=argparse.SUPPRESS,
                            help=f"port of the {svc} when starting all three (0 = any free port)")
        g[svc].add_argument(f"--{svc}-metrics-port", dest=f"{svc}_metrics_port", type=int, default=argparse.SUPPRESS,
                            help=f"/metrics port of the {svc} when starting all three (0 = any free port)")
    g["common"].add_argument("--supervisor-metrics-port", dest="supervisor_metrics_port", type=int,
                             default=argparse.SUPPRESS, help="/metrics of the supervisor (service restarts) when "
                             "starting all three (0 = any free port)")
    g["common"].add_argument("--restart-backoff-s", dest="restart_backoff_s", type=float, default=argparse.SUPPRESS,
                             help="wait before restarting a service that died (doubles per crash in a row, up to "
                                  "30 s)")
    g["common"].add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR")
    g["common"].add_argument("--ray", action="store_true",
                             help="run the three as Ray Serve deployments on a local Ray cluster; --config is then a "
                                  "Serve config or RayAppConfig YAML (docs/deploy.md)")
    p.set_defaults(module="specmesh.cli.serve", func="serve_main")

    gp = sub.add_parser("generate", help="stream a generation from a running router",
                        description="Stream a generation from a running router: the text to stdout, then the "
                                    "stats to stderr (--json: the stats alone on stdout). Options left unset take "
                                    "the router's defaults.")
    gp.add_argument("prompt", help="prompt text (one user turn with the chat template unless --raw; at most the "
                    "router's prompt limit: what its context leaves a reply unless --max-prompt-tokens is set)")
    c = gp.add_argument_group("connection")
    c.add_argument("--address", default=os.environ.get("SPECMESH_ADDRESS", "127.0.0.1:50051"),
                   help="the router, host:port, or several comma-separated (a stream whose router dies is "
                        "resumed on the next; default: the variable SPECMESH_ADDRESS, else 127.0.0.1:50051)")
    c.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds (unset: none)")
    c.add_argument("--no-resume", action="store_true",
                   help="fail when the router dies mid-stream instead of resuming the stream (resumed by default)")
    c.add_argument("--token-file", default=None, help="bearer token file (or the variable SPECMESH_AUTH_TOKEN)")
    c.add_argument("--ca", default=None, help="CA certificate (PEM): connect with TLS")
    c.add_argument("--cert", default=None, help="client certificate (PEM) for mutual TLS")
    c.add_argument("--key", default=None, help="client key (PEM) for mutual TLS")
    r = gp.add_argument_group("request")
    r.add_argument("--strategy", default="",
                   help="autoregressive | external | self | proactive | ssr | auto (default: the router's "
                        "--default-strategy, auto unless set)")
    from specmesh.drafters import registry

    r.add_argument("--drafter", default="", help="external drafter: " + " | ".join(registry.EXTERNAL)
                   + "; self: " + " | ".join(registry.SELF) + " (default: the strategy's). "
                   + registry.DRAFT_LM_NOTE.replace("%", "%%"))
    r.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate at most (default: the router's, 256, cut to what the prompt leaves of "
                        "the context; more than that is refused, as is more than the router's "
                        "--max-new-tokens-limit)")
    r.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string, repeatable: the output ends just before the first one")
    r.add_argument("--raw", action="store_true", help="no chat template")
    r.add_argument("--conversation-id", default="", help="conversation (proactive strategy)")
    r.add_argument("--reasoning", action="store_true", help="think inside <think>...</think> first")
    r.add_argument("--thinking-budget", type=int, default=None,
                   help="maximum thinking tokens (reasoning; default: half of --max-new-tokens)")
    r.add_argument("--draft-budget", type=int, default=None,
                   help="draft tokens per round at most (default: the router's, adapted per round)")
    r.add_argument("--draft-ahead", default="", choices=["", "on", "off", "auto"], metavar="DRAFT_AHEAD",
                   help="external token-only drafters: draft the next round while this one verifies (default: "
                        "the router's --draft-ahead)")
    sp = gp.add_argument_group("sampling and acceptance")
    sp.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default); > 0 samples (with the exact acceptance rule, from the target's own "
                         "distribution)")
    sp.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the top-p mass (default: 1)")
    sp.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    sp.add_argument("--seed", type=int, default=None, help="seed of the sampled draws (same seed, same output; "
                    "default: a fresh one)")
    sp.add_argument("--acceptance", default=None,
                    help="verify rule: exact (default) | typical | lenient | topk (lossy) | contrastive | "
                         "divergence (lossy; the verifier's specialist drafts: the router picks strategy self, "
                         "drafter specialist unless a drafter is named)")
    sp.add_argument("--acceptance-param", action="append", default=[], metavar="NAME=VALUE",
                    help="the rule's parameter, repeatable: lenience=0.5, accept_top_k=4, cd_alpha=0.1, "
                         "cd_beta=0.5, typical_epsilon=0.3, jsd_threshold=0.3, ...")
    o = gp.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print only the stats as one JSON object on stdout (the text streams to stderr)")
    gp.set_defaults(module="specmesh.cli.serve", func="generate_main")


# ---------------------------------------------------------------- serve

def serve_main(args) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "ray", False):
        from specmesh.cli.serve_ray import serve_ray

        return serve_ray(args)
    settings = settings_from_args(args)
    if args.service is None and settings.port is not None:
        from ..types import InvalidArgument

        raise InvalidArgument("--port", f"{settings.port} names the port of a single service (`specmesh serve "
                              "router --port N`); starting all three, give each its own: --router-port, "
                              "--drafter-port, --verifier-port")
    from specmesh.threads import place

    try:  # every service's CPUs checked, then this one placed before torch loads (its OpenMP runtime sizes itself then)
        for svc in SERVICES:
            place(settings.cpus_for(svc), apply=False)
        if args.service is not None:
            place(settings.cpus_for(args.service))
    except ValueError as e:
        from ..types import InvalidArgument

        raise InvalidArgument("cpus", str(e)) from None
    if args.service in (None, "verifier", "drafter"):
        settings.torch_device()  # a device this machine lacks: one clear error before anything starts
    if args.service is None:
        return serve_all(settings)
    if args.service == "openai":  # the HTTP front alone: speaks the SDK to the routers, resumes their streams
        from ..serving.openai_http import run_front

        return run_front(settings)
    return serve_one(args.service, settings)


def serve_one(service: str, s) -> int:
    from ..observability import tracing
    from ..serving.server import build_server, serve_until_signal

    tracing.setup_from_env(f"specmesh-{service}")  # OTEL_* variables; off unless asked for
    cleanup, router = None, None
    if service == "verifier":
        from specmesh.verifier_service.servicer import verifier_service

        svc, batcher = verifier_service(s)
        cleanup = batcher.stop
    elif service == "drafter":
        from specmesh.drafter_service.servicer import drafter_service

        svc = drafter_service(s)
    else:
        from specmesh.router.servicer import router_service

        svc, router = router_service(s)
        cleanup = router.close
    metrics = None
    if s.metrics:
        from ..observability.wiring import instrument

        metrics = instrument(service, svc, router)
    running = build_server(s, [svc], s.port_of(service))
    mode = "tls" if running.tls else "insecure"
    auth = "token" if s.token() else "no auth"
    dev = f", device {s.torch_device()}" if service == "verifier" else ""
    if service == "verifier":
        dev += f", {model_dtype(s)}"
    if service in ("verifier", "drafter"):
        import torch

        from specmesh.threads import model_thread

        dev += (f", cpus {s.cpus_for(service) or 'all'}, model thread with {model_thread().run(torch.get_num_threads)}"
                f" torch threads")
    print(f"specmesh {service} listening on {running.address} ({mode}, {auth}{dev})", flush=True)
    if metrics is not None:
        mhost = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
        try:
            mport = metrics.serve(s.metrics_port_of(service), s.host)
            print(f"specmesh {service} metrics on http://{mhost}:{mport}/metrics", flush=True)
        except OSError as e:  # metrics are auxiliary: serve without them rather than not at all
            metrics = None
            print(f"specmesh {service}: WARNING no /metrics, port {s.metrics_port_of(service)} on {mhost}: {e} "
                  f"(set --metrics-port, or --metrics false)", flush=True)
    http = None
    if router is not None and s.http:
        from ..serving.openai_http import start_http

        try:
            http = start_http(s, running.address)
            print(f"specmesh {service} OpenAI API on {http.url}", flush=True)
        except OSError as e:  # the gRPC API is up; say why the HTTP one is not
            print(f"specmesh {service}: WARNING no OpenAI HTTP API, port {s.http_port} on {s.host}: {e} "
                  f"(set --http-port, or --http false)", flush=True)
    try:
        serve_until_signal(running, s.drain_s)
    finally:
        if http is not None:
            http.stop()
        if cleanup:
            cleanup()
        if metrics is not None:
            metrics.stop()
        tracing.shutdown()
    return 0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sk:
        sk.bind((host, 0))
        return sk.getsockname()[1]


def _settings_env(s) -> dict:
    """The resolved settings as SPECMESH_* variables (auth_token stays in the parent's env)."""
    env = {}
    for name, value in s.model_dump(exclude={"auth_token", "port", "metrics_port"}).items():
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(value)
        env[f"SPECMESH_{name.upper()}"] = str(value)
    return env


def serve_all(s) -> int:
    """The three services (and the OpenAI front, a fourth) as child processes under a ``Supervisor``: a service
    that dies after it came up is restarted on its port (backoff, logged,
    counted on the supervisor's /metrics) while the others keep serving."""
    from ..serving.supervisor import RestartPolicy, Supervisor, SupervisorMetrics

    host = s.host
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    ports = {svc: getattr(s, f"{svc}_port") or _free_port(host) for svc in SERVICES}
    addr = {svc: f"{client_host}:{p}" for svc, p in ports.items()}
    env = dict(os.environ, **_settings_env(s))
    env.pop("SPECMESH_CONFIG", None)  # already resolved into the variables above
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    extra = {"router": ["--drafter-address", addr["drafter"], "--verifier-addresses", addr["verifier"],
                        "--http", "false"]}
    http_url = None
    cmds = {svc: [sys.executable, "-m", "specmesh.cli", "serve", svc, "--port", str(ports[svc])] + extra.get(svc, [])
            for svc in SERVICES}
    if s.http:  # the OpenAI HTTP API: a process of its own (a router restart does not end its streams)
        http_port = s.http_port or _free_port(host)
        cmds["openai"] = [sys.executable, "-m", "specmesh.cli", "serve", "openai", "--port", str(http_port),
                          "--router-addresses", addr["router"]]
        http_url = f"{'https' if s.tls_cert else 'http'}://{client_host}:{http_port}/v1"
    metrics = SupervisorMetrics(list(cmds)) if s.metrics else None
    sup = Supervisor(cmds, env, RestartPolicy(backoff_s=s.restart_backoff_s, max_backoff_s=s.restart_max_backoff_s),
                     metrics)
    stop = threading.Event()
    prev = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if metrics is not None:
            try:
                mport = metrics.serve(s.supervisor_metrics_port, host)
                print(f"specmesh: supervisor metrics on http://{client_host}:{mport}/metrics", file=sys.stderr)
            except OSError as e:
                metrics = None
                print(f"specmesh: WARNING no supervisor /metrics on port {s.supervisor_metrics_port}: {e}",
                      file=sys.stderr)
        sup.start()
        announced, reason = False, None
        while not stop.is_set():
            reason = sup.poll()
            if reason:
                print(f"specmesh: {reason}", file=sys.stderr)
                break
            if not announced and sup.all_ready():
                announced = True
                for svc in SERVICES:
                    print(f"{svc:9s} {addr[svc]}", flush=True)
                if http_url:
                    print(f"{'openai':9s} {http_url}", flush=True)
                print(f'try: specmesh generate "Hello" --address {addr["router"]}', flush=True)
            stop.wait(0.2)
        return 0 if stop.is_set() else 1
    finally:
        sup.stop([x for x in ("openai",) if x in cmds] + list(reversed(SERVICES)), s.drain_s + 10)  # fronts first
        if metrics is not None:
            metrics.stop()
        for sig, h in prev.items():
            signal.signal(sig, h)


# ---------------------------------------------------------------- generate

def format_stats(st) -> str:
    pa = ", ".join(f"{x:.2f}" for x in st.position_acceptance)
    lines = [
        f"strategy {st.strategy}" + (f" ({st.drafter})" if st.drafter else "") + f", finish {st.finish_reason}"
        + (f", LOSSY acceptance ({getattr(st, 'acceptance', '') or '?'})" if st.lossy else "")
        + (f", verifier {st.verifier}" if st.verifier else ""),
        f"{st.new_tokens} new tokens in {st.total_s:.2f} s ({st.tokens_per_s:.1f} tok/s), ttft {st.ttft_s:.3f} s, "
        f"prompt {st.prompt_tokens} tokens",
        f"rounds {st.rounds}, tau {st.tau:.2f} tokens/forward, drafted {st.drafted_tokens}, "
        f"accepted {st.accepted_tokens}, fallbacks {st.fallbacks}, re-prefills {st.reprefills}",
        f"acceptance histogram {st.accept_hist}; per-position acceptance [{pa}]",
        f"time: prefill {st.prefill_s:.3f} s, draft {st.draft_s:.3f} s, verify {st.verify_s:.3f} s, "
        f"network {st.network_s:.3f} s",
    ]
    if getattr(st, "strategy_reason", ""):
        lines.insert(1, f"why: {st.strategy_reason}")
    if getattr(st, "cache_drafted_tokens", 0) or getattr(st, "warm_prefix_tokens", 0):
        lines.append(f"cache hit {st.cache_hit}: {st.cache_accepted_tokens}/{st.cache_drafted_tokens} cached draft "
                     f"tokens accepted; warm prefix {st.warm_prefix_tokens} tokens")
    if getattr(st, "thinking_tokens", 0) or getattr(st, "answer_tokens", 0):
        lines.append(f"reasoning: {st.thinking_tokens} thinking tokens, answer {st.answer_tokens} tokens in "
                     f"{st.answer_s:.2f} s; side branches {st.side_branches} ({st.side_tokens} tokens)")
    return "\n".join("-- " + x for x in lines)


def _acceptance_params(pairs) -> dict:
    """["lenience=0.5", "accept_top_k=3"] -> {"lenience": 0.5, "accept_top_k": 3}."""
    out: dict = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        out[name.strip()] = value.strip() if name.strip() == "cd_amateur" else (
            int(value) if name.strip() == "accept_top_k" else float(value))
    return out


def generate_main(args) -> int:
    from ..client import Client
    from ..errors import InvalidArgumentError, SpecmeshError

    token = os.environ.get("SPECMESH_AUTH_TOKEN") or None
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    client = Client(args.address, token=token, root_certificates=args.ca, timeout=args.timeout,
                    private_key=args.key, certificate_chain=args.cert, resume=not args.no_resume)
    kw = dict(strategy=args.strategy, drafter=args.drafter, max_new_tokens=args.max_new_tokens,
              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
              draft_budget=args.draft_budget, raw_prompt=args.raw, conversation_id=args.conversation_id,
              reasoning=args.reasoning, thinking_budget=args.thinking_budget, stop=args.stop, acceptance=args.acceptance,
              acceptance_params=_acceptance_params(args.acceptance_param), draft_ahead=args.draft_ahead)
    out = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON alone (| jq works)
    try:
        s = client.stream(args.prompt, **kw)
        for piece in s:
            out.write(piece)
            out.flush()
        out.write("\n")
    except SpecmeshError as e:
        print(f"\nspecmesh: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, InvalidArgumentError) else 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(s.result.stats.to_dict()))
    else:
        print(format_stats(s.result.stats), file=sys.stderr)
    return 0
