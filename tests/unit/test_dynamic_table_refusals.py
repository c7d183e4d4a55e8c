"""Dynamic tables under refused requests: a push the memory budget refuses evicts no trained
row, of its own table or of another one it names, and ids that hash to another shard are
refused as a fixed table refuses them."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import InvalidArgument, ResourceExhausted
from ps_common.shardmap import Component, Shard, VariableSpec, owners_of
from ps_common.tensors import TensorMeta
from ps_server.dynamic_rows import DynamicRows
from ps_server.store import ShardStore

DIM = 4
SGD1 = Component.of({"name": "sgd", "lr": 1.0})


def table_spec(name: str, capacity: int = 0) -> VariableSpec:
    return VariableSpec(name, (0, DIM), kind="embedding", capacity=capacity,
                        initializer=Component.of("zeros"), optimizer=SGD1)


def push_rows(store: ShardStore, refs_and_ids: list[tuple[tuple[str, int], np.ndarray]]):
    refs = [ref for ref, _ in refs_and_ids]
    ids = [np.asarray(i, np.int64) for _, i in refs_and_ids]
    metas = [TensorMeta("float32", (len(i), DIM)) for i in ids]
    targets = store.plan_push(store.epoch, refs, metas, ids)
    grads = [np.ones((len(i), DIM), np.float32) for i in ids]
    store.apply(targets, grads, rows=store.sum_rows(targets, grads, ids))


def held_ids(rows: DynamicRows, ids) -> np.ndarray:
    return rows.find(np.asarray(ids, np.int64)) >= 0


def test_a_growth_the_budget_refuses_evicts_nothing():
    refused = []

    def admit(nbytes: int) -> None:
        if refused:
            raise ResourceExhausted("no room")

    rows = DynamicRows(DIM, "float32", capacity=100, ttl_s=0.0,
                       make_rows=lambda ids: np.zeros((len(ids), DIM), np.float32),
                       make_slots=lambda n: {}, clock=lambda: 0.0, admit=admit)
    rows.locate(np.arange(64, dtype=np.int64))  # the pool's first 64 rows, all held
    refused.append(True)
    # 50 new ids: 14 rows over the capacity are evicted, and the pool must grow for the rest.
    with pytest.raises(ResourceExhausted):
        rows.locate(np.arange(1000, 1050, dtype=np.int64))
    assert held_ids(rows, range(64)).all() and rows.evictions == 0 and rows.rows_held == 64


def test_a_push_refused_room_in_one_table_leaves_the_other_tables_rows():
    store = ShardStore()
    store.assign(1, {"a": table_spec("a", capacity=64), "b": table_spec("b")},
                 [Shard("a", 0, 0, 0, "s", 1), Shard("b", 0, 0, 0, "s", 1)])
    push_rows(store, [(("a", 0), np.arange(64))])  # a is full of trained rows
    a, b = store.lookup([("a", 0), ("b", 0)])
    before = a.values.copy()
    store.memory_budget = store.nbytes()  # b's pool cannot grow
    with pytest.raises(ResourceExhausted):
        push_rows(store, [(("a", 0), np.arange(500, 510)), (("b", 0), np.arange(10))])
    assert held_ids(a.dynamic, range(64)).all() and a.dynamic.evictions == 0
    np.testing.assert_array_equal(a.values, before)
    assert b.dynamic.rows_held == 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_ids_of_another_shard_are_refused_on_push_and_pull(dynamic):
    spec = table_spec("t") if dynamic else VariableSpec(
        "t", (64, DIM), kind="embedding", initializer=Component.of("zeros"), optimizer=SGD1)
    rows = spec.shape[0]
    store = ShardStore()
    store.assign(1, {"t": spec}, [Shard("t", 0, 0, rows, "s", 2), Shard("t", 1, 1, rows, "s", 2)])
    ids = np.arange(64, dtype=np.int64)
    foreign = ids[owners_of(spec, ids, 2) == 1][:4]  # shard 1's
    with pytest.raises(InvalidArgument, match="belong to other shards"):
        store.plan_push(1, [("t", 0)], [TensorMeta("float32", (len(foreign), DIM))], [foreign])
    with pytest.raises(InvalidArgument, match="belong to other shards"):
        store.plan_pull(1, [("t", 0)], None, [foreign])
    (held,) = store.lookup([("t", 0)])
    assert held.dynamic is None or held.dynamic.rows_held == 0


def test_rows_past_their_ttl_make_room_before_the_pool_is_grown():
    now = [0.0]

    def admit(nbytes: int) -> None:
        raise ResourceExhausted("no room")  # the pool may not grow at all

    rows = DynamicRows(DIM, "float32", capacity=0, ttl_s=10.0,
                       make_rows=lambda ids: np.zeros((len(ids), DIM), np.float32),
                       make_slots=lambda n: {}, clock=lambda: now[0], admit=None)
    rows.locate(np.arange(64, dtype=np.int64))  # the whole first pool
    rows._admit = admit
    now[0] = 100.0  # every row is past its ttl
    rows.reserve(np.arange(1000, 1064, dtype=np.int64))  # their room, no growth
    assert rows.rows_held == 0 and len(rows.values) == 64
