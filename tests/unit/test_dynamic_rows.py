"""A dynamic table's shard (ps_server.dynamic_rows) on a fake clock: rows made on first use,
least-recently-used eviction at capacity, ttl expiry, growth, and adoption of a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_server.dynamic_rows import FREE, HELD_SLOT, IDS_SLOT, DynamicRows


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(capacity: int = 0, ttl_s: float = 0.0, clock=None) -> DynamicRows:
    # A row's initial value is its id, so tests can see which row is which.
    return DynamicRows(
        2, "float32", capacity=capacity, ttl_s=ttl_s,
        make_rows=lambda ids: np.repeat(ids[:, None], 2, axis=1).astype(np.float32),
        make_slots=lambda n: {"accumulator": np.full((n, 2), 0.5, np.float32)},
        clock=clock or Clock())


def ids(*values) -> np.ndarray:
    return np.array(values, np.int64)


def held_ids(t: DynamicRows) -> set[int]:
    return set(t.slots[IDS_SLOT][t.slots[HELD_SLOT] == 1].tolist())


def test_rows_are_made_once_with_their_initial_values_and_fresh_slots():
    t = table()
    rows = t.locate(ids(7, -3, 2**62))
    np.testing.assert_array_equal(t.values[rows][:, 0], [7, -3, 2**62])
    np.testing.assert_array_equal(t.slots["accumulator"][rows], 0.5)
    t.values[rows] += 1.0  # trained
    again = t.locate(ids(2**62, 7))
    np.testing.assert_array_equal(again, rows[[2, 0]])
    np.testing.assert_array_equal(t.values[again][:, 0], [2**62 + 1, 8])
    assert t.rows_held == 3 and t.evictions == 0
    np.testing.assert_array_equal(t.find(ids(7, 8)), [rows[0], FREE])


def test_growth_keeps_every_row_and_its_slots():
    t = table()
    first = t.locate(np.arange(10, dtype=np.int64))
    t.slots["accumulator"][first] = 9.0
    t.locate(np.arange(10, 1000, dtype=np.int64))
    assert t.rows_held == 1000 and len(t.values) >= 1000
    rows = t.locate(np.arange(10, dtype=np.int64))
    np.testing.assert_array_equal(t.values[rows][:, 0], np.arange(10))
    np.testing.assert_array_equal(t.slots["accumulator"][rows], 9.0)


def test_capacity_evicts_exactly_the_least_recently_used_rows():
    t = table(capacity=4)
    t.locate(ids(1, 2))
    t.locate(ids(3))
    t.locate(ids(4))
    t.locate(ids(1))  # 2 is now the oldest, then 3, then 4
    t.locate(ids(5, 6))
    assert held_ids(t) == {1, 4, 5, 6}
    assert t.evictions == 2 and len(t.values) <= 4
    t.locate(ids(3, 5))  # 3 is made again; the oldest other row is 4 (1 was used after it)
    assert held_ids(t) == {1, 3, 5, 6}


def test_a_request_never_evicts_its_own_rows_and_is_refused_past_capacity():
    t = table(capacity=3)
    t.locate(ids(1, 2, 3))
    t.locate(ids(1, 2, 9))  # evicts 3, not 1 or 2 (in the request) even though older
    assert held_ids(t) == {1, 2, 9}
    with pytest.raises(InvalidArgument, match="capacity"):
        t.locate(ids(1, 2, 3, 4))
    assert held_ids(t) == {1, 2, 9}


def test_rows_untouched_for_the_ttl_are_evicted():
    clock = Clock()
    t = table(ttl_s=10.0, clock=clock)
    t.locate(ids(1, 2))
    clock.now += 6
    t.locate(ids(2))
    clock.now += 6  # 1 untouched for 12 s, 2 for 6 s
    assert t.expire() == 1
    assert held_ids(t) == {2}
    clock.now += 11
    trained = t.locate(ids(3))
    t.values[trained] = 50.0
    assert held_ids(t) == {3}  # 2 expired on the way
    assert t.evictions == 2


def test_adopt_rebuilds_the_index_from_checkpointed_arrays():
    t = table(capacity=10)
    rows = t.locate(ids(4, 5, 6))
    t.values[rows] = [[40, 40], [50, 50], [60, 60]]
    t.locate(ids(4))
    values, slots = t.values.copy(), {k: v.copy() for k, v in t.slots.items()}

    restored = table(capacity=10)
    restored.adopt(values, slots)
    assert restored.rows_held == 3
    np.testing.assert_array_equal(restored.values[restored.locate(ids(6, 4))][:, 0], [60, 40])
    fresh = restored.locate(ids(7))  # a free row of the adopted pool is reused
    np.testing.assert_array_equal(restored.values[fresh][:, 0], [7])
    with pytest.raises(ValueError, match="repeat"):
        table().adopt(values, {**slots, IDS_SLOT: np.where(slots[IDS_SLOT] == 5, 4,
                                                           slots[IDS_SLOT])})


def test_every_int64_is_an_id_minus_one_included():
    """No id marks a free row: -1 is evicted, expired and restored like any other."""
    clock = Clock()
    t = table(capacity=2, ttl_s=10.0, clock=clock)
    t.locate(ids(-1))
    t.locate(ids(0))
    t.locate(ids(5))  # evicts -1, the least recently used
    assert held_ids(t) == {0, 5} and t.rows_held == 2
    t.locate(ids(-1))
    assert held_ids(t) == {5, -1}
    values, slots = t.values.copy(), {k: v.copy() for k, v in t.slots.items()}
    restored = table(capacity=2, clock=clock)
    restored.adopt(values, slots)
    assert held_ids(restored) == {5, -1}
    clock.now += 20
    assert t.expire() == 2 and t.rows_held == 0
