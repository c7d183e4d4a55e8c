"""PushShared over a Unix socket, for clients that share this server's memory.

A push through shared memory carries its tensors in a push slot; what still travels is its
header, a few hundred bytes. Over gRPC that small call costs the server about 0.7 ms of CPU
(receiving, handing it to a handler thread, replying), more than the update itself for a
model of a few MB, and in a co-located cluster every such millisecond is taken from the
workers' compute. Through this socket it costs a read and a write in a thread that does
nothing else.

The socket sits beside the segments (ps_common.shm: same directory, same naming, so that
`clear_dead` removes what a killed server left), mode 0600, and answers only requests that
carry a proven connection's secret: exactly the PushShared call, with the same handler, the
same validation and the same status codes (ps_proto PushSocketReply). Each accepted socket
gets a thread that serves its calls one at a time; a client opens one per push in flight.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Callable

from ps_common import shm
from ps_common.errors import InvalidArgument, PSError
from ps_common.framing import read_frame, write_frame
from ps_common.status import internal_status, status_of
from ps_proto.v1 import parameter_server_pb2 as pb

log = logging.getLogger(__name__)

# Sockets served at once (a thread each). A client that finds them all taken pushes over gRPC.
MAX_SOCKETS = 256
# A request larger than this is no PushSharedRequest (the header of a push to every shard of
# a large model is a few hundred KB): the socket is closed.
MAX_REQUEST_BYTES = 64 << 20

_REFUSED = pb.PushSocketReply(refused=True).SerializeToString()
# An answer its peer does not take within this long ends the socket: a client reads each
# answer as soon as it comes, and a thread blocked sending to one that does not would outlive
# close(), which can wake only a thread waiting to read. (A client whose answer is lost so
# pushes again over gRPC, under the same sequence: answered as a duplicate if it was applied.)
SEND_TIMEOUT_S = 10.0


class PushSocket:
    """Thread-safe. Listens at `path` and answers each request with `handle(request)`, which
    returns the PushSharedReply or raises (PSError: its status; anything else: INTERNAL)."""

    def __init__(self, path: str, handle: Callable[[pb.PushSharedRequest], pb.PushSharedReply]):
        self.path = path
        self._handle = handle
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Made 0600 before anyone can connect: bound in a directory only this user can
            # enter, then renamed into place. (Not by setting the umask around bind(): the
            # umask is the whole process's, and another thread's files would get it.)
            # Named after the socket, with ".new": clear_dead removes it if this process is
            # killed before it does.
            private = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".new",
                                       dir=os.path.dirname(path))
            try:
                staged = os.path.join(private, "socket")
                listener.bind(staged)
                os.chmod(staged, 0o600)
                os.rename(staged, path)
            finally:
                shutil.rmtree(private, ignore_errors=True)
            listener.listen(64)
        except OSError:
            listener.close()
            shm.unlink(path)
            raise
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, name="push-socket-accept",
                                          daemon=True)
        self._acceptor.start()

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def _accept(self) -> None:
        delay = 0.0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as error:
                with self._lock:
                    if self._closed:
                        return
                # Out of file descriptors for a moment (EMFILE, ENFILE), say: the listener
                # still queues connections, and an acceptor that gave up would leave their
                # clients waiting out their timeouts. Try again, backing off.
                delay = min(max(2 * delay, 0.01), 1.0)
                log.warning("push socket: cannot accept a connection (%s); trying again in "
                            "%g s", error.strerror or error, delay)
                time.sleep(delay)
                continue
            delay = 0.0
            with self._lock:
                refused = self._closed or len(self._open) >= MAX_SOCKETS
                if not refused:
                    self._open.add(sock)
            if not refused:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                    _timeval(SEND_TIMEOUT_S))
                    threading.Thread(target=self._serve, args=(sock,), name="push-socket",
                                     daemon=True).start()
                    continue
                except (OSError, RuntimeError) as error:  # no thread to be had for a moment
                    log.warning("push socket: cannot serve a connection (%s); its client "
                                "pushes over gRPC", error)
                    with self._lock:
                        self._open.discard(sock)
            try:
                write_frame(sock, _REFUSED)
            except OSError:
                pass
            sock.close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = read_frame(sock, MAX_REQUEST_BYTES)
                if frame is None:
                    return
                write_frame(sock, self._answer(frame).SerializeToString())
        except OSError as error:  # the client went away, took no answer (SEND_TIMEOUT_S), or
            # close() shut the socket
            log.debug("push socket ended: %s", error)
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()

    def _answer(self, frame: bytes) -> pb.PushSocketReply:
        try:
            request = pb.PushSharedRequest.FromString(frame)
        except Exception:  # protobuf's DecodeError and friends
            return pb.PushSocketReply(status=status_of(InvalidArgument(
                "the request is not a PushSharedRequest")).SerializeToString())
        try:
            return pb.PushSocketReply(reply=self._handle(request))
        except PSError as error:
            return pb.PushSocketReply(status=status_of(error).SerializeToString())
        except Exception:
            log.exception("internal error in PushShared (push socket)")
            return pb.PushSocketReply(status=internal_status("PushShared").SerializeToString())

    def close(self) -> None:
        """Stop accepting calls and remove the socket file. A call being applied finishes and
        is answered; each socket then ends (its client pushes over gRPC, or finds the
        server gone)."""
        with self._lock:
            self._closed = True
            sockets = list(self._open)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        shm.unlink(self.path)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RD)  # wakes a thread waiting for the next call
            except OSError:
                pass



def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
