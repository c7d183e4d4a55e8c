"""Placement (one pure function) and the coordinator's cluster state, with a fake clock."""

from __future__ import annotations

import math

import pytest

from ps_common.clock import FakeClock
from ps_common.errors import InvalidArgument, NotReady, ResourceExhausted, SpecConflict
from ps_common.shardmap import EMPTY_MAP, Component, ShardMap, VariableSpec
from ps_common.wire import shardmap_from_proto, shardmap_to_proto
from ps_server.coordinator.placement import Candidate, footprint, place, server_loads
from ps_server.coordinator.state import CoordinatorState

SGD = Component.of({"name": "sgd", "lr": 0.1})
ADAM = Component.of({"name": "adam"})


def var(name: str, rows: int, cols: int = 1, optimizer: Component = SGD) -> VariableSpec:
    shape = (rows,) if cols == 1 else (rows, cols)
    return VariableSpec(name, shape, optimizer=optimizer)


def cands(n: int, budget: int = 0) -> list[Candidate]:
    return [Candidate(f"s{i}", f"127.0.0.1:{7000 + i}", budget) for i in range(n)]


def check_map_invariants(m: ShardMap) -> None:
    for name, spec in m.variables.items():
        shards = m.shards[name]
        assert [s.index for s in shards] == list(range(len(shards)))
        assert shards[0].row_start == 0 and shards[-1].row_stop == spec.rows
        for a, b in zip(shards, shards[1:]):
            assert a.row_stop == b.row_start
        assert all(s.row_start < s.row_stop for s in shards)
        assert all(s.variable == name for s in shards)
        assert len({s.server_id for s in shards}) == len(shards)  # distinct servers
        assert all(s.server_id in m.servers for s in shards)


# ---- placement ----------------------------------------------------------------------------

def test_no_candidates_is_not_ready():
    with pytest.raises(NotReady) as info:
        place(EMPTY_MAP, [var("a", 10)], [], split_threshold_bytes=1 << 20)
    assert info.value.code == "UNAVAILABLE"


def test_small_variables_are_balanced_by_footprint():
    specs = [var(f"v{i}", 100) for i in range(6)]  # 400 bytes each
    m = place(EMPTY_MAP, specs, cands(3), split_threshold_bytes=1 << 20)
    check_map_invariants(m)
    assert all(len(m.shards[s.name]) == 1 for s in specs)
    assert sorted(server_loads(m).values()) == [800, 800, 800]
    assert m.epoch == 1
    assert m.servers == {c.server_id: c.address for c in cands(3)}


def test_footprint_counts_optimizer_slots():
    big_adam = var("adam", 100, optimizer=ADAM)  # 400 bytes of values, 1200 with m and v
    assert footprint(big_adam, 100) == 1200
    assert footprint(var("x", 100), 100) == 400
    assert footprint(var("m", 100, optimizer=Component("momentum")), 50) == 400
    specs = [big_adam, var("y", 100), var("z", 100), var("w", 100)]
    m = place(EMPTY_MAP, specs, cands(2), split_threshold_bytes=1 << 20)
    where = {name: shards[0].server_id for name, shards in m.shards.items()}
    assert where["adam"] == "s0"
    # by bytes alone y would go to s1 and z back to s0; by footprint all three go to s1
    assert where["y"] == where["z"] == where["w"] == "s1"
    assert server_loads(m) == {"s0": 1200, "s1": 1200}


def test_placement_accounts_for_existing_load():
    first = place(EMPTY_MAP, [var("a", 1000)], cands(2), split_threshold_bytes=1 << 20)
    second = place(first, [var("b", 10), var("c", 10)], cands(2), split_threshold_bytes=1 << 20)
    assert second.shards["a"] == first.shards["a"]
    other = "s1" if first.shards["a"][0].server_id == "s0" else "s0"
    assert second.shards["b"][0].server_id == other
    assert second.shards["c"][0].server_id == other
    assert second.epoch == first.epoch + 1
    # `place` is pure: the input map is unchanged
    assert set(first.variables) == {"a"} and first.epoch == 1


