"""What the Assigner delivers when a declaration lands while an assignment to the same server
is being sent: the restore it carries always matches its map, and a variable a checkpoint
holds is restored (never initialized) once its own assignment arrives. Fake server stub,
fake clock."""

from __future__ import annotations

from pathlib import Path

from ps_common.checkpoints import Manifest
from ps_common.clock import FakeClock
from ps_common.shardmap import Component, VariableSpec
from ps_common.wire import shardmap_from_proto
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.state import CoordinatorState

SPEC = VariableSpec("w", (10,), optimizer=Component.of({"name": "sgd", "lr": 1.0}))


class CheckpointOfW:
    """A Catalog whose current checkpoint holds `w` as SPEC declares it."""

    def __init__(self):
        self._manifest = Manifest("ckpt-1", 3, 1, 0.0, {"w": SPEC}, [], {},
                                  directory=Path("ckpt-1"))

    def current(self) -> Manifest:
        return self._manifest


class RecordingServer:
    """Stands in for the server's stub: keeps every assignment, creates everything."""

    def __init__(self):
        self.requests: list[ps_pb.AssignShardsRequest] = []

    def AssignShards(self, request, timeout):  # noqa: N802 - the stub's method name
        self.requests.append(request)
        return ps_pb.AssignShardsReply()


def test_a_declaration_landing_while_an_assignment_is_built_is_restored_not_initialized():
    state = CoordinatorState(FakeClock(), heartbeat_timeout_s=10.0,
                             split_threshold_bytes=1 << 20)
    state.use_checkpoints(CheckpointOfW())
    state.register_server("s0", "h:0", 0)
    state.declare([VariableSpec("a", (4,))])  # a map the server has yet to get
    server = RecordingServer()
    assigner = Assigner(state, b"token")
    assigner._stub = lambda address: server
    read = state.delivery

    def declare_just_after_the_read(server_id):
        delivery = read(server_id)
        if len(server.requests) == 0:  # the declaration lands while this one is in flight
            state.declare([SPEC])
        return delivery

    state.delivery = declare_just_after_the_read
    try:
        assigner.sync()  # delivers the map with `a` only
        assigner.sync()  # what the declaration's own sync does
    finally:
        assigner.close()

    first, second = server.requests
    assert "w" not in shardmap_from_proto(first.map).variables
    assert not first.HasField("restore")  # it would count as done while the map lacks `w`
    assert "w" in shardmap_from_proto(second.map).variables
    assert second.restore.checkpoint == "ckpt-1"
    assert [(r.variable, r.index) for r in second.restore.shards] == [("w", 0)]
    assert state.shards_restored == 1
