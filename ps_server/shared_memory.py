"""The server side of the shared-memory data path (layout: ps_common.shm).

With it on, every shard's values live in a segment of their own, so that a client on the
same host pulls by copying them under the segment's sequence lock, with no call at all; the
server bumps the lock around every update (ShardStore.apply). A client pushes by writing
its gradients into a push slot (a segment the server made for its connection) and sending the
push's header over gRPC (PushShared): the server validates and applies it from the slot
exactly as it does a push that came over the wire. The same call also goes through the
server's push socket (ps_server.push_socket), which costs the server a fraction of a gRPC
call; gRPC remains for clients that cannot reach the socket.

The handshake proves that a client shares the host and the user: the server writes a
secret into a probe segment (mode 0600) and the client must present it on every call. A
client that cannot read it (another host or container, another user) uses gRPC.

Segments are the server's: made 0600, unlinked when a shard is dropped, a connection closes or
the server stops, and those a dead server left behind are cleared when a server starts
(`clear_dead`). A shard whose segment cannot be made (a small /dev/shm) lives in ordinary
memory and is pulled over gRPC.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ps_common import shm
from ps_common.errors import InvalidArgument, Overloaded
from ps_server.push_socket import PushSocket

log = logging.getLogger(__name__)

# Connections held at once: past it, the least recently used one ends (its client opens a new
# one). Push slots per connection: a client's push window.
MAX_CONNECTIONS = 1024
MAX_SLOTS_PER_CONNECTION = 8
# A push from a slot at least this large is read from the slot's file (ps_common.shm.
# BlockReader), so that it never becomes resident in the server; smaller slots are read
# through the mapping, which stays resident (no copy, and little memory).
READ_SLOTS_FROM_FILE_BYTES = 16 << 20
# A connection whose client never proved the secret (it could not read the probe: another host
# or user) ends after this long, with its probe.
UNPROVEN_CONNECTION_S = 30.0


# Segment names are unique per process (several servers may share one: tests, embedders).
_SERIAL = itertools.count(1)


@dataclass
class Connection:
    id: int
    client_id: str
    secret: bytes
    probe: shm.Segment | None
    opened: float = field(default_factory=time.monotonic)
    slots: dict[int, shm.Segment] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # closed, evicted or the server stopping: no new slots

    def __post_init__(self):
        # Kept apart from `probe`, which the first proven call takes away.
        self.probe_name = self.probe.name if self.probe is not None else ""


class SharedMemory:
    """Thread-safe. The segments of one server process; also the ShardStore's value memory
    (`empty`, `seqlock`, `retire`, `set_epoch`)."""

    def __init__(self):
        self._lock = threading.Lock()
        start = shm.process_start_time(os.getpid())
        self._prefix = f"{shm.PREFIX}{os.getpid()}.{start}."
        self._values: dict[int, tuple[np.ndarray, shm.Segment]] = {}  # id(values) -> ...
        self._connections: OrderedDict[int, Connection] = OrderedDict()
        self._connection_ids = itertools.count(1)
        self._closed = False
        shm.allow_more_open_files()  # a descriptor per segment
        self.control = shm.create(self._name("control"), 0, locked=True)
        self.control.header[shm.PID] = os.getpid()
        self._push_socket: PushSocket | None = None

    def _name(self, kind: str) -> str:
        return f"{self._prefix}{next(_SERIAL)}.{kind}"

    # ---- value memory (ShardStore) ----------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An uninitialized array in a segment of its own, or in ordinary memory when no
        segment can be made (the shard is then pulled over gRPC)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        try:
            segment = shm.create(self._name("values"), nbytes)
        except OSError as error:
            log.warning("no shared memory for a shard of %.1f MiB (%s): it is served over "
                        "gRPC only", nbytes / 2**20, error.strerror or error)
            return np.empty(shape, dtype)
        values = segment.array(dtype, shape)
        with self._lock:
            if not self._closed:
                self._values[id(values)] = (values, segment)
                return values
        _retire(segment)  # the server is stopping: nothing may outlive close()
        return values

    def seqlock(self, values: np.ndarray) -> np.ndarray | None:
        """The header words of `values`' segment (None if it has none): ShardStore.apply
        bumps word shm.VERSION around every update, under the shard's lock."""
        with self._lock:
            entry = self._values.get(id(values))
        return None if entry is None else entry[1].header

    def segment_of(self, values: np.ndarray) -> shm.Segment | None:
        with self._lock:
            entry = self._values.get(id(values))
        return None if entry is None else entry[1]

    def retire(self, values: np.ndarray) -> None:
        """The shard no longer exists here: readers that mapped it stop using it."""
        with self._lock:
            entry = self._values.pop(id(values), None)
        if entry is not None:
            _retire(entry[1])

    def serve_pushes(self, handle) -> None:
        """Answer PushShared calls through a push socket with `handle` (the servicer's).
        Without one (the socket cannot be made) clients send them over gRPC."""
        try:
            push_socket = PushSocket(str(shm.DIRECTORY / self._name("socket")), handle)
        except OSError as error:
            log.warning("no push socket (%s): shared-memory pushes are announced over gRPC",
                        error.strerror or error)
            return
        with self._lock:
            if not self._closed and self._push_socket is None:
                self._push_socket, push_socket = push_socket, None
        if push_socket is not None:
            push_socket.close()

    @property
    def push_socket_name(self) -> str:
        """The push socket's name in the segments' directory ("": none)."""
        return "" if self._push_socket is None else self._push_socket.name

    def set_epoch(self, epoch: int) -> None:
        self.control.header[shm.EPOCH] = epoch

    # ---- connections ----------------------------------------------------------------------

    def open_connection(self, client_id: str) -> Connection:
        secret = secrets.token_bytes(shm.SECRET_BYTES)
        probe = shm.create(self._name("probe"), shm.SECRET_BYTES)
        probe.data[:shm.SECRET_BYTES] = secret
        with self._lock:
            if self._closed:
                shm.unlink(probe.path)
                raise Overloaded("the server is stopping")
            connection = Connection(next(self._connection_ids), client_id, secret, probe)
            self._connections[connection.id] = connection
            now = time.monotonic()
            ended = [s for s in self._connections.values()
                     if s.probe is not None and now - s.opened > UNPROVEN_CONNECTION_S]
            for old in ended:
                del self._connections[old.id]
            if len(self._connections) > MAX_CONNECTIONS:
                # The least recently used connection no client has proven yet, if any: a
                # stream of handshakes that are never proven (a caller on another host,
                # say) must not end the connections of the workers that share this host.
                unproven = next((s for s in self._connections.values()
                                 if s.probe is not None and s is not connection), None)
                old = unproven or next(iter(self._connections.values()))
                del self._connections[old.id]
                ended.append(old)
        for old in ended:
            _end(old)
        return connection

    def connection(self, connection_id: int, secret: bytes) -> Connection | None:
        """The connection, if it exists and `secret` is its own (None: the client opens a new
        one). The first call that proves the secret removes the probe."""
        with self._lock:
            connection = self._connections.get(connection_id)
            if connection is None or not secrets.compare_digest(connection.secret, secret):
                return None
            self._connections.move_to_end(connection_id)
            probe, connection.probe = connection.probe, None
        if probe is not None:
            shm.unlink(probe.path)
        return connection

    def new_slot(self, connection: Connection, nbytes: int,
                 limit: int) -> tuple[int, shm.Segment] | None:
        """A push slot of `nbytes` for `connection` (None: the connection has ended). Raises
        InvalidArgument past `limit` (more than any push to this server can carry) and
        Overloaded when the connection holds its MAX_SLOTS_PER_CONNECTION already; OSError when
        /dev/shm has no room."""
        if not 0 < nbytes <= limit:
            raise InvalidArgument(f"a push slot of {nbytes} bytes: must be between 1 and "
                                  f"{limit} (the bytes this server holds)")
        with connection.lock:
            if connection.ended:
                return None
            if len(connection.slots) >= MAX_SLOTS_PER_CONNECTION:
                raise Overloaded(f"connection of {connection.client_id} holds "
                                 f"{MAX_SLOTS_PER_CONNECTION} push slots already")
            segment = shm.create(self._name("slot"), nbytes)
            slot = next(_SERIAL)
            connection.slots[slot] = segment
        return slot, segment

    @staticmethod
    def reader(segment: shm.Segment) -> shm.BlockReader | None:
        """How the server reads a push from `segment`: a BlockReader for a large slot, None
        (through the mapping) for the others, once their file is found as long as the
        mapping. (A file its client truncated would kill this process with SIGBUS when the
        mapping is read; a BlockReader makes the same check.)"""
        if segment.nbytes >= READ_SLOTS_FROM_FILE_BYTES:
            return segment.reader()
        try:
            held = os.stat(segment.path).st_size
        except FileNotFoundError:
            return None  # unlinked as its connection ended: nobody can truncate it by name
        if held < shm.HEADER_BYTES + segment.nbytes:
            raise InvalidArgument(f"a push's file holds {held} bytes, fewer than the "
                                  f"{shm.HEADER_BYTES + segment.nbytes} it was made with; "
                                  "nothing was applied")
        return None

    def slot(self, connection: Connection, slot: int) -> shm.Segment | None:
        """The connection's push slot (None: the connection has ended)."""
        with connection.lock:
            if connection.ended:
                return None
            segment = connection.slots.get(slot)
        if segment is None:
            raise InvalidArgument(f"push slot {slot} is not one of this connection's")
        return segment

    def close_connection(self, connection: Connection) -> None:
        with self._lock:
            self._connections.pop(connection.id, None)
        _end(connection)

    def close_client(self, client_id: str) -> None:
        """End the connections of a client the coordinator declared gone."""
        with self._lock:
            ended = [s for s in self._connections.values() if s.client_id == client_id]
            for connection in ended:
                del self._connections[connection.id]
        for connection in ended:
            _end(connection)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Mark everything retired and unlink every segment (the server is stopping).
        Mappings stay valid until the arrays are gone, so handlers still running are safe."""
        with self._lock:
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
            values = [segment for _, segment in self._values.values()]
            self._values.clear()
            push_socket, self._push_socket = self._push_socket, None
        if push_socket is not None:
            push_socket.close()
        for connection in connections:
            _end(connection)
        for segment in values:
            _retire(segment)
        _retire(self.control)
        self.control.unlock()


def _retire(segment: shm.Segment) -> None:
    segment.header[shm.FLAGS] = int(segment.header[shm.FLAGS]) | shm.RETIRED
    shm.unlink(segment.path)


def _end(connection: Connection) -> None:
    with connection.lock:
        connection.ended = True
        segments = list(connection.slots.values())
        connection.slots.clear()
        probe, connection.probe = connection.probe, None
    if probe is not None:
        segments.append(probe)
    for segment in segments:
        shm.unlink(segment.path)


def clear_dead() -> int:
    """Remove the segments of paramserve servers of this user that are no longer running
    (killed, say, with SIGKILL): marked retired first, so that clients still mapping them
    stop using them. A server is running if its pid is, here, or if it holds the lock on its
    control segment (ps_common.shm.owner_locked: a server in another pid namespace that
    shares this directory). Returns how many were removed."""
    removed = 0
    try:
        entries = list(shm.DIRECTORY.iterdir())
    except OSError:
        return 0
    uid = os.getuid()
    locked = {shm.owner_prefix(path.name) for path in entries
              if path.name.startswith(shm.PREFIX) and path.name.endswith(".control")
              and not shm.owner_alive(path.name) and shm.owner_locked(path)}
    for path in entries:
        if path.name.startswith("." + shm.PREFIX) and path.name.endswith(".new"):
            # A control segment its maker died before renaming (shm.create(locked=True)), or
            # the directory a push socket is bound in before it is renamed into place
            # (ps_server.push_socket): this user's only (/dev/shm is sticky: another's cannot
            # be removed).
            try:
                if (path.stat().st_uid == uid and not shm.owner_alive(path.name[1:])
                        and shm.owner_prefix(path.name[1:]) not in locked
                        and not shm.owner_locked(path)):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        shm.unlink(path)
            except OSError:
                pass
            continue
        if (not path.name.startswith(shm.PREFIX) or shm.owner_alive(path.name)
                or shm.owner_prefix(path.name) in locked):
            continue
        try:
            if path.stat().st_uid != uid:
                continue
            segment = shm.attach(path.name, writable=True)
            segment.header[shm.FLAGS] = int(segment.header[shm.FLAGS]) | shm.RETIRED
        except (OSError, ValueError):
            pass  # not ours to mark, or not a segment: remove it all the same if we may
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d shared-memory segment(s) left by a parameter server that is no "
                 "longer running", removed)
    return removed
