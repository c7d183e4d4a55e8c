"""PSClient.flush reports a failed push_async once, even one whose done callback has not run
yet; interrupt() ends a call waiting on the coordinator, and refuses later pulls on every
path, shared memory included."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_server.testing import wait_until
from ps_worker import PSClient

WAIT_S = 30.0  # a bound a sound build never reaches


class HeldRelease(threading.BoundedSemaphore):
    """A push window whose release (the first thing a finished push's done callback does)
    waits for `gate`: the callback runs only after the test has looked."""

    def __init__(self, value: int):
        super().__init__(value)
        self.gate = threading.Event()

    def release(self, n: int = 1) -> None:
        assert self.gate.wait(WAIT_S)
        super().release(n)


def test_flush_raises_a_failed_push_whose_callback_has_not_run_yet_and_only_once(make_cluster):
    cluster = make_cluster(servers=1)
    ps = PSClient(cluster.coordinator_address, shared_memory=False)
    try:
        ps.declare("w", (4,))
        ps._window = window = HeldRelease(4)
        failed = ps.push_async({"unknown": np.ones(4, np.float32)})
        with pytest.raises(RemoteError) as caught:
            ps.flush(timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        window.gate.set()
        with pytest.raises(RemoteError):
            failed.result(timeout=WAIT_S)
        ps.flush(timeout=WAIT_S)  # reported already: not again
    finally:
        window.gate.set()
        ps.close()  # nor here


def test_interrupt_ends_a_declare_waiting_on_the_coordinator(make_cluster, spawn):
    cluster = make_cluster(servers=1)
    stalled = threading.Event()
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        cluster.faults.hold_next("AssignShards", stalled)  # the declare waits for its shards
        try:
            declaring = spawn(ps.declare, "w", (4,))
            wait_until(lambda: cluster.faults.calls.get("AssignShards", 0) >= 1,
                       "the declare's assignment held at the server", timeout_s=WAIT_S)
            ps.interrupt()
            with pytest.raises(RemoteError) as caught:
                declaring.result()
            assert caught.value.code() == grpc.StatusCode.CANCELLED
        finally:
            stalled.set()


@pytest.mark.parametrize("rows", [False, True], ids=["dense", "rows"])
def test_every_pull_after_interrupt_is_cancelled_over_shared_memory_too(make_cluster, rows):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        if rows:
            ps.declare_embedding("t", dim=4, num_rows=10)
            pull = lambda: ps.pull_rows("t", np.array([1, 2], np.int64))  # noqa: E731
        else:
            ps.declare("w", (4,))
            pull = lambda: ps.pull("w")  # noqa: E731
        pull()
        if set(ps.data_paths.values()) != {"shm"}:
            pytest.skip("no shared memory on this host")
        ps.interrupt()
        with pytest.raises(RemoteError) as caught:
            pull()
        assert caught.value.code() == grpc.StatusCode.CANCELLED
