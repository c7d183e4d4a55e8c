"""ShardStore.assign and pushes planned at the epoch it replaces. It checks that no shard it
drops holds trained values, makes the new shards outside the store lock (pulls and pushes go
on meanwhile), and checks again under the dropped shards' locks before it swaps: a push
applied meanwhile makes it refuse (TrainedShardConflict), and a push that comes after the
swap is refused as stale, never applied to values no longer held. The interleavings are
forced with events."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ps_server.store as store_module
from ps_common.errors import PSError, StaleEpoch, TrainedShardConflict
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.store import ShardStore

WAIT_S = 10.0


def _spec(name: str) -> VariableSpec:
    return VariableSpec(name, (4,), initializer=Component.of("zeros"),
                        optimizer=Component.of({"name": "sgd", "lr": 1.0}))


def test_a_push_applied_while_an_assignment_drops_its_shard_is_not_lost(monkeypatch):
    store = ShardStore()
    w, v = _spec("w"), _spec("v")
    store.assign(1, {"w": w}, [Shard("w", 0, 0, 4, "s")])
    targets = store.plan_push(1, [("w", 0)], [TensorMeta("float32", (4,))])

    initializing, pushed = threading.Event(), threading.Event()
    real_initialize = store_module.initialize_rows

    def slow_initialize(spec, start, stop, out=None):
        if spec.name == "v":  # the new shard: its initialization takes a while
            initializing.set()
            assert pushed.wait(WAIT_S)
        return real_initialize(spec, start, stop, out=out)

    monkeypatch.setattr(store_module, "initialize_rows", slow_initialize)
    outcome: list = []

    def assign():
        try:
            outcome.append(store.assign(2, {"v": v}, [Shard("v", 0, 0, 4, "s")]))
        except PSError as error:
            outcome.append(error)

    assigner = threading.Thread(target=assign, name="assign-epoch-2")
    assigner.start()
    try:
        assert initializing.wait(WAIT_S)
        # The push was checked at epoch 1 and is applied now, while "w" is still held.
        store.apply(targets, [np.ones(4, np.float32)])
        pushed.set()
    finally:
        pushed.set()
        assigner.join(WAIT_S)
    assert not assigner.is_alive()

    (held,) = targets
    assert held.updates == 1  # the push was applied (and would be acknowledged)
    # Either the assignment is refused (the shard it drops is trained now), or the shard
    # and its update are still here.
    if isinstance(outcome[0], TrainedShardConflict):
        return
    assert ("w", 0) in {h.key for h in store.held()}, (
        f"the assignment ({outcome[0]}) dropped shard w/0 after a push was applied to it "
        f"({held.updates} update): the acknowledged update is lost")


def test_a_push_planned_before_an_assignment_dropped_its_shard_is_refused_as_stale():
    store = ShardStore()
    store.assign(3, {"w": _spec("w")}, [Shard("w", 0, 0, 4, "s")])
    targets = store.plan_push(3, [("w", 0)], [TensorMeta("float32", (4,))])
    store.assign(5, {"v": _spec("v")}, [Shard("v", 0, 0, 4, "s")])
    with pytest.raises(StaleEpoch) as refused:
        store.apply(targets, [np.ones(4, np.float32)])
    assert (refused.value.request_epoch, refused.value.current_epoch) == (3, 5)
    assert targets[0].updates == 0  # not applied: the client retries on the new map
