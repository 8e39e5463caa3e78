"""Configuration of the Ray Serve application (pydantic).

``RayAppConfig`` is what ``build_app`` takes (and what a Serve config file's
``args`` holds): the service settings shared by every replica (any
``ServeSettings`` field: model, dtype, n_slots, limits, TLS, ...) and, for each
of the deployments (``Router``, ``Drafter``, ``Verifier``, and ``OpenAI``: the
OpenAI HTTP front, left out when ``settings.http`` is false), its replica
count or autoscaling bounds and its resources (``num_cpus``, ``num_gpus``,
``memory``). Devices: the verifier's replicas run on ``verifier.device`` or else
``settings.device``; when that is ``cuda`` / ``cuda:N`` and ``verifier.num_gpus`` is 0
the config asks Ray for one GPU per replica (Ray shows an actor only the GPUs it
was given, so ``auto`` follows ``num_gpus``). Drafter replicas (the draft LM) run on
``drafter.device``, else ``auto`` when they have GPUs and the CPU when not; the
router needs no device. ``load_serve_config`` reads a YAML file that is either a Serve
config (``applications: [...]``, the format of ``serve deploy`` and a KubeRay
``serveConfigV2``) or a bare ``RayAppConfig``, and returns a Serve config dict.

Scaling one deployment without touching the others: override it in the Serve
config's ``deployments:`` list (``{name: Drafter, num_replicas: 2}``), which
Serve applies in place. Changing ``args`` changes the application's code
version and restarts every replica.

This module knows nothing about Ray's runtime, gRPC or models; it imports
neither ray nor torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

IMPORT_PATH = "specmesh.deploy.ray.app:build_app"
DEPLOYMENTS = ("Router", "Drafter", "Verifier", "OpenAI")
# The OpenAI HTTP front's port unless settings.http_port is given: Serve's own
# HTTP proxy holds 8000 (ServeSettings' default) on the nodes it runs on.
RAY_HTTP_PORT = 8001


class Autoscaling(BaseModel):
    """Replica bounds; the load signal is what the replicas report
    (``record_autoscaling_stats``: active sessions and calls in flight), because
    gRPC traffic does not pass through Serve's own request counters."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=0)
    target_load: float = Field(4.0, gt=0, description="sessions + in-flight calls one replica should carry")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self

    def to_serve(self) -> dict:
        d = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
             "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
             "target_ongoing_requests": self.target_load,
             "policy": {"policy_function": "specmesh.deploy.ray.autoscale:load_policy"}}
        if self.initial_replicas is not None:
            d["initial_replicas"] = self.initial_replicas
        return d


class DeploymentSpec(BaseModel):
    """One deployment: a fixed ``num_replicas`` or ``autoscaling``, and the
    resources of each replica."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=0)
    autoscaling: Optional[Autoscaling] = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: Optional[int] = Field(None, ge=0, description="bytes of memory reserved per replica")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources per replica, e.g. to pin the router "
                                                    "to the pods a Kubernetes Service targets")
    torch_threads: Optional[int] = Field(None, ge=1, description="default: max(1, floor(num_cpus))")
    device: Optional[str] = Field(None, description="auto | cpu | cuda | cuda:N for this deployment's replicas "
                                  "(verifier default: settings.device; drafter default: auto with GPUs, else cpu)")
    max_ongoing_requests: int = Field(16, ge=1, description="Serve handle calls (info) per replica")
    health_check_period_s: float = Field(5.0, gt=0)

    def threads(self) -> int:
        return self.torch_threads or max(1, int(self.num_cpus))

    def options(self, name: str) -> dict:
        """Keyword arguments of ``Deployment.options``."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        spin = _spin_env()
        if spin:  # the replicas' OpenMP threads spin briefly, as `specmesh serve`'s do (specmesh.threads)
            actor["runtime_env"] = {"env_vars": spin}
        if self.memory:
            actor["memory"] = self.memory
        if self.resources:
            actor["resources"] = dict(self.resources)
        d: dict[str, Any] = {"name": name, "ray_actor_options": actor,
                             "max_ongoing_requests": self.max_ongoing_requests,
                             "health_check_period_s": self.health_check_period_s}
        if self.autoscaling is not None:
            d["autoscaling_config"] = self.autoscaling.to_serve()
        else:
            d["num_replicas"] = self.num_replicas
        return d


class RayAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    settings: dict[str, Any] = Field(default_factory=dict,
                                     description="ServeSettings fields shared by every replica")
    router: DeploymentSpec = Field(default_factory=lambda: DeploymentSpec(num_cpus=0.5))
    drafter: DeploymentSpec = Field(default_factory=lambda: DeploymentSpec(num_cpus=0.5))
    verifier: DeploymentSpec = Field(default_factory=lambda: DeploymentSpec(num_cpus=1.0))
    openai: DeploymentSpec = Field(default_factory=lambda: DeploymentSpec(num_cpus=0.25))
    advertise_host: Optional[str] = Field(
        None, description="host others dial to reach a replica's gRPC server; default: the bind host when it "
                          "is a specific address, else the Ray node IP")
    registry: str = Field("", description="name of the replica registry actor; default: specmesh-<app name>")
    heartbeat_s: float = Field(1.0, gt=0, description="replica -> registry heartbeat period")
    ttl_s: float = Field(6.0, gt=0, description="a replica silent this long leaves the registry")
    refresh_s: float = Field(0.5, gt=0, description="router: how often it re-reads the registry")
    startup_timeout_s: float = Field(600.0, gt=0, description="router: wait this long for a first verifier")

    @model_validator(mode="after")
    def _check(self) -> "RayAppConfig":
        for role in DEPLOYMENTS:
            self.serve_settings(role)  # every settings key (and device) must be a valid ServeSettings field
        if self.ttl_s <= 2 * self.heartbeat_s:
            raise ValueError(f"ttl_s {self.ttl_s} must exceed twice heartbeat_s {self.heartbeat_s}")
        for role in ("Verifier", "Drafter"):  # a CUDA device needs a GPU from Ray
            spec = self.spec(role)
            if self.device(role).startswith("cuda") and spec.num_gpus == 0:
                spec.num_gpus = 1.0
        return self

    def device(self, deployment: str) -> str:
        """The device spec the replicas of ``deployment`` run on (see the module docstring)."""
        spec = self.spec(deployment)
        if spec.device:
            return spec.device.strip().lower()
        if deployment.lower() == "verifier":
            return str(self.settings.get("device", "auto")).strip().lower()
        return "auto" if spec.num_gpus > 0 else "cpu"

    def serve_settings(self, deployment: Optional[str] = None):
        """The ``ServeSettings`` of every replica, or of ``deployment``'s (its device filled in)."""
        from specmesh.serving.settings import load_settings

        if deployment is None or deployment.lower() in ("router", "openai"):
            return load_settings(None, **self.settings)
        return load_settings(None, **dict(self.settings, device=self.device(deployment)))

    def spec(self, deployment: str) -> DeploymentSpec:
        return getattr(self, deployment.lower())


# ---------------------------------------------------------------- Serve config files

def serve_config(cfg: RayAppConfig, name: str = "specmesh", route_prefix: str = "/specmesh",
                 deployments: Optional[list[dict]] = None) -> dict:
    """A Serve config (``serve deploy`` / ``serveConfigV2`` format) for one app."""
    app: dict[str, Any] = {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH,
                           "args": cfg.model_dump(mode="json", exclude_defaults=True)}
    if deployments:
        app["deployments"] = deployments
    return {"applications": [app]}


def specmesh_app(config: dict) -> dict:
    """The application entry of a Serve config whose import path is the builder."""
    apps = [a for a in config.get("applications", []) if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"the Serve config needs exactly one application with import_path {IMPORT_PATH}, "
                         f"found {len(apps)}")
    return apps[0]


def validate_serve_config(config: dict) -> RayAppConfig:
    """Check the specmesh application of a Serve config: its args validate as a
    ``RayAppConfig`` and its deployment overrides name real deployments."""
    app = specmesh_app(config)
    cfg = RayAppConfig.model_validate(app.get("args") or {})
    for d in app.get("deployments") or []:
        if d.get("name") not in DEPLOYMENTS:
            raise ValueError(f"deployments: unknown deployment {d.get('name')!r}; known: {list(DEPLOYMENTS)}")
    return cfg


def load_serve_config(path: Optional[str | Path]) -> dict:
    """Read a Serve config or a bare RayAppConfig YAML (None: defaults); returns a
    validated Serve config dict."""
    raw = yaml.safe_load(Path(path).read_text()) if path else None
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    config = raw if "applications" in raw else serve_config(RayAppConfig.model_validate(raw))
    validate_serve_config(config)
    return config


def _spin_env() -> dict[str, str]:
    """The OpenMP wait settings for the replicas' workers (which may run on other nodes,
    with an environment of their own): the user's where they chose one, else a brief spin."""
    import specmesh

    return specmesh.user_omp_env() or {"GOMP_SPINCOUNT": specmesh.SPINCOUNT}
