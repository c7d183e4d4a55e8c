"""The coordinator's view of the cluster: servers (with heartbeat leases) and the shard map.

Pure state behind one lock, with time from an injected clock: liveness is a lease
(`online_until = last heartbeat + timeout`) evaluated on read, so tests advance a fake clock
instead of sleeping. No grpc here.

Servers are the source of truth for the shards they hold. Every server reports, when it
registers, the shards it holds (with their specs and how often they were updated) and the
whole shard map of its last assignment. A coordinator that restarted rebuilds its map from
those reports: it never re-creates or moves a shard a live server holds, and until every
server named in the recovered map has registered again it refuses to place new variables
(one of the missing servers may hold them). A server that comes back without shards it had
acknowledged has lost them: the coordinator says so and, unless told to re-initialize lost
shards, stops handing out the map (DATA_LOSS) so that the job stops instead of training on
from initial values.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ps_common.clock import Clock
from ps_common.errors import DataLost, NotReady, SpecConflict
from ps_common.shardmap import EMPTY_MAP, Shard, ShardMap, VariableSpec
from ps_server.coordinator.identity import first_number
from ps_server.coordinator.placement import (
    Candidate, place, server_loads, shard_charge,
)
from ps_server.initializers import validate_initializer
from ps_server.optimizers import resolve_knobs

if TYPE_CHECKING:
    from ps_common.checkpoints import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldReport:
    """One shard as its server reports it."""

    spec: VariableSpec
    shard: Shard
    updates: int = 0  # pushes applied: > 0 means trained values


@dataclass(frozen=True)
class ServerReport:
    """What a registering server holds. The default is a server that holds nothing."""

    epoch: int = 0
    held: tuple[HeldReport, ...] = ()
    last_map: ShardMap = EMPTY_MAP
    generation: int = 0


@dataclass(frozen=True)
class ServerMember:
    server_id: str
    address: str
    budget_bytes: int
    online_until: float
    synced_epoch: int = 0  # the highest shard-map epoch this server has acknowledged
    last_heartbeat: float = 0.0
    told_to_stop: bool = False
    state_losses: int = 0  # times it came back without shards it had acknowledged
    lost_shards: tuple[str, ...] = ()  # what was lost the last time
    loss_action: str = ""  # "failed the job" | "re-initialized"
    # Its last report of its embedding tables' shards: (variable, index) -> (rows,
    # evictions, bytes).
    tables: tuple[tuple[tuple[str, int], tuple[int, int, int]], ...] = ()
    # Which registration this is (a number no other registration of any server has): an
    # acknowledgement counts only for the process that gave it.
    registration: int = 0


@dataclass(frozen=True)
class ServerEvent:
    """A change in a server's liveness that the coordinator must log or act on.

    kind: "down" (its lease ran out), "back" (it heartbeats again after "down"), "timed_out"
    (down, or awaited after a coordinator restart, for longer than the server timeout while
    it holds shards: its values are lost, as no checkpoint holds them or no live server has
    room for them), "moved" (the same, but its shards were moved to live servers from a
    checkpoint: `shards` says where)."""

    kind: str
    server_id: str
    address: str
    shards: tuple[str, ...] = ()
    checkpoint: str = ""  # "moved": the checkpoint the shards were restored from


@dataclass(frozen=True)
class RestorePlan:
    """Shards an assignment creates from a checkpoint (a directory), and whether the
    server's exactly-once ledger comes back with them."""

    checkpoint: Path | None
    keys: frozenset[tuple[str, int]]
    ledger: bool


@dataclass(frozen=True)
class Delivery:
    """One assignment to one server: the map, what it restores, and the shards placed
    elsewhere since that the server may still hold (it drops them)."""

    shard_map: ShardMap
    restore: RestorePlan | None
    superseded: frozenset[tuple[str, int]]
    registration: int  # the server's (ServerMember.registration) when it was built
    address: str = ""  # where that registration listens ("" if it is not a member)


def describe_shard(shard: Shard) -> str:
    if shard.stride > 1:  # an embedding table's residue class of ids
        return f"{shard.variable}[shard {shard.index} of {shard.stride}]"
    return f"{shard.variable}[{shard.row_start}:{shard.row_stop}]"


@dataclass
class _Recovery:
    """What a restarted coordinator learns from the servers' reports."""

    awaiting: set[str] = field(default_factory=set)  # named in a recovered map, not yet back
    epoch_floor: int = 0  # the highest epoch any server reported


