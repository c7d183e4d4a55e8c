"""Consistency steps and a stepped push that touches only some of the servers.

A push of a client that joined the steps is its step on every server (PSClient.join_steps):
a server its gradients do not go to gets an empty push, which counts as the client's step
there (ssp: finished; sync: a contribution of no gradients, each shard averaging the
gradients it got). The other clients are not held there waiting for it."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker import PSClient


def gate(server):
    return server._servicer.steps


@pytest.mark.parametrize("mode", ["sync", "ssp:0"])
def test_a_push_of_one_servers_variables_finishes_the_clients_step_on_every_server(
        make_cluster, spawn, mode):
    cluster = make_cluster(servers=2)
    for server in cluster.servers:
        # The product's 30 s bound on a step's wait, shortened (never reached when right:
        # both clients push their step at once).
        gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        for name in ("w", "v"):
            a.declare(name, (4,), optimizer={"name": "sgd", "lr": 1.0})
        shard_map = a.refresh()
        holders = {name: {s.server_id for s in shard_map.shards_of(name)} for name in "wv"}
        assert holders["w"] != holders["v"], holders  # one variable per server
        cluster.wait_until_synced()
        for ps in (a, b):
            ps.join_steps(mode)
        # Step 0: b has gradients of both variables, a of "w" only (none for "v" this step).
        both = spawn(b.push, {"w": np.full(4, 1.0, np.float32),
                              "v": np.full(4, 1.0, np.float32)})
        a.push({"w": np.full(4, 3.0, np.float32)})
        both.result()
        values = a.pull(["w", "v"])
        w_expected = -2.0 if mode == "sync" else -4.0
        np.testing.assert_array_equal(values["w"], np.full(4, w_expected, np.float32))
        np.testing.assert_array_equal(values["v"], np.full(4, -1.0, np.float32))
