"""Speculation strategies above the one draft–verify loop (docs/design.md, "Strategies").

  auto        choose a strategy from request features and live per-session stats (pure)
  adapt       entropy-capped draft size on top of ``loop.AdaptiveBudget``; loop helpers
              (resume a warm KV prefix, defer a session's release, meter cache drafts)
  proactive   per-conversation anticipation: the jobs, their bounded store and the idle
              worker that real requests preempt
  ssr         reasoning requests: thinking, forced end of thinking, side-branch answers
              that seed a draft cache, and the answer phase drafted from it

Everything here drives ``specmesh.loop.speculative_generate`` with any drafter and
verifier (in-process or gRPC adapters); nothing here imports grpc. Their commands
live elsewhere: ``specmesh bench-strategies`` in ``specmesh.cli.bench.strategies``,
``specmesh calibrate-layerskip`` in ``specmesh.cli.bench.calibrate``.
"""
