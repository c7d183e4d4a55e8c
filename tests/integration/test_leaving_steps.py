"""A client that leaves the steps (leave_steps, or a join_steps that failed) is in no server's
steps afterwards, so that no other client's step waits for it: not on a server whose step it
forgot after a failed sync step, not on one whose JoinSteps answer was lost, and not on one
whose JoinSteps (asked by a push in flight) answered after the leave began.

Each server's step wait is shortened from 30 s to 3 s (StepGate._wait_s): a client that
stayed a member would make the other client's push fail with DEADLINE_EXCEEDED after that
wait; when it has left, nothing waits at all.

Also: a push racing leave_steps lands once, and sends no empty push without a step.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common.rpc import RetryPolicy
from ps_server.consistency import StepGate, StepSum
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


class HeldJoin:
    """A client's JoinSteps to one server, its answer held (bounded) until `resume` (an
    Event: a new one if not given) is set; `answered` is set once the server has answered.
    `restore()` lets it go and puts the real call back."""

    def __init__(self, client: PSClient, server_id: str,
                 resume: threading.Event | None = None):
        self._stub = client._stub(client.shard_map.servers[server_id])
        self._real = self._stub.JoinSteps
        self.answered, self.resume = threading.Event(), resume or threading.Event()
        self._stub.JoinSteps = self._held

    def _held(self, request, timeout=None):
        reply = self._real(request, timeout=timeout)
        self.answered.set()
        assert self.resume.wait(WAIT_S)
        return reply

    def restore(self) -> None:
        self.resume.set()
        self._stub.JoinSteps = self._real


def push_while_leaving(spawn, client: PSClient, grads: dict, ready: threading.Event,
                       left: threading.Event) -> RemoteError | None:
    """`client.push(grads)`, while another thread calls `client.leave_steps()` once `ready`
    is set (and sets `left` when it returns). Returns the push's error, if any."""

    def leave():
        assert ready.wait(WAIT_S)
        try:
            client.leave_steps()
        finally:
            left.set()

    leaver = spawn(leave)
    try:
        client.push(grads)
        return None
    except RemoteError as error:
        return error
    finally:
        left.set()
        leaver.result()


def test_leave_steps_after_a_failed_sync_step_leaves_the_server(make_cluster, spawn,
                                                                monkeypatch):
    """A sync step the server refuses whole (here its average is made non-finite, which the
    server refuses rather than apply): each client forgets its step there (to ask again).
    b then leaves the steps; a's next step must not wait for b."""
    cluster, server = one_server_with_short_steps(make_cluster)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        real_average = StepSum.average
        monkeypatch.setattr(StepSum, "average",
                            lambda total: np.full_like(total.total, np.inf))
        one = np.full(4, 1.0, np.float32)
        b_push = spawn(b.push, {"w": one})
        with pytest.raises(RemoteError) as a_error:
            a.push({"w": one})
        assert a_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(RemoteError) as b_error:
            b_push.result()
        assert b_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        monkeypatch.setattr(StepSum, "average", real_average)
        np.testing.assert_array_equal(a.pull("w"), np.zeros(4, np.float32))

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
        join = HeldJoin(b, server.server_id)
        try:
            pushed = b.push_async({"w": np.full(4, 1.0, np.float32)})
            assert join.answered.wait(WAIT_S)
            leaving = spawn(b.leave_steps)
            wait_until(lambda: b.mode == "async", "leave_steps has begun", timeout_s=WAIT_S)
        finally:
            join.restore()
        pushed.result(timeout=WAIT_S)
        leaving.result()

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

        # The push's JoinSteps at that server is answered once leave_steps has begun (a
        # join answered after a leave is undone in PSClient._step_at).
        left = threading.Event()
        join = HeldJoin(ps, other, resume=left)
        try:
            error = push_while_leaving(spawn, ps, {"w": np.full(4, 1.0, np.float32)},
                                       join.answered, left)
        finally:
            join.restore()
        values = ps.pull("w")

    assert error is None, f"the push raised although it was applied: {error}"
    np.testing.assert_array_equal(values, np.full(4, -1.0, np.float32))


def test_a_sync_push_raced_by_leave_steps_lands_once_and_says_so(make_cluster, monkeypatch,
                                                                 spawn):
    """leave_steps in one thread while a sync push of the same client is in flight in
    another ("one PSClient may be used from many threads at once"), its LeaveSteps landing
    on the server right after the push's membership check. The step refuses the push (the
    client has left), and the client sends it again as a push that waits for nobody,
    applied whole; a 'duplicate' answer to that second send is its own first send's, not
    another client's. Over gRPC."""
    cluster = make_cluster(servers=1, shared_memory=False)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        a.join_steps("sync", replicas=2)
        b.join_steps("sync", replicas=2)

        checked, left = threading.Event(), threading.Event()
        real_check = StepGate.check_member

        def check_then_let_leave(self, client_id, incarnation):
            kind = real_check(self, client_id, incarnation)
            if client_id == a.client_id and not checked.is_set():
                checked.set()
                assert left.wait(WAIT_S)
            return kind

        monkeypatch.setattr(StepGate, "check_member", check_then_let_leave)
        error = push_while_leaving(spawn, a, {"w": np.full(4, 2.0, np.float32)}, checked,
                                   left)
        values = a.pull("w")

    assert error is None, f"the push failed: {error}"
    # Applied once, whole (b never pushed: no sync step of a's could have been applied).
    np.testing.assert_array_equal(values, np.full(4, -2.0, np.float32))
