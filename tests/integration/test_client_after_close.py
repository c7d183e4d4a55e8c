"""PSClient after close(), and close() from another thread while a call of this client
retries. close() "releases threads and channels" and tells the coordinator the
instance is done; errors of the API are RemoteError (README, "Errors"). A call made after
close, or cut short by it, must fail with RemoteError and send nothing, not reopen a
channel, apply a push under a released incarnation, or leak RuntimeError / ValueError."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

WAIT_S = 30.0  # a bound a sound build never reaches
SGD1 = {"name": "sgd", "lr": 1.0}

AFTER_CLOSE = {
    # "b" lives whole on one server, "w" is split over both.
    "pull one server": lambda ps: ps.pull("b"),
    "push one server": lambda ps: ps.push({"b": np.ones(10, np.float32)}),
    "pull two servers": lambda ps: ps.pull("w"),
    "push two servers": lambda ps: ps.push({"w": np.ones((100, 10), np.float32)}),
    "push_async": lambda ps: ps.push_async({"b": np.ones(10, np.float32)}).result(WAIT_S),
    "pull_async": lambda ps: ps.pull_async("b").result(WAIT_S),
    "refresh": lambda ps: ps.refresh(),
    "declare": lambda ps: ps.declare("late", shape=(3,)),
}


@pytest.mark.parametrize("call", list(AFTER_CLOSE), ids=list(AFTER_CLOSE))
def test_a_call_after_close_raises_remote_error_and_applies_nothing(make_cluster, call):
    cluster = make_cluster(servers=2, split_threshold_bytes=1000)
    ps = PSClient(cluster.coordinator_address)
    ps.declare("w", shape=(100, 10), optimizer=SGD1)
    ps.declare("b", shape=(10,), optimizer=SGD1)
    assert len({s.server_id for s in ps.shard_map.shards["w"]}) == 2
    ps.pull(["w", "b"])  # channels (and shared memory) open
    # A push of zeros: the client has its incarnation (changes no value).
    ps.push({"w": np.zeros((100, 10), np.float32), "b": np.zeros(10, np.float32)})
    ps.close()
    with pytest.raises(RemoteError):
        AFTER_CLOSE[call](ps)
    with PSClient(cluster.coordinator_address) as other:
        np.testing.assert_array_equal(other.pull("b"), np.zeros(10, np.float32))
        np.testing.assert_array_equal(other.pull("w"), np.zeros((100, 10), np.float32))
        assert "late" not in other.refresh().variables


def test_close_from_another_thread_ends_a_retrying_pull_with_remote_error(make_cluster, spawn):
    cluster = make_cluster(servers=1, shared_memory=False)
    # Retries one second apart: the pull is waiting to retry when close() comes.
    patient = RetryPolicy(max_attempts=1000, initial_backoff_s=1.0, max_backoff_s=1.0,
                          jitter=0.0)
    ps = PSClient(cluster.coordinator_address, shared_memory=False, retry=patient)
    ps.declare("w", shape=(4,), optimizer=SGD1)
    before = cluster.faults.calls.get("Pull", 0)
    cluster.faults.fail_next("Pull", 1000)  # UNAVAILABLE: the pull retries
    try:
        pulling = spawn(ps.pull, "w")
        wait_until(lambda: cluster.faults.calls.get("Pull", 0) >= before + 2,
                   "the pull retrying", timeout_s=WAIT_S)
        ps.close()
        with pytest.raises(RemoteError) as caught:
            pulling.result()
        assert caught.value.code() in (grpc.StatusCode.CANCELLED,
                                       grpc.StatusCode.FAILED_PRECONDITION), caught.value
    finally:
        cluster.faults.fail_next("Pull", 0)
        ps.close()
