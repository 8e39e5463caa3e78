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


# ---------------------------------------------------------------- settings flags (no pydantic import: --help stays fast)

_FLAGS = [
    # (flag, field, type, help)
    ("--host", "host", str, "bind address (default 127.0.0.1)"),
    ("--model", "model", str, "model alias or local HF directory (verifier, router tokenizer)"),
    ("--dtype", "dtype", str, "fp32 | bf16 | int8 | int4 (verifier; default bf16)"),
    ("--device", "device", str, "verifier and draft LM: auto | cpu | cuda | cuda:N (default auto)"),
    ("--cuda-graphs", "cuda_graphs", str, "on CUDA, replay CUDA graphs for small forwards: true | false | "
     "invariant (one bucket shape for every forward: bf16 greedy identity)"),
    ("--n-slots", "n_slots", int, "KV slots of the verifier"),
    ("--prefix-cache", "prefix_cache", str, "verifier: reuse the KV of earlier requests' common prefixes: true | "
     "false (default true)"),
    ("--prefix-cache-mib", "prefix_cache_mib", float, "verifier: the prefix cache's budget in MiB (default 512)"),
    ("--prefix-block", "prefix_block", int, "verifier: tokens per prefix-cache block (default 16)"),
    ("--prefill-chunk", "prefill_chunk", int, "verifier: a prompt's tokens per forward at most, between the running "
     "streams' rounds (default 256; 0 = a prompt in one forward)"),
    ("--prefill-stall-ratio", "prefill_stall_ratio", float, "verifier: while streams run, a forward with a prefill "
     "chunk costs at most this many times theirs (default 2; 0 = off)"),
    ("--max-seq-len", "max_seq_len", int, "longest sequence per slot"),
    ("--draft-model", "draft_model", str, "drafter: the draft LM's alias or directory (default: the target's "
     "paired draft model, else a subset of its layers)"),
    ("--preload-draft-lm", "preload_draft_lm", str, "drafter: load the draft LM at start: true | false "
     "(default: when it is a model of its own)"),
    ("--drafter-address", "drafter_address", str, "router: drafter host:port ('none' = no drafter)"),
    ("--drafter-timeout-s", "drafter_timeout_s", float, "router: deadline of one drafter call (default 2)"),
    ("--draft-ahead", "draft_ahead", str, "router: external token-only drafters draft the next round while the "
     "verifier verifies this one: off | on | auto (measured; default specmesh.ahead.AHEAD_DEFAULT)"),
    ("--decode-stream", "decode_stream", str, "router: rounds without a draft and self drafters' rounds read "
     "their tokens from a Verifier/Decode stream, the verifier decoding ahead: true | false (default true)"),
    ("--context-drafters", "context_drafters", str, "router: where an external request's context-only drafter "
     "(prompt_lookup, suffix) runs: verifier (default: in the verifiers' own turn, no hop a round, where they host "
     "it) | drafter (the drafter service)"),
    ("--verifier-drafters", "verifier_drafters", str, "verifier: comma-separated context-only drafters it runs "
     "for external requests (default prompt_lookup,suffix; '' = none)"),
    ("--verifier-addresses", "verifier_addresses", str, "router: comma-separated verifier host:port list"),
    ("--replica-choice", "replica_choice", str, "router: a new session's verifier replica: prefix (default: by cached "
     "prefix and conversation, unless much busier) | least_loaded | hash"),
    ("--router-addresses", "router_addresses", str, "openai: comma-separated router host:port list (or one DNS "
     "name with several records); a stream whose router dies is resumed on the next"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "limit on prompt tokens, after the chat template (default "
     "1536; a longer prompt is INVALID_ARGUMENT)"),
    ("--max-new-tokens-limit", "max_new_tokens", int, "limit on a request's max_new_tokens (default 1024)"),
    ("--default-strategy", "default_strategy", str, "router: the strategy of requests that name none: auto "
     "(default) | autoregressive | external | self | proactive | ssr"),
    ("--default-drafter", "default_drafter", str, "router: the drafter of external requests that name none "
     "(default prompt_lookup)"),
    ("--max-sessions-per-client", "max_sessions_per_client", int, "concurrent streams per client"),
    ("--max-message-bytes", "max_message_bytes", int, "largest request accepted"),
    ("--batch-window-ms", "batch_window_ms", float, "verifier: dynamic batching window"),
    ("--max-batch", "max_batch", int, "verifier: largest batch"),
    ("--workers", "workers", int, "handler threads"),
    ("--cpus", "cpus", str, "CPUs per service, which also sets its torch threads: verifier=0-1,drafter=1,router=0 "
     "(all three) or 0-1 (this service); default: every CPU, shared (docs/serving.md, \"Placement\")"),
    ("--tls-cert", "tls_cert", str, "server certificate (PEM); enables TLS"),
    ("--tls-key", "tls_key", str, "server private key (PEM)"),
    ("--tls-client-ca", "tls_client_ca", str, "require client certificates signed by this CA (mTLS)"),
    ("--peer-ca", "peer_ca", str, "router: CA of the drafter/verifier certificates"),
    ("--peer-cert", "peer_cert", str, "router: client certificate for mTLS to drafter/verifier"),
    ("--peer-key", "peer_key", str, "router: client key for mTLS to drafter/verifier"),
    ("--auth-token-file", "auth_token_file", str, "bearer token file (or env SPECMESH_AUTH_TOKEN)"),
    ("--drain-s", "drain_s", float, "grace period on SIGTERM"),
    ("--metrics", "metrics", str, "serve Prometheus /metrics over HTTP: true | false (default true)"),
    ("--metrics-port", "metrics_port", int, "/metrics port of a single service (0 = any free port)"),
    ("--log-stats-interval-s", "log_stats_interval_s", float, "router: log a throughput line (prompt and "
     "generation tok/s, running requests) every this many seconds when there was traffic (default 10; 0 = off)"),
    ("--http", "http", str, "router: serve the OpenAI-compatible HTTP API: true | false (default true)"),
    ("--http-port", "http_port", int, "router: port of the OpenAI HTTP API (default 8000; 0 = any free port)"),
    ("--http-timeout-s", "http_timeout_s", float, "OpenAI front: deadline of each generation (504 when it passes; "
     "default none)"),
    ("--resume-window-s", "resume_window_s", float, "OpenAI front: how long a stream whose router died waits for "
     "one to resume on (default 60; then 503)"),
]


