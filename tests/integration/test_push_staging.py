"""Pushes past a server's --push-memory wait in a file in --spill-dir until all of each has
arrived: applied exactly as from memory, all or nothing, and never left on disk."""

from __future__ import annotations

import os
import threading
import uuid

import grpc
import numpy as np
import pytest

from ps_common.rpc import make_channel
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.app import ServerConfig
from ps_server.cli import build_parser, config_from_args
from ps_server.testing import first_shard_push_header, wait_until
from ps_worker import PSClient, RemoteError

SHARED_MEMORY = False
SGD1 = {"name": "sgd", "lr": 1.0}
ZEROS = {"name": "constant", "value": 0.0}
WAIT_S = 30.0
SHAPE = (64, 32)  # 8 KiB: 128 chunks of 64 bytes


@pytest.fixture
def staged_cluster(make_cluster, tmp_path):
    """One server whose every streamed push waits in a file in `tmp_path`."""
    return make_cluster(servers=1, chunk_bytes=64, push_memory_bytes=0, spill_dir=tmp_path)


def staging(cluster):
    return cluster.servers[0].push_staging


def test_a_staged_push_is_applied_exactly(staged_cluster, tmp_path):
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        grad = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) / 7
        ps.push({"w": grad})
        ps.push({"w": grad})
        np.testing.assert_array_equal(ps.pull("w"), -2 * grad)
    assert staging(staged_cluster).staged_pushes == 2
    assert os.listdir(tmp_path) == []


def test_a_staged_push_with_a_non_finite_value_changes_nothing(staged_cluster):
    """A raw stream with a NaN reaches the server's check of a staged push."""
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        grad = np.ones(SHAPE, np.float32)
        grad[-1, -1] = np.nan
        with RawPush(staged_cluster, ps, "w") as push:
            push.send(grad.tobytes())
        assert push.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in push.details()
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(SHAPE, np.float32))
    assert staging(staged_cluster).staged_pushes == 1


def test_a_staged_push_that_ends_short_changes_nothing_and_leaves_no_file(staged_cluster,
                                                                          tmp_path):
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        data = np.ones(SHAPE, np.float32).tobytes()
        with RawPush(staged_cluster, ps, "w") as push:
            push.send(data[:len(data) // 2], end=False)
            wait_until(lambda: staging(staged_cluster).staged_pushes == 1,
                       "the server to stage the push")
            # Half of it is in the file by now, and the file has no name: a server killed
            # here leaves nothing behind.
            assert os.listdir(tmp_path) == []
        assert push.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ended after" in push.details()
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(SHAPE, np.float32))
        ps.push({"w": np.ones(SHAPE, np.float32)})  # the server goes on
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(SHAPE, np.float32))
    assert os.listdir(tmp_path) == []


def test_a_staged_push_reuses_the_file_of_earlier_ones_and_reads_none_of_their_bytes(
        staged_cluster, tmp_path):
    """Staging files are kept for the next push to write over; what earlier pushes left in
    the file (a whole push, half of a broken one, a larger variable's push) never reaches
    the values."""
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        ps.declare("big", shape=(2 * SHAPE[0], SHAPE[1]), init=ZEROS, optimizer=SGD1)
        ps.push({"big": np.full((2 * SHAPE[0], SHAPE[1]), 1000.0, np.float32)})
        with RawPush(staged_cluster, ps, "w") as push:
            push.send(np.full(SHAPE, 7.0, np.float32).tobytes()[:4096], end=False)
            wait_until(lambda: staging(staged_cluster).staged_pushes == 2,
                       "the server to stage the broken push")
        assert push.code() == grpc.StatusCode.INVALID_ARGUMENT
        grad = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) / 3
        ps.push({"w": grad})
        np.testing.assert_array_equal(ps.pull("w"), -grad)
        ps.push({"w": grad})
        np.testing.assert_array_equal(ps.pull("w"), -2 * grad)
    assert staging(staged_cluster).staged_pushes == 4
    assert staging(staged_cluster).staging_files_made == 1
    assert os.listdir(tmp_path) == []


def test_a_push_staged_after_a_refused_one_is_applied_exactly(staged_cluster):
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        refused = np.full(SHAPE, 1000.0, np.float32)
        refused[-1, -1] = np.inf
        with RawPush(staged_cluster, ps, "w") as push:
            push.send(refused.tobytes())
        assert push.code() == grpc.StatusCode.INVALID_ARGUMENT
        grad = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) / 3
        ps.push({"w": grad})
        np.testing.assert_array_equal(ps.pull("w"), -grad)
    assert staging(staged_cluster).staged_pushes == 2


