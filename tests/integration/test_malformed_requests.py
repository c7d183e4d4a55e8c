"""What the daemons answer to malformed requests that a buggy or hostile client sends
straight over gRPC, bypassing PSClient: INVALID_ARGUMENT (or the code the error has) that
reaches the client, nothing applied, and no answer the server holds far larger than the
request and the table."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.tensors import encode_chunk
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import tensor_pb2
from ps_worker import PSClient

SHARED_MEMORY = False  # the wire itself
SGD1 = {"name": "sgd", "lr": 1.0}
CALL_S = 30.0


@pytest.fixture
def declared(make_cluster):
    """(server address, epoch): a float32 'w' of 4 zeros on one server."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        epoch = ps.shard_map.epoch
    cluster.wait_until_synced()
    yield cluster.servers[0].address, epoch


def push_header(epoch: int, shape, *, sequence: int = 1, variable: str = "w") -> bytes:
    return ps_pb.PushHeader(
        client_id="raw-client", incarnation=1, sequence=sequence, epoch=epoch,
        shards=[ps_pb.ShardRef(variable=variable, index=0)],
        tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=list(shape))],
    ).SerializeToString()


def code_of(call, *args) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=CALL_S)
    return caught.value.code()


def pulled(address: str, epoch: int) -> np.ndarray:
    with grpc.insecure_channel(address) as channel:
        reply = channel.unary_stream("/ps.v1.ParameterServer/Pull")(
            ps_pb.PullRequest(epoch=epoch, shards=[ps_pb.ShardRef(variable="w", index=0)])
            .SerializeToString(), timeout=CALL_S)
        chunks = [ps_pb.PullChunk.FromString(message) for message in reply]
    return np.frombuffer(b"".join(c.data for c in chunks), np.float32)


def test_a_push_header_whose_shape_multiplies_past_4300_digits_is_invalid_argument(declared):
    """A 300-dimension shape (2.7 KB of header) makes receive_whole format the product of
    the dimensions into its message: Python refuses to print an int of over 4300 digits,
    and the push ends INTERNAL ("see the server log") instead of INVALID_ARGUMENT."""
    address, epoch = declared
    data = np.ones(4, np.float32).tobytes()
    with grpc.insecure_channel(address) as channel:
        for method in ("PushUnary", "PushThenPull"):
            call = channel.unary_unary(f"/ps.v1.ParameterServer/{method}")
            pull = (ps_pb.PullRequest(epoch=epoch, shards=[ps_pb.ShardRef(variable="w")])
                    .SerializeToString() if method == "PushThenPull" else None)
            message = encode_chunk(push_header(epoch, [2**62] * 300), data, pull)
            assert code_of(call, message) == grpc.StatusCode.INVALID_ARGUMENT, method
    np.testing.assert_array_equal(pulled(address, epoch), np.zeros(4, np.float32))


@pytest.mark.parametrize("method, streamed", [
    ("Pull", True), ("PushShared", False), ("AttachShards", False),
    ("OpenSharedMemory", False), ("JoinSteps", False), ("CloseSharedMemory", False)])
def test_an_undecodable_request_is_invalid_argument_not_internal(declared, method, streamed):
    """PullUnary, PushUnary, Push and PushThenPull answer bytes that are no message with
    INVALID_ARGUMENT, and so does the push socket for PushShared ("the same status codes");
    the handlers registered with protobuf's FromString end such a call INTERNAL
    ("Exception deserializing request!")."""
    address, epoch = declared
    garbage = b"\xff\xff\xff"
    with grpc.insecure_channel(address) as channel:
        path = f"/ps.v1.ParameterServer/{method}"
        if streamed:
            with pytest.raises(grpc.RpcError) as caught:
                list(channel.unary_stream(path)(garbage, timeout=CALL_S))
            code = caught.value.code()
        else:
            code = code_of(channel.unary_unary(path), garbage)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_refusal_that_echoes_a_long_request_still_reaches_the_client(declared):
    """A push stream whose header gives 'w' a shape of 100,000 ones: refused, as it should
    be, but its message lists the whole shape (300 KB), over gRPC's 16 KiB limit for the
    status message, and the client gets RESOURCE_EXHAUSTED ("received metadata size exceeds
    hard limit") from its own transport instead of the server's INVALID_ARGUMENT. The same
    for a name of 1 MB that no server holds (NOT_FOUND)."""
    address, epoch = declared
    data = np.ones(4, np.float32).tobytes()
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/ps.v1.ParameterServer/Push")
        shape_code = code_of(push, iter([encode_chunk(push_header(epoch, [1] * 100_000), data)]))
        name_code = code_of(push, iter([encode_chunk(
            push_header(epoch, [4], variable="v" * 1_000_000), data)]))
    assert (shape_code, name_code) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.NOT_FOUND)
    np.testing.assert_array_equal(pulled(address, epoch), np.zeros(4, np.float32))


def test_a_row_pull_of_one_id_repeated_does_not_make_the_server_allocate_its_answer_whole(
        make_cluster):
    """A fixed table of 100 rows x 64 float32 (25.6 KB). A raw Pull naming id 0 400,000
    times (3.2 MB of request; PSClient sends each id once) makes the server gather all
    400,000 rows into one array (102 MB) before it sends a byte, and hold it while the
    client reads (or does not: until the idle timeout). Either refuse the repeats or keep
    what the answer allocates near what the request and the table hold."""
    import tracemalloc

    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("t", dim=64, num_rows=100, init="zeros", optimizer=SGD1)
        epoch = ps.shard_map.epoch
    cluster.wait_until_synced()
    request = ps_pb.PullRequest(epoch=epoch, shards=[ps_pb.ShardRef(
        variable="t", index=0, row_ids=np.zeros(400_000, "<i8").tobytes())]).SerializeToString()
    table_bytes = 100 * 64 * 4
    with grpc.insecure_channel(cluster.servers[0].address) as channel:
        tracemalloc.start()
        try:
            answer = channel.unary_stream("/ps.v1.ParameterServer/Pull")(request, timeout=CALL_S)
            try:
                next(answer)
                refused = None
            except grpc.RpcError as error:
                refused = error.code()
            peak = tracemalloc.get_traced_memory()[1]
            answer.cancel()
        finally:
            tracemalloc.stop()
    assert refused == grpc.StatusCode.INVALID_ARGUMENT or \
        peak <= 8 * (len(request) + table_bytes), f"{peak} bytes allocated"


def test_an_undecodable_request_to_the_coordinator_is_invalid_argument(make_cluster):
    cluster = make_cluster(servers=1)
    with grpc.insecure_channel(cluster.coordinator_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/ps.v1.Coordinator/GetShardMap")(b"\xff\xff\xff",
                                                                  timeout=CALL_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GetShardMap" in caught.value.details()
