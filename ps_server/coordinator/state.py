"""The coordinator's view of the cluster: servers (with heartbeat leases) and the shard map.

Pure state behind one lock, with time from an injected clock: liveness is a lease
(`online_until = last heartbeat + timeout`) evaluated on read, so tests advance a fake clock
instead of sleeping. No grpc here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ps_common.clock import Clock
from ps_common.errors import SpecConflict
from ps_common.shardmap import EMPTY_MAP, ShardMap, VariableSpec
from ps_server.coordinator.placement import Candidate, place
from ps_server.initializers import validate_initializer
from ps_server.optimizers import resolve_knobs


@dataclass(frozen=True)
class ServerMember:
    server_id: str
    address: str
    budget_bytes: int
    online_until: float
    synced_epoch: int = 0  # the highest shard-map epoch this server has acknowledged
    last_heartbeat: float = 0.0
    told_to_stop: bool = False


class CoordinatorState:
    """Thread-safe."""

    def __init__(self, clock: Clock, *, heartbeat_timeout_s: float, split_threshold_bytes: int):
        self._clock = clock
        self._timeout = heartbeat_timeout_s
        self._split_threshold = split_threshold_bytes
        self._servers: dict[str, ServerMember] = {}
        self._map = EMPTY_MAP
        self._lock = threading.Lock()

    @property
    def shard_map(self) -> ShardMap:
        with self._lock:
            return self._map

    # ---- servers -----------------------------------------------------------------------

    def register_server(self, server_id: str, address: str, budget_bytes: int) -> None:
        """(Re-)register a server. A re-registering server is treated as having lost its
        shards (it restarted) and is resynced; a changed address moves the map's epoch."""
        now = self._clock.monotonic()
        with self._lock:
            self._servers[server_id] = ServerMember(
                server_id, address, budget_bytes, now + self._timeout, synced_epoch=0,
                last_heartbeat=now)
            known_address = self._map.servers.get(server_id)
            if known_address is not None and known_address != address:
                self._map = replace(self._map, epoch=self._map.epoch + 1,
                                    servers={**self._map.servers, server_id: address})

    def server_heartbeat(self, server_id: str, server_epoch: int) -> tuple[bool, bool]:
        """Renew the lease. Returns (known, needs_sync)."""
        now = self._clock.monotonic()
        with self._lock:
            member = self._servers.get(server_id)
            if member is None:
                return False, False
            self._servers[server_id] = replace(
                member, online_until=now + self._timeout, last_heartbeat=now,
                synced_epoch=min(member.synced_epoch, server_epoch))
            return True, server_epoch < self._map.epoch and self._holds_shards(server_id)

    def mark_synced(self, server_id: str, epoch: int) -> None:
        with self._lock:
            member = self._servers.get(server_id)
            if member is not None and epoch > member.synced_epoch:
                self._servers[server_id] = replace(member, synced_epoch=epoch)

    def mark_told_to_stop(self, server_id: str) -> None:
        with self._lock:
            member = self._servers.get(server_id)
            if member is not None:
                self._servers[server_id] = replace(member, told_to_stop=True)

    def live_servers(self) -> list[ServerMember]:
        now = self._clock.monotonic()
        with self._lock:
            return [m for m in self._servers.values() if m.online_until > now]

    def servers(self) -> list[ServerMember]:
        with self._lock:
            return list(self._servers.values())

    def server_states(self) -> list[tuple[ServerMember, str, float]]:
        """Every server with its state ("alive", "dead" or "done": told the job is over)
        and the seconds since its last heartbeat."""
        now = self._clock.monotonic()
        return [(m, "done" if m.told_to_stop else "alive" if m.online_until > now else "dead",
                 now - m.last_heartbeat) for m in self.servers()]

    def unsynced(self, shard_map: ShardMap) -> list[ServerMember]:
        """Live servers holding shards of `shard_map` that have not acknowledged its epoch.
        A dead one is resynced when it registers again, not waited for: declarations go on
        while a server restarts."""
        now = self._clock.monotonic()
        with self._lock:
            holders = {s.server_id for shards in shard_map.shards.values() for s in shards}
            return [m for sid, m in self._servers.items()
                    if sid in holders and m.synced_epoch < shard_map.epoch
                    and m.online_until > now]

    def _holds_shards(self, server_id: str) -> bool:
        return any(s.server_id == server_id for shards in self._map.shards.values() for s in shards)

    # ---- variables ---------------------------------------------------------------------

    def declare(self, specs: list[VariableSpec]) -> ShardMap:
        """Add the new variables among `specs` to the map; identical redeclarations are
        no-ops; a different spec under a known name raises SpecConflict naming both."""
        seen: dict[str, VariableSpec] = {}
        for spec in specs:
            validate_initializer(spec)
            resolve_knobs(spec)
            if spec.name in seen and seen[spec.name] != spec:
                raise SpecConflict(
                    f"variable {spec.name!r} declared twice in one request with different "
                    f"specs: {seen[spec.name].describe()} vs {spec.describe()}")
            seen[spec.name] = spec
        candidates = [Candidate(m.server_id, m.address, m.budget_bytes)
                      for m in self.live_servers()]
        with self._lock:
            new = []
            for spec in seen.values():
                existing = self._map.variables.get(spec.name)
                if existing is None:
                    new.append(spec)
                elif existing != spec:
                    raise SpecConflict(
                        f"variable {spec.name!r} is already declared as {existing.describe()}; "
                        f"this declaration asks for {spec.describe()}")
            if new:
                self._map = place(self._map, new, candidates,
                                  split_threshold_bytes=self._split_threshold)
            return self._map
