"""Configuration of the gRPC services (pydantic-settings).

One ``ServeSettings`` object configures any of the three servers and the router's
outgoing connections: bind address and ports, limits, TLS files, the bearer
token, batching and retry knobs. Values come from (highest priority first)
command-line flags (``specmesh serve``, defined in ``specmesh/cli/serve.py``),
environment variables ``SPECMESH_<FIELD>`` (e.g. ``SPECMESH_MAX_NEW_TOKENS=512``,
``SPECMESH_VERIFIER_ADDRESSES=a:1,b:2``), a YAML file (``--config`` or
``SPECMESH_CONFIG``), then the defaults below. The token
is never a flag (it would show in ``ps``): ``SPECMESH_AUTH_TOKEN`` or
``auth_token_file``.

This module knows nothing about gRPC objects, models or the services' logic.
"""

from __future__ import annotations

import contextvars
import os
import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, YamlConfigSettingsSource

from ..ahead import AHEAD_DEFAULT

_YAML_FILE: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("specmesh_yaml", default=None)

MiB = 1 << 20


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECMESH_", extra="forbid", validate_default=True)

    # ---- where to listen / connect
    host: str = Field("127.0.0.1", description="bind address; loopback unless told otherwise")
    port: Optional[int] = Field(None, ge=0, le=65535, description="port of a single service (0 = any free port)")
    router_port: int = Field(50051, ge=0, le=65535)
    drafter_port: int = Field(50052, ge=0, le=65535)
    verifier_port: int = Field(50053, ge=0, le=65535)
    drafter_address: str = Field("", description="router -> drafter; empty = host:drafter_port, 'none' = no drafter")
    verifier_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="router -> verifier replicas; empty = [host:verifier_port]")
    replica_choice: Literal["prefix", "least_loaded", "hash"] = Field(
        "prefix", description="router: a new session's verifier replica: prefix (its conversation's replica, else the "
        "one whose prefix cache likely holds the longest prefix of its prompt unless much busier, else the least "
        "loaded), least_loaded, or hash (of the session id)")
    router_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="OpenAI front (`serve openai`) -> routers: host:port list, or one DNS name "
        "with several records; a stream is resumed on the next one when its router dies; empty = "
        "[host:router_port]")

    # ---- model (verifier; the router loads only the tokenizer)
    model: str = "smollm2-135m-instruct"
    # auto: int4 (the GGUF's own blocks on the int8 kernels) where the model is a GGUF and the
    # device a CPU with those kernels, else bf16 (runtime.resolve_dtype): both are batch-invariant
    # on the CPU, so greedy speculation equals plain decoding; docs/performance.md
    dtype: Literal["auto", "fp32", "bf16", "int8", "int4"] = "auto"
    n_slots: int = Field(8, ge=1, description="KV slots of the verifier")
    draft_head_rows: int = Field(65536, ge=0, description="the draft LM's head keeps the first N token ids (and "
                                 "the added tokens) where its vocabulary is at least 2N: a draft step reads less "
                                 "(output unchanged: the target verifies); 0 = the whole head")
    # the limits below default from the served model's context (serving/limits.py)
    max_seq_len: Optional[int] = Field(None, ge=16, description="KV positions per slot (verifier, draft LM): the "
                                       "longest prompt + reply; None = the model's context, at most 8192")
    layerskip_exit: Optional[int] = Field(None, ge=1, description="layer-skip exit layer; None = the calibrated "
                                          "one (specmesh calibrate-layerskip), else 24")
    draft_model: Optional[str] = Field(None, description="draft LM directory for draft_lm (default: derived)")
    preload_draft_lm: Optional[bool] = Field(
        None, description="drafter service: load the draft LM at start, not on the first draft_lm request (None: "
        "when it is a model of its own, the target's paired draft model or draft_model)")
    device: str = Field("auto", description="verifier and draft LM: auto | cpu | cuda | cuda:N (auto: CUDA when "
                        "torch.cuda.is_available()); whether it exists is checked when a service starts")
    prefix_cache: bool = Field(True, description="verifier: keep the KV of committed tokens in blocks that later "
                               "requests starting with the same tokens reuse (multi-turn chat, shared system "
                               "prompts): prefill only what the cache lacks")
    prefix_cache_mib: float = Field(512.0, gt=0, description="verifier: the prefix cache's storage budget in MiB "
                                    "(least recently used blocks evicted); refused at start-up when it cannot hold "
                                    "one sequence of max_seq_len tokens")
    prefix_block: int = Field(16, ge=1, le=1024, description="verifier: tokens per prefix-cache block")
    prefill_chunk: int = Field(256, ge=0, description="verifier: a prompt's (uncached) tokens computed per forward "
                               "at most, between the running streams' rounds (0: a prompt in one forward)")
    prefill_stall_ratio: float = Field(2.0, ge=0, description="verifier: while streams run, a forward carrying a "
                                       "prefill chunk costs at most this many times the streams' own forward "
                                       "(measured; 0: chunks of prefill_chunk tokens regardless)")
    cuda_graphs: Union[bool, Literal["invariant"]] = Field(
        True, description="on CUDA, replay CUDA graphs for small forwards (GraphedEngine); 'invariant': one bucket "
        "shape for every forward (prompts in chunks), so bf16 greedy speculation equals plain decoding")

    # ---- limits
    max_prompt_tokens: Optional[int] = Field(None, ge=1, description="limit on prompt tokens; None = all the "
                                             "context leaves a reply (max_seq_len - 2)")
    max_new_tokens: Optional[int] = Field(None, ge=1, description="cap on GenerateRequest.max_new_tokens (refused "
                                          "above it); None = none but the context: a request for more than "
                                          "its prompt leaves is refused")
    default_max_new_tokens: int = Field(256, ge=1, description="max_new_tokens of a request that names none")
    max_sessions_per_client: int = Field(16, ge=1, description="concurrent Generate streams per client")
    max_message_bytes: int = Field(4 * MiB, ge=1024, description="larger requests are INVALID_ARGUMENT")
    max_tree_nodes: int = Field(64, ge=1)
    max_drafter_sessions: int = Field(1024, ge=1)

    # ---- strategies
    # auto: picks per request from its features and the session's measured speedups (suffix
    # decoding where the answer reuses the prompt, the trained block drafter on fresh text,
    # speculation off where it measured a slowdown); external:prompt_lookup, the old default,
    # reached tau 1.0-1.2 on open text where auto ran about 2x faster (issue 50)
    default_strategy: Literal["autoregressive", "external", "self", "proactive", "ssr", "auto"] = Field(
        "auto", description="the strategy of requests that name none (and name no drafter: a request naming only "
        "a drafter is external)")
    default_drafter: str = Field("prompt_lookup", description="the external drafter of requests that name none "
                                 "(one of drafters.registry.EXTERNAL)")
    draft_budget: int = Field(6, ge=1)
    draft_ahead: Literal["off", "on", "auto"] = Field(AHEAD_DEFAULT, description="external token-only drafters "
                                                      "draft the next round while this one verifies (specmesh.ahead)")
    decode_stream: bool = Field(True, description="router: rounds without a draft (plain decoding's, drafting "
                                "that stopped) and self drafters' rounds read their tokens from a Verifier/Decode "
                                "stream (the verifier decodes the next round while the router handles this one); "
                                "false: a Verify call a round")
    # where an external request's context-only drafter runs: in the verifier (no hop a round: measured faster
    # through serve, docs/performance.md) unless the router is told the drafter service (its suffix tree is
    # shared by all verifier replicas; a verifier's learns from the outputs it verified)
    context_drafters: Literal["verifier", "drafter"] = Field(
        "verifier", description="router: where an external request's context-only drafter (prompt_lookup, suffix) "
        "runs: 'verifier' (the verifiers run it in their own turn from the session's tokens, rounds on the Decode "
        "stream, no hop a round; where every verifier hosts it: verifier_drafters) or 'drafter' (the drafter "
        "service, a Propose a round)")
    verifier_drafters: Annotated[list[str], NoDecode] = Field(
        ["prompt_lookup", "suffix"], description="verifier: the context-only drafters it runs for external requests "
        "(context_drafters); a comma list, empty: none")
    draft_ahead_width: int = Field(1, ge=1, le=64, description="drafter: guesses tried per draft-ahead outcome "
                                   "(1: the bonus token is its best guess, a rejection's token its second choice)")
    draft_ahead_outcomes: int = Field(4, ge=1, le=64, description="drafter: ahead rounds drafted per verify, at most")
    draft_ahead_ttl_s: float = Field(30.0, gt=0, description="drafter: a draft-ahead cache entry's lifetime")
    auto_anticipate: bool = Field(False, description="anticipate every finished turn that has a conversation_id")
    anticipate_tokens: int = Field(512, ge=1, description="idle tokens per anticipation (upper limit)")
    anticipate_next_turns: int = Field(2, ge=0, le=8, description="predicted next user turns per anticipation")
    anticipate_reply_tokens: int = Field(96, ge=1, description="tokens of each anticipated reply")
    anticipate_ttl_s: float = Field(600.0, gt=0, description="lifetime of an anticipation and its draft cache")
    anticipate_max_conversations: int = Field(64, ge=1)
    anticipate_max_warm: int = Field(2, ge=0, description="warm KV sessions held for idle conversations")
    ssr_side_tokens: int = Field(24, ge=1, description="tokens of each SSR side-branch answer")
    ssr_fractions: str = Field("0.5,0.75", description="comma list of fractions of the thinking budget where "
                               "SSR branches (each in (0, 1))")

    # ---- batching / threads
    batch_window_ms: float = Field(5.0, ge=0, description="verifier: how long a forward waits for the other "
                                   "active sessions' requests (a lone session never waits)")
    max_batch: int = Field(8, ge=1)
    workers: int = Field(32, ge=1, description="gRPC handler threads per server")
    cpus: str = Field("", description="CPUs each service may use, and so its torch threads: a CPU list for every "
                      "service of this process (\"0-1\") or one per service (\"verifier=0-1,drafter=1,router=0\"); "
                      "\"\" = every CPU, torch's default thread count")

    # ---- timeouts, retries
    drain_s: float = Field(5.0, ge=0, description="grace period for in-flight calls on SIGTERM")
    drafter_timeout_s: Optional[float] = Field(
        None, gt=0, description="router: deadline of one drafter call; None = 2 s, plus for a real draft model "
        "4x its measured time for the call's tokens (DrafterInfo draft_prefill_ms / draft_token_ms)")
    verifier_timeout_s: float = Field(60.0, gt=0)
    verifier_retry_s: float = Field(15.0, ge=0, description="how long the router retries unreachable verifiers")
    drafter_backoff_s: float = Field(1.0, gt=0, description="first wait before retrying an unhealthy drafter")
    drafter_backoff_max_s: float = Field(30.0, gt=0)

    # ---- observability (tracing is configured by the OTEL_* variables, see docs/observability.md)
    metrics: bool = Field(True, description="serve Prometheus /metrics over HTTP")
    log_stats_interval_s: float = Field(10.0, ge=0, description="router: every this many seconds with traffic, "
                                        "log one throughput line (prompt and generation tok/s, running and "
                                        "finished requests; observability/throughput.py); 0 = off")
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="/metrics port of a single service "
                                        "(0 = any free port); default: <service>_metrics_port")
    router_metrics_port: int = Field(9451, ge=0, le=65535)
    drafter_metrics_port: int = Field(9452, ge=0, le=65535)
    verifier_metrics_port: int = Field(9453, ge=0, le=65535)
    supervisor_metrics_port: int = Field(9450, ge=0, le=65535, description="`specmesh serve` (all three): the "
                                         "supervisor's /metrics (service restarts and up/down)")
    restart_backoff_s: float = Field(1.0, gt=0, description="`specmesh serve`: wait before restarting a dead "
                                     "service; doubles with each crash in a row")
    restart_max_backoff_s: float = Field(30.0, gt=0, description="`specmesh serve`: longest wait before a restart")

    # ---- the OpenAI-compatible HTTP API of the router (serving/openai_http.py)
    http: bool = Field(True, description="router: serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    http_port: int = Field(8000, ge=0, le=65535, description="router: port of the OpenAI HTTP API (0 = any free "
                           "port); same host, token and TLS as the gRPC server")
    http_timeout_s: Optional[float] = Field(None, gt=0, description="OpenAI front: deadline of each generation "
                                            "(HTTP 504 when it passes, e.g. while no router is back); None = none")
    resume_window_s: float = Field(60.0, gt=0, description="OpenAI front: how long a stream whose router died "
                                   "waits for a router to resume on (HTTP 503 after it, or 504 at the deadline)")

    # ---- security
    tls_cert: Optional[Path] = Field(None, description="server certificate chain (PEM); enables TLS")
    tls_key: Optional[Path] = Field(None, description="server private key (PEM)")
    tls_client_ca: Optional[Path] = Field(None, description="CA of client certificates: mutual TLS")
    peer_ca: Optional[Path] = Field(None, description="router -> drafter/verifier: CA to trust (TLS)")
    peer_cert: Optional[Path] = Field(None, description="router -> drafter/verifier: client certificate (mTLS)")
    peer_key: Optional[Path] = Field(None, description="router -> drafter/verifier: client key (mTLS)")
    auth_token: Optional[SecretStr] = Field(None, description="bearer token (env SPECMESH_AUTH_TOKEN only)")
    auth_token_file: Optional[Path] = Field(None, description="file holding the bearer token")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        sources = [init_settings, env_settings]
        path = _YAML_FILE.get()
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @field_validator("verifier_addresses", "router_addresses", "verifier_drafters", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            return [a.strip() for a in v.split(",") if a.strip()]
        return v

    @field_validator("verifier_drafters")
    @classmethod
    def _verifier_drafters(cls, v: list[str]) -> list[str]:
        from specmesh.drafters.in_verifier import HOSTABLE

        bad = [d for d in v if d not in HOSTABLE]
        if bad:
            raise ValueError(f"verifier_drafters: {bad} are not context-only drafters a verifier runs; choose from "
                             f"{list(HOSTABLE)}")
        return list(dict.fromkeys(v))

    @field_validator("default_drafter")
    @classmethod
    def _default_drafter(cls, v: str) -> str:
        from specmesh.drafters.registry import EXTERNAL

        if v not in EXTERNAL:
            raise ValueError(f"default_drafter: must be one of {list(EXTERNAL)}, got {v!r}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        v = str(v).strip().lower()
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"device: expected auto | cpu | cuda | cuda:N, got {v!r}")
        return v

    def torch_device(self):
        """The ``torch.device`` of ``device`` on this machine; raises
        ``InvalidArgument("device", ...)`` when it does not exist here."""
        from specmesh.engine.device import resolve_device

        return resolve_device(self.device)

    @field_validator("ssr_fractions")
    @classmethod
    def _fractions(cls, v: str) -> str:
        try:
            fs = [float(a) for a in v.split(",") if a.strip()]
        except ValueError:
            raise ValueError(f"ssr_fractions: not a comma list of numbers: {v!r}") from None
        if any(not 0 < f < 1 for f in fs):
            raise ValueError("ssr_fractions must lie in (0, 1)")
        return v

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: str) -> str:
        _cpu_map(v)  # raises ValueError naming the part
        return v

    def cpus_for(self, service: str) -> Optional[str]:
        """The CPU list of ``service`` ("verifier", "drafter", "router", ...), or None: not pinned."""
        m = _cpu_map(self.cpus)
        return m.get(service, m.get("*")) or None

    def model_threads(self, service: str) -> Optional[int]:
        """Torch threads of the service's model thread: its CPU count when pinned, else None (torch's default)."""
        from specmesh.threads import parse_cpus

        c = self.cpus_for(service)
        return len(parse_cpus(c)) if c else None

    def ssr_fraction_list(self) -> list[float]:
        return [float(a) for a in self.ssr_fractions.split(",") if a.strip()]

    @model_validator(mode="after")
    def _check(self) -> "ServeSettings":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if (self.peer_cert is None) != (self.peer_key is None):
            raise ValueError("peer_cert and peer_key must be given together")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "peer_ca", "peer_cert", "peer_key", "auth_token_file"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"{name}: file {p} does not exist")
        if self.prefill_stall_ratio and self.prefill_stall_ratio < 1:
            raise ValueError(f"prefill_stall_ratio: must be 0 (off) or >= 1, got {self.prefill_stall_ratio}")
        return self

    # ---- derived values
    def token(self) -> Optional[str]:
        """The bearer token (file wins over the environment), or None: no auth."""
        if self.auth_token_file is not None:
            t = Path(self.auth_token_file).read_text().strip()
            if not t:
                raise ValueError(f"auth_token_file {self.auth_token_file} is empty")
            return t
        return self.auth_token.get_secret_value() if self.auth_token else None

    def drafter_target(self) -> Optional[str]:
        if self.drafter_address.lower() == "none":
            return None
        return self.drafter_address or f"{self.host}:{self.drafter_port}"

    def verifier_targets(self) -> list[str]:
        return list(self.verifier_addresses) or [f"{self.host}:{self.verifier_port}"]

    def router_targets(self) -> list[str]:
        return list(self.router_addresses) or [f"{self.host}:{self.router_port}"]

    def port_of(self, service: str) -> int:
        return self.port if self.port is not None else getattr(self, f"{service}_port")

    def metrics_port_of(self, service: str) -> int:
        return self.metrics_port if self.metrics_port is not None else getattr(self, f"{service}_metrics_port")


