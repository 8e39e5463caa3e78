"""What the three gRPC services share: settings (``settings``), server assembly
(``server``: health, reflection, TLS, drain), interceptors (auth, size limit, error
mapping), proto <-> domain conversion (``convert``), client channels (``channels``),
the ``specmesh serve`` / ``specmesh generate`` command line (``cli``) and the
in-process stack builder (``stack``). Each service's own code lives in its folder:
``specmesh.router`` (with its remote adapters and replica sets),
``specmesh.drafter_service`` and ``specmesh.verifier_service`` (with its batcher)."""