@pytest.mark.parametrize(
    "servers, rows, cols, threshold",
    [
        (4, 1000, 10, 4000),      # 40000 bytes / 4000 = 10 parts -> 4 servers
        (4, 1000, 10, 16000),     # ceil(2.5) = 3 parts
        (8, 3, 1000, 100),        # 3 rows -> 3 parts
        (5, 1001, 7, 28028 // 2),  # exactly 2 parts
        (3, 10, 1, 39),           # 40 bytes, just over -> 2 parts
    ],
)
def test_large_variable_is_split_over_distinct_servers(servers, rows, cols, threshold):
    spec = var("big", rows, cols)
    m = place(EMPTY_MAP, [spec], cands(servers), split_threshold_bytes=threshold)
    check_map_invariants(m)
    expected_parts = min(servers, rows, math.ceil(spec.nbytes / threshold))
    shards = m.shards["big"]
    assert len(shards) == expected_parts
    sizes = [s.row_stop - s.row_start for s in shards]
    assert max(sizes) - min(sizes) <= 1  # near-equal


def test_variable_at_the_threshold_is_not_split():
    spec = var("edge", 100, 10)  # 4000 bytes
    m = place(EMPTY_MAP, [spec], cands(4), split_threshold_bytes=4000)
    assert len(m.shards["edge"]) == 1


def test_split_shards_go_to_least_loaded_servers_first():
    existing = place(EMPTY_MAP, [var("a", 100), var("b", 50)], cands(3),
                     split_threshold_bytes=1 << 20)
    loads = server_loads(existing)
    empty = [c.server_id for c in cands(3) if c.server_id not in loads]
    assert len(empty) == 1
    m = place(existing, [var("big", 100, 10)], cands(3), split_threshold_bytes=2000)
    shards = m.shards["big"]
    assert len(shards) == 2
    assert shards[0].server_id == empty[0]


def test_memory_budget_is_respected():
    # s0 can hold 500 bytes, s1 is unlimited: a 400-byte variable fits s0 once.
    candidates = [Candidate("s0", "a:1", 500), Candidate("s1", "a:2", 0)]
    m = place(EMPTY_MAP, [var("a", 100), var("b", 100), var("c", 100)], candidates,
              split_threshold_bytes=1 << 20)
    loads = server_loads(m)
    assert loads["s0"] <= 500
    assert loads == {"s0": 400, "s1": 800}


def test_budget_counts_optimizer_slots():
    candidates = [Candidate("s0", "a:1", 1000), Candidate("s1", "a:2", 1000)]
    with pytest.raises(ResourceExhausted) as info:
        place(EMPTY_MAP, [var("adam", 100, optimizer=ADAM)], candidates,
              split_threshold_bytes=1 << 20)  # 400 bytes of values, 1200 with slots
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert "adam" in info.value.message


def test_resource_exhausted_when_nothing_fits():
    candidates = [Candidate("s0", "a:1", 300), Candidate("s1", "a:2", 300)]
    with pytest.raises(ResourceExhausted):
        place(EMPTY_MAP, [var("a", 100)], candidates, split_threshold_bytes=1 << 20)
    full = place(EMPTY_MAP, [var("x", 75), var("y", 75)], candidates,
                 split_threshold_bytes=1 << 20)
    with pytest.raises(ResourceExhausted):
        place(full, [var("z", 1)], candidates, split_threshold_bytes=1 << 20)


def test_split_variable_fits_where_whole_one_would_not():
    candidates = [Candidate(f"s{i}", f"a:{i}", 1000) for i in range(3)]
    spec = var("big", 600)  # 2400 bytes: no server could hold it whole
    m = place(EMPTY_MAP, [spec], candidates, split_threshold_bytes=800)
    check_map_invariants(m)
    assert len(m.shards["big"]) == 3
    assert all(load <= 1000 for load in server_loads(m).values())


# ---- coordinator state --------------------------------------------------------------------

TIMEOUT = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> CoordinatorState:
    return CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20)


