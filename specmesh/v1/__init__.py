"""Generated gRPC stubs of protos/specmesh/v1 (``make protos``; do not edit by hand).

Import the modules directly: ``from specmesh.v1 import router_pb2, router_pb2_grpc``.
"""
