"""A PSClient in a forked child refuses before any lock a parent's thread may hold, and a sync
step with an infinite gradient (where both sides allow them) is applied rather than hung.
In-process clusters on OS-chosen ports; waits are on events, each bounded (a forked child
that hangs is killed at its bound)."""

from __future__ import annotations

import os
import select
import signal
import threading

import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_worker import PSClient

WAIT_S = 30.0
CHILD_WAIT_S = 10.0  # a refusal in a forked child takes milliseconds
SGD1 = {"name": "sgd", "lr": 1.0}


# ---- ps_worker/client.py: the fork guard ---------------------------------------------------

IN_CHILD = {
    "push_rows": lambda ps: ps.push_rows("t", np.array([1], np.int64),
                                         np.ones((1, 4), np.float32)),
    "push_pull_rows": lambda ps: ps.push_pull_rows("t", np.array([1], np.int64),
                                                   np.ones((1, 4), np.float32),
                                                   np.array([2], np.int64)),
    "join_steps": lambda ps: ps.join_steps("ssp:1"),
    "leave_steps": lambda ps: ps.leave_steps(),
    "flush": lambda ps: ps.flush(),
}


def _child_outcome(call, ps: PSClient) -> bytes:
    try:
        call(ps)
    except RemoteError as error:
        return f"{error.code().name}: {error.details()}".encode()
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        return f"{type(error).__name__}: {error}".encode()
    return b"no error"


def _in_forked_child(ps: PSClient, call) -> str:
    """`call(ps)` in a forked child: what it raised, or 'hung' when it did not end within
    CHILD_WAIT_S (the child is then killed)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            os.write(write_end, _child_outcome(call, ps))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], CHILD_WAIT_S)
        outcome = os.read(read_end, 4096).decode() if ready else "hung"
    finally:
        os.close(read_end)
        if outcome == "hung":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return outcome


@pytest.mark.parametrize("name", list(IN_CHILD))
def test_a_forked_child_is_refused_before_the_client_lock_a_parent_thread_holds(
        make_cluster, name):
    """README: in a child forked after the client was made "every call of the parent's
    client raises FAILED_PRECONDITION at once". Commit cfe275e moved the refusal before
    _stub's lock, "which a parent's thread may hold" at the fork. Other public calls still
    take self._lock before any refusal (push_rows/push_pull_rows in _push_rows, join_steps
    and leave_steps, flush): in a child forked while a parent's thread was inside any call
    that holds the lock, they wait forever. (flush also never refuses: with nothing in
    flight it returns, with a parent's push_async in flight it waits for a thread the child
    does not have.)"""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("t", dim=4, num_rows=8, optimizer=SGD1)
        ps.push_rows("t", np.array([1], np.int64), np.ones((1, 4), np.float32))
        held, done = threading.Event(), threading.Event()

        def hold_the_lock():  # a parent's thread inside one of the client's calls
            with ps._lock:
                held.set()
                done.wait(WAIT_S)

        holder = threading.Thread(target=hold_the_lock, name="lock-holder")
        holder.start()
        try:
            assert held.wait(WAIT_S)
            outcome = _in_forked_child(ps, IN_CHILD[name])
        finally:
            done.set()
            holder.join(WAIT_S)
    assert outcome.startswith("FAILED_PRECONDITION"), f"{name} in the child: {outcome}"


@pytest.mark.parametrize("name", ["flush", "leave_steps"])
def test_flush_and_leave_steps_refuse_in_a_forked_child(make_cluster, name):
    """README: in such a child "every call of the parent's client raises
    FAILED_PRECONDITION at once". flush() never checks (it returns, or, with a parent's
    push_async in flight at the fork, waits for a future whose thread the child lacks), and
    leave_steps() of a client in no steps returns without a check."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("b", shape=(4,), optimizer=SGD1)
        ps.push({"b": np.ones(4, np.float32)})
        outcome = _in_forked_child(ps, IN_CHILD[name])
    assert outcome.startswith("FAILED_PRECONDITION"), f"{name} in the child: {outcome}"


# ---- a sync step with an infinite gradient ------------------------------------------------

def test_a_sync_step_with_an_infinite_gradient_is_applied_on_a_server_that_allows_it(
        make_cluster, spawn):
    """README: non-finite gradients are accepted from PSClient(allow_non_finite=True) by a
    server run with --allow-non-finite; in sync the step's average of [inf, 1] and [1, 1]
    is [inf, 1] (as before 5d40319). StepSum.add loops forever on the second gradient
    (its bound of the first is inf, and halving inf leaves inf) while holding the step
    gate's lock: every later push to that server hung (until the clients' own deadline;
    tests/unit/test_step_sum.py shows the loop itself, bounded)."""
    cluster = make_cluster(servers=1, allow_non_finite=True)
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as first, \
            PSClient(cluster.coordinator_address, allow_non_finite=True) as second:
        first.declare("w", shape=(2,), optimizer=SGD1)
        first.join_steps("sync", replicas=2)
        second.join_steps("sync", replicas=2)
        waiting = spawn(first.push, {"w": np.array([np.inf, 1.0], np.float32)})
        try:
            second.push({"w": np.array([1.0, 1.0], np.float32)})
            failed = None
        except RemoteError as error:
            failed = error
            second.leave_steps()  # the first push's step is applied without it
        try:
            waiting.result()
        except RemoteError:
            pass
        assert failed is None, f"the second push of the step failed: {failed}"
        np.testing.assert_array_equal(first.pull("w"), np.array([-np.inf, -1.0], np.float32))
