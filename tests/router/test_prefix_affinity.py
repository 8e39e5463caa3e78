"""Routing by cached prefix (router/prefix_affinity.py, pure) and the ReplicaSet choice over it."""

from __future__ import annotations

import grpc

from specmesh.router.prefix_affinity import PrefixAffinity, block_hashes
from specmesh.router.replicas import ReplicaSet

SYSTEM = list(range(100, 164))  # 4 blocks of 16


def test_block_hashes_chain_their_prefix():
    a, b = block_hashes(SYSTEM + [1] * 16), block_hashes([7] + SYSTEM[1:] + [1] * 16)
    assert len(a) == 5 and len(block_hashes(SYSTEM + [1] * 15)) == 4  # full blocks only
    assert a[1:] != b[1:]  # same later blocks, other prefix: other hashes
    assert block_hashes(SYSTEM)[:2] == block_hashes(SYSTEM[:32])


def test_the_longest_indexed_prefix_wins_unless_its_replica_is_busy():
    a = PrefixAffinity()
    a.record("r1", SYSTEM[:32])
    a.record("r2", SYSTEM)
    prompt = SYSTEM + [5] * 20
    assert a.choose([("r1", 0), ("r2", 0), ("r3", 0)], prompt) == ("r2", "prefix")
    assert a.choose([("r1", 0), ("r2", 1), ("r3", 0)], prompt) == ("r2", "prefix")  # 1 more: not busy
    assert a.choose([("r1", 0), ("r2", 2), ("r3", 0)], prompt) == ("r1", "prefix")  # busy: the next longest
    assert a.choose([("r1", 2), ("r2", 2), ("r3", 0)], prompt) is None  # both busy: balance by load
    assert a.choose([("r1", 5), ("r2", 6), ("r3", 4)], prompt) == ("r2", "prefix")  # 6 - 4 >= 2 but not > 1.5 * 4
    assert a.choose([("r1", 0), ("r3", 0)], [9] * 40) is None  # nothing indexed: by load
    assert a.choose([("r1", 0)], [1, 2]) is None  # no full block
    assert a.routed == {"conversation": 0, "prefix": 4, "load": 3}


def test_a_conversation_stays_on_its_replica_while_it_can():
    a = PrefixAffinity()
    a.record("r2", [3] * 20, conversation="c1")
    assert a.choose([("r1", 0), ("r2", 1)], [9] * 40, "c1") == ("r2", "conversation")
    assert a.choose([("r1", 0), ("r2", 3)], [9] * 40, "c1") is None  # busy: it moves
    assert a.choose([("r1", 0)], [9] * 40, "c1") is None  # its replica is not a candidate (down, gone)
    a.forget("r2")
    assert a.choose([("r1", 0), ("r2", 0)], [3] * 20, "c1") is None


def test_the_index_forgets_the_least_recently_used_blocks():
    a = PrefixAffinity(block_size=2, max_blocks=3)
    a.record("r", [1, 1, 2, 2, 3, 3])
    a.record("r", [4, 4])  # the oldest block (the prefix head) goes
    assert a.matched("r", block_hashes([1, 1, 2, 2], 2)) == 0 and a.matched("r", block_hashes([4, 4], 2)) == 1


def test_replica_set_pins_by_prefix_and_records_what_sessions_held():
    rs = ReplicaSet(lambda a: grpc.insecure_channel(a), ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        first = rs.pin("s1", tokens=SYSTEM + [1] * 16)
        rs.unpin(first)
        again = rs.pin("s2", tokens=SYSTEM + [2] * 16)  # the system prompt's replica
        assert again is first
        other = rs.pin("s3", tokens=[8] * 64)  # nothing shared: the least loaded
        assert other is not first
        rs.record(other.address, [8] * 64 + [6] * 32, conversation="c")  # the session ended holding more
        rs.unpin(other)
        rs.unpin(again)
        assert rs.pin("s4", tokens=[5] * 64, conversation="c") is other
        rs.set_addresses(["127.0.0.1:1", "127.0.0.1:3"] if other.address == "127.0.0.1:2" else
                         ["127.0.0.1:1", "127.0.0.1:2"])  # the conversation's replica leaves: forgotten
        assert other.address not in rs.affinity._blocks
    finally:
        rs.close()
