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

    def close(self) -> None:
        mapping, self.mapping = self.mapping, None
        self.data = self.reader = None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a view outlived the push: GC unmaps
                mapping.close()


class _FileRegion:
    """Bytes `[start, start + length)` of a file, written with pwrite."""

    def __init__(self, fd: int, start: int, length: int):
        self._fd, self._start, self._length = fd, start, length

    def __len__(self) -> int:
        return self._length

    def write_at(self, offset: int, data: memoryview) -> None:
        while len(data):
            written = os.pwrite(self._fd, data, self._start + offset)
            data, offset = data[written:], offset + written


class PushStaging:
    """Thread-safe. `held_bytes()`: the bytes of values and slots the server holds now,
    from which the default bound follows."""

    def __init__(self, pool: BufferPool, held_bytes: Callable[[], int],
                 memory_bytes: int | None = None, directory: str | None = None):
        self._pool = pool
        self._held_bytes = held_bytes
        self._memory_bytes = memory_bytes
        self.directory = directory or tempfile.gettempdir()
        self._in_memory = 0
        self._lock = threading.Lock()
        self.staged_pushes = 0  # pushes that waited in a file, so far

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
            with self._file(total) as file:
                starts = itertools.accumulate(sizes[:-1], initial=0)
                staged = Staged(sizes, [_FileRegion(file.fileno(), start, size)
                                        for start, size in zip(starts, sizes)], file=file)
                try:
                    yield staged
                finally:
                    staged.close()
            return
        buffers = []
        try:
            for size in sizes:
                buffers.append(self._pool.acquire(size))
            yield Staged(sizes, buffers, data=buffers)
        finally:
            for buffer in buffers:
                self._pool.release(buffer)
            with self._lock:
                self._in_memory -= total

    @contextlib.contextmanager
    def _file(self, nbytes: int) -> Iterator:
        try:
            file = tempfile.TemporaryFile(dir=self.directory)
        except OSError as error:
            raise ResourceExhausted(
                f"a push of {nbytes} bytes cannot be staged in {self.directory} "
                f"({error.strerror or error}); check --spill-dir or raise --push-memory"
            ) from None
        with file:
            try:
                os.posix_fallocate(file.fileno(), 0, nbytes)
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise ResourceExhausted(
                        f"no room to stage a push of {nbytes} bytes in {self.directory} "
                        f"({error.strerror or error}); free space there, point --spill-dir "
                        "elsewhere or raise --push-memory") from None
                os.ftruncate(file.fileno(), nbytes)  # a file system that cannot reserve
            with self._lock:
                self.staged_pushes += 1
            yield file
