"""Health checks and the control plane always find a handler thread (README, Failure
behaviour), also while Pull/Push streams take up to --max-streams threads and unary pushes
waiting for their sync step (no stream slot; at most --max-streams clients take part in the
steps) take up to as many more: the pool is sized for both (streams.handler_threads)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.tensors import encode_chunk
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import tensor_pb2
from ps_server.streams import CONTROL_PLANE_THREADS
from ps_server.testing import wait_until
from ps_worker import PSClient

SHARED_MEMORY = False
MAX_STREAMS = CONTROL_PLANE_THREADS + 1  # 17: the pool has 33 threads
WAIT_S = 60.0  # bound of every wait here
STEP_WAIT_S = 20.0  # the product's 30 s step bound, shortened (the first event if the pool is full)
SERVICE = "/ps.v1.ParameterServer/"


def test_waiting_stepped_pushes_and_open_streams_leave_a_thread_for_health_checks(
        make_cluster):
    cluster = make_cluster(servers=1, max_streams=MAX_STREAMS, stream_idle_timeout_s=300.0)
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer={"name": "sgd", "lr": 1.0})
        epoch = ps.shard_map.epoch
    cluster.wait_until_synced()
    gate = server._servicer.steps
    gate._wait_s = STEP_WAIT_S
    release = threading.Event()
    channel = grpc.insecure_channel(server.address)
    pushes, streams = [], []
    try:
        join = channel.unary_unary(SERVICE + "JoinSteps")
        for i in range(MAX_STREAMS):  # as many step members as the server takes
            join(ps_pb.JoinStepsRequest(client_id=f"c{i}", incarnation=1, mode="sync",
                                        replicas=1).SerializeToString(), timeout=WAIT_S)
        push = channel.unary_unary(SERVICE + "PushUnary")
        for i in range(MAX_STREAMS - 1):  # all but the last push step 0 and wait for it
            header = ps_pb.PushHeader(
                client_id=f"c{i}", incarnation=1, sequence=1, epoch=epoch, step=0,
                shards=[ps_pb.ShardRef(variable="w", index=0)],
                tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[4])],
            ).SerializeToString()
            pushes.append(push.future(
                encode_chunk(header, np.ones(4, np.float32).tobytes(), None),
                timeout=WAIT_S))
        wait_until(lambda: len(gate._pending.contributions) == MAX_STREAMS - 1,
                   "the pushes wait in the step", WAIT_S)

        def silent():  # a push stream whose client has not sent its first chunk yet
            release.wait(WAIT_S)
            return
            yield

        open_push = channel.stream_unary(SERVICE + "Push")
        for _ in range(MAX_STREAMS):  # as many streams as --max-streams admits
            streams.append(open_push.future(silent(), timeout=WAIT_S))
        wait_until(lambda: server.streams.active == MAX_STREAMS, "the streams are open",
                   WAIT_S)

        health = health_pb2_grpc.HealthStub(channel).Check.future(
            health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        wait_until(lambda: health.done() or any(p.done() for p in pushes),
                   "the health check or a push is answered", WAIT_S)
        answered_pushes = sum(p.done() for p in pushes)
        assert health.done() and answered_pushes == 0, (
            f"the health check was answered only once {answered_pushes} waiting push(es) "
            "ended (their step timed out) and gave their handler threads back")
        assert health.result().status == health_pb2.HealthCheckResponse.SERVING
    finally:
        release.set()
        # The last member leaves: the step is applied and the waiting pushes are answered.
        channel.unary_unary(SERVICE + "LeaveSteps")(ps_pb.LeaveStepsRequest(
            client_id=f"c{MAX_STREAMS - 1}", incarnation=1).SerializeToString(),
            timeout=WAIT_S)
        for future in pushes + streams:
            try:
                future.result()
            except grpc.RpcError:
                pass
        channel.close()
