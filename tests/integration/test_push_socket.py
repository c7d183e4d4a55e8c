"""The push socket (ps_server.push_socket): shared-memory pushes announced through a Unix
socket instead of a gRPC call, with the same answers, the same errors and the same
exactly-once promise; an owner-only socket file that its server removes (and that a starting
server clears when a dead one left it); a server out of sockets sending its clients to gRPC;
and `interrupt()` ending a push that waits on the socket."""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import uuid

import grpc
import numpy as np
import pytest
from google.rpc import status_pb2

from ps_common import shm
from ps_common.framing import read_frame, write_frame
from ps_common.status import RemoteError
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_proto.v1 import tensor_pb2
from ps_server import push_socket
from ps_server import shared_memory as server_shm
from ps_server.app import ParameterServer, ServerConfig
from ps_server.testing import InProcessCluster, wait_until
from ps_worker import PSClient

UNSUPPORTED = shm.supported()
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")

SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


def grpc_pull(cluster: InProcessCluster, name: str) -> np.ndarray:
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        return ps.pull(name)


class RawSocketClient:
    """The handshake by hand, a push slot over gRPC, then calls on the push socket."""

    def __init__(self, cluster: InProcessCluster):
        self.channel = grpc.insecure_channel(cluster.servers[0].address)
        self.stub = ps_grpc.ParameterServerStub(self.channel)
        reply = self.stub.OpenSharedMemory(
            ps_pb.OpenSharedMemoryRequest(client_id="raw-socket-client"), timeout=10)
        assert reply.offered and reply.push_socket
        self.connection = reply.connection
        self.secret = bytes(shm.attach(reply.probe, writable=False).data[:shm.SECRET_BYTES])
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(str(shm.DIRECTORY / reply.push_socket))

    def slot(self, nbytes: int) -> tuple[int, shm.Segment]:
        reply = self.stub.PushShared(ps_pb.PushSharedRequest(
            connection=self.connection, secret=self.secret, slot_bytes=nbytes), timeout=10)
        return reply.slot, shm.attach(reply.segment, writable=True)

    def call(self, request: ps_pb.PushSharedRequest) -> ps_pb.PushSocketReply:
        return self.call_raw(request.SerializeToString())

    def call_raw(self, payload: bytes) -> ps_pb.PushSocketReply:
        write_frame(self.sock, payload)
        frame = read_frame(self.sock, 1 << 20)
        assert frame is not None, "the server closed the socket instead of answering"
        return ps_pb.PushSocketReply.FromString(frame)

    def push(self, slot: int, header: ps_pb.PushHeader, *, secret: bytes | None = None):
        return self.call(ps_pb.PushSharedRequest(
            connection=self.connection, secret=self.secret if secret is None else secret,
            slot=slot, header=header))

    def close(self) -> None:
        self.sock.close()
        self.channel.close()


@pytest.fixture
def raw_client():
    made: list[RawSocketClient] = []

    def make(cluster: InProcessCluster) -> RawSocketClient:
        made.append(RawSocketClient(cluster))
        return made[-1]

    yield make
    for client in made:
        client.close()


def header(epoch: int, *, sequence: int = 1, shape=(4,)) -> ps_pb.PushHeader:
    return ps_pb.PushHeader(
        client_id="raw-socket-client", incarnation=1, sequence=sequence, acked_through=0,
        epoch=epoch, shards=[ps_pb.ShardRef(variable="w", index=0)],
        tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=list(shape))])


def error_of(reply: ps_pb.PushSocketReply) -> RemoteError:
    assert reply.status, f"expected an error, got {reply}"
    return RemoteError.from_status(status_pb2.Status.FromString(reply.status))


