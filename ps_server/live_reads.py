"""Consistent pulls of shards larger than one message, copied only when a push overtakes them.

A pull streams such a shard in pieces, and a push applied between two pieces would mix
values from before and after it. A `LiveRead` reads each piece from the live values under
the shard's lock and stays registered on the shard while it streams. An update that finds
registered reads (ShardStore._updating calls `preserve_for_reads` under the shard's lock,
before it changes anything) copies the shard once, and every read registered there goes on
from that copy: copy on write. A pull that no push overtakes, which is every pull of a
client that pulls and then pushes, costs no copy and no memory beyond its messages.

The copies come from the server's buffer pool within a `ByteBudget`. When the budget has
no room, the update does not wait for the reads: they are overtaken, and their next piece
raises Overloaded, which tells the client to pull again after a moment.
"""

from __future__ import annotations

import threading

import numpy as np

from ps_common.errors import Overloaded
from ps_common.tensors import ByteReader, array_reader
from ps_server.buffers import BufferPool, ByteBudget

# How long an overtaken pull's client waits before it pulls again.
RETRY_AFTER_S = 0.2


class PullCopies:
    """Where the copies come from: the server's buffer pool, within `budget`."""

    def __init__(self, pool: BufferPool, budget: ByteBudget):
        self.pool = pool
        self.budget = budget


class _SharedCopy:
    """One copy of a shard's values, shared by the reads it was made for."""

    def __init__(self, copies: PullCopies, buffer: np.ndarray, values: np.ndarray, users: int):
        self._copies = copies
        self._buffer = buffer
        self.values = values
        self._users = users
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._copies.pool.release(self._buffer)
            self._copies.budget.release(self._buffer.nbytes)


class LiveRead:
    """A ByteReader over one shard's values as they were when `open` was called. Not
    thread-safe (one pull's stream); `close()` when the stream ends, however it ends."""

    def __init__(self, held, wire_dtype: str, copies: PullCopies):
        self._held = held
        self._wire_dtype = wire_dtype
        self.copies = copies
        self._copy: _SharedCopy | None = None
        self._copy_reader: ByteReader | None = None
        self._overtaken = False
        self._closed = False
        self._live = array_reader(held.values, wire_dtype, what=held.describe())
        with held.lock:
            held.live_reads.append(self)

    def __call__(self, offset: int, length: int, prefix: bytes | None = None):
        """The bytes at `offset`; with `prefix`, a message: `prefix` and then those bytes,
        built in one copy of them."""
        held = self._held
        with held.lock:
            if self._overtaken:
                raise Overloaded(
                    f"a push overtook this pull of {held.describe()} and the server's pull "
                    "copies are at their bound: pull again", retry_after_s=RETRY_AFTER_S)
            if self._copy is None:
                # Copied out under the lock: the message must not change once it is built.
                live = self._live(offset, length)
                return bytes(live) if prefix is None else b"".join([prefix, live])
        piece = self._copy_reader(offset, length)  # the copy never changes: a view is enough
        return piece if prefix is None else b"".join([prefix, piece])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._held.lock:
            if self in self._held.live_reads:
                self._held.live_reads.remove(self)
        if self._copy is not None:
            self._copy.release()
            self._copy = self._copy_reader = None

    def _use(self, copy: _SharedCopy) -> None:
        self._copy = copy
        self._copy_reader = array_reader(copy.values, self._wire_dtype,
                                         what=self._held.describe())


def preserve_for_reads(held) -> None:
    """Before an update changes `held` (its lock held): give the reads streaming it a copy of
    its values as they are, or, with no room for one, mark them overtaken."""
    reads, held.live_reads = held.live_reads, []
    if not reads:
        return
    copies = reads[0].copies
    nbytes = held.values.nbytes
    if not copies.budget.acquire(nbytes, 0.0):
        for read in reads:
            read._overtaken = True
        return
    try:
        buffer = copies.pool.acquire(nbytes)
    except BaseException:
        # No copy after all: the reads are off the shard, and must not go on reading it.
        copies.budget.release(nbytes)
        for read in reads:
            read._overtaken = True
        raise
    values = buffer.view(held.values.dtype).reshape(held.values.shape)
    np.copyto(values, held.values)
    shared = _SharedCopy(copies, buffer, values, users=len(reads))
    for read in reads:
        read._use(shared)