def add_settings_flags(p: argparse.ArgumentParser, port: bool = True) -> None:
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML settings file (or env SPECMESH_CONFIG)")
    if port:
        p.add_argument("--port", type=int, default=argparse.SUPPRESS,
                       help="port of a single service (0 = any); with all three it is refused: use --router-port, "
                            "--drafter-port, --verifier-port")
    for flag, dest, typ, hlp in _FLAGS:
        p.add_argument(flag, dest=dest, type=typ, default=argparse.SUPPRESS, help=hlp)


def settings_from_args(args: argparse.Namespace):
    from ..serving.settings import ServeSettings, load_settings

    fields = set(ServeSettings.model_fields)
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return load_settings(getattr(args, "config", None), **overrides)


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the gRPC services (one, or all three as processes)")
    p.add_argument("service", nargs="?", choices=SERVICES + ("openai",),
                   help="the service to run (default: all three, and the OpenAI HTTP front as a fourth process); "
                        "openai: the OpenAI HTTP API alone, in front of --router-addresses")
    add_settings_flags(p)
    for svc in SERVICES:
        p.add_argument(f"--{svc}-port", dest=f"{svc}_port", type=int, default=argparse.SUPPRESS,
                       help=f"port of the {svc} when starting all three (0 = any free port)")
        p.add_argument(f"--{svc}-metrics-port", dest=f"{svc}_metrics_port", type=int, default=argparse.SUPPRESS,
                       help=f"/metrics port of the {svc} when starting all three (0 = any free port)")
    p.add_argument("--supervisor-metrics-port", dest="supervisor_metrics_port", type=int, default=argparse.SUPPRESS,
                   help="/metrics of the supervisor (service restarts) when starting all three (0 = any free port)")
    p.add_argument("--restart-backoff-s", dest="restart_backoff_s", type=float, default=argparse.SUPPRESS,
                   help="wait before restarting a service that died (doubles per crash in a row, up to 30 s)")
    p.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR (default INFO)")
    p.add_argument("--ray", action="store_true",
                   help="run the three as Ray Serve deployments on a local Ray cluster; --config is then a Serve "
                        "config or RayAppConfig YAML (specmesh.deploy.ray)")
    p.set_defaults(module="specmesh.cli.serve", func="serve_main")

    g = sub.add_parser("generate", help="stream a generation from a running router")
    g.add_argument("prompt", help="prompt text (one user turn with the chat template unless --raw; at most the "
                   "router's --max-prompt-tokens, 1536 tokens by default)")
    g.add_argument("--address", default=os.environ.get("SPECMESH_ADDRESS", "127.0.0.1:50051"),
                   help="the router, host:port, or several comma-separated (a stream whose router dies is "
                        "resumed on the next; default: env SPECMESH_ADDRESS, else 127.0.0.1:50051)")
    g.add_argument("--strategy", default="",
                   help="autoregressive | external | self | proactive | ssr | auto (default: the router's "
                        "--default-strategy, auto unless set)")
    from specmesh.drafters import registry

    g.add_argument("--drafter", default="", help="external drafter: " + " | ".join(registry.EXTERNAL)
                   + "; self: " + " | ".join(registry.SELF) + " (specmesh.drafters.registry). "
                   + registry.DRAFT_LM_NOTE.replace("%", "%%"))
    g.add_argument("--conversation-id", default="", help="conversation (proactive strategy)")
    g.add_argument("--reasoning", action="store_true", help="think inside <think>...</think> first")
    g.add_argument("--thinking-budget", type=int, default=None, help="maximum thinking tokens (reasoning)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate at most (default: the router's, 256; its limit: 1024)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default); > 0 samples (with the exact acceptance rule, from the target's own "
                        "distribution)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the top-p mass (default 1)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampled draws (same seed, same output)")
    g.add_argument("--draft-budget", type=int, default=None,
                   help="draft tokens per round at most (default: the router's, adapted per round)")
    g.add_argument("--draft-ahead", default="", choices=["", "on", "off", "auto"],
                   help="external token-only drafters: draft the next round while this one verifies (default: "
                        "the router's --draft-ahead)")
    g.add_argument("--acceptance", default=None,
                   help="verify rule: exact (default) | typical | lenient | topk (lossy) | contrastive | "
                        "divergence (lossy; the verifier's specialist drafts: the router picks strategy self, "
                        "drafter specialist unless a drafter is named)")
    g.add_argument("--acceptance-param", action="append", default=[], metavar="NAME=VALUE",
                   help="the rule's parameter, repeatable: lenience=0.5, accept_top_k=4, cd_alpha=0.1, "
                        "cd_beta=0.5, typical_epsilon=0.3, jsd_threshold=0.3, ...")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string, repeatable: the output ends just before the first one")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds")
    g.add_argument("--no-resume", action="store_true",
                   help="fail when the router dies mid-stream instead of resuming the stream (on by default)")
    g.add_argument("--token-file", default=None, help="bearer token file (or env SPECMESH_AUTH_TOKEN)")
    g.add_argument("--ca", default=None, help="CA certificate (PEM): connect with TLS")
    g.add_argument("--cert", default=None, help="client certificate (PEM) for mutual TLS")
    g.add_argument("--key", default=None, help="client key (PEM) for mutual TLS")
    g.add_argument("--json", action="store_true",
                   help="print only the stats as one JSON object on stdout (the text streams to stderr)")
    g.set_defaults(module="specmesh.cli.serve", func="generate_main")


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
