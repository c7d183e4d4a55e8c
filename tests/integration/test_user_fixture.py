"""The `ps_cluster` fixture that README tells users to load with
`pytest_plugins = ["ps_server.testing"]` (tests/conftest.py loads it the same way)."""

from __future__ import annotations

import numpy as np

from ps_worker import PSClient


def test_ps_cluster_fixture_serves_a_training_loop(ps_cluster):
    assert len(ps_cluster.servers) == 2
    with PSClient(ps_cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4, 3), init={"name": "constant", "value": 1.0},
                   optimizer={"name": "sgd", "lr": 0.5})
        ps.push({"w": np.ones((4, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), np.full((4, 3), 0.5, np.float32))


def test_two_clusters_live_in_one_process(ps_cluster):
    from ps_server.testing import InProcessCluster

    with InProcessCluster(servers=1) as other:
        assert other.coordinator_address != ps_cluster.coordinator_address
        with PSClient(other.coordinator_address) as a, \
                PSClient(ps_cluster.coordinator_address) as b:
            a.declare("v", shape=(2,), init={"name": "constant", "value": 3.0})
            b.declare("v", shape=(2,), init={"name": "constant", "value": 7.0})
            assert a.pull("v")[0] == 3.0 and b.pull("v")[0] == 7.0
