"""Pulls sent again and again over gRPC: a server answers a request it has checked before
from what it remembered (ps_server.unary_pulls), a client sends a pull it has made before as
it is (ps_worker.one_call_pulls). Either must answer the values as they are now, and neither
may outlive the placement it was made for."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import tensor_pb2
from ps_common.tensors import decode_chunk
from ps_server.store import ShardStore
from ps_worker import PSClient

SHARED_MEMORY = False  # what is tested here is the gRPC path
SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(servers=1)


@pytest.fixture
def ps(cluster):
    with PSClient(cluster.coordinator_address, shared_memory=False) as client:
        client.declare("w", (4, 3), init={"name": "constant", "value": 1.0}, optimizer=SGD1)
        yield client


@pytest.fixture
def pull_unary(ps):
    """PullUnary with request bytes as they are, answers as bytes; closes its channel."""
    shard_map = ps.shard_map
    channel = grpc.insecure_channel(shard_map.servers[shard_map.shards["w"][0].server_id])
    yield channel.unary_unary("/ps.v1.ParameterServer/PullUnary")
    channel.close()


def request_bytes(epoch: int, wire: int = 0) -> bytes:
    return ps_pb.PullRequest(epoch=epoch, shards=[ps_pb.ShardRef(variable="w", index=0)],
                             wire_dtype=wire).SerializeToString()


def values_of(answer: bytes, dtype: str = "float32") -> np.ndarray:
    return np.frombuffer(decode_chunk(answer).data, dtype).reshape(4, 3)


@pytest.fixture
def counted(monkeypatch):
    """Calls of the general paths: the server's check of a pull, the client's planned pull."""
    calls = {"check_pull": 0, "_pull_from": 0}
    for cls, name in ((ShardStore, "check_pull"), (PSClient, "_pull_from")):
        def counting(*args, _name=name, _inner=getattr(cls, name), **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)
        monkeypatch.setattr(cls, name, counting)
    return calls


def test_the_same_request_bytes_answer_the_values_after_each_push(ps, pull_unary, counted):
    request = request_bytes(ps.shard_map.epoch)
    for step in range(3):
        np.testing.assert_array_equal(values_of(pull_unary(request, timeout=10)), 1.0 - step)
        ps.push({"w": np.ones((4, 3), np.float32)})
    assert counted["check_pull"] == 1  # the first; the others were answered from memory


def test_a_narrowed_request_answers_its_values_converted_after_each_push(ps, pull_unary):
    request = request_bytes(ps.shard_map.epoch, tensor_pb2.FLOAT16)
    for step in range(3):
        np.testing.assert_array_equal(values_of(pull_unary(request, timeout=10), "float16"),
                                      np.float16(1.0 - 0.5 * step))
        ps.push({"w": np.full((4, 3), 0.5, np.float32)})


def test_a_request_of_an_older_placement_is_refused_after_it_changed(cluster, ps, pull_unary):
    old = request_bytes(ps.shard_map.epoch)
    pull_unary(old, timeout=10)  # answered, and remembered
    ps.declare("v", (2,))  # a new shard map epoch
    cluster.wait_until_synced()
    with pytest.raises(grpc.RpcError) as caught:
        pull_unary(old, timeout=10)
    assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value
    assert "is stale" in caught.value.details()
    ps.push({"w": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(
        values_of(pull_unary(request_bytes(ps.refresh().epoch), timeout=10)), 0.0)


@pytest.mark.parametrize("request_", [b"\xff\xff\xff", b"\x0a\x05ab"], ids=["bad-varint", "short"])
def test_malformed_request_bytes_are_invalid_argument_every_time(pull_unary, request_):
    for _ in range(2):  # nothing about a bad request is remembered
        with pytest.raises(grpc.RpcError) as caught:
            pull_unary(request_, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert "malformed pull request" in caught.value.details()


def test_push_pull_with_the_same_pull_answers_the_values_after_its_push(ps):
    for step in range(1, 4):
        pulled = ps.push_pull({"w": np.ones((4, 3), np.float32)}, "w")
        np.testing.assert_array_equal(pulled, 1.0 - step)


def test_a_client_pulling_again_sees_another_clients_pushes(ps, counted):
    with PSClient(ps.coordinator, shared_memory=False) as other:
        for step in range(3):
            np.testing.assert_array_equal(ps.pull("w"), 1.0 - step)
            other.push({"w": np.ones((4, 3), np.float32)})
    assert counted["_pull_from"] == 1  # then the pull it kept


def test_a_client_pulling_again_fills_out_and_returns_it(ps):
    out = np.full((4, 3), -7.0, np.float32)
    for step in range(2):
        assert ps.pull("w", out={"w": out}) is out
        np.testing.assert_array_equal(out, 1.0 - step)
        ps.push({"w": np.ones((4, 3), np.float32)})
    bad = np.empty((3, 4), np.float32)
    with pytest.raises(ValueError, match="out\\['w'\\]"):
        ps.pull("w", out={"w": bad})


def test_a_client_pulling_several_names_again_gets_each_of_them(ps):
    ps.declare("b", (5,), init={"name": "constant", "value": 2.0}, optimizer=SGD1)
    for step in range(3):
        pulled = ps.pull(["w", "b", "w"])
        assert list(pulled) == ["w", "b"]
        np.testing.assert_array_equal(pulled["w"], 1.0 - step)
        np.testing.assert_array_equal(pulled["b"], 2.0 - step)
        ps.push({"w": np.ones((4, 3), np.float32), "b": np.ones(5, np.float32)})


def test_a_kept_pull_refused_for_a_stale_map_is_made_again_with_the_new_one(cluster, ps,
                                                                              counted):
    ps.pull("w")
    ps.pull("w")
    with PSClient(ps.coordinator, shared_memory=False) as other:
        other.declare("v", (2,))  # a new epoch this client has not seen
        cluster.wait_until_synced()
        other.push({"w": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(ps.pull("w"), 0.0)  # refused as stale, then made again
    assert counted["_pull_from"] == 2
    assert ps._one_call_pulls[(("w",), None)].shard_map is ps.shard_map
    ps.pull("w")
    assert counted["_pull_from"] == 2


def test_a_client_with_shared_memory_keeps_no_pull(make_cluster):
    cluster = make_cluster(servers=1, shared_memory=True)
    with PSClient(cluster.coordinator_address) as client:
        client.declare("w", (4, 3))
        for _ in range(3):
            client.pull("w")
        assert client.data_paths == {cluster.servers[0].address: "shm"}
        assert client._one_call_pulls == {}


def test_a_client_pulling_again_follows_a_new_shard_map(ps):
    ps.pull("w")
    ps.pull("w")
    kept = dict(ps._one_call_pulls)
    assert [key for key in kept] == [(("w",), None)]  # the pull is kept after it succeeded
    ps.declare("v", (2,))  # the map changes: what was kept is for the old one
    ps.refresh()
    ps.push({"w": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(ps.pull("w"), 0.0)
    assert ps._one_call_pulls[(("w",), None)].shard_map is ps.shard_map

