"""Where a streamed push waits until all of it has arrived: in memory, or in a file.

A push is applied only once every byte of it has arrived (all or nothing), so its bytes
wait somewhere first. Pushes wait in pooled buffers while the server's receive memory stays
within its bound (`--push-memory`; by default a quarter of the bytes the server holds, at
least MIN_PUSH_MEMORY). A push that would take it past the bound waits in an unlinked
temporary file instead (`--spill-dir`), written as its chunks arrive; the update then reads
it back a block at a time with pread into a buffer it reuses (ps_common.shm.BlockReader),
so that the file's pages never become resident in the server. Without this, a
whole-variable push of a 3 GiB shard needs 3 GiB of memory beside the shard. With it, the
server's RSS stays near the bytes it holds; the staged bytes sit in the page cache, which
the kernel may write back and reclaim. The file is unlinked from the start, so nothing is
left behind even by a killed server.

A finished push's file is kept open for the next staged push to write over, up to
KEEP_IDLE_BYTES and MAX_IDLE_FILES of such files: a fresh file costs the file system an
allocation and a release of every block it holds (on ext4, about as much CPU as writing and
reading the push once more). Nothing of an earlier push is ever read from a reused file: a
push is decoded only once every one of its bytes has arrived, written over the old ones, and
a file is reused only once no view of its last push's mapping is left. A kept file's bytes
are written back to disk like any file's; on a tmpfs (which --spill-dir should not be) they
stay in memory, up to KEEP_IDLE_BYTES.

Pushes that arrive in one message (most) are read in place and never staged.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from ps_common.errors import ResourceExhausted
from ps_common.shm import BlockReader
from ps_server.buffers import BufferPool

MIN_PUSH_MEMORY = 16 << 20
# Staging files kept open between pushes for reuse, at most this many bytes and files of
# them, the longest idle closed first: their bytes stay in the page cache (written back like
# any file's, and reclaimable then). A larger push's file is released when the push ends.
KEEP_IDLE_BYTES = 256 << 20
MAX_IDLE_FILES = 4


@dataclass
class Staged:
    """A push's tensors: `destinations`, one writable byte destination each for a
    StreamAssembler, and, after `finish()`, `data`: one view of each, to decode and apply.
    `reader` (None in memory) reads each block of `data` from the staging file."""

    sizes: list[int]
    destinations: list
    data: list | None = None
    reader: BlockReader | None = None
    file: object | None = None  # the staging file (a file object: owns its descriptor)
    mapping: mmap.mmap | None = None

    def finish(self) -> None:
        """All of the push has arrived: a staged file is mapped, for views of its tensors."""
        if self.data is not None:
            return
        self.mapping = mmap.mmap(self.file.fileno(), sum(self.sizes), mmap.MAP_SHARED,
                                 mmap.PROT_READ)
        view, self.data, start = memoryview(self.mapping), [], 0
        for size in self.sizes:
            self.data.append(view[start:start + size])
            start += size
        self.reader = BlockReader(self.mapping, self.file)

    def close(self) -> bool:
        """Unmap the staged file; False if a view of it outlived the push (the mapping then
        goes with the last view), so that the file must not be written again."""
        mapping, self.mapping = self.mapping, None
        self.data = self.reader = None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                return False
        return True


@dataclass
class _Lease:
    """A staging file lent to one push: reusable by a later one unless found otherwise."""

    capacity: int
    file: object
    reusable: bool = True


class _FileRegion:
    """Bytes `[start, start + length)` of a file, written with pwrite."""

    def __init__(self, fd: int, start: int, length: int, directory: str):
        self._fd, self._start, self._length = fd, start, length
        self._directory = directory

    def __len__(self) -> int:
        return self._length

    def write_at(self, offset: int, data: memoryview) -> None:
        while len(data):
            try:
                written = os.pwrite(self._fd, data, self._start + offset)
            except OSError as error:
                # A copy-on-write file system needs new blocks even where the file has them.
                if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ResourceExhausted(
                    f"no room left to stage a push in {self._directory} "
                    f"({error.strerror or error}); free space there, point --spill-dir "
                    "elsewhere or raise --push-memory") from None
            data, offset = data[written:], offset + written


class PushStaging:
    """Thread-safe. `held_bytes()`: the bytes of values and slots the server holds now,
    from which the default bound follows."""

    def __init__(self, held_bytes: Callable[[], int], memory_bytes: int | None = None,
                 directory: str | None = None):
        self._held_bytes = held_bytes
        self._memory_bytes = memory_bytes
        self.directory = directory or tempfile.gettempdir()
        self._in_memory = 0
        self._lock = threading.Lock()
        self._idle_files: list[tuple[int, object]] = []  # (capacity, file), for reuse
        self._closed = False
        self.staged_pushes = 0  # pushes that waited in a file, so far
        self.staging_files_made = 0  # of which in a file made for them (not reused)
        # Buffers of pushes waiting in memory, kept for the next ones: idle and in use
        # together within the bound, so that --push-memory bounds what pushes hold.
        self._pool = BufferPool(max_cached_bytes=self._idle_room)

    def _idle_room(self) -> int:
        return max(0, self.memory_bound() - self._in_memory)  # (under the pool's lock only)

    def memory_bound(self) -> int:
        if self._memory_bytes is not None:
            return self._memory_bytes
        return max(MIN_PUSH_MEMORY, self._held_bytes() // 4)

    @contextlib.contextmanager
    def stage(self, sizes: list[int]) -> Iterator[Staged]:
        """Room for a push of tensors of `sizes` bytes; call its `finish()` once all of it
        has arrived, before reading its `data`."""
        total = sum(sizes)
        with self._lock:
            in_memory = total == 0 or self._in_memory + total <= self.memory_bound()
            if in_memory:
                self._in_memory += total
        if not in_memory:
            with self._file(total) as lease:
                fd, starts = lease.file.fileno(), itertools.accumulate(sizes[:-1], initial=0)
                staged = Staged(sizes, [_FileRegion(fd, start, size, self.directory)
                                        for start, size in zip(starts, sizes)], file=lease.file)
                try:
                    yield staged
                finally:
                    lease.reusable = staged.close()
            return
        buffers = []
        try:
            for size in sizes:
                buffers.append(self._pool.acquire(size))
            yield Staged(sizes, buffers, data=buffers)
        finally:
            with self._lock:
                self._in_memory -= total
            for buffer in buffers:
                self._pool.release(buffer)

    def idle_buffer_bytes(self) -> int:
        """Bytes of buffers kept from pushes that waited in memory, for the next ones."""
        return self._pool.cached_bytes

    def idle_file_bytes(self) -> int:
        with self._lock:
            return sum(capacity for capacity, _ in self._idle_files)

    def close(self) -> None:
        """Release the files kept for reuse; pushes staged from now on release theirs."""
        with self._lock:
            self._closed, idle, self._idle_files = True, self._idle_files, []
        for _, file in idle:
            file.close()

    @contextlib.contextmanager
    def _file(self, nbytes: int) -> Iterator[_Lease]:
        """A staging file with room for `nbytes`: the smallest large enough of those kept
        from earlier pushes, else a new one. Given back for reuse when the push ends, unless
        the lease says otherwise or the push failed with an OSError (the file may be at
        fault)."""
        with self._lock:
            fits = [entry for entry in self._idle_files if entry[0] >= nbytes]
            kept = min(fits, key=lambda entry: entry[0]) if fits else None
            if kept is not None:
                self._idle_files.remove(kept)
        lease = _Lease(*kept) if kept else _Lease(nbytes, self._new_file(nbytes))
        with self._lock:
            self.staged_pushes += 1
            self.staging_files_made += kept is None
        try:
            yield lease
        except OSError:
            lease.reusable = False
            raise
        finally:
            self._give_back(lease)

    def _give_back(self, lease: _Lease) -> None:
        closing = []
        with self._lock:
            if self._closed or not lease.reusable or lease.capacity > KEEP_IDLE_BYTES:
                closing.append(lease.file)
            else:
                self._idle_files.append((lease.capacity, lease.file))
                while (len(self._idle_files) > MAX_IDLE_FILES or sum(
                        capacity for capacity, _ in self._idle_files) > KEEP_IDLE_BYTES):
                    closing.append(self._idle_files.pop(0)[1])  # the longest idle
        for file in closing:
            file.close()

    def _new_file(self, nbytes: int):
        """A new unlinked file in the spill directory, `nbytes` reserved where the file
        system can reserve them (so that a push cannot run out of room half-way)."""
        try:
            file = tempfile.TemporaryFile(dir=self.directory)
        except OSError as error:
            raise ResourceExhausted(
                f"a push of {nbytes} bytes cannot be staged in {self.directory} "
                f"({error.strerror or error}); check --spill-dir or raise --push-memory"
            ) from None
        try:
            try:
                os.posix_fallocate(file.fileno(), 0, nbytes)
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise ResourceExhausted(
                        f"no room to stage a push of {nbytes} bytes in {self.directory} "
                        f"({error.strerror or error}); free space there, point --spill-dir "
                        "elsewhere or raise --push-memory") from None
                os.ftruncate(file.fileno(), nbytes)  # a file system that cannot reserve
        except BaseException:
            file.close()
            raise
        return file
