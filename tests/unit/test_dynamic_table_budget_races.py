"""Two uncapped dynamic tables on one server growing at once: each growth runs under its own
shard's lock, and an admitted growth holds its room in the memory budget until its arrays
are made, so a second one checked meanwhile is refused when the budget has room for one, and
admitted when it has room for both (the first is never counted twice). A growth that fails
leaves its pool as it was. The interleavings are forced by wrapping the first table's
admission or its slots."""

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


def held_by_pools(store: ShardStore) -> int:
    """What the server counts against its budget for its tables: each pool with its
    bookkeeping (DynamicRows.nbytes)."""
    return sum(held.dynamic.nbytes for held in store.held())


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
    store.memory_budget = held_by_pools(store) + growth
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
        settle = admit(nbytes)  # a's growth is admitted, and not made yet
        admitted.set()
        b_done.wait(WAIT_S)
        return settle

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


def budget_for_both():
    """Two full tables, and a budget with room for both growing (one after the other)."""
    store = two_full_tables()
    a, b = store.lookup([("a", 0), ("b", 0)])
    growth = MIN_POOL_ROWS * (a.dynamic.row_bytes + ROW_OVERHEAD_BYTES)
    store.memory_budget = held_by_pools(store) + 2 * growth
    return store, a, b


def test_both_growths_fit_one_after_the_other():
    store, a, b = budget_for_both()
    push_rows(store, ("a", 0), NEW_IDS)
    push_rows(store, ("b", 0), NEW_IDS)
    assert len(a.values) == len(b.values) == 2 * MIN_POOL_ROWS


class SlotsThatLetBIn(dict):
    """a's slots: when a's growth reads them to make their grown copies (admitted, not yet
    installed), b's push runs, as another thread's would in the middle of a's growth."""

    def __init__(self, slots, run_b):
        super().__init__(slots)
        self.run_b = run_b

    def items(self):
        self.run_b()
        return super().items()


def test_a_growth_half_made_is_not_counted_twice():
    store, a, b = budget_for_both()
    outcome: dict[str, object] = {}

    def run_b():
        if "b" in outcome or not store._growing:
            return  # only once, and only in the middle of a's growth
        try:
            push_rows(store, ("b", 0), NEW_IDS)
            outcome["b"] = "applied"
        except ResourceExhausted as error:
            outcome["b"] = error

    a.dynamic.slots = SlotsThatLetBIn(a.dynamic.slots, run_b)
    push_rows(store, ("a", 0), NEW_IDS)
    assert len(a.values) == 2 * MIN_POOL_ROWS
    assert "b" in outcome, "the hook did not run in the middle of a's growth"
    assert outcome["b"] == "applied", (
        f"b's growth, which fits beside a's, was refused while a's was being made: "
        f"{outcome['b']}")
    assert held_by_pools(store) <= store.memory_budget


class SlotsOutOfMemory(dict):
    """a's slots: making their grown copies fails (np.empty raising MemoryError), after a's
    grown values array was made."""

    def items(self):
        raise MemoryError("injected: no memory for the grown slots")


def test_a_growth_that_fails_after_admission_leaves_the_pool_usable():
    store, a, b = budget_for_both()
    a.dynamic.slots = SlotsOutOfMemory(a.dynamic.slots)
    with pytest.raises(MemoryError):
        push_rows(store, ("a", 0), NEW_IDS)
    a.dynamic.slots = dict(a.dynamic.slots)  # memory is back
    assert store._growing == 0  # the admission's room was given back
    pool = a.dynamic
    assert {len(pool.values)} == {len(s) for s in pool.slots.values()}, (
        f"the failed growth left a half-grown pool: {len(pool.values)} rows of values, "
        f"{sorted({len(s) for s in pool.slots.values()})} rows of slots")
    push_rows(store, ("a", 0), NEW_IDS)  # the same growth, now that it fits
    assert len(a.values) == 2 * MIN_POOL_ROWS
