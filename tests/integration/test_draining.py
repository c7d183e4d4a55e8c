"""A stopping parameter server drains: its gRPC health says NOT_SERVING while the Pull and
Push streams in flight finish, it refuses new streams with UNAVAILABLE (unary calls, which
hold nothing open, are still served), and it stops once they have ended."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.rpc import RetryPolicy, make_channel
from ps_common.status import RemoteError
from ps_worker import PSClient

SHARED_MEMORY = False  # the streams drained are gRPC's
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


class _Context:
    """What StreamLimiter.admit needs of a call: a stream in flight, held by the test."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def cancel(self) -> None:
        pass


def health(address: str) -> str:
    with make_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_health_is_not_serving_while_a_server_drains_its_streams(make_cluster, spawn):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8,), dtype="float32", init="zeros", seed=0)
    assert health(server.bound_address) == "SERVING"

    in_flight = server.streams.admit(_Context(), "Push")  # a push still streaming
    stopping = spawn(server.stop, 60.0)
    deadline = time.monotonic() + WAIT_S
    while health(server.bound_address) != "NOT_SERVING":
        assert time.monotonic() < deadline, "health never said NOT_SERVING"
        time.sleep(0.01)
    assert not stopping.done.is_set()  # still draining: the stream has not ended

    # A new stream is refused (clients retry UNAVAILABLE), the held one still counts.
    # (chunk_bytes=16: the 32-byte pull is streamed, not a unary call, which is served.)
    with PSClient(cluster.coordinator_address, chunk_bytes=16,
                  retry=RetryPolicy(max_attempts=1)) as ps, pytest.raises(RemoteError) as refused:
        ps.pull("w")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopping" in str(refused.value)
    assert not stopping.done.is_set()

    in_flight.__exit__(None, None, None)  # the push ends: the drain is over
    stopping.result()
    assert server.wait(timeout=WAIT_S)
    with pytest.raises(grpc.RpcError) as gone:
        health(server.bound_address)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_with_no_stream_in_flight_stops_without_waiting_out_its_grace(make_cluster):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), dtype="float32", init="zeros", seed=0)
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(4, np.float32))
    assert server.streams.drain(0.0)  # nothing open: drained at once, whatever the grace
