"""The router's side of a ``Verifier/Decode`` stream's flow control
(``router.adapters.DecodeStream``), against a stub of the call that decodes exactly the
steps granted (a unit test of one piece: the real stream is in
tests/services/test_grpc_unit.py).

The verifier must never be more than ``lead`` steps past what the router read, must never
wait for a grant while the router keeps up, and the request side closes once every step
of the stream was granted."""

from __future__ import annotations

import queue

import pytest

from specmesh.router.adapters import DecodeStream
from specmesh.v1 import verifier_pb2


class Stub:
    """Decode as a server that outruns its reader: before each read it decodes every step
    granted so far (reading the grants already sent); records how many steps it held
    unread at most, and each read that found none decoded (the server had run out of
    grants while the reader kept up: in the real stream the reader then waits a round trip
    for its grant to reach the server)."""

    def __init__(self):
        self.max_ahead = 0
        self.starved = 0
        self.closed = False
        self.reader = None  # the DecodeStream (its request queue)

    def Decode(self, requests, timeout=None, metadata=None):
        stub = self
        first = next(requests)
        assert first.session_id == "s" and first.max_steps >= 1
        q = self.reader._requests

        class Call:
            def __init__(self):
                self.granted, self.decoded, self.unread = first.max_steps, 0, []

            def __next__(self):
                if self.decoded and not self.unread and not stub.closed:
                    stub.starved += 1  # it decoded every grant it had and the reader had read them all
                while not stub.closed:
                    if self.granted == 0:
                        try:
                            more = q.get_nowait()
                        except queue.Empty:
                            break
                        if more is None:
                            stub.closed = True
                            break
                        assert more.max_steps >= 1 and not more.session_id
                        self.granted = more.max_steps
                    else:
                        self.granted -= 1
                        self.decoded += 1
                        self.unread.append(self.decoded)
                stub.max_ahead = max(stub.max_ahead, len(self.unread))
                if not self.unread:
                    if stub.closed:
                        raise StopIteration
                    raise AssertionError("the reader asked for a step no grant allowed")
                return verifier_pb2.VerifyResponse(next_token=self.unread.pop(0))

            def cancel(self):
                pass

        return Call()


@pytest.mark.parametrize("total,lead", [(40, 8), (7, 8), (30, 4), (25, 2), (12, 0)])
def test_grants_keep_the_verifier_within_lead_and_never_starve_it(total, lead):
    stub = Stub()
    stream = DecodeStream.__new__(DecodeStream)
    stub.reader = stream  # the stub reads the grants from the stream's own queue
    DecodeStream.__init__(stream, stub, verifier_pb2.DecodeRequest(session_id="s"), total, lead, key=None)
    got = [next(stream).next_token for _ in range(total)]
    assert got == list(range(1, total + 1)) and stub.starved == 0
    assert stream.granted == total
    assert stub.max_ahead <= (lead or total)
    with pytest.raises(StopIteration):  # every step granted: the request side is closed
        next(stream)
    assert stub.closed
