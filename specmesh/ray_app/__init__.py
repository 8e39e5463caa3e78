"""specmesh on Ray Serve: drafters, verifiers and the router as three deployments.

- ``config``: ``RayAppConfig`` (pydantic) and Serve config files; no Ray import.
- ``app``: ``build_app(config)``, referenced as ``specmesh.ray_app.app:build_app``.
- ``deployments``: the replicas, each running its role's existing gRPC server.
- ``registry``: where the replicas' gRPC servers are (a named Ray actor, heartbeats).
- ``pools``: the router's verifier set (session affinity) and drafter pool
  (free balancing) with membership that changes at run time; no Ray import.
- ``autoscale``: the load-based autoscaling policy.
- ``cli``: ``specmesh serve --ray``.

Importing this package imports neither ray nor torch.
"""
