"""The coordinator rebuilding its view from servers' reports, finding lost shards, and
watching servers: CoordinatorState with a fake clock; the store's side of assignments."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.clock import FakeClock
from ps_common.errors import DataLost, NotReady, StaleEpoch, TrainedShardConflict
from ps_common.shardmap import Component, VariableSpec
from ps_server.coordinator.identity import (
    ClientRegistry, Incarnations, RetiredLog, first_number,
)
from ps_server.coordinator.state import CoordinatorState, HeldReport, ServerReport
from ps_server.store import ShardStore
from ps_common.tensors import TensorMeta

SGD = Component.of({"name": "sgd", "lr": 1.0})
TIMEOUT = 10.0
SERVER_TIMEOUT = 30.0


def var(name: str, rows: int) -> VariableSpec:
    return VariableSpec(name, (rows,), optimizer=SGD)


def make_state(clock: FakeClock, generation: int, **kwargs) -> CoordinatorState:
    return CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                            generation=generation, server_timeout_s=SERVER_TIMEOUT, **kwargs)


def report_of(state: CoordinatorState, server_id: str, updates: int = 1) -> ServerReport:
    """What `server_id` would report after holding everything `state` placed on it."""
    m = state.shard_map
    return ServerReport(
        epoch=m.epoch, generation=state.generation, last_map=m,
        held=tuple(HeldReport(m.variables[s.variable], s, updates) for s in m.shards_on(server_id)))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def before(clock: FakeClock) -> CoordinatorState:
    """A coordinator (generation 5) that placed a, b, c over s0 and s1, both acknowledged."""
    state = make_state(clock, generation=5)
    state.register_server("s0", "h:0", 0)
    state.register_server("s1", "h:1", 0)
    m = state.declare([var("a", 10), var("b", 20), var("c", 30)])
    for sid in ("s0", "s1"):
        state.mark_synced(sid, m.epoch)
    return state


def test_restart_recovers_the_map_from_reports_under_a_higher_epoch(before, clock):
    old = before.shard_map
    after = make_state(clock, generation=6)
    assert after.register_server("s0", "h:0", 0, report_of(before, "s0")) == {}
    assert after.register_server("s1", "h:1", 0, report_of(before, "s1")) == {}
    recovered = after.shard_map
    assert recovered.epoch > old.epoch
    assert recovered.variables == old.variables and recovered.shards == old.shards
    # declaring again, in another order, changes nothing
    again = after.declare([var("c", 30), var("a", 10), var("b", 20)])
    assert again.shards == old.shards and again.epoch == recovered.epoch


def test_new_variables_wait_for_every_server_of_the_recovered_map(before, clock):
    after = make_state(clock, generation=6)
    after.register_server("s0", "h:0", 0, report_of(before, "s0"))
    assert after.awaiting() == ["s1"]
    after.declare([var("a", 10), var("b", 20)])  # known variables: fine meanwhile
    with pytest.raises(NotReady) as caught:
        after.declare([var("new", 5)])  # s1 might hold it
    assert "s1" in caught.value.message
    after.register_server("s1", "h:1", 0, report_of(before, "s1"))
    assert after.awaiting() == []
    assert "new" in after.declare([var("new", 5)]).variables


def test_epochs_and_incarnations_only_go_up_across_generations(before):
    assert before.shard_map.epoch >= first_number(5)
    assert first_number(6) > before.shard_map.epoch
    older, newer = Incarnations(5), Incarnations(6)
    assert max(older() for _ in range(1000)) < newer()


def test_a_server_back_without_acknowledged_shards_is_a_data_loss(before, clock):
    lost = before.register_server("s1", "h:1", 0)  # restarted empty
    assert lost and list(lost) == ["s1"]
    with pytest.raises(DataLost):
        before.check_no_data_loss()
    with pytest.raises(DataLost):
        before.declare([var("z", 3)])
    (s1,) = [m for m in before.servers() if m.server_id == "s1"]
    assert s1.state_losses == 1 and s1.loss_action == "failed the job"
    assert "s1" not in {m.server_id for m in before.unsynced(before.shard_map)}  # not re-created


def test_reinitializing_lost_shards_is_opt_in_and_counted(clock):
    state = make_state(clock, generation=5, reinitialize_lost=True)
    state.register_server("s0", "h:0", 0)
    m = state.declare([var("a", 10)])
    state.mark_synced("s0", m.epoch)
    assert state.register_server("s0", "h:0", 0) == {"s0": ["a[0:10]"]}
    state.check_no_data_loss()
    (s0,) = state.servers()
    assert s0.state_losses == 1 and s0.loss_action == "re-initialized"
    assert [u.server_id for u in state.unsynced(state.shard_map)] == ["s0"]


def test_a_shard_recovered_onto_a_server_that_registered_empty_is_lost(before, clock):
    after = make_state(clock, generation=6)
    after.register_server("s1", "h:1", 0)  # restarted empty, and first to register
    lost = after.register_server("s0", "h:0", 0, report_of(before, "s0"))
    assert set(lost) == {"s1"}
    with pytest.raises(DataLost):
        after.check_no_data_loss()


def test_trained_shards_stay_with_their_holder(before, clock):
    old = before.shard_map
    (shard,) = old.shards["a"]
    other = "s1" if shard.server_id == "s0" else "s0"
    wrong = dict(old.shards, a=(shard.__class__(shard.variable, shard.index, shard.row_start,
                                                 shard.row_stop, other),))
    stale_map = old.__class__(old.epoch - 1, old.servers, old.variables, wrong)
    after = make_state(clock, generation=6)
    after.register_server(other, f"h:{other[1]}", 0,
                          ServerReport(epoch=stale_map.epoch, last_map=stale_map))
    after.register_server(shard.server_id, "h", 0, report_of(before, shard.server_id))
    assert after.shard_map.shards["a"][0].server_id == shard.server_id


def test_watch_logs_a_loss_at_once_and_times_out_holders(before, clock):
    assert before.watch() == []
    clock.advance(TIMEOUT + 0.1)
    events = before.watch()
    assert sorted(e.kind for e in events) == ["down", "down"]
    assert before.watch() == []  # reported once
    before.server_heartbeat("s0", before.shard_map.epoch)
    assert [(e.kind, e.server_id) for e in before.watch()] == [("back", "s0")]
    clock.advance(SERVER_TIMEOUT)
    before.server_heartbeat("s0", before.shard_map.epoch)  # s0 stays
    timed_out = before.watch()
    assert [(e.kind, e.server_id) for e in timed_out] == [("timed_out", "s1")]
    with pytest.raises(DataLost) as caught:
        before.check_no_data_loss()
    assert "s1" in caught.value.message
    assert {m.server_id: state for m, state, _ in before.server_states()}["s1"] == "lost"


def test_awaited_servers_time_out_too(before, clock):
    after = make_state(clock, generation=6)
    after.register_server("s0", "h:0", 0, report_of(before, "s0"))
    clock.advance(SERVER_TIMEOUT + TIMEOUT)
    after.server_heartbeat("s0", 0)
    assert [(e.kind, e.server_id) for e in after.watch()] == [("timed_out", "s1")]


def test_registering_a_client_again_retires_its_previous_incarnation():
    retired = RetiredLog()
    clients = ClientRegistry(Incarnations(1), retired, capacity=2)
    first = clients.register("x")
    second = clients.register("x")
    assert second > first
    entries, through = retired.since(0)
    assert [(e.client_id, e.incarnation) for e in entries] == [("x", first)]
    clients.release("x", second)
    entries, through = retired.since(through)
    assert [(e.client_id, e.incarnation) for e in entries] == [("x", second)]
    assert retired.since(through) == ([], through)


def test_retired_log_is_bounded_and_a_lagging_cursor_skips_ahead():
    retired = RetiredLog(capacity=3)
    for i in range(5):
        retired.append(f"c{i}", 1)
    entries, through = retired.since(0)
    assert [e.client_id for e in entries] == ["c2", "c3", "c4"] and through == 5
    # a cursor from another coordinator generation starts over (retiring is idempotent)
    assert [e.client_id for e in retired.since(99)[0]] == ["c2", "c3", "c4"]
    entries, _ = retired.since(4)
    assert [e.client_id for e in entries] == ["c4"]


# ---- the store's side ----------------------------------------------------------------------

SPEC = VariableSpec("w", (8,), optimizer=SGD)


def shards(server: str = "s"):
    from ps_common.shardmap import Shard
    return [Shard("w", 0, 0, 8, server)]


def test_an_older_assignment_is_refused_not_ignored():
    store = ShardStore()
    store.assign(5, {"w": SPEC}, shards())
    with pytest.raises(StaleEpoch):
        store.assign(4, {"w": SPEC}, [])
    assert store.epoch == 5 and len(store.held()) == 1


def test_a_trained_shard_is_never_dropped_or_recreated():
    store = ShardStore()
    store.assign(1, {"w": SPEC}, shards())
    targets = store.plan_push(1, [("w", 0)], [TensorMeta("float32", (8,))])
    store.apply(targets, [np.ones(8, np.float32)])
    with pytest.raises(TrainedShardConflict):
        store.assign(2, {}, [])
    other = VariableSpec("w", (8,), optimizer=Component.of({"name": "sgd", "lr": 2.0}))
    with pytest.raises(TrainedShardConflict):
        store.assign(2, {"w": other}, shards())
    (held,) = store.held()
    np.testing.assert_array_equal(held.values, -np.ones(8, np.float32))
    assert store.epoch == 1


def test_an_untrained_shard_may_be_dropped():
    store = ShardStore()
    store.assign(1, {"w": SPEC}, shards())
    assert store.assign(2, {}, []).created == 0
    assert store.held() == [] and store.epoch == 2


def test_a_shard_that_cannot_be_allocated_does_not_block_the_others():
    store = ShardStore()
    huge = VariableSpec("huge", (2**47,), optimizer=SGD)
    from ps_common.shardmap import Shard
    outcome = store.assign(3, {"w": SPEC, "huge": huge},
                           shards() + [Shard("huge", 0, 0, 2**47, "s")])
    assert outcome.created == 1
    assert [s.variable for s, _ in outcome.failed] == ["huge"]
    assert store.epoch == 3 and [h.spec.name for h in store.held()] == ["w"]


# ---- what a restart must not take for a loss, or wait for forever ---------------------------

def test_no_new_variable_is_placed_during_the_recovery_grace(clock):
    state = make_state(clock, generation=6, recovery_grace_s=3.0)
    state.register_server("fresh", "h:9", 0)  # a new server, first to register
    with pytest.raises(NotReady):
        state.declare([var("a", 10)])  # an old server holding "a" may not have reported yet
    clock.advance(3.0)
    assert "a" in state.declare([var("a", 10)]).variables


def test_a_declaration_cut_short_by_a_crash_is_no_data_loss(clock):
    before = make_state(clock, generation=5)
    before.register_server("s0", "h:0", 0)
    before.register_server("s1", "h:1", 0)
    m = before.declare([var("big", 10)])
    holder = m.shards["big"][0].server_id
    other = "s1" if holder == "s0" else "s0"
    before.mark_synced(other, m.epoch)  # the coordinator died before the holder got the map
    after = make_state(clock, generation=6)
    # The holder lives on (it registered before): it never had "big", nothing is lost.
    assert after.register_server(holder, "h", 0, ServerReport(generation=5)) == {}
    assert after.register_server(other, "h", 0, report_of(before, other)) == {}
    after.check_no_data_loss()


def test_a_registration_racing_an_assignment_is_no_data_loss(clock):
    state = make_state(clock, generation=5)
    state.register_server("s0", "h:0", 0)
    m = state.declare([var("a", 10)])
    state.mark_synced("s0", m.epoch)
    # A report built before the assignment, processed after its acknowledgement: the same
    # process (it registered with this generation) cannot have lost anything.
    assert state.register_server("s0", "h:0", 0, ServerReport(generation=5)) == {}
    state.check_no_data_loss()


def test_servers_holding_nothing_are_not_awaited_and_are_forgotten(clock):
    before = make_state(clock, generation=5)
    for sid in ("s0", "spare"):
        before.register_server(sid, f"h:{sid}", 0)
    before.declare([var("a", 10)])  # placed on one of them
    holder = before.shard_map.shards["a"][0].server_id
    spare = "spare" if holder == "s0" else "s0"
    after = make_state(clock, generation=6)
    after.register_server(holder, "h", 0, report_of(before, holder))
    assert after.awaiting() == []  # the spare held nothing
    assert "b" in after.declare([var("b", 3)]).variables
    after.register_server(spare, "h:spare", 0)  # registers, holds nothing, then dies
    for _ in range(4):
        clock.advance((TIMEOUT + SERVER_TIMEOUT) / 3)
        after.server_heartbeat(holder, after.shard_map.epoch, after.generation)
        after.watch()
    assert {m.server_id for m in after.servers()} == {holder}
    assert spare not in after.shard_map.servers
    after.check_no_data_loss()


def test_creation_failures_are_kept_per_variable():
    clock = FakeClock()
    state = make_state(clock, generation=1)
    state.register_server("s0", "h:0", 0)
    _, added = state.declare_new([var("x", 4), var("y", 4)])
    assert sorted(added) == ["x", "y"]
    state.record_creation_failure("x", "server s0: out of memory")
    assert state.creation_failures(["y"]) == {}
    assert state.creation_failures(added) == {"x": "server s0: out of memory"}
    assert state.declare_new([var("x", 4)]) == (state.shard_map, [])


def test_incarnations_stay_above_a_reported_generation():
    incarnations = Incarnations(5)
    incarnations.raise_floor(9)
    assert incarnations() > first_number(9)
