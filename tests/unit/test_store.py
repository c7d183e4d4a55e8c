"""ShardStore.assign under repeated delivery (the coordinator resends an assignment while a
large shard is still being initialized)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ps_server.store as store_module
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import to_wire
from ps_server.store import GatheredRows, ShardStore

SPEC = VariableSpec("w", (8, 4), initializer=Component.of("zeros"),
                    optimizer=Component.of({"name": "sgd", "lr": 1.0}))
SHARDS = [Shard("w", 0, 0, 4, "s"), Shard("w", 1, 4, 8, "s")]


def test_a_repeated_assignment_during_initialization_creates_nothing_twice(monkeypatch):
    second_started = threading.Event()
    real_initialize = store_module.initialize_rows

    def slow_initialize(spec, start, stop, out=None):
        second_started.wait(timeout=2.0)  # let the duplicate delivery arrive meanwhile
        return real_initialize(spec, start, stop, out)

    monkeypatch.setattr(store_module, "initialize_rows", slow_initialize)
    store = ShardStore()
    created = []
    first = threading.Thread(target=lambda: created.append(store.assign(1, {"w": SPEC}, SHARDS).created),
                             name="assign-first")
    first.start()

    def second():
        second_started.set()
        created.append(store.assign(1, {"w": SPEC}, SHARDS).created)

    duplicate = threading.Thread(target=second, name="assign-duplicate")
    duplicate.start()
    first.join(10)
    duplicate.join(10)
    assert sorted(created) == [0, 2]


def test_an_applied_push_survives_a_repeated_assignment():
    store = ShardStore()
    store.assign(1, {"w": SPEC}, SHARDS)
    targets = store.plan_push(1, [("w", 0)], [store_module.TensorMeta("float32", (4, 4))])
    store.apply(targets, [np.ones((4, 4), np.float32)])
    assert store.assign(1, {"w": SPEC}, SHARDS).created == 0
    (held,) = store.lookup([("w", 0)])
    np.testing.assert_array_equal(held.values, -np.ones((4, 4), np.float32))


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_gathered_rows_read_in_any_pieces_are_the_rows_in_the_requests_order(wire):
    distinct = np.arange(12, dtype=np.float32).reshape(4, 3)
    order = np.array([2, 0, 2, 3, 1, 2, 0])
    rows = GatheredRows(distinct, order)
    expected = to_wire(distinct[order], wire).tobytes()
    assert to_wire(rows.whole(), wire).tobytes() == expected
    read = rows.reader(wire)
    for piece in (1, 5, 7, 12, len(expected)):  # pieces that cut rows and elements
        got = b"".join(bytes(read(offset, min(piece, len(expected) - offset)))
                       for offset in range(0, len(expected), piece))
        assert got == expected, piece
