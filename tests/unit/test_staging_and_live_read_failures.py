"""The bounds and snapshots of the gRPC path's buffers hold also where they used to slip:
pushes of changing sizes under --push-memory, and a streamed pull whose copy could not be
made."""

from __future__ import annotations

import numpy as np

from ps_common.errors import Overloaded
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.buffers import BufferPool, ByteBudget
from ps_server.live_reads import LiveRead, PullCopies
from ps_server.push_staging import PushStaging
from ps_server.store import ShardStore

BOUND = 1 << 20


def test_buffers_kept_from_earlier_pushes_and_a_new_push_stay_within_push_memory(tmp_path):
    """Buffers of pushes waiting in memory, idle and in use together, stay within
    --push-memory. Idle ones were trimmed only when a buffer was given back: a push of
    another size (row pushes change size every step) made a new buffer beside those kept,
    up to twice the bound."""
    staging = PushStaging(lambda: 0, BOUND, str(tmp_path))
    with staging.stage([BOUND]):
        pass
    assert staging.idle_buffer_bytes() == BOUND  # kept for the next push of that size
    with staging.stage([BOUND // 2]) as staged:
        assert staged.reader is None and staged.file is None  # waits in memory
        in_use = sum(len(memoryview(buffer).cast("B")) for buffer in staged.destinations)
        assert in_use + staging.idle_buffer_bytes() <= staging.memory_bound()
    staging.close()


def test_a_read_whose_copy_could_not_be_made_is_never_left_reading_live_values():
    """A streamed pull of a large shard never mixes values from before and after a push: an
    update gives it a copy or marks it overtaken (Overloaded: pull again). When the copy's
    buffer could not be had (MemoryError), the reads were taken off the shard and left
    neither copied nor overtaken: the next update changed the values under them."""
    rows, cols, piece = 64, 16, 1024
    nbytes = rows * cols * 4
    spec = VariableSpec("w", (rows, cols), initializer=Component.of("zeros"),
                        optimizer=Component.of({"name": "sgd", "lr": 1.0}))
    store = ShardStore()
    store.assign(1, {"w": spec}, [Shard("w", 0, 0, rows, "s")])
    (held,) = store.lookup([("w", 0)])

    def push_ones():
        targets = store.plan_push(1, [("w", 0)], [TensorMeta("float32", (rows, cols))])
        store.apply(targets, [np.ones((rows, cols), np.float32)])

    pool = BufferPool()
    real_acquire = pool.acquire
    failures = [MemoryError("no room for the pull's copy")]

    def acquire(size):
        if failures:
            raise failures.pop()
        return real_acquire(size)

    pool.acquire = acquire
    read = LiveRead(held, "float32", PullCopies(pool, ByteBudget(1 << 20)))
    first = np.frombuffer(bytes(read(0, piece)), np.float32)
    try:
        push_ones()  # its copy for the read fails: the update fails, nothing applied
    except MemoryError:
        pass
    assert (held.values == 0).all()
    push_ones()  # applied
    assert (held.values == -1).all()
    try:
        rest = np.frombuffer(b"".join(bytes(read(offset, piece))
                                      for offset in range(piece, nbytes, piece)), np.float32)
    except Overloaded:
        return  # told to pull again: consistent
    finally:
        read.close()
    assert (first == 0).all()
    assert (rest == 0).all(), "the pull mixes values from before and after a push"
