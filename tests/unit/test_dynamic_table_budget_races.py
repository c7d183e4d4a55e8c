"""Two uncapped dynamic tables on one server growing at once: each growth runs under its own
shard's lock, and an admitted growth holds its room in the memory budget until its arrays
are made, so a second one checked meanwhile is refused when the budget has room for one.
The interleaving is forced by wrapping the first table's admission."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_common.errors import ResourceExhausted
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.dynamic_rows import MIN_POOL_ROWS, ROW_OVERHEAD_BYTES
from ps_server.store import ShardStore

DIM = 4
SGD = Component.of({"name": "sgd", "lr": 1.0})
WAIT_S = 10.0


def uncapped(name: str) -> VariableSpec:
    return VariableSpec(name, (0, DIM), kind="embedding", initializer=Component.of("zeros"),
                        optimizer=SGD)


def push_rows(store: ShardStore, ref: tuple[str, int], ids: np.ndarray) -> None:
    targets = store.plan_push(store.epoch, [ref], [TensorMeta("float32", (len(ids), DIM))],
                              [ids])
    grads = [np.ones((len(ids), DIM), np.float32)]
    store.apply(targets, grads, rows=store.sum_rows(targets, grads, [ids]))


def two_full_tables() -> ShardStore:
    """Tables a and b, each with its first pool (64 rows) full, and a budget with room for
    one more growth of one of them, not of both."""
    store = ShardStore()
    store.assign(1, {"a": uncapped("a"), "b": uncapped("b")},
                 [Shard("a", 0, 0, 0, "s", 1), Shard("b", 0, 0, 0, "s", 1)])
    push_rows(store, ("a", 0), np.arange(MIN_POOL_ROWS, dtype=np.int64))
    push_rows(store, ("b", 0), np.arange(MIN_POOL_ROWS, dtype=np.int64))
    a, _ = store.lookup([("a", 0), ("b", 0)])
    growth = MIN_POOL_ROWS * (a.dynamic.row_bytes + ROW_OVERHEAD_BYTES)  # doubling one pool
    store.memory_budget = store.nbytes() + growth
    return store


NEW_IDS = np.arange(1000, 1000 + MIN_POOL_ROWS, dtype=np.int64)  # each pool must double


def test_one_at_a_time_the_budget_takes_one_growth_and_refuses_the_other():
    store = two_full_tables()
    push_rows(store, ("a", 0), NEW_IDS)
    with pytest.raises(ResourceExhausted):
        push_rows(store, ("b", 0), NEW_IDS)


def test_two_tables_growing_at_once_are_not_both_admitted_past_the_budget():
    store = two_full_tables()
    budget = store.memory_budget
    a, b = store.lookup([("a", 0), ("b", 0)])
    admitted, b_done = threading.Event(), threading.Event()
    admit = a.dynamic._admit

    def admit_then_let_b_in(nbytes: int):
        grown = admit(nbytes)  # a's growth is admitted, and not made yet
        admitted.set()
        b_done.wait(WAIT_S)
        return grown

    a.dynamic._admit = admit_then_let_b_in
    outcomes: dict[str, object] = {}

    def push_a() -> None:
        try:
            push_rows(store, ("a", 0), NEW_IDS)
            outcomes["a"] = "applied"
        except ResourceExhausted as error:
            outcomes["a"] = error

    thread = threading.Thread(target=push_a, name="push-to-a")
    thread.start()
    try:
        assert admitted.wait(WAIT_S)
        try:
            push_rows(store, ("b", 0), NEW_IDS)  # b's growth, checked before a's is made
            outcomes["b"] = "applied"
        except ResourceExhausted as error:
            outcomes["b"] = error
    finally:
        b_done.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    # One growth fits the budget, two do not: one of the pushes must have been refused.
    refused = [name for name, outcome in outcomes.items()
               if isinstance(outcome, ResourceExhausted)]
    growth = MIN_POOL_ROWS * (a.dynamic.row_bytes + ROW_OVERHEAD_BYTES)
    assert refused, (f"both tables grew to {len(a.values)} and {len(b.values)} pool rows: "
                     f"two growths of {growth} bytes each admitted beside "
                     f"{budget - growth} bytes held, within a budget of {budget} bytes")
