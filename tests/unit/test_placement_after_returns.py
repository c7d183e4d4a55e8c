"""The coordinator's state when servers come back: a lost server whose shards moved that
heartbeats again and is lost again, and a delivery queued while a server registered anew.
Fake clock, no processes."""

from __future__ import annotations

import threading

from ps_common.checkpoints import Manifest
from ps_common.clock import FakeClock
from ps_common.shardmap import Component, VariableSpec
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import tensor_pb2
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.state import CoordinatorState, ServerReport

SGD = Component.of({"name": "sgd", "lr": 1.0})
TIMEOUT = 10.0
SERVER_TIMEOUT = 30.0


class OneCheckpoint:
    """A Catalog whose current checkpoint holds every variable declared so far."""

    def __init__(self, state: CoordinatorState):
        self._manifest = Manifest("ckpt-1", 3, 0, 0.0, dict(state.shard_map.variables), [], {})

    def current(self) -> Manifest:
        return self._manifest


def var(name: str, rows: int) -> VariableSpec:
    return VariableSpec(name, (rows,), optimizer=SGD)


def away(state: CoordinatorState, clock: FakeClock, gone: str, seconds: float,
         until: str = "") -> list:
    """Every server but `gone` heartbeats while `seconds` pass (or until watch() gives an
    event of kind `until` for `gone`); the events watch() gave."""
    events = []
    for _ in range(int(seconds // (TIMEOUT * 0.5)) + 1):
        clock.advance(TIMEOUT * 0.5)
        for member in state.servers():
            if member.server_id != gone:
                state.server_heartbeat(member.server_id, state.shard_map.epoch)
        events += state.watch()
        if any(e.kind == until and e.server_id == gone for e in events):
            break
    return events


def test_a_moved_server_that_heartbeats_again_is_watched_again_when_it_goes_away_for_good():
    """A server holding shards that stays away past --server-timeout has its shards moved, or
    the job fails. s1 is lost once (its shard `b` moves to s0) and its heartbeats come back
    before watch() forgets it: it is alive again, a new variable is placed on it, and it
    goes away for good. It stayed marked as timed out, so its second loss was never handled:
    its shard `c` neither moved nor failed the job."""
    clock = FakeClock()
    state = CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                             server_timeout_s=SERVER_TIMEOUT)
    state.register_server("s0", "h:s0", 0)
    state.register_server("s1", "h:s1", 0)
    state.declare([var("a", 100), var("b", 10)])
    assert {s.server_id for s in state.shard_map.shards["b"]} == {"s1"}
    state.use_checkpoints(OneCheckpoint(state))
    events = away(state, clock, "s1", TIMEOUT + 2 * SERVER_TIMEOUT, until="moved")
    assert [e.kind for e in events if e.server_id == "s1"][-1] == "moved"
    assert {s.server_id for s in state.shard_map.shards["b"]} == {"s0"}

    # s1's partition heals: its heartbeat comes before the next watch() forgets it.
    known, needs_sync = state.server_heartbeat("s1", 0)
    assert known and needs_sync
    assert [(e.kind, e.server_id) for e in state.watch()] == [("back", "s1")]
    state.mark_synced("s1", state.shard_map.epoch)
    state.declare([var("c", 10)])  # s1 is the least loaded now
    assert {s.server_id for s in state.shard_map.shards["c"]} == {"s1"}
    state.use_checkpoints(OneCheckpoint(state))  # a checkpoint holds c too

    # s1 goes away for good, holding c.
    events = away(state, clock, "s1", TIMEOUT + 3 * SERVER_TIMEOUT)
    kinds = [e.kind for e in events if e.server_id == "s1"]
    assert "down" in kinds
    assert "moved" in kinds or "timed_out" in kinds, (
        f"s1 stayed away {3 * SERVER_TIMEOUT:g} s past --server-timeout holding c, and "
        f"watch() gave only {kinds}; c is still on "
        f"{[s.server_id for s in state.shard_map.shards['c']]}, no data loss recorded: "
        f"{state.data_loss!r}")


class FakeServer:
    """A ParameterServer stub at one address: records each AssignShards request and
    answers it (no failures); `hold` makes the next call wait until `release` is set."""

    def __init__(self):
        self.requests = []
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def AssignShards(self, request, timeout=None):
        self.requests.append(request)
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.release.wait(30), "the test never released the held assignment"
        return ps_pb.AssignShardsReply()


def test_a_delivery_queued_before_a_server_registered_again_is_not_sent_to_its_old_address(
        monkeypatch):
    """A restarted server gets its shards restored. A delivery to s0 at its old address is in
    flight (its old process slow to answer) and a second one queues behind it; s0's new
    process registers at a new address, and the coordinator plans to restore `x` there. The
    queued delivery was built for the new registration but sent to the address it was
    queued with: the old process took the restore, the coordinator counted it done and the
    new process synced, and the new process later made `x` from its initializer."""
    clock = FakeClock()
    state = CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                             server_timeout_s=SERVER_TIMEOUT)
    state.register_server("s0", "h:old", 0)
    placed = state.declare([var("x", 10)])
    state.mark_synced("s0", placed.epoch)  # s0 holds x, trained
    state.use_checkpoints(OneCheckpoint(state))
    state.declare([var("y", 10)])  # a new epoch for s0

    servers = {"h:old": FakeServer(), "h:new": FakeServer()}
    assigner = Assigner(state, b"token")
    monkeypatch.setattr(assigner, "_stub", lambda address: servers[address])
    sends = []
    second_queued = threading.Event()
    original_send = assigner._send

    def send(server_id, address, min_epoch):
        sends.append(address)
        if len(sends) == 2:
            second_queued.set()
        return original_send(server_id, address, min_epoch)

    monkeypatch.setattr(assigner, "_send", send)
    try:
        servers["h:old"].hold = True
        first = threading.Thread(target=assigner.sync)  # a Declare's sync: in flight
        first.start()
        assert servers["h:old"].entered.wait(30)
        second = threading.Thread(target=assigner.sync)  # another sync, queued for s0
        second.start()
        assert second_queued.wait(30)  # it waits for s0's per-server lock
        assert sends == ["h:old", "h:old"]

        # s0's new process registers at h:new, empty: x is to be restored there.
        losses = state.register_server("s0", "h:new", 0, ServerReport())
        assert losses == {"s0": ["x[0:10]"]}
        assert state.delivery("s0").restore.keys == {("x", 0)}

        servers["h:old"].release.set()  # the old process answers the first delivery late
        first.join(30)
        second.join(30)
        assert not first.is_alive() and not second.is_alive()

        assigner.sync()  # whatever syncs next (a heartbeat, a Declare)
        restored_at = {address: [tuple((r.variable, r.index) for r in req.restore.shards)
                                 for req in fake.requests if req.HasField("restore")]
                       for address, fake in servers.items()}
        assert restored_at["h:new"] == [(("x", 0),)], (
            f"restores sent per address: {restored_at}; the coordinator now plans "
            f"{state.delivery('s0').restore} for s0 and counts it synced at "
            f"{[m.synced_epoch for m in state.servers() if m.server_id == 's0']} "
            f"(map epoch {state.shard_map.epoch})")
    finally:
        servers["h:old"].release.set()
        assigner.close()