def test_declare_without_live_servers_is_not_ready(state: CoordinatorState, clock: FakeClock):
    with pytest.raises(NotReady):
        state.declare([var("a", 10)])
    state.register_server("s0", "h:1", 0)
    clock.advance(TIMEOUT + 0.001)
    with pytest.raises(NotReady):
        state.declare([var("a", 10)])
    assert state.shard_map.epoch == 0


def test_declare_same_spec_twice_is_a_no_op(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    state.register_server("s1", "h:2", 0)
    first = state.declare([var("a", 10), var("b", 20)])
    assert first.epoch == 1
    again = state.declare([var("a", 10)])
    assert again == first and again.epoch == 1
    both = state.declare([var("b", 20), var("a", 10), var("a", 10)])
    assert both == first
    assert state.shard_map.epoch == 1


def test_declaring_a_new_variable_moves_the_epoch(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    first = state.declare([var("a", 10)])
    second = state.declare([var("a", 10), var("b", 10)])
    assert second.epoch == first.epoch + 1
    assert set(second.variables) == {"a", "b"}
    assert second.shards["a"] == first.shards["a"]


def test_conflicting_spec_names_both(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    original = VariableSpec("emb", (100, 8), initializer=Component("uniform"), seed=1)
    state.declare([original])
    changed = VariableSpec("emb", (100, 16), initializer=Component("uniform"), seed=1)
    with pytest.raises(SpecConflict) as info:
        state.declare([changed])
    assert info.value.code == "FAILED_PRECONDITION"
    assert original.describe() in info.value.message
    assert changed.describe() in info.value.message
    assert state.shard_map.epoch == 1
    assert state.shard_map.variables["emb"] == original


def test_conflicting_specs_within_one_request(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    a = var("w", 10)
    b = VariableSpec("w", (10,), optimizer=Component.of({"name": "sgd", "lr": 0.2}))
    with pytest.raises(SpecConflict) as info:
        state.declare([a, b])
    assert a.describe() in info.value.message and b.describe() in info.value.message
    assert state.shard_map.epoch == 0


def test_conflict_leaves_the_other_variables_undeclared(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    state.declare([var("a", 10)])
    with pytest.raises(SpecConflict):
        state.declare([var("new", 10), var("a", 11)])
    assert set(state.shard_map.variables) == {"a"}


def test_declare_validates_components(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    with pytest.raises(InvalidArgument):
        state.declare([VariableSpec("x", (3,), optimizer=Component("nope"))])
    with pytest.raises(InvalidArgument):
        state.declare([VariableSpec("x", (3,), initializer=Component("nope"))])
    assert state.shard_map.epoch == 0


def test_expired_server_is_not_a_candidate(state: CoordinatorState, clock: FakeClock):
    state.register_server("old", "h:1", 0)
    clock.advance(TIMEOUT / 2)
    state.register_server("new", "h:2", 0)
    clock.advance(TIMEOUT / 2 + 0.001)  # old's lease is over, new's is not
    assert [m.server_id for m in state.live_servers()] == ["new"]
    m = state.declare([var(f"v{i}", 10) for i in range(4)])
    assert {s.server_id for shards in m.shards.values() for s in shards} == {"new"}
    # a heartbeat renews the lease (and, behind the map, asks for a resync)
    assert state.server_heartbeat("old", 0) == (True, True)
    assert {s.server_id for s in state.live_servers()} == {"old", "new"}
    clock.advance(TIMEOUT - 0.001)
    assert {s.server_id for s in state.live_servers()} == {"old"}


def test_lease_ends_exactly_at_timeout(state: CoordinatorState, clock: FakeClock):
    state.register_server("s0", "h:1", 0)
    clock.advance(TIMEOUT - 0.5)
    assert len(state.live_servers()) == 1
    clock.advance(0.5)
    assert state.live_servers() == []
    assert [m.server_id for m in state.servers()] == ["s0"]  # still known, just not live


def test_heartbeat_from_unknown_server(state: CoordinatorState):
    assert state.server_heartbeat("ghost", 3) == (False, False)


def test_heartbeat_with_old_epoch_needs_sync(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    m = state.declare([var("a", 10)])
    state.register_server("idle", "h:2", 0)  # registered after placement: holds nothing
    assert state.server_heartbeat("s0", m.epoch - 1) == (True, True)
    assert state.server_heartbeat("s0", m.epoch) == (True, False)
    # every server gets the whole map (a restarted coordinator recovers it from any)
    assert state.server_heartbeat("idle", 0) == (True, True)
    assert state.server_heartbeat("idle", m.epoch) == (True, False)


def test_reregistering_with_a_new_address_moves_the_epoch(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    state.register_server("s1", "h:2", 0)
    m = state.declare([var("a", 10), var("b", 10)])
    state.register_server("s0", "h:1", 0)  # same address: no change to the map
    assert state.shard_map.epoch == m.epoch
    state.register_server("s0", "h:9", 0)
    after = state.shard_map
    assert after.epoch == m.epoch + 1
    assert after.servers["s0"] == "h:9"
    assert after.servers["s1"] == "h:2"
    assert after.shards == m.shards
    assert {s.server_id: s.address for s in state.servers()}["s0"] == "h:9"
    # holders that have not seen the new epoch are told to sync
    holders = {s.server_id for shards in after.shards.values() for s in shards}
    for sid in holders:
        assert state.server_heartbeat(sid, m.epoch) == (True, True)


def test_unsynced_and_mark_synced(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    state.register_server("s1", "h:2", 0)
    state.register_server("s2", "h:3", 0)
    m = state.declare([var("a", 10), var("b", 10)])
    everyone = {"s0", "s1", "s2"}
    assert {s.server_id for s in state.unsynced(m)} == everyone
    first = "s0"
    state.mark_synced(first, m.epoch)
    assert {s.server_id for s in state.unsynced(m)} == everyone - {first}
    state.mark_synced(first, m.epoch - 1)  # an older acknowledgement does not undo it
    assert first not in {s.server_id for s in state.unsynced(m)}
    for sid in everyone:
        state.mark_synced(sid, m.epoch)
    assert state.unsynced(m) == []
    state.mark_synced("ghost", 5)  # unknown servers are ignored
    # a new epoch makes everyone unsynced again
    m2 = state.declare([var("c", 10)])
    assert {s.server_id for s in state.unsynced(m2)} == everyone


def test_server_restarted_before_it_acknowledged_is_simply_resynced(state: CoordinatorState):
    state.register_server("s0", "h:1", 0)
    m = state.declare([var("a", 10)])
    assert state.register_server("s0", "h:1", 0) == {}  # it never had "a": nothing lost
    assert [s.server_id for s in state.unsynced(m)] == ["s0"]


def test_budget_reaches_placement(state: CoordinatorState):
    # "a-small" sorts first among equally loaded servers, but its budget is too small
    state.register_server("a-small", "h:1", 100)
    state.register_server("b-large", "h:2", 0)
    m = state.declare([var("a", 50)])  # 200 bytes
    assert m.shards["a"][0].server_id == "b-large"
    m = state.declare([var("tiny", 25)])  # 100 bytes: fits the small one exactly
    assert m.shards["tiny"][0].server_id == "a-small"


def test_shard_map_survives_the_proto_round_trip():
    specs = [
        VariableSpec("emb", (10, 3), initializer=Component.of(
            {"name": "uniform", "minval": -1.0, "maxval": 1.0}),
            optimizer=Component.of({"name": "adam", "lr": 0.1, "beta1": 0.5}), seed=3),
        VariableSpec("bias", (100,), dtype="float16",
                     optimizer=Component.of({"name": "momentum", "nesterov": True})),
        var("small", 2),
    ]
    m = place(EMPTY_MAP, specs, cands(3), split_threshold_bytes=100)
    assert len(m.shards["emb"]) == 2 and len(m.shards["bias"]) == 2
    again = shardmap_from_proto(shardmap_to_proto(m))
    assert again == m
