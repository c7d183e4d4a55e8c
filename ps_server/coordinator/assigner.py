"""Delivers the shard map to servers (the coordinator's only outbound call to servers).

Every live server gets the whole current map: it holds the shards placed on it, and a
restarted coordinator recovers the map from any server's report. Assignments carry the
coordinator's generation and control token, so servers obey this coordinator only.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from ps_common.checkpoints import FileRecord
from ps_common.errors import CheckpointFailed, NotReady
from ps_common.rpc import make_channel
from ps_common.shardmap import Shard
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_common.wire import shard_from_proto, shardmap_to_proto
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.coordinator.checkpointer import SavedPart
from ps_server.coordinator.state import CoordinatorState

log = logging.getLogger(__name__)

# Writing a server's part takes as long as its disk needs for its shards.
CHECKPOINT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class CreationFailure:
    server_id: str
    shard: Shard
    message: str


class Assigner:
    """Thread-safe. Keeps one channel per server address; deliveries to one server are
    serialized (each sends the map current at that moment, so they never go backwards)."""

    def __init__(self, state: CoordinatorState, token: bytes, *, timeout_s: float = 60.0,
                 cluster_token: str | None = None, cluster_tls: TLS | None = None):
        self._state = state
        self._token = token
        self._cluster_token = cluster_token  # on every call (ps_common.auth)
        self._cluster_tls = cluster_tls  # ps_common.tls
        self._timeout = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self._server_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ps-assign")
        # Servers a background delivery is going to now (sync_in_background).
        self._delivering: set[str] = set()
        self._closed = False

    def _stub(self, address: str) -> ps_grpc.ParameterServerStub:
        with self._lock:
            if self._closed:  # no new channel (and 60 s call) once close() cancelled them
                raise _stopping(address)
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = make_channel(
                    address, self._cluster_token, self._cluster_tls)
            # Under the lock: grpcio crashes the process (SIGSEGV) when a stub's methods are
            # registered on a channel that close() is closing at that moment.
            return ps_grpc.ParameterServerStub(channel)

    def _server_lock(self, server_id: str) -> threading.Lock:
        with self._lock:
            return self._server_locks.setdefault(server_id, threading.Lock())

    def _send(self, server_id: str, address: str, min_epoch: int) -> list[CreationFailure]:
        """Deliver the current map to `server_id` unless it has acknowledged `min_epoch`.
        Raises RemoteError when the server refuses it or cannot be reached."""
        with self._server_lock(server_id):
            member = next((m for m in self._state.servers() if m.server_id == server_id), None)
            if member is not None and member.synced_epoch >= min_epoch:
                return []
            delivery = self._state.delivery(server_id)
            shard_map, plan = delivery.shard_map, delivery.restore
            # Where the registration the delivery is for listens, read with it: the caller's
            # address may be an earlier process's, which must not be credited with it.
            address = delivery.address or address
            request = ps_pb.AssignShardsRequest(
                map=shardmap_to_proto(shard_map), generation=self._state.generation,
                control_token=self._token)
            if plan is not None:
                request.restore.checkpoint = str(plan.checkpoint)
                request.restore.shards.extend(ps_pb.ShardRef(variable=v, index=i)
                                              for v, i in sorted(plan.keys))
                request.restore.ledger = plan.ledger
            request.superseded.extend(ps_pb.ShardRef(variable=v, index=i)
                                      for v, i in sorted(delivery.superseded))
            try:
                reply = self._stub(address).AssignShards(request, timeout=self._timeout)
            except grpc.RpcError as error:
                raise RemoteError.from_rpc_error(error, target=server_id) from None
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
                if not self._closed:
                    raise
                raise _stopping(server_id) from None
            failures = [CreationFailure(server_id, shard_from_proto(f.shard), f.message)
                        for f in reply.failed if not f.checkpoint_unreadable]
            unreadable = [f.message for f in reply.failed if f.checkpoint_unreadable]
            if plan is not None:
                unrestored = {f.shard.key for f in failures} & plan.keys
                self._state.restore_done(server_id,
                                         set() if unreadable else plan.keys - unrestored,
                                         delivery.registration)
                if unreadable:
                    self._state.restore_failed(server_id, plan.checkpoint, unreadable[0],
                                               delivery.registration)
                elif unrestored:  # e.g. out of memory for now: sent again with the next epoch
                    log.error("server %s could not restore %d shard(s) (%s); trying again",
                              server_id, len(unrestored), failures[0].message)
                    self._state.retry_restore()
                    failures = [f for f in failures if f.shard.key not in plan.keys]
            # Recorded before the acknowledgement: a declaration that then finds this server
            # synced also finds the failure (whichever declaration placed it looks it up).
            for failure in failures:
                self._state.record_creation_failure(
                    failure.shard.variable, f"server {server_id}: {failure.message}")
            self._state.mark_synced(server_id, shard_map.epoch, delivery.registration)
            return failures

    def sync(self, server_ids: set[str] | None = None,
             min_epoch: int | None = None) -> list[CreationFailure]:
        """Bring live servers (all, or `server_ids`) to at least `min_epoch` (default: the
        current epoch). Returns the shards servers could not create; raises NotReady naming
        the servers that could not be reached or refused the map (the caller may retry:
        this is idempotent)."""
        epoch = self._state.shard_map.epoch if min_epoch is None else min_epoch
        targets = [m for m in self._state.unsynced(self._state.shard_map)
                   if server_ids is None or m.server_id in server_ids]
        pending = {m.server_id: self._pool.submit(self._send, m.server_id, m.address, epoch)
                   for m in targets if m.synced_epoch < epoch}
        failures, refused = [], []
        for server_id, future in pending.items():
            try:
                failures.extend(future.result())
            except RemoteError as error:
                refused.append(f"{server_id} ({error.code().name}: {error.details()})")
        if refused:
            raise NotReady(f"could not deliver shard map epoch {epoch} to server(s) "
                           f"{'; '.join(refused)}; retry")
        return failures

    def sync_in_background(self) -> None:
        """Resync whoever is behind, without blocking the caller (e.g. a heartbeat). Each
        server's delivery goes on its own: one that takes long (a server slow to answer, a
        restore that falls back to an older checkpoint, read whole first) holds up no other
        server's, and a server already being delivered to is not sent another meanwhile."""
        epoch = self._state.shard_map.epoch
        behind = [m for m in self._state.unsynced(self._state.shard_map)
                  if m.synced_epoch < epoch]
        with self._lock:
            targets = [m for m in behind if m.server_id not in self._delivering]
            self._delivering.update(m.server_id for m in targets)
        for member in targets:
            try:
                self._pool.submit(self._deliver_in_background, member.server_id,
                                  member.address, epoch)
            except RuntimeError:  # the pool is shut down: the coordinator is stopping
                with self._lock:
                    self._delivering.discard(member.server_id)

    def _deliver_in_background(self, server_id: str, address: str, epoch: int) -> None:
        try:
            for failure in self._send(server_id, address, epoch):
                log.error("server %s could not create a shard: %s", failure.server_id,
                          failure.message)
        except RemoteError as error:
            log.warning("could not deliver shard map epoch %d to server %s (%s: %s); retry",
                        epoch, server_id, error.code().name, error.details())
        finally:
            with self._lock:
                self._delivering.discard(server_id)

    def save_checkpoint(self, server_id: str, address: str, directory: Path,
                        epoch: int) -> SavedPart:
        """Ask one server to write its part of a checkpoint into `directory`. Raises the
        server's error (NotReady when it is not at `epoch` or out of reach; CheckpointFailed)."""
        request = ps_pb.SaveCheckpointRequest(
            generation=self._state.generation, control_token=self._token,
            directory=str(directory), epoch=epoch)
        try:
            reply = self._stub(address).SaveCheckpoint(request, timeout=CHECKPOINT_TIMEOUT_S)
        except grpc.RpcError as error:
            remote = RemoteError.from_rpc_error(error, target=server_id)
            if remote.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE):
                # Not at this epoch (yet), or out of reach: the checkpoint is tried again.
                raise NotReady(f"server {server_id}: {remote.details()}") from None
            raise CheckpointFailed(f"server {server_id} ({address}) could not save its part: "
                                   f"{remote.code().name}: {remote.details()}") from None
        return SavedPart(
            files=[FileRecord(f.name, f.bytes, f.sha256) for f in reply.files],
            shards={(s.shard.variable, s.shard.index): (s.updates, s.optimizer_steps, s.file)
                    for s in reply.shards})

    def close(self) -> None:
        # Channels first: closing them cancels assignments in flight, so that stopping the
        # coordinator never waits out a stalled server's RPC deadline.
        with self._lock:
            self._closed = True
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _stopping(target: str) -> RemoteError:
    return RemoteError(grpc.StatusCode.CANCELLED, "the coordinator is stopping", target=target)
