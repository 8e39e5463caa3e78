"""What the SDK and the servers both speak on the wire, below both of them:
``channels`` (client channels: insecure or TLS, mutual TLS, size limits),
``convert`` (proto <-> domain, one small function per message, and ``RouterStats``) and
``choices`` (the seeds of a request's n choices).

``specmesh.client`` (the SDK) and ``specmesh.serving`` with the three services import
these; this package imports neither of them (only grpc, the generated ``specmesh.v1``
protos and the domain types).
"""
