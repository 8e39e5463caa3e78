"""router/readiness.py: ready once a verifier serves and its Info was read; once ready, not
ready only after ``down_after`` checks in a row found none (a busy replica misses a probe)."""

from __future__ import annotations

import pytest

from specmesh.router import readiness as rd
from specmesh.router.replicas import Unavailable


class _Peer:
    def __init__(self, address):
        self.address = address


class _Replicas:
    def __init__(self, *addresses):
        self.peers = [_Peer(a) for a in addresses]


def test_ready_needs_a_serving_replica_whose_info_was_read(monkeypatch):
    up: dict = {"a": False}
    monkeypatch.setattr(rd, "serving", lambda peer, timeout_s=1.0: up.get(peer.address, False))
    read: set = set()
    r = rd.Readiness(_Replicas("a"), lambda addrs: set(addrs) & read, down_after=2)
    seen = []
    r.watch(seen.append)
    with pytest.raises(Unavailable, match="no verifier replica is serving yet"):
        r.require()
    up["a"] = True
    with pytest.raises(Unavailable, match="Info of the serving verifier replicas"):
        r.require()
    read.add("a")
    r.require()
    assert r.ready() and seen == [False, True]
    up["a"] = False
    assert r.check() is False and r.ready()  # one missed probe: still ready
    assert r.check() is False and not r.ready() and seen == [False, True, False]
    assert rd.Readiness(_Replicas(), lambda a: set()).check() is False
