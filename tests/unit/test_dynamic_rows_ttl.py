"""A dynamic table's `ttl_seconds` evicts rows untouched that long: a row untouched for longer
than the ttl does not come back with its trained values, even before the (throttled) sweep
reaches it; a pull or push of its id starts again from the initial row and slots."""

from __future__ import annotations

import numpy as np

from ps_server.dynamic_rows import DynamicRows


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, ttl_s: float) -> DynamicRows:
    # A row's initial value is its id, so a test sees whether a row was made afresh.
    return DynamicRows(
        2, "float32", capacity=0, ttl_s=ttl_s,
        make_rows=lambda ids: np.repeat(ids[:, None], 2, axis=1).astype(np.float32),
        make_slots=lambda n: {"accumulator": np.full((n, 2), 0.5, np.float32)},
        clock=clock)


def test_a_row_untouched_for_longer_than_the_ttl_comes_back_as_its_initial_row():
    clock = Clock()
    t = table(clock, ttl_s=10.0)
    row = t.locate(np.array([1], np.int64))
    t.values[row] = 50.0           # trained
    t.slots["accumulator"][row] = 9.0
    clock.now += 9.9               # another id's request: a sweep finds nothing stale yet
    t.locate(np.array([2], np.int64))
    clock.now += 1.1               # id 1 now untouched for 11 s > ttl 10 s
    again = t.locate(np.array([1], np.int64))
    np.testing.assert_array_equal(t.values[again], [[1.0, 1.0]])   # its initial row
    np.testing.assert_array_equal(t.slots["accumulator"][again], [[0.5, 0.5]])
    assert t.evictions == 1 and t.rows_held == 2  # counted as a ttl eviction, then remade
