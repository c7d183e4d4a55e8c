"""A parameter server stopped and restarted while a sync step waits.

ParameterServer.stop wakes the pushes waiting in its steps (StepGate.close: UNAVAILABLE),
over gRPC and over shared memory (the push socket) alike: the waiting push is retried
against the restarted server, joins its steps again, and the step completes with both
clients' gradients."""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.testing import wait_until
from ps_worker import PSClient


def gate(server):
    return server._servicer.steps


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_sync_a_server_restarted_while_a_step_waits_completes_the_step(
        make_cluster, spawn, tmp_path, shared_memory):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck",
                           shared_memory=shared_memory)
    # The product's 30 s bound on a step's wait, shortened (never reached when right).
    gate(cluster.servers[0])._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer={"name": "sgd", "lr": 1.0})
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        other = spawn(b.push, {"w": np.full(4, 1.0, np.float32)})
        a.push({"w": np.full(4, 3.0, np.float32)})
        other.result()
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -2.0, np.float32))
        cluster.checkpoint()  # holds w = -2
        waiting = spawn(a.push, {"w": np.full(4, 5.0, np.float32)})
        wait_until(lambda: gate(cluster.servers[0])._pending.contributions,
                   "a's push of step 1 waiting at the server")
        restarted = cluster.restart_server(0)  # its shard comes back from the checkpoint
        gate(restarted)._wait_s = 5.0
        b.push({"w": np.full(4, 7.0, np.float32)})
        waiting.result()
        # -2 - (5 + 7) / 2
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -8.0, np.float32))
