"""The layout of paramserve's shared-memory segments, shared by servers and clients.

A segment is a file in /dev/shm that a parameter server creates (mode 0600: readable by its
own user only) and maps; a client on the same host maps it too. Every segment starts with a
64-byte header of eight little-endian uint64 words; a segment's data starts at byte 64.

    word 0  MAGIC
    word 1  version: a sequence lock over the data. The server makes it odd before it
            changes the data and even after; a reader copies the data between two reads
            of an equal, even version, or reads again.
    word 2  flags: RETIRED (the segment no longer backs a shard the server holds, or the
            server is gone): a reader must not use it
    word 3  epoch (control segment): the shard-map epoch the server holds
    word 4  pid of the server (control segment)

The sequence lock relies on x86-64's store order (stores are seen in program order by other
cores, loads are not reordered with loads), with which a reader that sees an even version
twice has seen every store the server made before the second one. Other architectures need
memory fences that Python cannot issue, so the shared-memory path is offered on x86-64 only.

Names: `paramserve.<pid>.<start time>.<serial>.<kind>` where pid and start time
(/proc/<pid>/stat) identify the server process, so that a server can tell which segments a
dead one left behind (`owner_alive`).
"""

from __future__ import annotations

import mmap
import os
import platform
import sys
from pathlib import Path

import numpy as np

DIRECTORY = Path("/dev/shm")
PREFIX = "paramserve."
MAGIC = 0x70617261_6D736572  # "paramser"
HEADER_BYTES = 64
VERSION, FLAGS, EPOCH, PID = 1, 2, 3, 4
RETIRED = 1
# Bytes of a connection's secret in its probe segment.
SECRET_BYTES = 32


def supported() -> str | None:
    """None when this machine can use the shared-memory path, else why not."""
    if not sys.platform.startswith("linux"):
        return f"shared memory needs Linux (this is {sys.platform})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return (f"shared memory needs x86-64's store order (this is {platform.machine()}); "
                "using gRPC")
    if not DIRECTORY.is_dir() or not os.access(DIRECTORY, os.W_OK | os.X_OK):
        return f"{DIRECTORY} is missing or not writable"
    return None


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    return stat[stat.rindex(")") + 2:].split()[19]


def owner_alive(name: str) -> bool:
    """Whether the server process that created segment `name` is still running."""
    parts = name.split(".")
    try:
        pid = int(parts[1])
    except (IndexError, ValueError):
        return False
    return process_start_time(pid) == parts[2]


class Segment:
    """One mapped segment: `header` (8 uint64 words) and the `data` bytes after it."""

    def __init__(self, path: Path, mapping: mmap.mmap, writable: bool):
        self.path = path
        self.name = path.name
        self._mapping = mapping
        self.writable = writable
        # Read-only for a client that mapped it read-only (PROT_READ).
        self.header = np.frombuffer(mapping, np.uint64, 8)
        self.nbytes = len(mapping) - HEADER_BYTES

    def array(self, dtype, shape) -> np.ndarray:
        """The data as an array: a view into the mapping."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mapping, np.dtype(dtype), count, HEADER_BYTES).reshape(shape)

    @property
    def data(self) -> memoryview:
        return memoryview(self._mapping)[HEADER_BYTES:]

    def releaser(self) -> "Releaser":
        return Releaser(self._mapping)

    @property
    def retired(self) -> bool:
        return bool(int(self.header[FLAGS]) & RETIRED)


def create(name: str, nbytes: int) -> Segment:
    """A new segment with room for `nbytes` of data, owner-only, its space reserved.

    The space is allocated up front (posix_fallocate) because a tmpfs that runs out of room
    (a container's 64 MiB /dev/shm) would otherwise kill the process with SIGBUS when it
    first touches a page; here it raises OSError (ENOSPC) instead.
    """
    path = DIRECTORY / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = HEADER_BYTES + max(nbytes, 1)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    segment = Segment(path, mapping, writable=True)
    segment.header[0] = MAGIC
    return segment


def attach(name: str, *, writable: bool) -> Segment:
    """Map an existing segment (a client: read-only for values, writable for push slots).
    Raises OSError when it cannot be opened (another host, another user) or ValueError when
    it is not a paramserve segment."""
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"{name!r} is not a paramserve segment name")
    path = DIRECTORY / name
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise ValueError(f"segment {name} is too short")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED,
                            mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    segment = Segment(path, mapping, writable)
    if int(segment.header[0]) != MAGIC:
        raise ValueError(f"segment {name} is not a paramserve segment")
    return segment


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Releaser:
    """Drops pages of a mapping from this process's memory once they have been read, so
    that reading a large segment front to back never holds more than RELEASE_BYTES of it
    resident here (the data stays in the segment: other processes, and a later read, see it).
    Call it with each array read in turn (views into the mapping), then `finish()`."""

    RELEASE_BYTES = 4 << 20

    def __init__(self, mapping: mmap.mmap):
        self._mapping = mapping
        self._base = np.frombuffer(mapping, np.uint8).ctypes.data
        self._size = len(mapping)
        self._released = 0  # where the range read but not yet released starts
        self._seen = 0  # where it ends

    def __call__(self, block: np.ndarray) -> None:
        start = block.ctypes.data - self._base
        end = start + block.nbytes
        if not 0 <= start < end <= self._size:
            return  # not in this mapping (e.g. a widened copy)
        if start < self._seen:  # another pass from the front (validation, then the update)
            self._release()
            self._released = start - start % mmap.PAGESIZE
        self._seen = end
        if self._seen - self._released >= self.RELEASE_BYTES:
            self._release()

    def finish(self) -> None:
        self._release()

    def _release(self) -> None:
        start = self._released - self._released % mmap.PAGESIZE
        stop = self._seen - self._seen % mmap.PAGESIZE
        if stop > start:
            self._mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)
            self._released = stop