class CoordinatorState:
    """Thread-safe.

    `generation` makes every epoch this coordinator issues higher than any a predecessor
    issued (see identity.py). `recovery_grace_s`: for this long after it starts, the
    coordinator places no new variable, so that servers of a predecessor (which heartbeat
    every second or so) have reported what they hold before anything could be placed over
    it. `server_timeout_s`: how long a server holding shards may stay
    away before its shards count as lost. `reinitialize_lost`: re-create lost shards from
    their initializers instead of failing (the user opted in). `expected_servers`: no new
    variable is placed before that many servers are alive at once; from then on, any number
    will do (the first variables are spread over the cluster it was told to expect).
    """

    def __init__(self, clock: Clock, *, heartbeat_timeout_s: float, split_threshold_bytes: int,
                 generation: int = 0, server_timeout_s: float = 60.0,
                 reinitialize_lost: bool = False, recovery_grace_s: float = 0.0,
                 expected_servers: int = 1):
        self._clock = clock
        self._timeout = heartbeat_timeout_s
        self._split_threshold = split_threshold_bytes
        self.generation = generation
        self._server_timeout = server_timeout_s
        self._reinitialize_lost = reinitialize_lost
        self._recovery_grace = recovery_grace_s
        self._expected_servers = expected_servers
        self._expected_servers_seen = expected_servers <= 1  # set once; under _lock
        self._started = clock.monotonic()
        self._servers: dict[str, ServerMember] = {}
        self._map = replace(EMPTY_MAP, epoch=first_number(generation))
        # The epoch at which this coordinator placed each variable (absent: recovered from a
        # server's report, i.e. held since before this coordinator started).
        self._placed_at: dict[str, int] = {}
        # The highest epoch each server has acknowledged to this coordinator, ever.
        self._acked: dict[str, int] = {}
        self._reported_held: dict[str, set[tuple[Shard, VariableSpec]]] = {}
        self._loss_checked: set[tuple[str, Shard]] = set()
        # Servers whose last registration came from a new process (it had never registered
        # with any coordinator): only such a server can have lost shards. A process that
        # lives on keeps what it holds (it refuses to drop trained shards).
        self._fresh: set[str] = set()
        self._creation_failures: dict[str, str] = {}  # variable -> why a server could not
        self.highest_reported_generation = 0
        self._recovery = _Recovery()
        self._down_since: dict[str, float] = {}
        self._timed_out: set[str] = set()
        self._frozen: set[str] = set()  # lost shards, not re-initialized: never resynced
        self._data_loss = ""
        # The loss is of this run only (no live server had room for shards a checkpoint
        # holds): a restart with room resumes the job.
        self._data_loss_resumable = False
        # Checkpoints (a Catalog, or None): shards lost with their server are restored from
        # the current one; `_restore` holds, per server, the shards its next assignment
        # creates from a checkpoint, each with the checkpoint (Manifest) current when that
        # was decided (a newer one may have been cut before the shard's variable existed).
        self._catalog = None
        self._restore: dict[str, dict[tuple[str, int], Manifest]] = {}
        # (server, shard key): copies a server may still hold of shards placed elsewhere
        # since (moved from a checkpoint, or a newer holder won): it is told to drop them.
        self._moved_away: set[tuple[str, tuple[str, int]]] = set()
        # The map epoch at which each shard's current placement was decided or learned.
        self._placement_epoch: dict[tuple[str, int], int] = {}
        self.shards_restored = 0
        self._registrations = 0
        self._lock = threading.Lock()

    def use_checkpoints(self, catalog) -> None:
        with self._lock:
            self._catalog = catalog

    def _restorable(self, shard: Shard) -> bool:
        """Expects the lock held: the current checkpoint holds `shard`'s variable as the map
        declares it."""
        manifest = self._catalog.current() if self._catalog else None
        return (manifest is not None
                and manifest.variables.get(shard.variable) == self._map.variables[shard.variable])

    def delivery(self, server_id: str) -> Delivery:
        """What the next assignment to `server_id` carries, read at one instant: a
        declaration or move that lands while it is built never pairs a newer restore with an
        older map (the server would skip shards its map lacks, and the restore would count
        as done)."""
        with self._lock:
            member = self._servers.get(server_id)
            return Delivery(self._map, self._restore_plan(server_id),
                            frozenset(self._superseded(server_id)),
                            member.registration if member else 0,
                            member.address if member else "")

    def _mark_for_restore(self, server_id: str, keys) -> None:
        """Expects the lock held, and every key restorable from the current checkpoint."""
        manifest = self._catalog.current()
        pending = self._restore.setdefault(server_id, {})
        for key in keys:
            pending[key] = manifest

    def restore_sources(self) -> set[str]:
        """Ids of the checkpoints that restores not yet done come from (never pruned)."""
        with self._lock:
            return {m.id for pending in self._restore.values() for m in pending.values()}

    def _restore_source(self, pending: dict) -> Manifest | None:
        """Expects the lock held. The checkpoint to restore `pending` (key -> the one it was
        decided with) from: the current one if it holds all of them as declared, else the
        newest of those they were decided with that does."""
        current = self._catalog.current() if self._catalog else None
        decided = sorted({id(m): m for m in pending.values()}.values(),
                         key=lambda m: m.id, reverse=True)
        for manifest in [current, *decided]:
            if manifest is not None and all(
                    manifest.variables.get(v) == self._map.variables.get(v) for v, _ in pending):
                return manifest
        return current or (decided[0] if decided else None)

    def _restore_plan(self, server_id: str) -> RestorePlan | None:
        """Expects the lock held. The ledger comes back with the shards this server saved
        in that checkpoint, when each is restored to the same rows (clients' retries to it
        are then deduplicated as before); shards it saved that moved elsewhere since, or
        shards others saved that moved here, do not keep it from coming back."""
        keys = self._restore.get(server_id)
        manifest = self._restore_source(keys) if keys else None
        if not keys or manifest is None:
            return None
        saved = {(r.variable, r.index): (r.server_id, r.row_start, r.row_stop)
                 for r in manifest.shards}
        placed = {s.key: (s.server_id, s.row_start, s.row_stop)
                  for s in self._map.shards_on(server_id)}
        own = [key for key in keys if saved.get(key, ("",))[0] == server_id]
        ledger = server_id in manifest.ledgers and bool(own) and all(
            saved[key] == placed.get(key) for key in own)
        return RestorePlan(manifest.directory, frozenset(keys), ledger)

    def restore_done(self, server_id: str, keys: set[tuple[str, int]],
                     registration: int | None = None) -> None:
        """`server_id` created `keys` from the checkpoint. Nothing is recorded when it has
        registered again since `registration` (its Delivery's): a new process holds none of
        it, and its next assignment restores them."""
        with self._lock:
            if not self._same_registration(server_id, registration):
                return
            pending = self._restore.get(server_id, {})
            self.shards_restored += len(pending.keys() & keys)
            for key in keys:
                pending.pop(key, None)
            if not pending:
                self._restore.pop(server_id, None)

    def restore_failed(self, server_id: str, checkpoint, message: str,
                       registration: int | None = None) -> None:
        """`server_id` could not read `checkpoint` (a directory) and restored none of it. If
        it is still the current checkpoint, the previous good one becomes current; the
        server's shards are then sent again (a new epoch) from whichever is current. Shards
        no checkpoint left can give are re-initialized or lost. Ignored when the server has
        registered again since `registration` (the process that could not read it is gone:
        its successor, on another host, may read it well)."""
        with self._lock:
            if not self._same_registration(server_id, registration):
                return
        if self._catalog is not None:  # outside the lock: it reads checkpoints whole
            self._catalog.fall_back(checkpoint, message)
        with self._lock:
            keys = self._restore.get(server_id, {})
            gone = [s for s in self._map.shards_on(server_id)
                    if s.key in keys and not self._restorable(s)]
            for shard in gone:
                keys.pop(shard.key)
            for key in keys:  # sent again from whichever checkpoint is current now
                keys[key] = self._catalog.current()
            if not keys:
                self._restore.pop(server_id, None)
            recreate = bool(keys)
            if gone:
                why = f"no good checkpoint holds them ({message})"
                recreate |= self._reinitialize_or_fail(
                    server_id, [describe_shard(s) for s in gone], why)
            if recreate:
                self._map = replace(self._map, epoch=self._next_epoch())

    def retry_restore(self) -> None:
        """Restores that failed for a passing reason are sent again, under a new epoch."""
        with self._lock:
            self._map = replace(self._map, epoch=self._next_epoch())

    def _superseded(self, server_id: str) -> set[tuple[str, int]]:
        """Expects the lock held. Trained shards `server_id` may hold that the map has placed
        elsewhere since."""
        elsewhere = {s.key for s in self._map.shards_on(server_id)}
        return {key for sid, key in self._moved_away if sid == server_id and key not in elsewhere}

    @property
    def shard_map(self) -> ShardMap:
        with self._lock:
            return self._map

    def check_no_data_loss(self) -> None:
        """Raise DataLost once trained values are known to be gone (the map is not served)."""
        with self._lock:
            if self._data_loss:
                raise DataLost(self._data_loss)

    @property
    def data_loss(self) -> str:
        with self._lock:
            return self._data_loss

    @property
    def data_loss_resumable(self) -> bool:
        """Whether a restarted coordinator may resume the job the data loss failed."""
        with self._lock:
            return self._data_loss_resumable

    def awaiting(self) -> list[str]:
        """Servers holding shards of a recovered map that have not registered again yet."""
        with self._lock:
            return sorted(self._recovery.awaiting)

    def _next_epoch(self) -> int:
        """Expects the lock held."""
        return max(self._map.epoch, self._recovery.epoch_floor) + 1

    # ---- servers -----------------------------------------------------------------------

    def register_server(self, server_id: str, address: str, budget_bytes: int,
                        report: ServerReport | None = None) -> dict[str, list[str]]:
        """(Re-)register a server with what it holds. Returns, per server, the shards
        (described) found lost: the registering server came back without shards it had
        acknowledged, or its report recovered shards that another registered server said it
        did not hold. When some are lost and `reinitialize_lost` is off, the state records a
        data loss (`check_no_data_loss` raises from then on), those servers are never
        resynced, and the caller fails the job."""
        report = report or ServerReport()
        now = self._clock.monotonic()
        with self._lock:
            previous = self._servers.get(server_id)
            self._recovery.awaiting.discard(server_id)
            self._reported_held[server_id] = {(h.shard, h.spec) for h in report.held}
            self.highest_reported_generation = max(self.highest_reported_generation,
                                                   report.generation)
            if report.generation == 0:
                self._fresh.add(server_id)
            else:
                self._fresh.discard(server_id)
            changed = self._merge_report(server_id, report)
            self._registrations += 1
            self._servers[server_id] = ServerMember(
                server_id, address, budget_bytes, now + self._timeout,
                synced_epoch=report.epoch if report.generation == self.generation else 0,
                last_heartbeat=now,
                state_losses=previous.state_losses if previous else 0,
                lost_shards=previous.lost_shards if previous else (),
                loss_action=previous.loss_action if previous else "",
                registration=self._registrations)
            self._down_since.pop(server_id, None)
            self._timed_out.discard(server_id)
            if self._map.servers.get(server_id, address) != address:
                self._map = replace(self._map, servers={**self._map.servers, server_id: address})
                changed = True
            losses = self._find_losses(server_id)
            recreate = False
            for sid, lost in losses.items():
                recreate |= self._record_loss(sid, lost)
            if report.generation == 0:  # acknowledgements were the previous process's
                self._acked.pop(server_id, None)
            if changed or recreate:
                self._map = replace(self._map, epoch=self._next_epoch())
            return {sid: [describe_shard(s) for s in lost] for sid, lost in losses.items()}

    def _find_losses(self, registering: str) -> dict[str, list[Shard]]:
        """Expects the lock held. Only a new server process (`_fresh`) can have lost shards,
        and a shard placed on it counts as lost when it does not hold it and had it: the
        registering server had acknowledged it to this coordinator, or the shard comes from
        a recovered map (it was placed before this coordinator started)."""
        losses: dict[str, list[str]] = {}
        for sid in self._servers.keys() & self._fresh:
            held = self._reported_held.get(sid, set())
            acked = self._acked.get(sid, 0)
            for shard in self._map.shards_on(sid):
                if (shard, self._map.variables[shard.variable]) in held:
                    continue
                placed_at = self._placed_at.get(shard.variable)
                if sid == registering:
                    # Placed by this coordinator and never acknowledged: nothing to lose.
                    is_lost = placed_at is None or acked >= placed_at
                else:
                    is_lost = placed_at is None and (sid, shard) not in self._loss_checked
                if is_lost:
                    self._loss_checked.add((sid, shard))
                    losses.setdefault(sid, []).append(shard)
        return losses

    def _record_loss(self, server_id: str, lost: list[Shard]) -> bool:
        """Expects the lock held. Shards the current checkpoint holds are restored from it;
        the rest are re-initialized (if the user opted in) or lost (the job fails). Returns
        True if shards are to be created again (a new epoch)."""
        member = self._servers[server_id]
        restorable = [s for s in lost if self._restorable(s)]
        gone = [describe_shard(s) for s in lost if s not in restorable]
        manifest = self._catalog.current() if restorable else None
        action = (f"restored from checkpoint {manifest.id} (step {manifest.step})"
                  if manifest else "")
        self._servers[server_id] = replace(
            member, state_losses=member.state_losses + 1,
            lost_shards=tuple(describe_shard(s) for s in lost), loss_action=action)
        if restorable:
            self._mark_for_restore(server_id, [s.key for s in restorable])
            log.warning("parameter server %s (%s) came back without %s: restoring them from "
                        "checkpoint %s (step %d); updates applied after it are lost",
                        server_id, member.address,
                        ", ".join(describe_shard(s) for s in restorable), manifest.directory,
                        manifest.step)
        if gone:
            why = ("no checkpoint holds them" if self._catalog is not None
                   else "the coordinator has no --checkpoint-dir")
            return self._reinitialize_or_fail(server_id, gone, why) or bool(restorable)
        return True

    def _reinitialize_or_fail(self, server_id: str, lost: list[str], why: str) -> bool:
        """Expects the lock held. Returns True if the shards are re-created."""
        member = self._servers.get(server_id)
        address = member.address if member else self._map.servers.get(server_id, "?")
        action = "re-initialized" if self._reinitialize_lost else "failed the job"
        if member is not None:
            done = member.loss_action
            self._servers[server_id] = replace(
                member, loss_action=f"{done}; {action}" if done else action)
        if self._reinitialize_lost:
            log.warning("parameter server %s (%s) came back without %s (%s): re-creating "
                        "them from their initializers (--reinitialize-lost-shards)", server_id,
                        address, ", ".join(lost), why)
            return True
        self._frozen.add(server_id)
        self._data_loss = self._data_loss or (
            f"parameter server {server_id} ({address}) came back without the trained "
            f"values of {', '.join(lost)} and {why}: they are lost. Restart the job (or start "
            "the coordinator with --reinitialize-lost-shards to go on from re-initialized "
            "values)")
        log.error("%s", self._data_loss)
        return False

    def _merge_report(self, server_id: str, report: ServerReport) -> bool:
        """Fold a server's report into the map: variables of its last map that this
        coordinator does not know (it restarted), and trained shards it holds that the map
        places elsewhere. Returns True if the map changed. Expects the lock held."""
        recovered = report.last_map
        self._recovery.epoch_floor = max(self._recovery.epoch_floor, report.epoch,
                                         recovered.epoch)
        servers = dict(self._map.servers)
        variables = dict(self._map.variables)
        shards = dict(self._map.shards)
        changed = False
        for name, spec in recovered.variables.items():
            known = variables.get(name)
            if known is None:
                variables[name], shards[name] = spec, recovered.shards[name]
                changed = True
                for shard in recovered.shards[name]:
                    self._placement_epoch[shard.key] = recovered.epoch
                for shard in recovered.shards[name]:
                    servers.setdefault(shard.server_id, recovered.servers.get(shard.server_id, ""))
                    if shard.server_id not in self._servers and shard.server_id != server_id:
                        self._recovery.awaiting.add(shard.server_id)
            elif known != spec:
                log.error("server %s reports variable %s as %s, the map has %s: keeping the "
                          "map's", server_id, name, spec.describe(), known.describe())
        for held in report.held:
            name = held.shard.variable
            placed = list(shards.get(name, ()))
            for i, shard in enumerate(placed):
                same_rows = (shard.index, shard.row_start, shard.row_stop) == (
                    held.shard.index, held.shard.row_start, held.shard.row_stop)
                if not (same_rows and held.updates and shard.server_id != server_id
                        and variables[name] == held.spec):
                    continue
                # The newer placement wins: a copy from before the shard was moved is stale.
                if ((server_id, shard.key) in self._moved_away
                        or report.epoch < self._placement_epoch.get(shard.key, 0)):
                    self._moved_away.add((server_id, shard.key))
                    log.warning("server %s holds an old copy of %s, which has been on %s "
                                "since: it is told to drop it", server_id,
                                describe_shard(shard), shard.server_id)
                    continue
                log.warning("server %s holds trained %s, which the map placed on %s: the "
                            "holder wins", server_id, describe_shard(shard), shard.server_id)
                self._moved_away.add((shard.server_id, shard.key))
                self._placement_epoch[shard.key] = report.epoch
                placed[i] = replace(shard, server_id=server_id)
                shards[name] = tuple(placed)
                changed = True
        if changed:
            self._map = replace(self._map, servers=servers, variables=variables, shards=shards)
        return changed

    def server_heartbeat(self, server_id: str, server_epoch: int,
                         generation: int | None = None, tables=None) -> tuple[bool, bool]:
        """Renew the lease. Returns (known, needs_sync). A server that registered with
        another coordinator generation is not known: it registers again (and reports).
        `tables`: its embedding tables' shards, as in ServerMember.tables (None: unchanged)."""
        now = self._clock.monotonic()
        with self._lock:
            member = self._servers.get(server_id)
            if member is None or (generation is not None and generation != self.generation):
                return False, False
            # The epoch a heartbeat carries is no acknowledgement either way: it may have
            # been read before an assignment the server has acknowledged since (lowering
            # synced_epoch would send that map again and hold declarations of known
            # variables behind the server), or come from a process that has died since
            # (its successor registered and holds nothing).
            self._servers[server_id] = replace(
                member, online_until=now + self._timeout, last_heartbeat=now,
                tables=member.tables if tables is None else tuple(tables))
            return True, (server_epoch < self._map.epoch and server_id not in self._frozen)

    def _same_registration(self, server_id: str, registration: int | None) -> bool:
        """Expects the lock held."""
        member = self._servers.get(server_id)
        return registration is None or (member is not None
                                        and member.registration == registration)

    def mark_synced(self, server_id: str, epoch: int, registration: int | None = None) -> None:
        """`server_id` acknowledged `epoch`; ignored when it has registered again since
        `registration` (the process that acknowledged may be gone, its successor empty)."""
        with self._lock:
            if not self._same_registration(server_id, registration):
                return
            member = self._servers.get(server_id)
            if member is not None and epoch > member.synced_epoch:
                self._servers[server_id] = replace(member, synced_epoch=epoch)
            if member is not None:
                self._acked[server_id] = max(self._acked.get(server_id, 0), epoch)

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
        """Every server with its state ("alive", "dead", "lost": away past the server timeout
        while holding shards, or "done": told the job is over) and the seconds since its
        last heartbeat."""
        now = self._clock.monotonic()
        with self._lock:
            timed_out = set(self._timed_out)
        return [(m, "done" if m.told_to_stop else "alive" if m.online_until > now
                 else "lost" if m.server_id in timed_out else "dead",
                 now - m.last_heartbeat) for m in self.servers()]

    def unsynced(self, shard_map: ShardMap) -> list[ServerMember]:
        """Live servers that have not acknowledged `shard_map`'s epoch. Every server gets the
        whole map (a restarted coordinator recovers it from any of them). A dead one is
        resynced when it registers again, not waited for."""
        now = self._clock.monotonic()
        with self._lock:
            return [m for sid, m in self._servers.items()
                    if m.synced_epoch < shard_map.epoch and m.online_until > now
                    and sid not in self._frozen]

    def holders(self, names) -> tuple[set[str], int]:
        """The servers holding shards of `names`, and the epoch each must have acknowledged
        before those shards exist there."""
        with self._lock:
            servers = {s.server_id for n in names for s in self._map.shards.get(n, ())}
            return servers, max((self._placed_at.get(n, 0) for n in names), default=0)

    def watch(self) -> list[ServerEvent]:
        """Liveness changes since the last call (the coordinator logs them at once and fails
        the job on "timed_out"). A timeout also records the data loss."""
        now = self._clock.monotonic()
        events, gone = [], []
        with self._lock:
            for sid, m in self._servers.items():
                if m.told_to_stop:
                    continue
                holds = tuple(describe_shard(s) for s in self._map.shards_on(sid))
                if m.online_until > now:
                    if self._down_since.pop(sid, None) is not None:
                        events.append(ServerEvent("back", sid, m.address, holds))
                        # Its shards moved while it was away, if it timed out: from now on
                        # it is watched afresh, for what it holds now.
                        self._timed_out.discard(sid)
                    continue
                if sid not in self._down_since:
                    self._down_since[sid] = m.online_until
                    events.append(ServerEvent("down", sid, m.address, holds))
                if (holds and sid not in self._timed_out
                        and now - self._down_since[sid] >= self._server_timeout):
                    events.append(self._lose(sid, m.address, holds, now))
                elif not holds and now - self._down_since[sid] >= self._server_timeout:
                    gone.append(sid)  # holds nothing: forgotten, as if never seen
            for sid in gone:
                self._forget_server(sid)
            if now - self._started >= self._server_timeout + self._timeout:
                for sid in sorted(self._recovery.awaiting - self._timed_out):
                    holds = tuple(describe_shard(s) for s in self._map.shards_on(sid))
                    if holds:
                        events.append(self._lose(sid, self._map.servers.get(sid, "?"), holds,
                                                 now))
        return events

    def _lose(self, server_id: str, address: str, holds: tuple[str, ...],
              now: float) -> ServerEvent:
        """Expects the lock held. A server holding shards is gone for good: its shards move
        to the live servers from the current checkpoint, or, when that cannot be, its values
        are lost (`_time_out`).

        Targets are chosen as placement chooses them: by footprint (values plus optimizer
        slots), least loaded first, never past a server's --memory-budget. The move is all or
        nothing: if one shard fits nowhere, none moves and the loss is reported as when no
        checkpoint holds the shards (a partial move could not save the job, whose map is no
        longer served after a data loss, and would only fill the survivors)."""
        shards = self._map.shards_on(server_id)
        live = [m for m in self._servers.values()
                if m.online_until > now and not m.told_to_stop
                and m.server_id not in self._frozen and m.server_id != server_id]
        if not live or not all(self._restorable(s) for s in shards):
            return self._time_out(server_id, address, holds)
        reported = self._reported_tables()
        loads = server_loads(self._map, reported)
        load = {m.server_id: loads.get(m.server_id, 0) for m in live}
        budget = {m.server_id: m.budget_bytes for m in live}
        lost_reported = reported.get(server_id, {})

        def cost(shard: Shard) -> int:
            return shard_charge(self._map.variables[shard.variable], shard, lost_reported)

        chosen: list[tuple[Shard, str]] = []
        for shard in sorted(shards, key=lambda s: (-cost(s), s.key)):
            fits = [sid for sid in sorted(load, key=lambda sid: (load[sid], sid))
                    if not budget[sid] or load[sid] + cost(shard) <= budget[sid]]
            if not fits:
                return self._time_out(server_id, address, holds, self._no_room(
                    shard, cost(shard), load, budget), resumable=True)
            load[fits[0]] += cost(shard)
            chosen.append((shard, fits[0]))
        moved = dict(self._map.shards)
        # A target that registered after the last placement is not in the map's servers yet.
        used = {target for _, target in chosen}
        servers = {**self._map.servers,
                   **{m.server_id: m.address for m in live if m.server_id in used}}
        targets = []
        for shard, target in chosen:
            moved[shard.variable] = tuple(replace(s, server_id=target) if s == shard else s
                                          for s in moved[shard.variable])
            self._mark_for_restore(target, [shard.key])
            self._moved_away.add((server_id, shard.key))
            targets.append(f"{describe_shard(shard)} -> {target}")
        self._timed_out.add(server_id)
        self._recovery.awaiting.discard(server_id)
        self._map = replace(self._map, servers=servers, shards=moved,
                            epoch=self._next_epoch())
        for shard in shards:
            self._placement_epoch[shard.key] = self._map.epoch
        manifest = self._catalog.current()
        return ServerEvent("moved", server_id, address, tuple(targets),
                           f"{manifest.id} (step {manifest.step})")

    def _no_room(self, shard: Shard, cost: int, load: dict[str, int],
                 budget: dict[str, int]) -> str:
        """Expects the lock held. Why a lost server's shards are not moved from the current
        checkpoint: no live server has room for `shard` within its memory budget."""
        manifest = self._catalog.current()
        room = ", ".join(f"{sid} {load[sid]} of {budget[sid]}" for sid in sorted(load))
        return (f"the current checkpoint {manifest.id} (step {manifest.step}) holds them, but "
                f"no live server has room for {describe_shard(shard)} ({cost} bytes with "
                f"optimizer slots) within its --memory-budget (bytes placed of budget: {room}): "
                "they are lost to this run. Add servers or raise --memory-budget and restart "
                "the job, which resumes from that checkpoint")

    def _forget_server(self, server_id: str) -> None:
        """Expects the lock held."""
        for table in (self._servers, self._acked, self._reported_held, self._down_since):
            table.pop(server_id, None)
        self._fresh.discard(server_id)
        self._frozen.discard(server_id)
        self._loss_checked = {(sid, shard) for sid, shard in self._loss_checked
                              if sid != server_id}
        if server_id in self._map.servers:
            self._map = replace(self._map, epoch=self._next_epoch(), servers={
                k: v for k, v in self._map.servers.items() if k != server_id})

    def _time_out(self, server_id: str, address: str, holds: tuple[str, ...],
                  why: str = "without checkpoints its values are lost",
                  resumable: bool = False) -> ServerEvent:
        """Expects the lock held. `resumable`: the values are not lost to a restarted
        coordinator (see data_loss_resumable)."""
        self._timed_out.add(server_id)
        if not self._data_loss:
            self._data_loss_resumable = resumable
        self._data_loss = self._data_loss or (
            f"parameter server {server_id} ({address}) has been gone for more than "
            f"{self._server_timeout:g} s (--server-timeout) holding {', '.join(holds)}; {why}")
        return ServerEvent("timed_out", server_id, address, holds)

    # ---- variables ---------------------------------------------------------------------

    def declare(self, specs: list[VariableSpec]) -> ShardMap:
        """Add the new variables among `specs` to the map; identical redeclarations are
        no-ops; a different spec under a known name raises SpecConflict naming both.
        Raises NotReady during the recovery grace period, while servers of a recovered
        map are still awaited, if the request adds variables (one of them may hold those),
        and until `expected_servers` servers have been alive at once; DataLost after a data
        loss."""
        return self.declare_new(specs)[0]

    def _reported_tables(self) -> dict:
        """Expects the lock held: each server's last report of its dynamic tables' shards
        (placement charges an uncapped table what it holds)."""
        return {m.server_id: dict(m.tables) for m in self._servers.values()}

    def declare_new(self, specs: list[VariableSpec]) -> tuple[ShardMap, list[str]]:
        """`declare`, also returning the names this call placed."""
        seen: dict[str, VariableSpec] = {}
        for spec in specs:
            validate_initializer(spec)
            resolve_knobs(spec)
            if spec.name in seen and seen[spec.name] != spec:
                raise SpecConflict(
                    f"variable {spec.name!r} declared twice in one request with different "
                    f"specs: {seen[spec.name].describe()} vs {spec.describe()}")
            seen[spec.name] = spec
        now = self._clock.monotonic()
        with self._lock:
            # Read under the lock that places: a server re-registering at a new address
            # meanwhile must not have its old address written back into the map.
            candidates = [Candidate(m.server_id, m.address, m.budget_bytes)
                          for m in self._servers.values() if m.online_until > now]
            if self._data_loss:
                raise DataLost(self._data_loss)
            new = []
            for spec in seen.values():
                existing = self._map.variables.get(spec.name)
                if existing is None:
                    new.append(spec)
                elif existing != spec:
                    raise SpecConflict(
                        f"variable {spec.name!r} is already declared as {existing.describe()}; "
                        f"this declaration asks for {spec.describe()}")
            if not new:
                return self._map, []
            if now - self._started < self._recovery_grace:
                raise NotReady(
                    f"the coordinator started {now - self._started:.1f} s ago: it places new "
                    f"variables after {self._recovery_grace:g} s, once servers that held shards "
                    "before it started have reported them; retry")
            if self._recovery.awaiting:
                raise NotReady(
                    f"waiting for server(s) {', '.join(sorted(self._recovery.awaiting))} to "
                    "register again after the coordinator restarted (they may hold these "
                    "variables); retry")
            if not self._expected_servers_seen:
                if len(candidates) < self._expected_servers:
                    raise NotReady(
                        f"{len(candidates)} of the {self._expected_servers} parameter servers "
                        "this coordinator expects are registered (--expect-servers): new "
                        "variables are placed once all of them are; retry")
                self._expected_servers_seen = True
            candidates = [c for c in candidates if c.server_id not in self._frozen]
            placed = place(self._map, new, candidates,
                           split_threshold_bytes=self._split_threshold,
                           reported=self._reported_tables())
            self._map = replace(placed, epoch=self._next_epoch())
            for spec in new:
                self._placed_at[spec.name] = self._map.epoch
                for shard in self._map.shards[spec.name]:
                    self._placement_epoch[shard.key] = self._map.epoch
                self._creation_failures.pop(spec.name, None)
                for shard in self._map.shards[spec.name]:
                    if self._restorable(shard):  # a checkpoint holds it: training resumes
                        self._mark_for_restore(shard.server_id, [shard.key])
            return self._map, [spec.name for spec in new]

    def record_creation_failure(self, variable: str, message: str) -> None:
        """A server could not create a shard of `variable` (its memory ran out)."""
        with self._lock:
            self._creation_failures[variable] = message

    def creation_failures(self, names) -> dict[str, str]:
        with self._lock:
            return {n: self._creation_failures[n] for n in names if n in self._creation_failures}

    def withdraw(self, names) -> ShardMap:
        """Take variables just placed out of the map again (a server could not create them)."""
        with self._lock:
            names = [n for n in names if n in self._map.variables]
            if names:
                self._map = replace(
                    self._map, epoch=self._next_epoch(),
                    variables={k: v for k, v in self._map.variables.items() if k not in names},
                    shards={k: v for k, v in self._map.shards.items() if k not in names})
                for name in names:
                    self._placed_at.pop(name, None)
            return self._map
