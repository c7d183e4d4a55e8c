"""Delivers shard assignments to servers (the coordinator's only outbound data-plane call)."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc

from ps_common.errors import NotReady
from ps_common.rpc import make_channel
from ps_common.shardmap import ShardMap
from ps_common.wire import shard_to_proto, spec_to_proto
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.coordinator.state import CoordinatorState

log = logging.getLogger(__name__)


class Assigner:
    """Thread-safe. Keeps one channel per server address."""

    def __init__(self, state: CoordinatorState, *, timeout_s: float = 60.0):
        self._state = state
        self._timeout = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ps-assign")
        self._background_sync_running = False

    def _stub(self, address: str) -> ps_grpc.ParameterServerStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = make_channel(address)
        return ps_grpc.ParameterServerStub(channel)

    def _send(self, server_id: str, address: str, shard_map: ShardMap) -> None:
        shards = shard_map.shards_on(server_id)
        names = {s.variable for s in shards}
        request = ps_pb.AssignShardsRequest(
            epoch=shard_map.epoch,
            variables=[spec_to_proto(shard_map.variables[n]) for n in sorted(names)],
            shards=[shard_to_proto(s) for s in shards],
        )
        self._stub(address).AssignShards(request, timeout=self._timeout)
        self._state.mark_synced(server_id, shard_map.epoch)

    def sync(self, shard_map: ShardMap) -> None:
        """Deliver `shard_map` to every shard holder that lacks it; raise NotReady naming the
        servers that could not be reached (the caller may retry: this is idempotent)."""
        pending = {m.server_id: self._pool.submit(self._send, m.server_id, m.address, shard_map)
                   for m in self._state.unsynced(shard_map)}
        failed = []
        for server_id, future in pending.items():
            try:
                future.result()
            except grpc.RpcError as error:
                failed.append(f"{server_id} ({error.code().name})")
        if failed:
            raise NotReady(f"could not deliver shard map epoch {shard_map.epoch} to server(s) "
                           f"{', '.join(failed)}; retry")

    def sync_in_background(self) -> None:
        """Resync whoever is behind, without blocking the caller (e.g. a heartbeat)."""
        with self._lock:
            if self._background_sync_running:
                return
            self._background_sync_running = True

        def run():
            try:
                self.sync(self._state.shard_map)
            except NotReady as error:
                log.warning("%s", error.message)
            finally:
                with self._lock:
                    self._background_sync_running = False

        self._pool.submit(run)

    def close(self) -> None:
        # Channels first: closing them cancels assignments in flight, so that stopping the
        # coordinator never waits out a stalled server's RPC deadline.
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
