"""gRPC adapter of the coordinator: decode, call state / assigner, encode."""

from __future__ import annotations

import threading

from ps_common.errors import InvalidArgument
from ps_common.status import translate_errors
from ps_common.wire import shardmap_to_proto, spec_from_proto
from ps_proto.v1 import coordinator_pb2 as pb
from ps_proto.v1 import coordinator_pb2_grpc as pb_grpc
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.state import CoordinatorState


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thread-safe."""

    def __init__(self, state: CoordinatorState, assigner: Assigner, *, heartbeat_interval_s: float):
        self._state = state
        self._assigner = assigner
        self._heartbeat_interval_ms = int(heartbeat_interval_s * 1000)
        # Declarations are serialized so each one's placement sees the previous one's.
        self._declare_lock = threading.Lock()

    def RegisterServer(self, request, context):
        with translate_errors(context, "RegisterServer"):
            if not request.server_id or not request.address:
                raise InvalidArgument("RegisterServer needs a server_id and an address")
            if request.memory_budget_bytes < 0:
                raise InvalidArgument("memory_budget_bytes must be >= 0")
            self._state.register_server(
                request.server_id, request.address, request.memory_budget_bytes)
            self._assigner.sync_in_background()
            return pb.RegisterServerReply(heartbeat_interval_ms=self._heartbeat_interval_ms)

    def ServerHeartbeat(self, request, context):
        with translate_errors(context, "ServerHeartbeat"):
            known, needs_sync = self._state.server_heartbeat(request.server_id, request.epoch)
            if needs_sync:
                self._assigner.sync_in_background()
            return pb.ServerHeartbeatReply(epoch=self._state.shard_map.epoch, known=known)

    def Declare(self, request, context):
        with translate_errors(context, "Declare"):
            if not request.variables:
                raise InvalidArgument("Declare names no variables")
            specs = [spec_from_proto(v) for v in request.variables]
            with self._declare_lock:
                shard_map = self._state.declare(specs)
                self._assigner.sync(shard_map)
            return shardmap_to_proto(shard_map)

    def GetShardMap(self, request, context):
        with translate_errors(context, "GetShardMap"):
            return shardmap_to_proto(self._state.shard_map)
