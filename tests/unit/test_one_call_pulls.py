"""OneCallPull: an answer laid out as the last one checked is copied into the outputs; any
other is checked in full first, as the general pull path checks it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.shardmap import Component, Shard, ShardMap, VariableSpec
from ps_common.status import RemoteError
from ps_common.tensors import TensorMeta, decode_chunk, encode_chunk
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_worker import one_call_pulls
from ps_worker.one_call_pulls import OneCallPull

SPECS = {"w": VariableSpec("w", (6, 2), initializer=Component.of("zeros")),
         "b": VariableSpec("b", (3,), dtype="float64", initializer=Component.of("zeros"))}
# "w" in two shards on this server, answered in the order of the request: rows 3:6 first.
SHARDS = [Shard("w", 1, 3, 6, "s"), Shard("b", 0, 0, 3, "s"), Shard("w", 0, 0, 3, "s")]
SHARD_MAP = ShardMap(epoch=7, servers={"s": "127.0.0.1:1"}, variables=SPECS,
                     shards={"w": [SHARDS[2], SHARDS[0]], "b": [SHARDS[1]]})
W = np.arange(12, dtype=np.float32).reshape(6, 2)
B = np.array([0.5, -1.5, 2.25])


def a_pull() -> OneCallPull:
    return OneCallPull(SHARD_MAP, "s", ["w", "b"], SHARDS, b"request", 30.0)


def answer(w=W, b=B, *, header_shapes=((3, 2), (3,), (3, 2))) -> bytes:
    dtypes = ("float32", "float64", "float32")
    header = pb.PullHeader(tensors=[TensorMeta(d, s).to_proto()
                                    for d, s in zip(dtypes, header_shapes)])
    return encode_chunk(header.SerializeToString(), [w[3:].tobytes(), b.tobytes(),
                                                     w[:3].tobytes()])


def outputs() -> list[np.ndarray]:
    return [np.full((6, 2), np.nan, np.float32), np.full(3, np.nan)]


def test_bytes_of_counts_every_shard():
    assert a_pull().nbytes == OneCallPull.bytes_of(SHARD_MAP, SHARDS) == 12 * 4 + 3 * 8


@pytest.fixture
def full_checks(monkeypatch):
    """How many answers were decoded in full (the others were copied by their prefix)."""
    calls = []
    monkeypatch.setattr(one_call_pulls, "decode_chunk",
                        lambda raw: calls.append(1) or decode_chunk(raw))
    return calls


@pytest.mark.parametrize("answers", [1, 3])
def test_each_shards_bytes_land_in_its_rows(answers, full_checks):
    pull = a_pull()
    for i in range(answers):  # the first is checked in full, the others copied
        w, b = W + i, B * i
        out = outputs()
        pull.unpack(answer(w, b), out)
        np.testing.assert_array_equal(out[0], w)
        np.testing.assert_array_equal(out[1], b)
    assert len(full_checks) == 1


def test_an_answer_with_another_header_is_checked_in_full_and_still_lands(full_checks):
    pull = a_pull()
    pull.unpack(answer(), outputs())
    # Another header of the same length in bytes (a server may say something else in it).
    other = answer(W * 2, header_shapes=((2, 3), (3,), (3, 2)))
    for i in range(2):  # checked in full once, then its prefix is the one copied by
        out = outputs()
        pull.unpack(other, out)
        np.testing.assert_array_equal(out[0], W * 2)
    assert len(full_checks) == 2
    pull.unpack(answer(), outputs())
    assert len(full_checks) == 3


@pytest.mark.parametrize("checked_before", [False, True])
@pytest.mark.parametrize("size,message", [(-1, "ended after"), (1, "more than")],
                         ids=["a-byte-short", "a-byte-too-many"])
def test_an_answer_of_another_size_is_refused(checked_before, size, message):
    pull = a_pull()
    if checked_before:
        pull.unpack(answer(), outputs())
    header = pb.PullHeader().SerializeToString()
    with pytest.raises(InvalidArgument, match=f"pull from s: .*{message}"):
        pull.unpack(encode_chunk(header, bytes(pull.nbytes + size)), outputs())


def test_a_malformed_answer_is_internal_as_from_grpc():
    pull = a_pull()
    pull.unpack(answer(), outputs())
    with pytest.raises(RemoteError) as caught:
        pull.unpack(b"\x12\xff", outputs())
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.target == "s"

