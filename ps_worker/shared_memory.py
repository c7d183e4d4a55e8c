"""The client side of the shared-memory data path (server side: ps_server.shared_memory).

A `SharedConnection` is one client's connection with one server on its host. Pulls copy shard
values straight out of the server's segments under their sequence locks, with no call;
pushes write the gradients into a push slot and send only the header (PushShared).

Whenever something does not fit (the server's epoch differs from the caller's map, a shard
is not in shared memory, the lock keeps moving under a long update, no slot can be had),
`read` returns False or `push_slot` returns None and the caller does the call over gRPC,
which gives the answer, or the error, a gRPC call gives. `ConnectionLost` means the connection is
over (the server restarted or stopped): the caller forgets it and opens a new one later.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import grpc
import numpy as np
from google.rpc import status_pb2

from ps_common import shm
from ps_common.framing import read_frame, write_frame
from ps_common.shardmap import Shard, ShardMap
from ps_common.status import RemoteError
from ps_common.tensors import FINITE_BLOCK_ELEMENTS, all_finite
from ps_proto.v1 import parameter_server_pb2 as pb

log = logging.getLogger(__name__)

# Copies tried while updates keep changing a shard, before the pull goes over gRPC (which
# waits for the shard's lock instead); between tries the reader waits this long at most.
MAX_READ_ATTEMPTS = 8
MAX_READ_BACKOFF_S = 0.002
HANDSHAKE_TIMEOUT_S = 5.0
# The largest answer taken from a push socket: a PushSocketReply names the members of the
# server's steps (up to its --max-streams, each an id of up to 1,024 characters), about 1 MiB
# at 1,000 members; the bound is the server's own for a request (ps_server.push_socket).
MAX_REPLY_BYTES = 64 << 20
# How often a reader looks whether the server behind its connection still runs.
OWNER_CHECK_S = 1.0
# A process's (EMFILE) or the system's (ENFILE) open files are at their limit.
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


class HandshakeFailed(Exception):
    """The handshake call failed: use gRPC, and try the handshake again later."""


class ConnectionLost(Exception):
    """The server no longer knows this connection (it restarted or stopped)."""


class PushSlot:
    """A push slot: a segment the client writes a push's tensors into, back to back."""

    def __init__(self, slot: int, segment: shm.Segment):
        self.slot = slot
        self.segment = segment
        self.nbytes = segment.nbytes

    def write(self, tensors: list[np.ndarray], *, check_finite: bool = False) -> int | None:
        """Write `tensors` (C-contiguous, each in its wire dtype's raw element type) back to
        back. With `check_finite`: check each block as it is written, in the slot, while it
        is still in cache, and return the position of the first tensor with a NaN or Inf
        (the rest is not written); None when every one is finite."""
        offset = 0
        for position, tensor in enumerate(tensors):
            flat = tensor.reshape(-1)
            written = np.frombuffer(self.segment.data, flat.dtype, flat.size, offset)
            step = FINITE_BLOCK_ELEMENTS if check_finite else max(1, flat.size)
            for start in range(0, flat.size, step):
                block = written[start:start + step]
                np.copyto(block, flat[start:start + step])
                if check_finite and not all_finite(block):
                    return position
            offset += flat.nbytes
        return None


