"""A server takes at most --max-streams clients in its ssp/sync steps: a push waiting for
its step holds one of its handler threads, and past that many, waiting pushes would take
the threads the pool keeps for health checks and the control plane (and the push that
completes the step would wait for a thread until the step's bound)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_worker import PSClient, RemoteError

SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.mark.parametrize("mode", ["sync", "ssp:1"])
def test_a_client_past_max_streams_is_refused_joining_naming_the_flag(make_cluster, mode):
    cluster = make_cluster(servers=1, max_streams=2)
    clients = [PSClient(cluster.coordinator_address) for _ in range(3)]
    try:
        clients[0].declare("w", shape=(4,), optimizer=SGD1)
        for ps in clients[:2]:
            ps.join_steps(mode)
        with pytest.raises(RemoteError) as refused:
            clients[2].join_steps(mode)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--max-streams" in str(refused.value)
        # The two members' step goes on: averaged in sync, each push applied in ssp.
        first = clients[0].push_async({"w": np.ones(4, np.float32)})
        clients[1].push({"w": np.full(4, 3.0, np.float32)})
        first.result(timeout=30)
        expected = -2.0 if mode == "sync" else -4.0
        np.testing.assert_array_equal(clients[0].pull("w"), np.full(4, expected, np.float32))
    finally:
        for ps in clients:
            ps.close()


def test_sync_replicas_past_max_streams_are_refused(make_cluster):
    cluster = make_cluster(servers=1, max_streams=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        with pytest.raises(RemoteError) as refused:
            ps.join_steps("sync", replicas=3)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "replicas 3" in str(refused.value) and "--max-streams" in str(refused.value)
