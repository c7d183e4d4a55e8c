"""The push socket (ps_server.push_socket) served on its own, with a trivial handler: a peer
that misbehaves on it, or a thread that cannot be started, leaves no thread or socket
behind and does not stop it serving others."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest

from ps_common import shm
from ps_common.framing import read_frame, write_frame
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_server import push_socket

pytestmark = pytest.mark.skipif(shm.supported() is not None,
                                reason=f"no shared memory here: {shm.supported()}")

WAIT_S = 30.0  # bound of every wait; never reached when the code is right
GARBAGE = b"\xff\xff\xff"  # no PushSharedRequest: answered INVALID_ARGUMENT


def _serving_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "push-socket"}


def _answered(sock: socket.socket) -> ps_pb.PushSocketReply:
    frame = read_frame(sock, 1 << 20)
    assert frame is not None, "the server closed the socket instead of answering"
    return ps_pb.PushSocketReply.FromString(frame)


def test_close_ends_a_socket_whose_peer_reads_none_of_its_answers(tmp_path, monkeypatch):
    """A peer (any process of the server's user can connect) sends many malformed requests
    back to back and reads none of the answers: the serving thread blocks sending once the
    socket's send buffer is full. close() wakes only a thread waiting to read: without a
    bound on sends, the thread and its socket outlived the server's stop for as long as the
    peer kept the socket open."""
    monkeypatch.setattr(push_socket, "SEND_TIMEOUT_S", 0.5)
    sndbuf = int(Path("/proc/sys/net/core/wmem_default").read_text())
    answer = 4 + len(ps_pb.PushSocketReply(status=push_socket.status_of(
        push_socket.InvalidArgument("the request is not a PushSharedRequest"))
        .SerializeToString()).SerializeToString())
    # The answers are four times what the server's send buffer holds; the requests fit
    # well within the peer's own, so that sendall below never waits on the server.
    count = 4 * sndbuf // answer
    request = struct.pack("<I", len(GARBAGE)) + GARBAGE
    assert count * len(request) < sndbuf * 0.7

    path = tmp_path / "push.socket"
    served = push_socket.PushSocket(str(path), lambda request: ps_pb.PushSharedReply())
    before = _serving_threads()
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    closed = False
    try:
        peer.settimeout(WAIT_S)
        peer.connect(str(path))
        # The socket is served: one request answered, so its thread is known.
        write_frame(peer, GARBAGE)
        assert _answered(peer).status
        (thread,) = _serving_threads() - before
        peer.sendall(request * count)  # none of these answers is ever read
        served.close()
        closed = True
        thread.join(WAIT_S)
        assert not thread.is_alive(), (
            "the push socket's serving thread (and its socket) outlived close(): it is "
            "blocked sending answers its peer does not read")
    finally:
        peer.close()  # lets a thread blocked in sendall fail (EPIPE) and end
        if not closed:
            served.close()


def test_a_serving_thread_that_cannot_be_started_does_not_end_the_acceptor(
        tmp_path, monkeypatch, unstartable_threads):
    """A client that cannot be served is told so (`refused`) and pushes over gRPC. Where no
    thread could be started for a moment (RuntimeError "can't start new thread": a pids
    cgroup or `ulimit -u` at its limit), the error ended the acceptor for good: the accepted
    socket was never answered, and every later push through the socket waited out the
    client's timeout, although the server was well."""
    failed = unstartable_threads(push_socket, "push-socket", once=True)
    path = tmp_path / "push.socket"
    served = push_socket.PushSocket(
        str(path), lambda request: ps_pb.PushSharedReply(connection_lost=True))
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        first.settimeout(WAIT_S)
        first.connect(str(path))
        assert failed.wait(WAIT_S), "the first socket was never accepted"
        # The push socket goes on serving the next socket.
        second.settimeout(WAIT_S)
        second.connect(str(path))
        write_frame(second, ps_pb.PushSharedRequest(connection=1).SerializeToString())
        try:
            reply = _answered(second)
        except socket.timeout:
            pytest.fail("the push socket serves no socket after one serving thread could "
                        "not be started: its acceptor is gone")
        assert reply.reply.connection_lost
        # And the socket whose thread could not start is refused or closed, not left hanging.
        try:
            frame = read_frame(first, 1 << 20)
        except socket.timeout:
            pytest.fail("a socket whose serving thread could not start was left open and "
                        "unanswered")
        assert frame is None or ps_pb.PushSocketReply.FromString(frame).refused
    finally:
        first.close()
        second.close()
        served.close()
