"""``build_app(config)``: the specmesh Ray Serve application.

Four deployments, each with its own replica count or autoscaling bounds and
its own resources from ``RayAppConfig``: ``Drafter`` and ``Verifier`` (each
replica runs that role's gRPC server), ``Router``, the ingress, which runs
the router's gRPC server and reaches the other two over the same gRPC
contracts, and ``OpenAI`` (unless ``settings.http`` is false), the OpenAI HTTP
API in front of the router replicas through the SDK, so a router replica that
dies does not end its streams (see ``deployments``). Serve calls this function when a config
names ``import_path: specmesh.deploy.ray.app:build_app``; its ``args`` become the
``RayAppConfig``.

No ``from __future__ import annotations`` here: Serve reads the parameter's
annotation to validate ``args`` with the pydantic model.

This module knows nothing about gRPC or models.
"""

from ray.serve import Application

from .config import RayAppConfig
from .deployments import DrafterReplica, OpenAIReplica, RouterReplica, VerifierReplica


def build_app(config: RayAppConfig) -> Application:
    cfg = config if isinstance(config, RayAppConfig) else RayAppConfig.model_validate(config or {})
    args = cfg.model_dump(mode="json")
    drafter = DrafterReplica.options(**cfg.drafter.options("Drafter")).bind(args)
    verifier = VerifierReplica.options(**cfg.verifier.options("Verifier")).bind(args)
    openai = None
    if cfg.serve_settings().http:  # the HTTP front: a deployment of its own, not inside a router replica
        openai = OpenAIReplica.options(**cfg.openai.options("OpenAI")).bind(args)
    return RouterReplica.options(**cfg.router.options("Router")).bind(args, drafter, verifier, openai)

