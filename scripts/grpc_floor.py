#!/usr/bin/env python3
"""What one gRPC Python call costs on this machine: the floor under the router's hop.

Times, side by side in one run, a round trip of an empty ``Health/Check`` against a bare
``grpc.server`` over TCP loopback and over a Unix socket, the same against a server built
by ``specmesh.serving.server.build_server`` (its interceptors), and 200-byte messages as
unary calls and on one open bidirectional stream, and the hop of a call whose handler
first waits 0-12 ms (as a Verify waits for its forward). Prints microseconds per call
(issue 48's hop target, docs/performance.md "The services against their own engine").

    .venv/bin/python scripts/grpc_floor.py [--calls 3000]

Knows nothing about models; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def _per_call_us(call, n: int) -> float:
    for _ in range(200):  # warm the channel
        call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def _health(address: str, n: int) -> float:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    req = health_pb2.HealthCheckRequest(service="")
    return _per_call_us(lambda: stub.Check(req, timeout=5), n)


def _bare_health_server(bind: str):
    srv = grpc.server(futures.ThreadPoolExecutor(8))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(experimental_non_blocking=True), srv)
    port = srv.add_insecure_port(bind)
    srv.start()
    return srv, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    n = ap.parse_args().calls
    from specmesh.serving.server import build_server
    from specmesh.serving.settings import ServeSettings

    srv, port = _bare_health_server("127.0.0.1:0")
    print(f"Health/Check, bare server, TCP      {_health(f'127.0.0.1:{port}', n):7.1f} µs/call")
    srv.stop(0)
    sock = os.path.join(tempfile.mkdtemp(), "floor.sock")
    srv, _ = _bare_health_server(f"unix:{sock}")
    print(f"Health/Check, bare server, Unix     {_health(f'unix:{sock}', n):7.1f} µs/call")
    srv.stop(0)
    rs = build_server(ServeSettings(), [], 0, host="127.0.0.1", token=None)
    print(f"Health/Check, specmesh server, TCP  {_health(rs.address, n):7.1f} µs/call")
    rs.stop(0)

    ident = lambda b: b  # noqa: E731 - raw bytes both ways

    def echo(requests, _context):
        yield from requests

    handler = grpc.method_handlers_generic_handler("floor.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(echo, ident, ident),
        "Unary": grpc.unary_unary_rpc_method_handler(lambda r, _c: r, ident, ident)})
    srv = grpc.server(futures.ThreadPoolExecutor(8))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    msg = b"x" * 200
    unary = ch.unary_unary("/floor.Echo/Unary", ident, ident)
    print(f"200 bytes, unary call               {_per_call_us(lambda: unary(msg), n):7.1f} µs/call")
    q: queue.Queue = queue.Queue()

    def outgoing():
        while (m := q.get()) is not None:
            yield m

    replies = ch.stream_stream("/floor.Echo/Stream", ident, ident)(outgoing())

    def one():
        q.put(msg)
        next(replies)

    print(f"200 bytes, on an open stream        {_per_call_us(one, n):7.1f} µs/message")
    q.put(None)
    srv.stop(0)
    _after_a_wait(max(50, n // 20))


def _after_a_wait(n: int) -> None:
    """The hop of a call whose handler sleeps first (as a verifier's forward keeps a
    Verify waiting): wall time minus the handler's own, by how long it slept. Both
    sides' threads sleep through the wait, and waking them costs more than the
    back-to-back floor."""
    import statistics

    def handler(req, _context):
        t0 = time.perf_counter()
        time.sleep(float(req.decode()))
        return str(time.perf_counter() - t0).encode()

    ident = lambda b: b  # noqa: E731
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor.Wait", {"Call": grpc.unary_unary_rpc_method_handler(handler, ident, ident)}),))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/floor.Wait/Call", ident, ident)
    for wait_ms in (0, 1, 5, 12):
        arg, hops = str(wait_ms / 1e3).encode(), []
        for i in range(n + 10):
            t0 = time.perf_counter()
            served = float(call(arg))
            if i >= 10:
                hops.append(time.perf_counter() - t0 - served)
        print(f"after a wait of {wait_ms:2d} ms, unary call   {statistics.median(hops) * 1e6:7.1f} µs/call (median)")
    srv.stop(0)


if __name__ == "__main__":
    main()
