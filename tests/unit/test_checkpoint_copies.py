"""A checkpoint's shard copies are freed as each shard is written, also a copy a push made
while the writer finished that shard."""

from __future__ import annotations

import threading

import numpy as np

from ps_common.shardmap import Component, Shard, VariableSpec
from ps_server import snapshots
from ps_server.snapshots import Capture, shard_bytes
from ps_server.store import ShardStore

WAIT_S = 10.0
ADAM = Component("adam", (("lr", 0.1),))
ROWS = 1 << 16  # 512 KiB of values, 1.5 MiB with adam's slots


def store_with(*names: str) -> ShardStore:
    store = ShardStore()
    specs = {n: VariableSpec(n, (ROWS, 2), optimizer=ADAM) for n in names}
    store.assign(1, specs, [Shard(n, 0, 0, ROWS, "s") for n in names])
    return store


def push(store: ShardStore, name: str) -> None:
    (held,) = store.lookup([(name, 0)])
    store.apply([held], [np.ones(held.shape, np.float32)])


def test_a_copy_made_while_the_writer_finishes_its_shard_is_freed_with_it(monkeypatch):
    """A push takes the shard's lock right after the writer read its last block, and copies
    the shard; the writer then marks the shard written (Capture.written, which frees its
    copy) before the push has stored that copy. The copy must not outlive the shard's write:
    "`held` is on disk: pushes no longer preserve it, and its copy is freed"."""
    store = store_with("a", "b")
    a, b = sorted(store.held(), key=lambda h: h.key)
    capture = Capture([a, b], memory_bytes=shard_bytes(a))
    store.begin_capture(capture)

    copying, written = threading.Event(), threading.Event()
    real_of = snapshots.ShardCopy.of

    def slow_of(held):  # the copy of a large shard takes a while: the writer goes on
        copying.set()
        assert written.wait(WAIT_S)
        return real_of(held)

    monkeypatch.setattr(snapshots.ShardCopy, "of", staticmethod(slow_of))
    pusher = threading.Thread(target=push, args=(store, "a"))
    pusher.start()
    assert copying.wait(WAIT_S)
    capture.written(a)  # the writer has just appended a's last block
    written.set()
    pusher.join(WAIT_S)
    assert not pusher.is_alive()
    monkeypatch.setattr(snapshots.ShardCopy, "of", real_of)

    # a is on disk: nothing of it may stay in the checkpoint's memory.
    leaked = capture.copy_of(a)
    assert leaked is None, (
        f"a copy of {a.describe()} ({leaked.nbytes} bytes) is still held after the shard "
        "was written")

    # And its bytes no longer count against --checkpoint-memory: a push to b (which fits
    # the bound on its own) copies b instead of waiting for the writer to reach it.
    done = threading.Event()
    t = threading.Thread(target=lambda: (push(store, "b"), done.set()))
    t.start()
    try:
        assert done.wait(WAIT_S), "a push to b waits for the writer: a's freed copy still counts"
    finally:
        capture.written(b)
        t.join(WAIT_S)
