"""Speculation strategies above the one draft–verify loop (DESIGN.md section 3).

  auto        choose a strategy from request features and live per-session stats (pure)
  adapt       entropy-capped draft size on top of ``loop.AdaptiveBudget``; loop helpers
              (resume a warm KV prefix, defer a session's release, meter cache drafts)
  proactive   per-conversation anticipation: the jobs, their bounded store and the idle
              worker that real requests preempt
  ssr         reasoning requests: thinking, forced end of thinking, side-branch answers
              that seed a draft cache, and the answer phase drafted from it
  calibrate   ``specmesh calibrate-layerskip``: pick the layer-skip exit E from measurements
  bench       ``specmesh bench-strategies``: workloads x strategies through the services

Everything here drives ``specmesh.loop.speculative_generate`` with any drafter and
verifier (in-process or gRPC adapters); nothing here imports grpc except ``bench``
(which starts the services to measure them).
"""
