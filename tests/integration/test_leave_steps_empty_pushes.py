"""A stepped push sends an empty push (no shards, only the step) to every server it has no
gradients for. When leave_steps runs while such a push is between its planning (the client
was in the steps) and asking that server for its step (answered None: the client left, or
its JoinSteps was answered after the leave and undone), nothing goes to that server: an
empty push carries a step, and the caller's push returns (its gradients were applied).
The interleaving is forced with events on the JoinSteps answer.
"""

from __future__ import annotations

import threading

import numpy as np

from ps_worker import PSClient, RemoteError

WAIT_S = 10.0


def test_a_push_raced_by_leave_steps_does_not_send_an_empty_push_without_a_step(
        make_cluster, spawn):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", (4,), optimizer={"name": "sgd", "lr": 1.0})
        shard_map = ps.refresh()
        (holder,) = {shard.server_id for shard in shard_map.shards_of("w")}
        (other,) = set(shard_map.servers) - {holder}
        ps.join_steps("ssp:4")
        # Forget the step at the server without gradients: the push asks for it again.
        with ps._lock:
            ps._steps.pop(other)

        # The push's JoinSteps at that server is answered once leave_steps has begun (the
        # path a68a0fd undoes with a LeaveSteps in _step_at).
        stub = ps._stub(shard_map.servers[other])
        real_join = stub.JoinSteps
        asking, left = threading.Event(), threading.Event()

        def held_join(request, timeout=None):
            reply = real_join(request, timeout=timeout)
            asking.set()
            assert left.wait(WAIT_S)
            return reply

        stub.JoinSteps = held_join

        def leave():
            assert asking.wait(WAIT_S)
            try:
                ps.leave_steps()
            finally:
                left.set()

        leaver = spawn(leave)
        error = None
        try:
            ps.push({"w": np.full(4, 1.0, np.float32)})
        except RemoteError as raised:
            error = raised
        finally:
            left.set()
        leaver.result()
        stub.JoinSteps = real_join
        values = ps.pull("w")

    assert error is None, f"the push raised although it was applied: {error}"
    np.testing.assert_array_equal(values, np.full(4, -1.0, np.float32))
