"""Where the drafter and verifier replicas' gRPC servers are: a soft-state registry.

Each replica starts its gRPC server on a free port and announces
``(role, replica_id, address)`` to one named Ray actor, ``Registry``, every
``heartbeat_s``; an entry not refreshed within ``ttl_s`` drops out (a replica
that died, whatever way), and a replica shutting down removes its own. The
router reads ``snapshot()`` every ``refresh_s`` and updates its replica sets.
The actor is detached (a killed replica that happened to create it does not
take it along) and holds only what heartbeats rebuild, so a lost registry is
recreated by the next heartbeat.

``Heartbeat`` is the replica side (a daemon thread), ``RegistryReader`` the
router side; both re-acquire the actor if it went away.

This module knows nothing about gRPC, models or Serve; it needs a connected Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import ray

log = logging.getLogger("specmesh.deploy.ray")
NAMESPACE = "specmesh"


class Registry:
    """role -> replica_id -> (address, last heartbeat); times from this actor's clock."""

    def __init__(self, ttl_s: float = 6.0):
        self.ttl_s = ttl_s
        self.entries: dict[str, dict[str, tuple[str, float]]] = {}

    def heartbeat(self, role: str, replica_id: str, address: str) -> None:
        self.entries.setdefault(role, {})[replica_id] = (address, time.monotonic())

    def remove(self, role: str, replica_id: str) -> None:
        self.entries.get(role, {}).pop(replica_id, None)

    def snapshot(self) -> dict[str, dict[str, str]]:
        """role -> {replica_id: address} of the replicas heard from within ttl_s."""
        now = time.monotonic()
        out = {}
        for role, reps in self.entries.items():
            for rid in [r for r, (_, t) in reps.items() if now - t > self.ttl_s]:
                del reps[rid]
            out[role] = {rid: addr for rid, (addr, _) in sorted(reps.items())}
        return out


def registry_actor(name: str, ttl_s: float):
    """The named registry actor, created on first use."""
    return ray.remote(Registry).options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                        num_cpus=0, max_restarts=-1).remote(ttl_s)


class Heartbeat:
    """Announce one replica every ``period_s`` until ``stop()``."""

    def __init__(self, name: str, ttl_s: float, role: str, replica_id: str, address: str, period_s: float = 1.0):
        self.name, self.ttl_s, self.role, self.replica_id, self.address = name, ttl_s, role, replica_id, address
        self.period_s = period_s
        self._stop = threading.Event()
        self._actor = registry_actor(name, ttl_s)
        ray.get(self._actor.heartbeat.remote(role, replica_id, address), timeout=60)
        self._thread = threading.Thread(target=self._run, name=f"specmesh-heartbeat-{role}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                ray.get(self._actor.heartbeat.remote(self.role, self.replica_id, self.address),
                        timeout=max(2.0, self.ttl_s / 2))
            except Exception as e:  # noqa: BLE001 - the registry died or is slow: find or recreate it
                log.warning("registry heartbeat failed (%s); re-acquiring", type(e).__name__)
                try:
                    self._actor = registry_actor(self.name, self.ttl_s)
                except Exception:  # noqa: BLE001
                    pass

    def stop(self) -> None:
        self._stop.set()
        try:
            ray.get(self._actor.remove.remote(self.role, self.replica_id), timeout=5)
        except Exception:  # noqa: BLE001 - shutting down; the TTL cleans up
            pass


class RegistryReader:
    def __init__(self, name: str, ttl_s: float):
        self.name, self.ttl_s = name, ttl_s
        self._actor = registry_actor(name, ttl_s)

    def snapshot(self, timeout: float = 5.0) -> Optional[dict[str, dict[str, str]]]:
        """The current snapshot, or None when the registry could not be read."""
        try:
            return ray.get(self._actor.snapshot.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001
            log.warning("registry read failed (%s); re-acquiring", type(e).__name__)
            try:
                self._actor = registry_actor(self.name, self.ttl_s)
            except Exception:  # noqa: BLE001
                pass
            return None
