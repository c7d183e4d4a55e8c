"""Where CoordinatorState moves a lost server's shards from the current checkpoint: by
footprint (values plus optimizer slots), least loaded first, never past a survivor's memory
budget; when one fits nowhere nothing moves and the loss is reported. Fake clock."""

from __future__ import annotations

import pytest

from ps_common.checkpoints import Manifest
from ps_common.clock import FakeClock
from ps_common.errors import DataLost
from ps_common.shardmap import EMBEDDING, Component, VariableSpec
from ps_server.coordinator.state import CoordinatorState

SGD = Component.of({"name": "sgd", "lr": 1.0})
ADAM = Component.of({"name": "adam", "lr": 0.1})
TIMEOUT = 10.0
SERVER_TIMEOUT = 30.0


class OneCheckpoint:
    """A Catalog whose current checkpoint holds every variable declared so far."""

    def __init__(self, state: CoordinatorState):
        self._manifest = Manifest("ckpt-1", 3, 0, 0.0, dict(state.shard_map.variables), [], {})

    def current(self) -> Manifest:
        return self._manifest


def var(name: str, rows: int, optimizer: Component = SGD) -> VariableSpec:
    return VariableSpec(name, (rows,), optimizer=optimizer)  # float32: 4 bytes a row


def cluster(budgets: dict[str, int], clock: FakeClock) -> CoordinatorState:
    state = CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                             server_timeout_s=SERVER_TIMEOUT)
    for sid, budget in budgets.items():
        state.register_server(sid, f"h:{sid}", budget)
    return state


def lose(state: CoordinatorState, clock: FakeClock, lost: str) -> list:
    """A checkpoint of everything is taken; then every other server heartbeats while `lost`
    stays away past the server timeout."""
    state.use_checkpoints(OneCheckpoint(state))
    events = []
    for _ in range(5):  # 45 s: down after 10 s, lost 30 s later
        clock.advance(TIMEOUT * 0.9)
        for member in state.servers():
            if member.server_id != lost:
                state.server_heartbeat(member.server_id, state.shard_map.epoch)
        events += [e for e in state.watch() if e.kind in ("moved", "timed_out")]
    return events


def placed_on(state: CoordinatorState, name: str) -> set[str]:
    return {s.server_id for s in state.shard_map.shards[name]}


def test_load_is_values_plus_optimizer_slots():
    """s0 holds 4000 bytes of sgd values; s1 2000 bytes of adam values, 6000 with its two
    slots: s0 is the less loaded, and takes the lost server's shard."""
    clock = FakeClock()
    state = cluster({"s0": 0, "s1": 0, "s2": 0}, clock)
    state.declare([var("a", 1000), var("b", 500, ADAM), var("c", 10)])
    assert [placed_on(state, n) for n in "abc"] == [{"s0"}, {"s1"}, {"s2"}]
    assert [e.kind for e in lose(state, clock, "s2")] == ["moved"]
    assert placed_on(state, "c") == {"s0"}


def test_the_least_loaded_survivor_is_passed_over_when_the_shard_would_exceed_its_budget():
    clock = FakeClock()
    state = cluster({"s0": 0, "s1": 9000}, clock)
    state.declare([var("a", 2000), var("b", 1500)])  # s0: 8000 bytes, s1: 6000
    state.register_server("s2", "h:s2", 0)
    state.declare([var("c", 1000)])  # 4000 bytes, on s2
    assert [e.kind for e in lose(state, clock, "s2")] == ["moved"]
    assert placed_on(state, "c") == {"s0"}  # s1 would hold 10000 bytes of its 9000


def test_shards_spread_over_the_survivors_with_room():
    clock = FakeClock()
    state = cluster({"s0": 12_000, "s1": 10_000}, clock)
    state.declare([var("a", 2000), var("b", 1500)])  # s0: 8000 bytes, s1: 6000
    state.register_server("s2", "h:s2", 8000)
    state.declare([var("c", 1000), var("d", 1000)])  # 4000 bytes each: both on s2
    assert placed_on(state, "c") == placed_on(state, "d") == {"s2"}
    assert [e.kind for e in lose(state, clock, "s2")] == ["moved"]
    # c goes to s1 (the least loaded: 10000 of 10000), d to s0, which still has room.
    assert (placed_on(state, "c"), placed_on(state, "d")) == ({"s1"}, {"s0"})
    assert state.shard_map.servers["s2"] == "h:s2"  # until s2 is forgotten


def test_a_shard_that_fits_on_no_survivor_moves_nothing_and_is_a_data_loss():
    clock = FakeClock()
    state = cluster({"s0": 10_000, "s1": 10_000}, clock)
    state.declare([var("a", 2000), var("b", 1500)])  # s0: 8000 bytes, s1: 6000
    state.register_server("s2", "h:s2", 10_000)
    state.declare([var("c", 1000), var("d", 1000)])  # s2: 8000
    before = state.shard_map
    events = lose(state, clock, "s2")
    assert [(e.kind, e.server_id) for e in events] == [("timed_out", "s2")]
    assert state.shard_map.shards == before.shards  # not even c, which would have fit
    with pytest.raises(DataLost) as caught:
        state.check_no_data_loss()
    assert "--memory-budget" in caught.value.message and "ckpt-1" in caught.value.message
    assert {m.server_id: s for m, s, _ in state.server_states()}["s2"] == "lost"


def test_a_target_that_joined_after_the_last_placement_is_in_the_moved_map():
    clock = FakeClock()
    state = cluster({"s0": 0}, clock)
    state.declare([var("w", 10)])
    state.register_server("s1", "h:s1", 0)  # registered, never placed on
    assert "s1" not in state.shard_map.servers
    assert [e.kind for e in lose(state, clock, "s0")] == ["moved"]
    assert placed_on(state, "w") == {"s1"} and state.shard_map.servers["s1"] == "h:s1"


def test_an_uncapped_tables_shard_is_charged_what_its_lost_server_held():
    """An uncapped dynamic table's shard has no capacity share to charge (0): the lost
    server's shard, reported holding 8,000 bytes, went to s0, whose budget is 5,000, although
    s1 has no budget limit. It is charged what the lost server last reported holding."""
    clock = FakeClock()
    state = cluster({"s0": 5000, "s1": 0, "s2": 0}, clock)
    state.declare([VariableSpec("t", (0, 4), optimizer=SGD, kind=EMBEDDING)])  # uncapped
    state.declare([var("a", 1500)])  # 6,000 bytes: s1 is then the more loaded survivor
    assert placed_on(state, "a") == {"s1"}
    (lost_shard,) = [s for s in state.shard_map.shards["t"] if s.server_id == "s2"]
    state.server_heartbeat("s2", state.shard_map.epoch,
                           tables=[(lost_shard.key, (500, 0, 8000))])
    assert [e.kind for e in lose(state, clock, "s2")] == ["moved"]
    (moved,) = [s for s in state.shard_map.shards["t"] if s.index == lost_shard.index]
    assert moved.server_id == "s1", f"the 8,000-byte shard went to {moved.server_id}"
