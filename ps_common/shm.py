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
dead one left behind (`owner_alive`). A pid says nothing across pid namespaces (containers
of one pod share /dev/shm but not their pids), so a server also holds an exclusive flock on
its control segment for as long as it runs (`create(..., locked=True)`), which the kernel
drops when the process dies: a segment whose owner's control segment is locked belongs to a
live server, whatever its pid says here (`owner_locked`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import resource
import sys
import threading
from pathlib import Path

import numpy as np

from ps_common.errors import InvalidArgument

DIRECTORY = Path("/dev/shm")
PREFIX = "paramserve."
MAGIC = 0x70617261_6D736572  # "paramser"
HEADER_BYTES = 64
VERSION, FLAGS, EPOCH, PID = 1, 2, 3, 4
RETIRED = 1
# Bytes of a connection's secret in its probe segment.
SECRET_BYTES = 32


# A soft limit on open files set above the hard one, where the hard one is unlimited.
UNLIMITED_FILES_TARGET = 1 << 20
_files_limit_lock = threading.Lock()
_files_limit_raised = False


def allow_more_open_files() -> None:
    """Raise this process's soft limit on open files to its hard limit, once. Each mapped
    segment keeps a file descriptor open (Python's mmap holds a duplicate of the one it
    mapped), one per shard in the server and in each client: at the usual soft limit of
    1024, a server of a thousand shards could map no more, and its shards would go over
    gRPC. Raising the soft limit up to the hard one needs no privilege."""
    global _files_limit_raised
    with _files_limit_lock:  # a second caller returns once the first has raised it
        if _files_limit_raised:
            return
        _files_limit_raised = True
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = UNLIMITED_FILES_TARGET if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                pass  # as it was: segments that cannot be mapped fall back to gRPC


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
    """Whether the server process that created segment `name` is still running, as far as
    this pid namespace can tell (see `owner_locked`)."""
    parts = name.split(".")
    try:
        pid = int(parts[1])
    except (IndexError, ValueError):
        return False
    return process_start_time(pid) == parts[2]


def owner_prefix(name: str) -> str:
    """The part of a segment's name that names its server process (`paramserve.<pid>.<start
    time>.`)."""
    return ".".join(name.split(".")[:3]) + "."


def owner_locked(control: Path) -> bool:
    """Whether a running server holds its lock on control segment `control` (in any pid
    namespace that shares this directory)."""
    try:
        fd = os.open(control, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the shared lock, if taken
    return False


class Segment:
    """One mapped segment: `header` (8 uint64 words) and the `data` bytes after it."""

    def __init__(self, path: Path, mapping: mmap.mmap, writable: bool,
                 lock_fd: int | None = None):
        self.path = path
        self._lock_fd = lock_fd  # holds the owner's flock (create(..., locked=True))
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

    def reader(self) -> "BlockReader | None":
        """A BlockReader of this segment, which opens its file until `finish()` (None: the
        file is gone, e.g. unlinked as its connection ended; read through the mapping)."""
        try:
            file = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            return None
        try:
            return BlockReader(self._mapping, file, close=True)
        except BaseException:
            file.close()
            raise

    @property
    def retired(self) -> bool:
        return bool(int(self.header[FLAGS]) & RETIRED)

    def unlock(self) -> None:
        """Drop the owner's lock (the server has retired the segment)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)


def create(name: str, nbytes: int, *, locked: bool = False) -> Segment:
    """A new segment with room for `nbytes` of data, owner-only, its space reserved.

    The space is allocated up front (posix_fallocate) because a tmpfs that runs out of room
    (a container's 64 MiB /dev/shm) would otherwise kill the process with SIGBUS when it
    first touches a page; here it raises OSError (ENOSPC) instead.

    `locked` (a server's control segment): the segment holds an exclusive flock until
    `unlock()` or the process's end. It is made under a name outside PREFIX and renamed once
    locked, so that no other server ever sees it unlocked (see `owner_locked`).
    """
    path = DIRECTORY / name
    made = DIRECTORY / f".{name}.{os.getpid()}.new" if locked else path
    fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size = HEADER_BYTES + max(nbytes, 1)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if locked:
            fcntl.flock(fd, fcntl.LOCK_EX)
            np.frombuffer(mapping, np.uint64, 1)[0] = MAGIC
            os.rename(made, path)
    except BaseException:
        os.close(fd)
        unlink(made)
        raise
    if not locked:
        os.close(fd)
    segment = Segment(path, mapping, writable=True, lock_fd=fd if locked else None)
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


class BlockReader:
    """Reads blocks of a file-backed mapping with pread instead of through the mapping.

    A server reads a large push (a client's push slot, a staged push's file) twice: once to
    check it, once to apply it. Read through the mapping, each pass maps every page of it
    into the server (a minor fault per page), and the pages stay resident unless dropped
    again after each block, which makes the next pass fault them in again. pread copies a
    block from the page cache into a buffer of this reader's, reused block after block: the
    push never becomes resident in this process and costs no page faults (W2 over shared
    memory: benchmarks/RESULTS.md).

    Call it with a view into the mapping (`block`): it returns an array of the same dtype,
    shape and contents, valid until the next call. A block that is not a contiguous view
    into the mapping (a converted copy) is returned as it is. Call `finish()` at the end of
    the push: whatever was read through the mapping after all (a sync step's sum, a row
    push's sum of repeated ids) is dropped from this process's memory, and
    with `close`, `file` is closed.

    Raises InvalidArgument when the file is shorter than the mapping (a client truncated its
    slot): before anything is read, so that nothing of the push is applied."""

    def __init__(self, mapping: mmap.mmap, file, *, close: bool = False):
        self._mapping = mapping
        self._file = file  # an open file object over the mapped file
        self._close = close
        self._size = len(mapping)
        held = os.fstat(file.fileno()).st_size
        if held < self._size:
            raise InvalidArgument(f"a push's file holds {held} bytes, fewer than the "
                                  f"{self._size} it was made with; nothing was applied")
        self._base = np.frombuffer(mapping, np.uint8).ctypes.data
        self._buffer = np.empty(0, np.uint8)

    def __call__(self, block: np.ndarray) -> np.ndarray:
        start = block.ctypes.data - self._base
        if not (block.flags.c_contiguous and 0 <= start
                and start + block.nbytes <= self._size):
            return block
        if self._buffer.nbytes < block.nbytes:
            self._buffer = np.empty(block.nbytes, np.uint8)
        out = self._buffer[:block.nbytes]
        done = 0
        while done < block.nbytes:
            got = os.preadv(self._file.fileno(), [out[done:]], start + done)
            if got <= 0:
                raise OSError(f"{block.nbytes} bytes at offset {start} are past the end of "
                              "the mapped file")
            done += got
        return out.view(block.dtype).reshape(block.shape)

    def finish(self) -> None:
        self._mapping.madvise(mmap.MADV_DONTNEED, 0, self._size)
        if self._close:
            self._file.close()
