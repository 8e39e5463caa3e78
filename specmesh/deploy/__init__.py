"""Deployment: the same three services on Ray Serve and on plain Kubernetes.

  ray            the Ray Serve application (``specmesh serve --ray``, KubeRay's
                 ``RayService``): config, deployments, registry, autoscaling
  k8s_discovery  ``python -m specmesh.deploy.k8s_discovery``: the router with its
                 replicas found in DNS (headless Services), for HPA-scaled pods

Composition roots only: they wire the services (``specmesh.router``,
``specmesh.drafter_service``, ``specmesh.verifier_service``) into a platform and hold
no decoding logic. The manifests themselves are in ``k8s/`` and ``deploy/``; they name
these modules by path (``specmesh.deploy.ray.app:build_app``, ``python -m
specmesh.deploy.k8s_discovery``), so this package shares the top layer with the
commands (``specmesh.cli``): the DNS router takes ``specmesh serve``'s settings flags
from ``specmesh.cli.serve``, and ``specmesh serve --ray`` deploys the app from here.
Importing this package imports neither ray nor torch.
"""
