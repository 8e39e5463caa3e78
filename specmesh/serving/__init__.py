"""The gRPC serving layer: settings, server assembly, interceptors, proto <-> domain
conversion, the verifier's dynamic batcher and the adapters the router's loop uses.
The servicers themselves live in drafter_service/, verifier_service/ and router/."""
