"""The coordinator's state when something lands at the worst moment: a declaration while an
assignment to the same server is being built, a server's successor registering while an
assignment is acknowledged, a server moving its address while a declaration places. Each
interleaving is forced by wrapping the call at which it happens. Fake server stub, fake
clock."""

from __future__ import annotations

from pathlib import Path

from ps_common.checkpoints import Manifest
from ps_common.clock import FakeClock
from ps_common.shardmap import Component, VariableSpec
from ps_common.wire import shardmap_from_proto
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.state import CoordinatorState, ServerReport

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


class ServerThatRestartsAfterItsReply:
    """The first assignment is applied and answered by the old process, which then crashes;
    the new one registers (empty) before the coordinator has handled the reply."""

    def __init__(self, state: CoordinatorState):
        self.state = state
        self.requests: list[ps_pb.AssignShardsRequest] = []

    def AssignShards(self, request, timeout):  # noqa: N802 - the stub's method name
        self.requests.append(request)
        if len(self.requests) == 1:
            self.state.register_server("s0", "h:0", 0, ServerReport())  # a fresh process
        return ps_pb.AssignShardsReply(shards_created=1)


def acknowledged_by_a_process_that_then_died() -> CoordinatorState:
    state = CoordinatorState(FakeClock(), heartbeat_timeout_s=10.0,
                             split_threshold_bytes=1 << 20)
    state.register_server("s0", "h:0", 0)
    state.declare([VariableSpec("a", (4,))])  # not acknowledged by anyone yet
    assigner = Assigner(state, b"token")
    assigner._stub = lambda address: ServerThatRestartsAfterItsReply(state)
    try:
        assigner.sync()
    finally:
        assigner.close()
    return state


def test_an_acknowledgement_is_not_credited_to_the_empty_successor_of_the_process_that_gave_it():
    state = acknowledged_by_a_process_that_then_died()
    (member,) = state.servers()
    assert member.synced_epoch < state.shard_map.epoch  # so it is sent the map again


def test_a_restart_of_that_successor_is_no_loss_of_trained_values():
    """Nobody trained `a` (its declaration had not returned), and the new process never held
    it: its next restart is no data loss."""
    state = acknowledged_by_a_process_that_then_died()
    assert state.register_server("s0", "h:0", 0, ServerReport()) == {}
    assert state.data_loss == ""


class ClockThatLetsAServerMove(FakeClock):
    """While armed, every reading (made outside the state's lock: none is made under it)
    first re-registers s0 at a new address, as a server rescheduled again and again would:
    whenever a declaration reads the live servers, s0 may move right after."""

    def __init__(self):
        super().__init__()
        self.state: CoordinatorState | None = None
        self.addresses: list[str] = []

    def monotonic(self) -> float:
        state, self.state = self.state, None  # no move from inside register_server
        if state is not None:
            self.addresses.append(f"10.0.0.{len(self.addresses) + 2}:50061")
            state.register_server("s0", self.addresses[-1], 0, ServerReport())
            self.state = state
        return super().monotonic()


def test_a_server_that_moves_while_a_declaration_places_keeps_its_new_address_in_the_map():
    clock = ClockThatLetsAServerMove()
    state = CoordinatorState(clock, heartbeat_timeout_s=10.0, split_threshold_bytes=1 << 20)
    state.register_server("s0", "10.0.0.1:50061", 0)
    state.declare([VariableSpec("a", (4,))])
    clock.state = state
    state.declare([VariableSpec("b", (4,))])
    clock.state = None
    assert clock.addresses
    assert state.server_heartbeat("s0", state.shard_map.epoch, state.generation) == (True, False)
    # Clients route by the map: it names where s0 listens now.
    assert state.shard_map.servers["s0"] == clock.addresses[-1]


def test_a_heartbeat_read_before_an_acknowledged_assignment_leaves_the_server_synced():
    state = CoordinatorState(FakeClock(), heartbeat_timeout_s=10.0,
                             split_threshold_bytes=1 << 20)
    state.register_server("s0", "h:0", 0)
    before = state.shard_map.epoch
    state.declare([VariableSpec("a", (4,))])
    state.mark_synced("s0", state.shard_map.epoch)  # acknowledged
    state.server_heartbeat("s0", before, state.generation)  # sent before the assignment
    (member,) = state.servers()
    assert member.synced_epoch == state.shard_map.epoch
    assert state.unsynced(state.shard_map) == []  # nothing is sent again
