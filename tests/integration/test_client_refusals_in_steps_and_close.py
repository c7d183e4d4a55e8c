"""The client in two corners: a push refused for NaN or Inf by the one server it goes to,
while the client takes part in steps on several; and close() from another thread while a
streamed call waits to retry.

Every wait is bounded (a bound a sound build never reaches), ports come from the OS, and
every cluster and thread is ended by the fixtures."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_worker import PSClient, RemoteError

WAIT_S = 30.0  # bound of every wait; never reached when the code is right
SGD1 = {"name": "sgd", "lr": 1.0}


def step_gate(server):
    """A server's StepGate (read only: the steps it counted)."""
    return server._servicer.steps


def server_index(cluster, server_id: str) -> int:
    return next(i for i, s in enumerate(cluster.servers) if s.server_id == server_id)


# ---- a refused push changes nothing, in the steps too -----------------------------------

@pytest.mark.parametrize("mode", ["sync", "ssp:1"])
@pytest.mark.parametrize("shared", [False, True], ids=["grpc", "shm"])
def test_a_refused_non_finite_push_to_one_server_counts_no_step_on_the_others(
        make_cluster, mode, shared):
    """A push with a NaN or Inf is refused (INVALID_ARGUMENT) and changes nothing. A client
    in steps carries its step to every server with each push (an empty push to those its
    gradients do not go to). A push to one server that checks was left to that server's
    check while the empty step pushes went out beside it: the other servers counted the
    refused push as the client's step, and its steps drifted apart with every refusal."""
    cluster = make_cluster(servers=2, shared_memory=shared)
    with PSClient(cluster.coordinator_address, shared_memory=shared) as ps:
        ps.declare("b", shape=(4,), optimizer=SGD1)  # small: whole on one server
        (holder,) = {s.server_id for s in ps.shard_map.shards_of("b")}
        other = cluster.servers[1 - server_index(cluster, holder)]
        ps.join_steps(mode)
        ps.push({"b": np.ones(4, np.float32)})  # a good step: the holder says it checks
        assert ps.shard_map.servers[holder] in ps._servers_checking

        def counted(server):
            gate = step_gate(server)
            if mode == "sync":
                return gate.current_step()
            return gate._members[ps.client_id].done  # ssp: steps finished

        before = counted(other)
        bad = np.array([1.0, np.nan, 0.0, 0.0], np.float32)
        with pytest.raises(RemoteError) as refused:
            ps.push({"b": bad})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        np.testing.assert_array_equal(ps.pull("b"), np.full(4, -1.0, np.float32))
        assert counted(other) == before, (
            f"the refused push counted as a step on server {other.server_id}, which got none "
            f"of its gradients ({before} -> {counted(other)})")


# ---- close() from another thread while a streamed call waits to retry --------------------

class _GatedBackoff(threading.Event):
    """Stands in for PSClient._interrupted (the `stop` event of its retries): a retry's
    backoff wait signals `waiting` and lasts until the test sets `go`, so that the test
    knows the call is between two attempts. Set as an event, it behaves as the real one."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()
        self.go = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        self.go.wait(WAIT_S)
        return self.is_set()


STREAMED = {
    # 100 float32 = 400 bytes, over the client's chunk_bytes of 64: a stream each way.
    "pull": lambda ps: ps.pull("w"),
    "push": lambda ps: ps.push({"w": np.ones(100, np.float32)}),
}


@pytest.mark.parametrize("call", list(STREAMED))
def test_close_from_another_thread_ends_a_retrying_streamed_call_with_remote_error(
        make_cluster, spawn, call):
    """Any call after close(), or made while it runs, fails with RemoteError. A pull or push
    larger than one message is a stream; a retry of one that began after another thread's
    close() raised grpc's bare ValueError ("Cannot invoke RPC: Channel closed!"), where the
    same call one message long ended with RemoteError."""
    cluster = make_cluster(servers=1, shared_memory=False)
    ps = PSClient(cluster.coordinator_address, shared_memory=False, chunk_bytes=64)
    try:
        ps.declare("w", shape=(100,), optimizer=SGD1)
        ps.push({"w": np.zeros(100, np.float32)})  # channel open, incarnation registered
        gate = _GatedBackoff()
        ps._interrupted = gate
        method = "Pull" if call == "pull" else "Push"
        cluster.faults.fail_next(method, 1)  # UNAVAILABLE: the call waits to retry
        running = spawn(STREAMED[call], ps)
        assert gate.waiting.wait(WAIT_S), "the call never waited to retry"
        ps.close()  # from this thread, while the call waits between two attempts
        gate.go.set()
        with pytest.raises(RemoteError) as caught:
            running.result()
        assert caught.value.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                       grpc.StatusCode.CANCELLED), caught.value
    finally:
        cluster.faults.fail_next("Pull", 0)
        cluster.faults.fail_next("Push", 0)
        gate_event = getattr(ps, "_interrupted", None)
        if isinstance(gate_event, _GatedBackoff):
            gate_event.go.set()
        ps.close()
