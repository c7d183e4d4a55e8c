"""A sync step on a server whose shard moved away while a client's push waited in it: the
step's average reaches the dropped shard and fails for every contributor (StaleEpoch), and
the clients finish it. Two clients a and b, two servers: S holds w, T holds x. a's push of
w (w to S, an empty push to T) waits for b; the coordinator moves w to T (S drops it, T
creates it); b, on the new map, pushes w to T and an empty push to S. S's step fails; T's
is applied. a sends w to T as the step its part there carried (applied without it: dropped
as late) and an empty push to S (its part there failed), b its empty push to S again: S's
next step has both, and both pushes return.

The servers' step wait is shortened from 30 s to 10 s (StepGate._wait_s) to bound a
deadlock, never reached when the clients finish the step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError

SHARED_MEMORY = False
WAIT_S = 10.0


def _gate(server):
    return server._servicer.steps


def test_a_sync_step_refused_as_stale_after_a_move_is_finished_by_both_clients(
        make_cluster, spawn):
    cluster = make_cluster(servers=2)
    by_id = {server.server_id: server for server in cluster.servers}
    for server in cluster.servers:
        _gate(server)._wait_s = 10.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), init="zeros", optimizer={"name": "sgd", "lr": 1.0})
        a.declare("x", (4,), init="zeros", optimizer={"name": "sgd", "lr": 1.0})
        shard_map = a.refresh()
        (s_id,) = {shard.server_id for shard in shard_map.shards_of("w")}
        (t_id,) = {shard.server_id for shard in shard_map.shards_of("x")}
        assert s_id != t_id
        b.refresh()
        a.join_steps("sync", replicas=2)
        b.join_steps("sync", replicas=2)

        def result_of(client):
            try:
                client.push({"w": np.ones(4, np.float32)})
                return None
            except RemoteError as error:
                return error

        a_push = spawn(result_of, a)
        wait_until(lambda: all(len(_gate(by_id[sid])._pending.contributions) == 1
                               for sid in (s_id, t_id)),
                   "a's push waits for b on both servers", timeout_s=WAIT_S)

        # The coordinator moves w from S to T (a new epoch), and delivers it.
        state = cluster.coordinator.state
        with state._lock:
            old = state._map
            state._map = replace(old, epoch=state._next_epoch(), shards={
                **old.shards, "w": tuple(replace(s, server_id=t_id) for s in old.shards["w"])})
        cluster.wait_until_synced(WAIT_S)
        assert not [h for h in by_id[s_id].store.held() if h.spec.name == "w"]

        b.refresh()
        b_error = result_of(b)
        a_error = a_push.result()
        values = a.pull("w")

    assert (a_error, b_error) == (None, None), (
        f"a sync step refused as stale was not finished: a: {a_error}; b: {b_error}")
    # b's gradient applied in T's step (a's came late for it, and was dropped): -1.
    np.testing.assert_array_equal(values, np.full(4, -1.0, np.float32))
