"""A PSClient in a child process forked after it was made (a data loader's fork workers, say).

README ("Threads and processes"): a PSClient "is not to be used in a child process forked
after it was made: make the client in the process that uses it". The child shares the
parent's client id, push sequences, push slots and push sockets: a push of the child would
be taken for a retry of the parent's (answered, never applied), or written into a slot the
parent is writing, and its gRPC channels can hang. So in the child every call raises
FAILED_PRECONDITION at once and touches nothing, close() and interrupt() do nothing, and the
parent's client goes on as if there had been no fork.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_worker import PSClient

WAIT_S = 30.0  # a bound a sound build never reaches
SGD1 = {"name": "sgd", "lr": 1.0}

IN_CHILD = {
    "push": lambda ps: ps.push({"w": np.ones((100, 10), np.float32)}),
    "pull": lambda ps: ps.pull("b"),
    "push_pull": lambda ps: ps.push_pull({"b": np.ones(10, np.float32)}, "b"),
    "push_async": lambda ps: ps.push_async({"b": np.ones(10, np.float32)}).result(WAIT_S),
    "push_rows": lambda ps: ps.push_rows("t", np.array([1], np.int64),
                                         np.ones((1, 4), np.float32)),
    "pull_rows": lambda ps: ps.pull_rows("t", np.array([1], np.int64)),
    "refresh": lambda ps: ps.refresh(),
    "declare": lambda ps: ps.declare("late", shape=(3,)),
}


def _run_in_child(ps: PSClient) -> int:
    """In the forked child: 0 when every call raised FAILED_PRECONDITION and close() and
    interrupt() returned; else the position of the first one that did not, plus 1."""
    for position, (name, call) in enumerate(IN_CHILD.items(), start=1):
        try:
            call(ps)
        except RemoteError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                os.write(2, f"{name}: {error.code().name}: {error}\n".encode())
                return position
            continue
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(2, f"{name}: {type(error).__name__}: {error}\n".encode())
            return position
        os.write(2, f"{name}: no error\n".encode())
        return position
    ps.interrupt()
    ps.close()
    return 0


def _wait_for(pid: int) -> int:
    """The child's exit status; it is killed past WAIT_S (a call that hung)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"a call in the forked child did not end within {WAIT_S:g} s")


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_a_client_refuses_work_in_a_forked_child_and_the_parent_goes_on(make_cluster,
                                                                       shared_memory):
    cluster = make_cluster(servers=2, split_threshold_bytes=1000,
                           shared_memory=shared_memory)
    with PSClient(cluster.coordinator_address, shared_memory=shared_memory) as ps:
        ps.declare("w", shape=(100, 10), optimizer=SGD1)
        ps.declare("b", shape=(10,), optimizer=SGD1)
        ps.declare_embedding("t", dim=4, num_rows=8, optimizer=SGD1)
        ps.push({"w": np.ones((100, 10), np.float32), "b": np.ones(10, np.float32)})
        ps.pull(["w", "b"])  # channels, push slots and sockets open
        ps.pull("b")  # kept as one call: the next pull of "b" alone takes a shorter path
        rows = ps.pull_rows("t", np.array([1], np.int64))

        pid = os.fork()
        if pid == 0:
            status = 99
            try:
                status = _run_in_child(ps)
            finally:
                os._exit(status)
        status = _wait_for(pid)
        assert status == 0, (f"in the child, {list(IN_CHILD)[status - 1]} did not raise "
                             f"FAILED_PRECONDITION" if 0 < status <= len(IN_CHILD)
                             else f"the child ended with status {status}")

        # The parent's client goes on, its pushes applied once each; nothing of the child's.
        ps.push({"w": np.ones((100, 10), np.float32), "b": np.ones(10, np.float32)})
        np.testing.assert_array_equal(ps.pull("b"), np.full(10, -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull("w"), np.full((100, 10), -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull_rows("t", np.array([1], np.int64)), rows)
        assert "late" not in ps.refresh().variables
