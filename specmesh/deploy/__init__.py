"""Deployment: the same three services on Ray Serve and on plain Kubernetes.

  ray            the Ray Serve application (``specmesh serve --ray``, KubeRay's
                 ``RayService``): config, deployments, registry, autoscaling, cli
  k8s_discovery  ``python -m specmesh.deploy.k8s_discovery``: the router with its
                 replicas found in DNS (headless Services), for HPA-scaled pods

Composition roots only: they wire the services (``specmesh.router``,
``specmesh.drafter_service``, ``specmesh.verifier_service``) into a platform and hold
no decoding logic. The manifests themselves are in ``k8s/`` and ``deploy/``.
Importing this package imports neither ray nor torch.
"""