def _cpu_map(text: str) -> dict[str, str]:
    """``"0-1"`` -> {"*": "0-1"}; ``"verifier=0-1,3,drafter=1"`` -> {"verifier": "0-1,3", "drafter": "1"}
    (a part without ``=`` continues the service before it)."""
    from specmesh.threads import parse_cpus

    text = str(text or "").strip()
    if not text:
        return {}
    if "=" not in text:
        parse_cpus(text)
        return {"*": text}
    out: dict[str, list[str]] = {}
    name = None
    for part in (p.strip() for p in text.split(",")):
        if "=" in part:
            name, _, part = (x.strip() for x in part.partition("="))
            if not re.fullmatch(r"[a-z][a-z0-9_-]*", name):
                raise ValueError(f"cpus: {name!r} is not a service name (e.g. verifier=0-1,drafter=1)")
            if name in out:
                raise ValueError(f"cpus: {name} given twice")
            out[name] = []
        elif name is None:
            raise ValueError(f"cpus: {text!r} mixes a CPU list with service=CPUs parts")
        out[name].append(part)
    m = {k: ",".join(v) for k, v in out.items()}
    for k, v in m.items():
        try:
            parse_cpus(v)
        except ValueError as e:
            raise ValueError(f"cpus: {k}: {e}") from None
    return m


def load_settings(config: Optional[str | os.PathLike] = None, **overrides) -> ServeSettings:
    """Settings from ``overrides`` (flags) > environment > YAML ``config`` (or
    ``$SPECMESH_CONFIG``) > defaults."""
    path = config or os.environ.get("SPECMESH_CONFIG") or None
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    tok = _YAML_FILE.set(str(path) if path else None)
    try:
        return ServeSettings(**overrides)
    finally:
        _YAML_FILE.reset(tok)
