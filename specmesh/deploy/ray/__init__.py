"""specmesh on Ray Serve: drafters, verifiers and the router as three deployments.

- ``config``: ``RayAppConfig`` (pydantic) and Serve config files; no Ray import.
- ``app``: ``build_app(config)``, referenced as ``specmesh.deploy.ray.app:build_app``.
- ``deployments``: the replicas, each running its role's existing gRPC server; the
  router replica's verifier set and drafter pool are ``specmesh.router.replicas``.
- ``registry``: where the replicas' gRPC servers are (a named Ray actor, heartbeats).
- ``autoscale``: the load-based autoscaling policy.

``specmesh serve --ray`` (starting Ray, deploying through the dashboard) is
``specmesh.cli.serve_ray``. Importing this package imports neither ray nor torch. (Inside it, ``import ray`` is
still Ray itself: imports are absolute.)
"""
