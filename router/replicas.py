"""The router's remote endpoints: verifier replicas and drafter replicas.

- ``PeerHealth`` / ``Peer``: one endpoint (channel, stub, health, sessions
  pinned to it); ``PeerHealth`` backs off after failures (doubling, capped).
- ``ReplicaSet``: the verifier replicas. A session is pinned to one replica
  (``prefix``, the default: the replica its conversation is on, else the one whose
  prefix cache likely holds the longest prefix of its prompt, unless that one is much
  busier than the others (``prefix_affinity.PrefixAffinity``), else as ``least_loaded``;
  ``least_loaded``: fewest pinned sessions, ties by rendezvous hash; or
  ``hash``: rendezvous hash of the session id); replicas marked down are
  avoided while another is up. Its members are a static address list given at
  construction (``specmesh serve router``) or follow ``set_addresses`` (Ray's
  registry, Kubernetes DNS): a replica that leaves keeps serving the sessions
  pinned to it until they fail over (its channel closes once none is pinned),
  and with no replica at all ``pin`` waits up to ``wait_s`` and then fails with
  UNAVAILABLE.
- ``DrafterPool``: drafter replicas behind one ``Peer`` (what ``Router`` and
  ``RemoteDrafter`` take), balanced freely: a new session goes to the next live
  replica round-robin and stays there while that replica lives, so the delta
  sync stays cheap. When a replica fails with UNAVAILABLE it is marked down
  and the call is retried once on another replica; that one does not know the
  session and answers FAILED_PRECONDITION, so ``RemoteDrafter`` resends the
  session's tokens from 0 — the session resyncs from the router's committed
  tokens. With no live replica the call fails UNAVAILABLE and the router's
  rounds fall back to plain decoding until the pool's backoff passes.
  ``Seed`` (texts for a draft cache) goes to every live replica, since any of
  them may serve a session that reads the cache.

``specmesh.router.servicer.dynamic_router`` builds the router over an empty
``ReplicaSet`` and ``DrafterPool`` (the Ray router replica and Kubernetes
discovery fill them).

This module knows nothing about Ray, models or tokenizers: addresses in,
gRPC calls out.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import grpc

from specmesh.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

from .prefix_affinity import BLOCK, PrefixAffinity


class PeerHealth:
    """Up until a call fails; then down for a backoff that doubles with each
    consecutive failure (capped). ``available()`` turns true again when the
    backoff has passed, so the next call is the retry; success resets it."""

    def __init__(self, backoff_s: float = 1.0, max_backoff_s: float = 30.0, clock: Callable = time.monotonic):
        self.backoff_s, self.max_backoff_s, self.clock = backoff_s, max_backoff_s, clock
        self.failures = 0
        self.down_until = 0.0
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return self.failures == 0

    def available(self) -> bool:
        return self.clock() >= self.down_until

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
            self.down_until = self.clock() + min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))

    def ok(self) -> None:
        if self.failures:
            with self._lock:
                self.failures, self.down_until = 0, 0.0


@dataclass(eq=False)
class Peer:
    """One remote endpoint: its channel, stub, health and pinned sessions."""

    address: str
    channel: grpc.Channel
    stub: object
    health: PeerHealth
    load: int = 0


def drafter_peer(address: str, channel: grpc.Channel, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> Peer:
    return Peer(address, channel, drafter_pb2_grpc.DrafterStub(channel), PeerHealth(backoff_s, max_backoff_s))


class Unavailable(grpc.RpcError):
    """An UNAVAILABLE status raised locally (no replica to call)."""

    def __init__(self, details: str):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class ReplicaSet:
    """Verifier replicas with session affinity (see the module docstring).

    ``make_channel(address)`` opens a replica's channel; ``addresses`` are the
    first members (none: fill them with ``set_addresses``)."""

    def __init__(self, make_channel: Callable[[str], grpc.Channel], addresses: Iterable[str] = (),
                 choice: str = "prefix", backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 wait_s: float = 10.0, block_size: int = BLOCK):
        self.choice = choice
        self.affinity = PrefixAffinity(block_size)  # what each replica's prefix cache likely holds
        self.wait_s = wait_s
        self.peers: list[Peer] = []
        self._make, self._backoff = make_channel, (backoff_s, max_backoff_s)
        self._retired: list[Peer] = []  # left the set, still pinned by a session
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._closed = False
        self.set_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.peers]

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """The members from now on: new addresses get a channel, known ones keep
        theirs (and their pinned sessions), gone ones retire."""
        addresses = list(dict.fromkeys(addresses))
        with self._lock:
            current = {p.address: p for p in self.peers}
            peers = []
            for a in addresses:
                p = current.get(a)
                if p is None:
                    ch = self._make(a)
                    p = Peer(a, ch, verifier_pb2_grpc.VerifierStub(ch), PeerHealth(*self._backoff))
                peers.append(p)
            gone = [p for p in self.peers if p.address not in addresses]
            self._retired += gone
            self.peers = peers
            for p in gone:
                self.affinity.forget(p.address)
            idle = [p for p in self._retired if p.load <= 0]
            self._retired = [p for p in self._retired if p.load > 0]
        for p in idle:
            p.channel.close()
        if peers:
            self._changed.set()

    @staticmethod
    def _score(session_id: str, peer: Peer) -> int:
        return int.from_bytes(hashlib.blake2b(f"{session_id}|{peer.address}".encode(), digest_size=8).digest(), "big")

    def pin(self, session_id: str, old: Optional[Peer] = None, avoid: Sequence[Peer] = (), tokens: Sequence[int] = (),
            conversation: str = "") -> Peer:
        """The replica for ``session_id`` (moving it off ``old``, avoiding ``avoid``
        while another is up), whose first tokens are ``tokens`` (its prompt: ``prefix``
        routing), of ``conversation``; waits up to ``wait_s`` while the set is empty."""
        end = time.monotonic() + self.wait_s
        while not self.peers:
            left = end - time.monotonic()
            if left <= 0 or self._closed:
                if old is not None:
                    with self._lock:
                        old.load -= 1
                raise Unavailable("no verifier replica is registered")
            self._changed.clear()
            self._changed.wait(min(left, 0.2))
        with self._lock:
            if old is not None:
                old.load -= 1
            up = [p for p in self.peers if p.health.available()]
            cands = [p for p in up if p not in avoid] or up or [p for p in self.peers if p not in avoid] or self.peers
            peer = None
            if self.choice == "prefix":
                pick = self.affinity.choose([(p.address, p.load) for p in cands], tokens, conversation)
                peer = next((p for p in cands if pick is not None and p.address == pick[0]), None)
            if peer is not None:
                pass
            elif self.choice == "hash":
                peer = max(cands, key=lambda p: self._score(session_id, p))
            else:
                peer = min(cands, key=lambda p: (p.load, -self._score(session_id, p)))
            peer.load += 1
        if self.choice == "prefix" and (tokens or conversation):
            self.affinity.record(peer.address, tokens, conversation)
        return peer

    def record(self, address: str, tokens: Sequence[int], conversation: str = "") -> None:
        """A session on ``address`` ended holding ``tokens`` (its prompt and output: what
        that replica's prefix cache now has)."""
        if self.choice == "prefix":
            self.affinity.record(address, tokens, conversation)

    def unpin(self, peer: Peer) -> None:
        with self._lock:
            peer.load -= 1

    def sessions_per_replica(self) -> float:
        """Generations pinned now, per replica (at least 1): the load a new one will meet."""
        with self._lock:
            return max(1.0, sum(p.load for p in self.peers) / max(1, len(self.peers)))

    def close(self) -> None:
        with self._lock:
            peers, self.peers, self._retired = self.peers + self._retired, [], []
            self._closed = True
        for p in peers:
            p.channel.close()


class DrafterPool:
    """Drafter replicas; ``peer`` is the one ``Peer`` the router uses (its stub and
    channel are this pool)."""

    def __init__(self, make_channel: Callable[[str], grpc.Channel], backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, replica_backoff_s: float = 0.5, max_sessions: int = 4096):
        self._make = make_channel
        self._replica_backoff = (replica_backoff_s, min(max_backoff_s, 5.0))
        self.members: dict[str, Peer] = {}
        self._sessions: "OrderedDict[str, str]" = OrderedDict()  # session -> replica address
        self._max_sessions = max_sessions
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self.calls: Counter = Counter()  # replica address -> Propose calls it answered
        self.failovers = 0  # calls retried on another replica after UNAVAILABLE
        self.peer = Peer("ray:Drafter", self, self, PeerHealth(backoff_s, max_backoff_s))

    @property
    def addresses(self) -> list[str]:
        return list(self.members)

    def set_addresses(self, addresses: Iterable[str]) -> None:
        addresses = list(dict.fromkeys(addresses))
        with self._lock:
            gone = [p for a, p in self.members.items() if a not in addresses]
            for a in addresses:
                if a not in self.members:
                    ch = self._make(a)
                    self.members[a] = Peer(a, ch, drafter_pb2_grpc.DrafterStub(ch), PeerHealth(*self._replica_backoff))
            for p in gone:
                del self.members[p.address]
        for p in gone:
            p.channel.close()  # a call in flight on it fails UNAVAILABLE and is retried elsewhere

    def _pick(self, session_id: str, avoid: Sequence[Peer] = ()) -> Peer:
        with self._lock:
            addr = self._sessions.get(session_id)
            p = self.members.get(addr) if addr else None
            if p is not None and p not in avoid and p.health.available():
                self._sessions.move_to_end(session_id)
                return p
            live = [q for q in self.members.values() if q not in avoid and q.health.available()]
            if not live:
                self._sessions.pop(session_id, None)
                raise Unavailable("no drafter replica is available")
            p = live[next(self._rr) % len(live)]
            self._sessions[session_id] = p.address
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
            return p

    # ---- the Drafter stub surface RemoteDrafter uses
    def Propose(self, request, timeout=None, metadata=None):
        tried: list[Peer] = []
        while True:
            p = self._pick(request.session_id, tried)
            try:
                resp = p.stub.Propose(request, timeout=timeout, metadata=metadata)
            except (grpc.RpcError, ValueError) as e:  # ValueError: its channel was closed under us
                # a replica shutting down aborts the calls it holds with CANCELLED: fail over as when it is gone
                if isinstance(e, grpc.RpcError) and e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                                     grpc.StatusCode.CANCELLED):
                    raise
                p.health.failed()
                tried.append(p)
                if len(tried) >= 2:
                    raise Unavailable(f"drafter replicas {[q.address for q in tried]} unavailable") from None
                self.failovers += 1
                continue
            p.health.ok()
            self.calls[p.address] += 1
            return resp

    def Release(self, request, timeout=None, metadata=None):
        with self._lock:
            addr = self._sessions.pop(request.session_id, None)
            p = self.members.get(addr) if addr else None
        if p is None:
            return common_pb2.ReleaseResponse(released=False)
        try:
            return p.stub.Release(request, timeout=timeout, metadata=metadata)
        except ValueError:
            return common_pb2.ReleaseResponse(released=False)

    def Seed(self, request, timeout=None, metadata=None):
        """Draft caches are read by whichever replica serves a session: seed every
        live replica (a replica that joins later starts without the texts, which
        only costs drafts). Returns the answer with the largest cache."""
        live = [p for p in list(self.members.values()) if p.health.available()]
        if not live:
            raise Unavailable("no drafter replica is available")
        out, err = [], None
        for p in live:
            try:
                out.append(p.stub.Seed(request, timeout=timeout, metadata=metadata))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                p.health.failed()
                err = e
        if not out:
            raise err
        return max(out, key=lambda r: r.tokens)

    def Info(self, request, timeout=None, metadata=None):
        live = [p for p in list(self.members.values()) if p.health.available()]
        if not live:
            raise Unavailable("no drafter replica is available")
        return live[0].stub.Info(request, timeout=timeout, metadata=metadata)

    def close(self) -> None:
        with self._lock:
            peers, self.members = list(self.members.values()), {}
        for p in peers:
            p.channel.close()
