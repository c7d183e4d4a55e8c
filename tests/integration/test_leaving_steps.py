"""A client that leaves the steps (leave_steps, or a join_steps that failed) is in no server's
steps afterwards, so that no other client's step waits for it: not on a server whose step it
forgot after a failed sync step, not on one whose JoinSteps answer was lost, and not on one
whose JoinSteps (asked by a push in flight) answered after the leave began.

Each server's step wait is shortened from 30 s to 3 s (StepGate._wait_s): a client that
stayed a member would make the other client's push fail with DEADLINE_EXCEEDED after that
wait; when it has left, nothing waits at all.

Also: a push racing leave_steps sends no empty push without a step.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common.rpc import RetryPolicy
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError

WAIT_S = 10.0  # bound of every event wait in these tests; never reached when they pass


def gate(server):
    return server._servicer.steps


def member_incarnation(server, client_id: str):
    member = gate(server)._members.get(client_id)
    return None if member is None else member.incarnation


def one_server_with_short_steps(make_cluster):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    gate(server)._wait_s = 3.0
    return cluster, server


def sgd() -> dict:
    return {"name": "sgd", "lr": 1.0}


def test_leave_steps_after_a_failed_sync_step_leaves_the_server(make_cluster, spawn):
    """The documented overflow path (README, Consistency modes): a sync step whose sum
    overflows is refused whole; each client forgets its step there (to ask again). b then
    leaves the steps; a's next step must not wait for b."""
    cluster, server = one_server_with_short_steps(make_cluster)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        big = np.full(4, 3e38, np.float32)  # finite; two of them sum past float32's max
        b_push = spawn(b.push, {"w": big})
        with pytest.raises(RemoteError) as a_error:
            a.push({"w": big})
        assert a_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(RemoteError) as b_error:
            b_push.result()
        assert b_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        b.leave_steps()
        assert b.mode == "async"
        # a's step, alone now, is applied at once (sync averages a's gradient alone).
        a.push({"w": np.full(4, 1.0, np.float32)})
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -1.0, np.float32))
        assert member_incarnation(server, b.client_id) is None


def test_join_steps_whose_answer_was_lost_leaves_no_member_behind(make_cluster):
    """JoinSteps applied at the server, its answer lost (retries exhausted): join_steps
    raises UNAVAILABLE and promises the client takes part in no steps anywhere."""
    cluster, server = one_server_with_short_steps(make_cluster)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address,
                     retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01)) as b:
        a.declare("w", (4,), optimizer=sgd())
        b.pull("w")  # b knows the map and its server
        cluster.faults.drop_response_next("JoinSteps", 2)
        with pytest.raises(RemoteError) as caught:
            b.join_steps("ssp:0")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert b.mode == "async"

        a.join_steps("ssp:0")
        # a is the only client in the steps: ssp:0 lets its steps run one after another.
        a.push({"w": np.full(4, 1.0, np.float32)})
        a.push({"w": np.full(4, 1.0, np.float32)})
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -2.0, np.float32))
        assert member_incarnation(server, b.client_id) is None


def test_leave_steps_while_a_push_async_joins_again_leaves_the_server(make_cluster, spawn):
    """leave_steps "waits for push_async pushes in flight first; a push made meanwhile ...
    lands in its step, or after the leave as a push that waits for nobody". Here the push in
    flight asks the server for its step again (JoinSteps, after a sync step failed) and its
    answer comes once leave_steps has taken its snapshot of the servers to leave."""
    cluster, server = one_server_with_short_steps(make_cluster)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        b.join_steps("sync", replicas=1)
        b.push({"w": np.full(4, 1.0, np.float32)})  # step 0, b alone
        # b's step 1 is refused by the server (a non-finite gradient: b allows no such
        # thing; the server, told by b's first push that it checks, checks this one).
        bad = np.array([np.nan, 0, 0, 0], np.float32)
        with pytest.raises(RemoteError) as caught:
            b.push({"w": bad})
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # b's next push asks for its step again; hold its JoinSteps answer.
        stub = b._stub(b.shard_map.servers[server.server_id])
        real = stub.JoinSteps
        answered, resume = threading.Event(), threading.Event()

        def held_join(request, timeout=None):
            reply = real(request, timeout=timeout)
            answered.set()
            assert resume.wait(WAIT_S)
            return reply

        stub.JoinSteps = held_join
        pushed = b.push_async({"w": np.full(4, 1.0, np.float32)})
        assert answered.wait(WAIT_S)
        leaving = spawn(b.leave_steps)
        wait_until(lambda: b.mode == "async", "leave_steps has begun", timeout_s=WAIT_S)
        resume.set()
        pushed.result(timeout=WAIT_S)
        leaving.result()
        stub.JoinSteps = real

        a.join_steps("sync", replicas=1)
        a.push({"w": np.full(4, 1.0, np.float32)})  # a's step, alone
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -3.0, np.float32))
        assert member_incarnation(server, b.client_id) is None


# ---- a push racing leave_steps -------------------------------------------------------------

def test_a_push_raced_by_leave_steps_does_not_send_an_empty_push_without_a_step(
        make_cluster, spawn):
    """A stepped push sends an empty push (no shards, only the step) to every server it has
    no gradients for. When leave_steps runs while such a push is between its planning (the
    client was in the steps) and asking that server for its step (answered None: the
    client left, or its JoinSteps was answered after the leave and undone), nothing goes
    to that server, and the caller's push returns (its gradients were applied). The
    interleaving is forced with events on the JoinSteps answer."""
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