def test_kept_staging_files_are_closed_when_the_server_stops(staged_cluster, tmp_path):
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        ps.push({"w": np.ones(SHAPE, np.float32)})
    kept = staging(staged_cluster)
    assert kept.idle_file_bytes() == np.prod(SHAPE) * 4
    assert len(open_files_in(tmp_path)) == 1  # unlinked, kept open for the next push
    staged_cluster.stop()
    assert kept.idle_file_bytes() == 0
    assert open_files_in(tmp_path) == []


def open_files_in(directory) -> list[str]:
    """What this process's descriptors of files in `directory` point to (Linux's /proc)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if target.startswith(f"{directory}/"):
            targets.append(target)
    return targets


def test_pushes_within_the_memory_bound_are_not_staged(make_cluster, tmp_path):
    cluster = make_cluster(servers=1, chunk_bytes=64, push_memory_bytes=1 << 20,
                           spill_dir=tmp_path)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        ps.push({"w": np.ones(SHAPE, np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(SHAPE, np.float32))
    assert staging(cluster).staged_pushes == 0


def test_a_spill_dir_without_room_refuses_the_push_and_changes_nothing(staged_cluster,
                                                                       monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with PSClient(staged_cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=SHAPE, init=ZEROS, optimizer=SGD1)
        with pytest.raises(RemoteError) as raised:
            ps.push({"w": np.ones(SHAPE, np.float32)})
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--spill-dir" in str(raised.value) and "--push-memory" in str(raised.value)
        monkeypatch.undo()
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(SHAPE, np.float32))


@pytest.mark.parametrize("flags, fault", [
    (["--spill-dir", "/nonexistent/spill"], "--spill-dir"),
    (["--push-memory", "-1"], "--push-memory"),
])
def test_bad_staging_flags_exit_naming_the_flag(flags, fault, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        config_from_args(parser, parser.parse_args(["--coordinator", "127.0.0.1:1", *flags]),
                         environ={})
    assert exited.value.code == 2
    assert fault in capsys.readouterr().err


def test_the_default_bound_is_a_quarter_of_what_the_server_holds(make_cluster):
    assert ServerConfig().push_memory_bytes is None
    cluster = make_cluster(servers=1)
    bound = staging(cluster).memory_bound
    assert bound() == 16 << 20  # holding nothing: the floor
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("big", shape=(1 << 24,), init=ZEROS, optimizer=SGD1)  # 64 MiB
        ps.declare("adam", shape=(1 << 24,), init=ZEROS,
                   optimizer={"name": "adam"})  # 64 MiB of values, 128 of slots
    assert bound() == (64 + 64 + 128 << 20) // 4


class RawPush:
    """A raw Push stream of one tensor to shard 0 of `name`: `send(data, end=False)` sends
    `data` in 64-byte chunks and, unless `end` is False, ends the stream; leaving the block
    ends it in any case, whether or not all the bytes its header announced were sent."""

    def __init__(self, cluster, ps: PSClient, name: str):
        self._header = first_shard_push_header(ps.shard_map, name, f"raw-{uuid.uuid4().hex}")
        self._channel = make_channel(cluster.servers[0].address)
        self._pieces: list[bytes] = []
        self._ended = threading.Event()
        self._more = threading.Condition()
        self.future = None

    def _chunks(self):
        sent = 0
        while True:
            with self._more:
                self._more.wait_for(lambda: len(self._pieces) > sent or self._ended.is_set(),
                                    timeout=WAIT_S)
                pieces, ended = self._pieces[sent:], self._ended.is_set()
            for piece in pieces:
                yield ps_pb.PushChunk(header=self._header if sent == 0 else None, data=piece)
                sent += 1
            if ended and sent == len(self._pieces):
                return

    def send(self, data: bytes, end: bool = True) -> None:
        with self._more:
            self._pieces += [data[i:i + 64] for i in range(0, len(data), 64)]
            if end:
                self._ended.set()
            self._more.notify_all()

    def __enter__(self) -> "RawPush":
        stub = ps_grpc.ParameterServerStub(self._channel)
        self.future = stub.Push.future(self._chunks(), timeout=WAIT_S)
        return self

    def __exit__(self, *exc) -> None:
        with self._more:
            self._ended.set()
            self._more.notify_all()
        self.future.exception(timeout=WAIT_S)
        self._channel.close()

    def code(self) -> grpc.StatusCode:
        error = self.future.exception(timeout=WAIT_S)
        return grpc.StatusCode.OK if error is None else error.code()

    def details(self) -> str:
        error = self.future.exception(timeout=WAIT_S)
        return "" if error is None else error.details()
