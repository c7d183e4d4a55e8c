"""A server that received a lost server's shard (moved from the checkpoint) restarts before
the next checkpoint: its own shards come back from the checkpoint with its exactly-once
ledger (the moved shard, saved by the lost server, does not keep it from coming back), so a
push it applied before the checkpoint and that its client retries across the restart is
applied once.

`moved=False` is the control: the same restart without the move.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.rpc import make_channel
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.testing import first_shard_push_header, wait_until
from ps_worker import PSClient, RetryPolicy

SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0


def raw_push(address: str, header: ps_pb.PushHeader, epoch: int) -> ps_pb.PushReply:
    """One push of ones (the same client, incarnation and sequence each time: a retry)."""
    header = ps_pb.PushHeader.FromString(header.SerializeToString())
    header.epoch = epoch
    data = np.ones(list(header.tensors[0].shape), np.float32).tobytes()
    channel = make_channel(address)
    try:
        stub = ps_grpc.ParameterServerStub(channel)
        return stub.Push(iter([ps_pb.PushChunk(header=header, data=data)]), timeout=WAIT_S)
    finally:
        channel.close()


@pytest.mark.parametrize("moved", [False, True])
def test_a_push_retried_across_a_restart_is_applied_once_after_a_move(
        make_cluster, tmp_path, moved):
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path, server_timeout_s=0.5)
    state = cluster.coordinator.state
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("a", shape=(6,), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(6,), init="zeros", optimizer=SGD1)
        keeper = ps.shard_map.shards_of("a")[0].server_id
        lost = ps.shard_map.shards_of("b")[0].server_id
        assert keeper != lost
        index = next(i for i, s in enumerate(cluster.servers) if s.server_id == keeper)

        # A push to a, applied on its server, goes into the checkpoint with its ledger entry.
        header = first_shard_push_header(ps.shard_map, "a", "raw-retrier")
        reply = raw_push(cluster.servers[index].address, header, ps.shard_map.epoch)
        assert not reply.duplicate
        cluster.checkpoint()  # a = -1, and the ledger says raw-retrier's push 1 is applied

        if moved:
            # b's server goes for good: b moves to a's server from the checkpoint.
            next(s for s in cluster.servers if s.server_id == lost).stop(grace_s=0.5)
            wait_until(lambda: {s.server_id for s in state.shard_map.shards_of("b")}
                       == {keeper}, "b moves to the live server", WAIT_S)
            wait_until(lambda: state.shards_restored == 1, "b is restored there", WAIT_S)

        # a's server restarts (empty) and restores a (and b) from the checkpoint.
        restored_before = state.shards_restored
        server = cluster.restart_server(index)
        wait_until(lambda: state.shards_restored > restored_before,
                   "the restarted server restores its shards", WAIT_S)
        ps.refresh()
        np.testing.assert_array_equal(ps.pull("a"), np.full(6, -1.0, np.float32))

        # The push's client never got its answer and retries it: applied exactly once.
        reply = raw_push(server.address, header, ps.refresh().epoch)
        assert reply.duplicate
        np.testing.assert_array_equal(ps.pull("a"), np.full(6, -1.0, np.float32))
