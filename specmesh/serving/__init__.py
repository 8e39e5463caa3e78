"""What the three gRPC services share: settings (``settings``), server assembly
(``server``: health, reflection, TLS, drain), interceptors (auth, size limit, error
mapping), the supervisor of ``specmesh serve``'s processes (``supervisor``) and the
OpenAI-compatible HTTP front (``openai_http``, over the SDK). Proto <-> domain
conversion and client channels, which the SDK uses too, are in ``specmesh.wire``;
the ``specmesh serve`` / ``generate`` commands and the in-process stack builder in
``specmesh.cli`` (``serve``, ``stack``). Each service's own code lives in its folder:
``specmesh.router`` (with its remote adapters and replica sets),
``specmesh.drafter_service`` and ``specmesh.verifier_service`` (with its batcher)."""
