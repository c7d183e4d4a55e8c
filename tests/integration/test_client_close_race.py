"""A call made while close() is under way (close() waits for a push in flight) is a call
after close(): a push_async made once close() has begun raises RemoteError
FAILED_PRECONDITION ('this PSClient is closed'), never the pool's RuntimeError."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_server.testing import wait_until
from ps_worker import PSClient

SHARED_MEMORY = False
WAIT_S = 30.0


def test_push_async_while_close_waits_for_a_push_raises_remote_error(make_cluster, spawn):
    cluster = make_cluster(servers=1)
    ps = PSClient(cluster.coordinator_address, shared_memory=False)
    ps.declare("b", shape=(10,), optimizer={"name": "sgd", "lr": 1.0})
    ps.pull("b")
    release = threading.Event()
    before = cluster.faults.calls.get("Push", 0)
    cluster.faults.hold_next("Push", release)
    try:
        held = ps.push_async({"b": np.zeros(10, np.float32)})
        wait_until(lambda: cluster.faults.calls.get("Push", 0) > before, "the push held",
                   timeout_s=WAIT_S)
        closing = spawn(ps.close)
        # close() has begun: its first step shuts the push pool down (and waits for it).
        wait_until(lambda: ps._async_pool._shutdown, "close() under way", timeout_s=WAIT_S)
        with pytest.raises(RemoteError) as refused:
            ps.push_async({"b": np.ones(10, np.float32)})
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        release.set()
        ps.close()
    held.result(WAIT_S)
    closing.result()
