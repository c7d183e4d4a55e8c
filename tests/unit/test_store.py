"""ShardStore.assign under repeated delivery (the coordinator resends an assignment while a
large shard is still being initialized)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ps_server.store as store_module
from ps_common.errors import NotReady, UnknownVariable
from ps_common.shardmap import Component, Shard, ShardMap, VariableSpec
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


def test_a_shard_the_last_map_places_on_another_server_here_is_not_ready_not_unknown():
    """A server started under another id at a lost server's address is asked for that
    server's shards: it answers UNAVAILABLE naming both, so that clients wait and refresh
    their map. A shard of a server at another address (a misrouted request) and a variable
    no map places anywhere are refused as before."""
    store = ShardStore()
    store.server_id, store.address = "ps-other", "h:1"
    store.last_map = lambda: ShardMap(
        7, {"ps-0": "h:1", "ps-1": "h:2"}, {"w": SPEC},
        {"w": (Shard("w", 0, 0, 4, "ps-0"), Shard("w", 1, 4, 8, "ps-1"))})
    store.assign(7, {"w": SPEC}, [])
    with pytest.raises(NotReady) as moved:
        store.lookup([("w", 0)])
    assert "ps-other" in moved.value.message and "'w' shard 0 is on ps-0" in moved.value.message
    with pytest.raises(UnknownVariable):
        store.lookup([("w", 1)])
    with pytest.raises(UnknownVariable):
        store.lookup([("nobody", 0)])