class SharedConnection:
    """Thread-safe. Made by `open`, which returns None when the server cannot share memory
    with this process."""

    def __init__(self, stub, connection: int, secret: bytes, control: shm.Segment,
                 server_id: str, push_socket: str = ""):
        self._stub = stub
        self._connection = connection
        self._secret = secret
        self._control = control
        self._server_id = server_id
        self._lock = threading.Lock()
        # (variable, index) -> (shard, segment, values view), or None: not in shared memory.
        self._attached: dict[tuple[str, int], tuple[Shard, shm.Segment, np.ndarray] | None] = {}
        self._free: list[PushSlot] = []
        self._slots = 0
        self._no_more_slots = False
        # The push socket's path ("": none, or it refused us: PushShared goes over gRPC),
        # its sockets not in use, and every socket open (for interrupt and close).
        self._push_socket = str(shm.DIRECTORY / push_socket) if push_socket else ""
        self._idle_sockets: list[socket.socket] = []
        self._sockets: set[socket.socket] = set()
        self._ended = False
        self._warned_out_of_files = False
        self._owner_checked_at = time.monotonic()
        self._owner_dead = False

    @classmethod
    def open(cls, stub, client_id: str, server_id: str) -> "SharedConnection | None":
        """The handshake: a connection if the server offers one and this process can read the
        secret in its probe segment (same host, same user); else None. Raises
        HandshakeFailed when the call itself failed (the server away, slow or restarting):
        the answer may differ next time."""
        try:
            reply = stub.OpenSharedMemory(pb.OpenSharedMemoryRequest(client_id=client_id),
                                          timeout=HANDSHAKE_TIMEOUT_S)
        except ValueError:  # interrupt() closed the channel: gRPC says CANCELLED
            return None
        except grpc.RpcError as error:
            log.info("server %s: no shared-memory handshake (%s): using gRPC for now",
                     server_id, error.code().name)
            raise HandshakeFailed() from None
        if not reply.offered:
            log.info("server %s offers no shared memory: using gRPC", server_id)
            return None
        shm.allow_more_open_files()  # a descriptor per segment it maps
        try:
            probe = shm.attach(reply.probe, writable=False)
            secret = bytes(probe.data[:shm.SECRET_BYTES])
            control = shm.attach(reply.control, writable=False)
        except (OSError, ValueError) as error:
            log.info("server %s is not on this host's shared memory (%s): using gRPC",
                     server_id, error)
            return None
        log.info("server %s: pulls and pushes go through shared memory", server_id)
        return cls(stub, reply.connection, secret, control, server_id, reply.push_socket)

    @property
    def alive(self) -> bool:
        return not self._control.retired

    def owner_gone(self) -> bool:
        """Whether the server process behind this connection has died (the lock on its
        control segment is free: SIGKILLed, its segments left as they were), looked at no
        more than once every OWNER_CHECK_S. Its segments still hold the values of the
        moment it died, which pulls may go on reading until its shards are placed anew."""
        now = time.monotonic()
        if now - self._owner_checked_at >= OWNER_CHECK_S:
            self._owner_checked_at = now
            self._owner_dead = not shm.owner_locked(self._control.path)
        return self._owner_dead

    # ---- pull ----------------------------------------------------------------------------

    def read(self, epoch: int, shards: list[Shard], destinations: list[np.ndarray],
             timeout_s: float) -> bool:
        """Copy each shard's values into its destination (same shape and dtype), each a
        consistent snapshot. False: do this pull over gRPC instead."""
        if self._control.retired:
            raise ConnectionLost()
        if int(self._control.header[shm.EPOCH]) != epoch:
            return False  # gRPC answers stale or not-ready as it should
        sources = self._sources(epoch, shards, timeout_s)
        if sources is None:
            return False
        for (segment, values), destination in zip(sources, destinations):
            if not _copy_consistent(segment, lambda: np.copyto(destination, values)):
                return False
        return True

    def read_rows(self, epoch: int, shards: list[Shard], rows: list[np.ndarray],
                  destinations: list[np.ndarray], timeout_s: float) -> bool:
        """Copy rows `rows[i]` (indices into the shard) of each shard into `destinations[i]`
        (`(len(rows[i]), dim)`, the shard's dtype), each shard's at one instant. False: do
        this pull over gRPC instead."""
        if self._control.retired:
            raise ConnectionLost()
        if int(self._control.header[shm.EPOCH]) != epoch:
            return False
        sources = self._sources(epoch, shards, timeout_s)
        if sources is None:
            return False
        for (segment, values), local, destination in zip(sources, rows, destinations):
            if not _copy_consistent(segment, lambda: np.take(values, local, axis=0,
                                                             out=destination)):
                return False
        return True

    def _sources(self, epoch: int, shards: list[Shard], timeout_s: float):
        with self._lock:
            found = [self._attached.get(s.key, False) for s in shards]
        missing = [s for s, f in zip(shards, found)
                   if f is False or (f is not None and (f[0] != s or f[1].retired))]
        if missing:
            self._attach(epoch, missing, timeout_s)
            with self._lock:
                found = [self._attached.get(s.key) for s in shards]
        if any(f is None or f[0] != s for s, f in zip(shards, found)):
            return None
        return [(segment, values) for _, segment, values in found]

    def forget_moved(self, shard_map: ShardMap) -> None:
        """Unmap the segments of shards that `shard_map` no longer places on this server: a
        mapping kept would hold a moved shard's memory (and a file descriptor) for as long
        as this connection lasts, after the server dropped it."""
        here = {shard.key for shards in shard_map.shards.values() for shard in shards
                if shard.server_id == self._server_id}
        with self._lock:
            for key in [k for k in self._attached if k not in here]:
                del self._attached[key]

    def _attach(self, epoch: int, shards: list[Shard], timeout_s: float) -> None:
        request = pb.AttachShardsRequest(
            connection=self._connection, secret=self._secret, epoch=epoch,
            shards=[pb.ShardRef(variable=s.variable, index=s.index) for s in shards])
        try:
            reply = self._stub.AttachShards(request, timeout=timeout_s)
        except (grpc.RpcError, ValueError):  # ValueError: interrupt() closed the channel
            return  # the pull goes over gRPC, which reports what is wrong
        if reply.connection_lost:
            raise ConnectionLost()
        by_key = {s.key: s for s in shards}
        attached = {}
        for shared in reply.shards:
            shard = by_key[(shared.shard.variable, shared.shard.index)]
            entry = None
            if shared.segment:
                try:
                    segment = shm.attach(shared.segment, writable=False)
                    shape = tuple(shared.meta.shape)
                    dtype = _DTYPES[shared.meta.dtype]
                    entry = (shard, segment, segment.array(dtype, shape))
                except (OSError, ValueError) as error:
                    # Gone already (the map moved): over gRPC this time. Out of file
                    # descriptors (one per mapped segment): over gRPC from now on, said once.
                    if isinstance(error, OSError) and error.errno in _OUT_OF_FILES \
                            and not self._warned_out_of_files:
                        self._warned_out_of_files = True
                        log.warning("server %s: no file descriptor left to map a shard's "
                                    "segment (%s; raise `ulimit -n`): such shards are pulled "
                                    "over gRPC", self._server_id, error.strerror)
                    entry = None
            attached[shard.key] = entry
        with self._lock:
            self._attached.update(attached)

    # ---- push ----------------------------------------------------------------------------

    def push_slot(self, nbytes: int, timeout_s: float) -> PushSlot | None:
        """A free push slot of at least `nbytes`, or None (push over gRPC). Give it back
        with `release` once the push is over."""
        with self._lock:
            for i, slot in enumerate(self._free):
                if slot.nbytes >= nbytes:
                    return self._free.pop(i)
            if self._no_more_slots:
                return None
        request = pb.PushSharedRequest(connection=self._connection, secret=self._secret,
                                       slot_bytes=max(nbytes, 1))
        try:
            reply = self._stub.PushShared(request, timeout=timeout_s)
        except ValueError:  # interrupt() closed the channel: gRPC says CANCELLED
            return None
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with self._lock:
                    self._no_more_slots = True
            return None
        if reply.connection_lost:
            raise ConnectionLost()
        if not reply.slot:
            return None
        try:
            return PushSlot(reply.slot, shm.attach(reply.segment, writable=True))
        except (OSError, ValueError):
            return None

    def release(self, slot: PushSlot) -> None:
        with self._lock:
            self._free.append(slot)

    def push_request(self, slot: PushSlot, header: pb.PushHeader) -> pb.PushSharedRequest:
        return pb.PushSharedRequest(connection=self._connection, secret=self._secret,
                                    slot=slot.slot, header=header)

    def push(self, request: pb.PushSharedRequest, timeout_s: float) -> pb.PushSharedReply | None:
        """PushShared through the server's push socket; None: make the call over gRPC (the
        server has no socket for us). Raises RemoteError as the gRPC call would, and
        UNAVAILABLE or DEADLINE_EXCEEDED when the socket failed before the answer came (the
        push may or may not have been applied: retry it under the same sequence)."""
        sock = self._take_socket(timeout_s)
        if sock is None:
            return None
        try:
            sock.settimeout(timeout_s)
            write_frame(sock, request.SerializeToString())
            frame = read_frame(sock, MAX_REPLY_BYTES)
            if frame is None:
                raise ConnectionError("the server closed the push socket")
            answer = pb.PushSocketReply.FromString(frame)
        except socket.timeout:
            self._discard(sock)
            raise RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no answer on the push socket within {timeout_s:g} s",
                              target=self._server_id) from None
        except (OSError, ValueError) as error:  # ValueError: not a PushSocketReply
            self._discard(sock)
            raise RemoteError(grpc.StatusCode.UNAVAILABLE, f"push socket: {error}",
                              target=self._server_id) from None
        if answer.refused:  # the server serves no more sockets: it read nothing of ours
            self._discard(sock)
            with self._lock:
                self._push_socket = ""
            log.info("server %s takes no more push sockets: pushes are announced over gRPC",
                     self._server_id)
            return None
        with self._lock:
            keep = not self._ended
            if keep:
                self._idle_sockets.append(sock)
        if not keep:  # interrupted or closed meanwhile
            self._discard(sock)
        if answer.status:
            raise RemoteError.from_status(status_pb2.Status.FromString(answer.status),
                                          target=self._server_id)
        return answer.reply

    def _take_socket(self, timeout_s: float) -> socket.socket | None:
        with self._lock:
            if self._idle_sockets:
                return self._idle_sockets.pop()
            path = self._push_socket
            if not path or self._ended:
                return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
        except OSError as error:
            # No socket to reach (the server stopped, or is gone): gRPC says which.
            sock.close()
            log.debug("server %s: push socket unreachable (%s)", self._server_id, error)
            return None
        with self._lock:
            if self._ended:
                sock.close()
                return None
            self._sockets.add(sock)
        return sock

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def interrupt(self) -> None:
        """End every push socket call in flight (it raises UNAVAILABLE) and make no more."""
        with self._lock:
            self._ended = True
            sockets = list(self._sockets)
            self._idle_sockets.clear()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """End the connection at the server (best effort: it also ends when the server stops
        or the coordinator declares this client gone)."""
        self.interrupt()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            sock.close()
        try:
            self._stub.CloseSharedMemory(pb.CloseSharedMemoryRequest(
                connection=self._connection, secret=self._secret), timeout=2.0)
        except (grpc.RpcError, ValueError):  # ValueError: the channel is closed already
            pass


_DTYPES = {1: np.float32, 2: np.float64, 3: np.float16}


def _copy_consistent(segment: shm.Segment, copy) -> bool:
    """Run `copy()` (out of the segment's values) between two equal, even versions of the
    segment's sequence lock (ps_common.shm); False if updates kept it moving or the shard
    retired."""
    header = segment.header
    for attempt in range(MAX_READ_ATTEMPTS):
        before = int(header[shm.VERSION])
        if not before & 1:
            copy()
            if int(header[shm.VERSION]) == before:
                return not int(header[shm.FLAGS]) & shm.RETIRED
        time.sleep(min(MAX_READ_BACKOFF_S, 0.0001 * 2 ** attempt))
    return False
