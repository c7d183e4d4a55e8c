"""A server restarts (same --server-id, same port: empty) while the coordinator is between
building an assignment for it and sending it. That assignment was built before the
coordinator learned that the new process lost its shards, so it carries no restore: the
new process refuses it (its registration reply named the epoch from which it takes
assignments), and the next assignment restores the lost shard from the checkpoint instead
of creating it from its initializer."""

from __future__ import annotations

import grpc
import numpy as np

from ps_worker import PSClient, RetryPolicy

SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0


def test_an_assignment_built_before_a_restarted_server_registered_does_not_replace_its_restore(
        make_cluster, tmp_path):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    state = cluster.coordinator.state
    assigner = cluster.coordinator._assigner
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(8, 4), init="zeros", optimizer=SGD1)
        for _ in range(3):
            ps.push({"w": np.ones((8, 4), np.float32)})
        cluster.checkpoint()  # holds w = -3

        read = state.delivery
        restarted = []

        def delivery_then_the_server_restarts(server_id):
            delivery = read(server_id)
            if not restarted:
                restarted.append(True)
                # The server crashes and comes back empty on its port; it registers (the
                # coordinator finds w lost and plans its restore) before this assignment,
                # built a moment ago, is sent.
                server = cluster.restart_server(0)
                assert [m.state_losses for m in state.servers()] == [1]
                address = server.address
                # The coordinator's channel reconnects to the new process (a bounded wait
                # on the channel's state, so that the call below is not refused outright).
                grpc.channel_ready_future(assigner._channels[address]).result(timeout=WAIT_S)
            return delivery

        state.delivery = delivery_then_the_server_restarts
        try:
            ps.declare("x", shape=(2,), init="zeros", optimizer=SGD1)  # sends the map to ps-0
        finally:
            state.delivery = read
        assert restarted
        cluster.wait_until_synced(WAIT_S)
        ps.refresh()
        assert state.shards_restored == 1  # the coordinator says w was restored ...
        # ... so w must hold its checkpointed values, not its initial ones.
        np.testing.assert_array_equal(ps.pull("w"), np.full((8, 4), -3.0, np.float32))
