"""LiveRead: a pull of a large shard reads the live values and is copied only when a push
overtakes it; every piece it returns is from the values as they were when it opened."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import Overloaded
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.buffers import BufferPool, ByteBudget
from ps_server.live_reads import LiveRead, PullCopies
from ps_server.store import ShardStore

ROWS, COLS = 64, 16
NBYTES = ROWS * COLS * 4
SPEC = VariableSpec("w", (ROWS, COLS), initializer=Component.of("zeros"),
                    optimizer=Component.of({"name": "sgd", "lr": 1.0}))
PIECE = 1024  # bytes per read: 4 pieces


def held_shard():
    store = ShardStore()
    store.assign(1, {"w": SPEC}, [Shard("w", 0, 0, ROWS, "s")])
    (held,) = store.lookup([("w", 0)])
    return store, held


def push_ones(store):
    targets = store.plan_push(1, [("w", 0)], [TensorMeta("float32", (ROWS, COLS))])
    store.apply(targets, [np.ones((ROWS, COLS), np.float32)])


def read_all(read, start=0) -> np.ndarray:
    pieces = [read(offset, PIECE) for offset in range(start, NBYTES, PIECE)]
    return np.frombuffer(b"".join(bytes(p) for p in pieces), np.float32)


def copies(capacity=1 << 20):
    return PullCopies(BufferPool(), ByteBudget(capacity))


def test_a_read_no_push_overtakes_makes_no_copy():
    store, held = held_shard()
    pulls = copies()
    read = LiveRead(held, "float32", pulls)
    values = read_all(read)
    read.close()
    assert (values == 0).all()
    assert pulls.budget.out == 0 and pulls.pool.cached_bytes == 0
    push_ones(store)  # after close: the read is no longer registered, nothing is copied
    assert held.live_reads == [] and pulls.pool.cached_bytes == 0


def test_a_push_between_pieces_leaves_the_read_on_the_values_it_started_from():
    store, held = held_shard()
    pulls = copies()
    read = LiveRead(held, "float32", pulls)
    first = read(0, PIECE)
    push_ones(store)  # overtakes: the read goes on from a copy of the zeros
    assert pulls.budget.out == NBYTES
    rest = read_all(read, PIECE)
    assert (np.frombuffer(bytes(first), np.float32) == 0).all() and (rest == 0).all()
    assert (held.values == -1).all()  # the push was applied all the same
    read.close()
    assert pulls.budget.out == 0 and pulls.pool.cached_bytes == NBYTES  # back in the pool


def test_a_piece_read_as_a_message_follows_its_prefix_before_and_after_a_push():
    """With a prefix (the chunk message's fields before its data), a piece comes back as the
    whole message, from the live values or, once a push has overtaken the read, its copy."""
    store, held = held_shard()
    held.values.reshape(-1)[:] = np.arange(ROWS * COLS, dtype=np.float32)
    expected = held.values.reshape(-1).copy().view(np.uint8)
    read = LiveRead(held, "float32", copies())
    live = read(0, PIECE, b"prefix")
    push_ones(store)
    copied = read(PIECE, PIECE, b"another")
    read.close()
    assert isinstance(live, bytes) and isinstance(copied, bytes)
    assert live == b"prefix" + expected[:PIECE].tobytes()
    assert copied == b"another" + expected[PIECE:2 * PIECE].tobytes()


def test_reads_overtaken_together_share_one_copy():
    store, held = held_shard()
    pulls = copies()
    reads = [LiveRead(held, "float32", pulls) for _ in range(3)]
    push_ones(store)
    assert pulls.budget.out == NBYTES
    later = LiveRead(held, "float32", pulls)  # opened after the push: sees it, live
    push_ones(store)  # copies again, for `later` only
    assert pulls.budget.out == 2 * NBYTES
    for read in reads:
        assert (read_all(read) == 0).all()
    assert (read_all(later) == -1).all()
    for read in reads[:2]:
        read.close()
    assert pulls.budget.out == 2 * NBYTES  # the third still uses the shared copy
    reads[2].close()
    later.close()
    assert pulls.budget.out == 0


def test_a_narrowed_read_converts_from_the_values_it_started_from():
    store, held = held_shard()
    read = LiveRead(held, "float16", copies())
    first = read(0, PIECE // 2)
    push_ones(store)
    rest = [read(offset, PIECE // 2) for offset in range(PIECE // 2, NBYTES // 2, PIECE // 2)]
    values = np.frombuffer(b"".join([bytes(first), *map(bytes, rest)]), np.float16)
    assert values.size == ROWS * COLS and (values == 0).all()
    read.close()


def test_with_no_room_for_a_copy_the_overtaken_read_is_told_to_pull_again():
    store, held = held_shard()
    pulls = copies(capacity=NBYTES)
    other_store, other = held_shard()
    holder = LiveRead(other, "float32", pulls)
    push_ones(other_store)  # the budget now holds `holder`'s copy
    read = LiveRead(held, "float32", pulls)
    read(0, PIECE)
    push_ones(store)  # no room: the push is applied, the read is overtaken
    assert (held.values == -1).all()
    with pytest.raises(Overloaded) as raised:
        read(PIECE, PIECE)
    assert raised.value.retry_after_s > 0 and "pull again" in str(raised.value)
    read.close()
    holder.close()
    assert pulls.budget.out == 0