class FallBackCounter(OneCheckpoint):
    """OneCheckpoint that counts the fall-backs the coordinator asks of it."""

    def __init__(self, state: CoordinatorState):
        super().__init__(state)
        self.fall_backs = []

    def fall_back(self, failed_directory, reason: str):
        self.fall_backs.append(reason)
        return self._manifest


class UnreadableAtOldAddress(FakeServer):
    """Answers every restore it is sent: the checkpoint cannot be read here."""

    def AssignShards(self, request, timeout=None):
        reply = super().AssignShards(request, timeout)
        reply.failed.extend(ps_pb.ShardFailure(shard=ref_shard, message="stale mount",
                                               checkpoint_unreadable=True)
                            for ref_shard in _shards_of(request.restore))
        return reply


def _shards_of(restore):
    return [tensor_pb2.Shard(variable=ref.variable, index=ref.index) for ref in restore.shards]


def test_an_old_processs_unreadable_checkpoint_does_not_make_the_coordinator_fall_back(
        monkeypatch):
    """A restore sent to a server's old process (a stale mount on its old host) comes back
    "checkpoint unreadable" after the server registered again elsewhere: that answer says
    nothing of the checkpoint its new process will read, and the coordinator does not fall
    back to an older one (the updates since would be lost)."""
    clock = FakeClock()
    state = CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                             server_timeout_s=SERVER_TIMEOUT)
    state.register_server("s0", "h:old", 0)
    placed = state.declare([var("x", 10)])
    state.mark_synced("s0", placed.epoch)
    catalog = FallBackCounter(state)
    state.use_checkpoints(catalog)
    state.register_server("s0", "h:old", 0, ServerReport())  # back empty: x to restore

    servers = {"h:old": UnreadableAtOldAddress(), "h:new": FakeServer()}
    assigner = Assigner(state, b"token")
    monkeypatch.setattr(assigner, "_stub", lambda address: servers[address])
    try:
        servers["h:old"].hold = True
        answered = []
        delivery = threading.Thread(target=lambda: answered.append(assigner.sync()))
        delivery.start()
        assert servers["h:old"].entered.wait(30)
        state.register_server("s0", "h:new", 0, ServerReport())  # again, on another host
        servers["h:old"].release.set()  # the old process answers: unreadable
        delivery.join(30)
        assert not delivery.is_alive() and answered == [[]], answered  # it was answered
        assert servers["h:old"].requests[0].restore.shards  # a restore, answered unreadable
        assert catalog.fall_backs == [], catalog.fall_backs
        assigner.sync()
        restored_at_new = [tuple((r.variable, r.index) for r in req.restore.shards)
                           for req in servers["h:new"].requests if req.HasField("restore")]
        assert restored_at_new == [(("x", 0),)], restored_at_new
    finally:
        servers["h:old"].release.set()
        assigner.close()