@pytest.fixture
def declared(make_cluster):
    """(cluster, epoch) with a float32 'w' of 4 zeros on one server."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        epoch = ps.shard_map.epoch
    cluster.wait_until_synced()
    return cluster, epoch


# ---- the path a client takes ---------------------------------------------------------------

def test_shared_memory_pushes_go_through_the_push_socket_and_land_exactly(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=1000)
    rng = np.random.default_rng(5)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(61, 10), optimizer=SGD1)
        ps.declare("b", shape=(10,), optimizer=SGD1)
        cluster.wait_until_synced()
        grads = [rng.standard_normal((61, 10)).astype(np.float32) for _ in range(4)]
        for g in grads:
            ps.push({"w": g, "b": np.ones(10, np.float32)})
        ps.push_async({"w": grads[0], "b": np.ones(10, np.float32)})
        ps.flush()
    # One header per server per push, every one of them through a socket: none over gRPC.
    assert cluster.faults.calls.get("Push", 0) == 5 * 2
    assert cluster.faults.socket_calls == 5 * 2
    w = grpc_pull(cluster, "w")
    np.testing.assert_allclose(w, -(sum(grads) + grads[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(grpc_pull(cluster, "b"), np.full(10, -5.0, np.float32))


def test_a_lost_answer_on_the_push_socket_is_retried_and_applied_once(declared):
    cluster, _ = declared
    cluster.faults.drop_response_next("Push", 2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.push({"w": np.ones(4, np.float32)})
        ps.push({"w": np.ones(4, np.float32)})
    assert cluster.faults.socket_calls >= 4  # two answers lost, each push then answered
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.full(4, -2.0, np.float32))


def test_a_server_out_of_push_sockets_sends_its_clients_to_grpc(declared, monkeypatch):
    cluster, _ = declared
    monkeypatch.setattr(push_socket, "MAX_SOCKETS", 0)
    with PSClient(cluster.coordinator_address) as ps:
        for _ in range(3):
            ps.push({"w": np.ones(4, np.float32)})
        assert ps.data_paths == {cluster.servers[0].address: "shm"}
    assert cluster.faults.socket_calls == 0
    assert cluster.faults.calls.get("Push", 0) == 3  # as PushShared over gRPC
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.full(4, -3.0, np.float32))


def test_interrupt_ends_a_push_waiting_on_the_push_socket(declared):
    cluster, _ = declared
    held = threading.Event()
    errors: list[BaseException] = []
    ps = PSClient(cluster.coordinator_address)
    try:
        ps.pull("w")  # the connection is open before the push
        cluster.faults.hold_next("Push", held)

        def push():
            try:
                ps.push({"w": np.ones(4, np.float32)})
            except BaseException as error:  # noqa: BLE001 - the test inspects it
                errors.append(error)

        pusher = threading.Thread(target=push, name="test-held-push")
        pusher.start()
        wait_until(lambda: cluster.faults.socket_calls == 1, "the push to reach the socket")
        ps.interrupt()
        pusher.join(WAIT_S)
        assert not pusher.is_alive(), "interrupt() did not end the push"
        assert len(errors) == 1 and isinstance(errors[0], RemoteError), errors
        assert errors[0].code() == grpc.StatusCode.CANCELLED
    finally:
        held.set()
        ps.close()


# ---- the socket file --------------------------------------------------------------------------

def test_the_push_socket_is_owner_only_beside_the_segments_and_removed_at_stop():
    with InProcessCluster(servers=1) as cluster:
        name = cluster.servers[0].shared.push_socket_name
        path = shm.DIRECTORY / name
        own = f"{shm.PREFIX}{os.getpid()}.{shm.process_start_time(os.getpid())}."
        assert name.startswith(own) and name.endswith(".socket"), name
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert not path.exists()


def test_the_push_socket_is_made_owner_only_without_touching_the_process_umask(
        monkeypatch, tmp_path):
    # The umask is the whole process's: a server started in a training process must not
    # change it under the process's other threads, even for a moment.
    def no_umask(mask):
        raise AssertionError(f"os.umask({mask:o}) called")

    monkeypatch.setattr(os, "umask", no_umask)
    path = tmp_path / "push.socket"
    made = push_socket.PushSocket(str(path), lambda request: ps_pb.PushSharedReply())
    try:
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert os.listdir(tmp_path) == ["push.socket"]  # nothing else left beside it
    finally:
        made.close()


def test_a_starting_server_removes_the_push_socket_a_dead_server_left():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait(WAIT_S) == 0
    serial = 900_000 + (uuid.uuid4().int % 99_999)
    path = shm.DIRECTORY / f"{shm.PREFIX}{child.pid}.777.{serial}.socket"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        left.bind(str(path))
        left.close()  # what a SIGKILLed server leaves: the file, nobody listening
        with ParameterServer(ServerConfig(grace_s=0.5)) as server:
            assert server.data_path == "shm"
            assert not path.exists()
        assert server_shm.clear_dead() == 0
    finally:
        left.close()
        if path.exists():
            path.unlink()


# ---- what the socket answers ------------------------------------------------------------------

def test_a_push_on_the_socket_is_applied_and_its_repeat_is_a_duplicate(declared, raw_client):
    cluster, epoch = declared
    client = raw_client(cluster)
    slot, segment = client.slot(16)
    np.frombuffer(segment.data, np.float32, 4)[:] = [1, 2, 3, 4]
    first = client.push(slot, header(epoch))
    assert not first.status and not first.reply.connection_lost
    assert not first.reply.reply.duplicate
    again = client.push(slot, header(epoch))
    assert again.reply.reply.duplicate
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), [-1, -2, -3, -4])


def test_a_wrong_secret_on_the_socket_is_connection_lost_and_applies_nothing(declared, raw_client):
    cluster, epoch = declared
    client = raw_client(cluster)
    slot, segment = client.slot(16)
    np.frombuffer(segment.data, np.float32, 4)[:] = 1.0
    reply = client.push(slot, header(epoch), secret=bytes(shm.SECRET_BYTES))
    assert not reply.status and reply.reply.connection_lost
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.zeros(4, np.float32))


def test_bad_pushes_on_the_socket_get_the_codes_grpc_gives(declared, raw_client):
    cluster, epoch = declared
    client = raw_client(cluster)
    slot, segment = client.slot(16)
    values = np.frombuffer(segment.data, np.float32, 4)

    values[:] = [1.0, np.nan, 0.0, 0.0]
    assert error_of(client.push(slot, header(epoch))).code() == grpc.StatusCode.INVALID_ARGUMENT
    values[:] = 1.0
    stale = error_of(client.push(slot, header(epoch - 1, sequence=2)))
    assert stale.code() == grpc.StatusCode.ABORTED and stale.stale_epoch is not None
    assert stale.stale_epoch.current_epoch == epoch
    wrong_shape = error_of(client.push(slot, header(epoch, sequence=3, shape=(5,))))
    assert wrong_shape.code() == grpc.StatusCode.INVALID_ARGUMENT
    not_mine = error_of(client.push(12345, header(epoch, sequence=4)))
    assert not_mine.code() == grpc.StatusCode.INVALID_ARGUMENT
    garbage = error_of(client.call_raw(b"\xff\xff\xff"))
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    # None of them changed anything; the socket still serves a good push afterwards.
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.zeros(4, np.float32))
    assert not client.push(slot, header(epoch, sequence=5)).status
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), -np.ones(4, np.float32))


def test_a_frame_longer_than_any_request_ends_the_socket(declared, raw_client):
    cluster, _ = declared
    client = raw_client(cluster)
    client.sock.sendall(struct.pack("<I", push_socket.MAX_REQUEST_BYTES + 1))
    assert client.sock.recv(1) == b""  # closed, nothing read further, nothing answered
    # The server goes on serving other sockets.
    with PSClient(cluster.coordinator_address) as ps:
        ps.push({"w": np.ones(4, np.float32)})
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), -np.ones(4, np.float32))


def test_a_push_answered_just_as_its_connection_is_interrupted_returns_and_drops_its_socket():
    """The answer arrives, then interrupt() marks the connection ended before the socket is
    put back: the push returns its answer and the socket is closed (once, this deadlocked)."""
    from ps_worker.shared_memory import SharedConnection

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    connection = SharedConnection(None, 1, b"", None, "ps-test")
    connection._sockets.add(mine)
    connection._idle_sockets.append(mine)

    def serve():
        read_frame(theirs, 1 << 20)
        with connection._lock:  # interrupt() between the answer and its bookkeeping (its
            connection._ended = True  # shutdown having come too late for this socket)
        write_frame(theirs, ps_pb.PushSocketReply(
            reply=ps_pb.PushSharedReply(reply=ps_pb.PushReply(duplicate=True)))
            .SerializeToString())

    answers: list = []
    server = threading.Thread(target=serve, name="test-socket-server")
    pusher = threading.Thread(target=lambda: answers.append(
        connection.push(ps_pb.PushSharedRequest(), WAIT_S)), name="test-socket-push")
    try:
        server.start()
        pusher.start()
        pusher.join(WAIT_S)
        server.join(WAIT_S)
        assert not pusher.is_alive(), "the push never returned"
    finally:
        theirs.close()
    assert len(answers) == 1 and answers[0].reply.duplicate
    assert mine.fileno() == -1 and mine not in connection._sockets
