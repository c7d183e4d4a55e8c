"""ByteBudget: the bound on pull snapshots held at once."""

from __future__ import annotations

import threading

from ps_server.buffers import ByteBudget


def test_requests_beyond_the_budget_wait_for_room():
    budget = ByteBudget(100)
    assert budget.acquire(60, timeout_s=1.0)
    assert not budget.acquire(60, timeout_s=0.0)  # 120 > 100: no room now
    got = threading.Event()

    def waiter():
        if budget.acquire(60, timeout_s=10.0):
            got.set()

    t = threading.Thread(target=waiter, name="budget-waiter")
    t.start()
    budget.release(60)
    t.join(10)
    assert got.is_set() and budget.out == 60


def test_one_request_larger_than_the_budget_is_served_alone():
    budget = ByteBudget(100)
    assert budget.acquire(500, timeout_s=0.0)
    assert not budget.acquire(1, timeout_s=0.0)
    budget.release(500)
    assert budget.out == 0 and budget.acquire(1, timeout_s=0.0)
