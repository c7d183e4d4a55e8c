"""`join_steps("sync", replicas=N)` on servers whose steps ran before.

In sync, the first step waits until `replicas` clients have joined (README). A client that
joins steps nobody takes part in starts a new run there: after an earlier run (sync or
ssp:K) whose clients all left, the first step of the new pair waits for the second replica
and is the average of both gradients, as on fresh servers."""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.testing import wait_until
from ps_worker import PSClient


def gate(server):
    return server._servicer.steps


@pytest.mark.parametrize("before", ["sync", "ssp:1"])
def test_sync_replicas_hold_the_first_step_of_a_new_run_on_servers_that_ran_steps(
        make_cluster, spawn, before):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    # The product's 30 s bound on a step's wait, shortened (never reached when it is right).
    gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", (4,), optimizer={"name": "sgd", "lr": 1.0})
    # A first run: two clients take part in steps, push once, and leave.
    with PSClient(cluster.coordinator_address) as r0, \
            PSClient(cluster.coordinator_address) as r1:
        for ps in (r0, r1):
            ps.join_steps(before, replicas=2) if before == "sync" else ps.join_steps(before)
        first = spawn(r0.push, {"w": np.full(4, 1.0, np.float32)})
        r1.push({"w": np.full(4, 1.0, np.float32)})
        first.result()
        for ps in (r0, r1):
            ps.leave_steps()
        start = r0.pull("w")
    assert gate(server).stats().members == 0
    # The same script again: rank 0 starts first.
    with PSClient(cluster.coordinator_address) as r0, \
            PSClient(cluster.coordinator_address) as r1:
        r0.join_steps("sync", replicas=2)
        pushed = spawn(r0.push, {"w": np.full(4, 2.0, np.float32)})
        wait_until(lambda: pushed.done.is_set() or gate(server)._pending.contributions,
                   "rank 0's push of its first step at the server")
        assert not pushed.done.is_set(), \
            "rank 0's first step was applied alone: replicas=2 was not honoured"
        r1.join_steps("sync", replicas=2)
        r1.push({"w": np.full(4, 6.0, np.float32)})
        pushed.result()
        # One step: the average (2 + 6) / 2 = 4, applied once.
        np.testing.assert_array_equal(r0.pull("w"), start - 4.0)
        assert r0.step_stats.dropped_stale == r1.step_stats.dropped_stale == 0
