"""A server's checkpoint cut: the update gate, copy-on-write within a memory bound, and the
files it writes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ps_common.checkpoints import TensorFile, slot_name, values_name
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_server.ledger import PushLedger
from ps_server.snapshots import Capture, UpdateGate, save, shard_bytes
from ps_server.store import ShardStore

WAIT_S = 10.0
ADAM = Component("adam", (("lr", 0.1),))


def store_with(*names: str, rows: int = 4) -> ShardStore:
    store = ShardStore()
    specs = {n: VariableSpec(n, (rows, 2), optimizer=ADAM) for n in names}
    store.assign(1, specs, [Shard(n, 0, 0, rows, "s") for n in names])
    return store


def push(store: ShardStore, name: str) -> None:
    (held,) = store.lookup([(name, 0)])
    store.apply([held], [np.ones(held.shape, np.float32)])


def test_a_cut_waits_for_pushes_inside_the_gate_and_holds_new_ones_back():
    gate = UpdateGate()
    inside, cut_taken, late_in = threading.Event(), threading.Event(), threading.Event()
    release = threading.Event()

    def pusher():
        with gate.shared():
            inside.set()
            release.wait(WAIT_S)

    def cutter():
        with gate.exclusive():
            cut_taken.set()

    def late():
        with gate.shared():
            late_in.set()

    first = threading.Thread(target=pusher)
    first.start()
    assert inside.wait(WAIT_S)
    cut = threading.Thread(target=cutter)
    cut.start()
    second = threading.Thread(target=late)
    # The cutter is waiting (it cannot be seen directly): wait until it registers.
    deadline = time.monotonic() + WAIT_S
    while not gate._cut_waiting:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    second.start()
    assert not cut_taken.is_set() and not late_in.is_set()
    release.set()
    for t in (first, cut, second):
        t.join(WAIT_S)
    assert cut_taken.is_set() and late_in.is_set()


def test_a_push_preserves_the_shard_as_it_was_at_the_cut():
    store = store_with("a")
    push(store, "a")
    (held,) = store.held()
    at_cut = (held.values.copy(), held.state.slots["m"].copy(), held.state.steps)
    capture = Capture([held], memory_bytes=shard_bytes(held))
    store.begin_capture(capture)
    push(store, "a")  # changes the live shard only after copying it
    copy = capture.copy_of(held)
    assert copy is not None
    np.testing.assert_array_equal(copy.values, at_cut[0])
    np.testing.assert_array_equal(copy.slots["m"], at_cut[1])
    assert copy.optimizer_steps == at_cut[2] == 1
    assert held.state.steps == 2


def test_past_its_memory_bound_a_push_waits_for_the_writer_instead_of_copying():
    store = store_with("a", "b")
    a, b = sorted(store.held(), key=lambda h: h.key)
    capture = Capture([a, b], memory_bytes=shard_bytes(a))
    store.begin_capture(capture)
    push(store, "a")  # fits: copied
    b_before = b.values.copy()
    pushed = threading.Event()
    t = threading.Thread(target=lambda: (push(store, "b"), pushed.set()))
    t.start()
    assert not pushed.wait(0.2)  # waiting (a push never copies past the bound)
    np.testing.assert_array_equal(b.values, b_before)
    capture.written(b)  # the writer has written b
    assert pushed.wait(WAIT_S)
    t.join(WAIT_S)
    assert not np.array_equal(b.values, b_before)


@pytest.mark.parametrize("memory_bytes", [0, 1 << 20])
def test_save_writes_every_shard_and_slot_as_of_the_cut(tmp_path, memory_bytes):
    store = store_with("a", "b")
    ledger = PushLedger()
    with ledger.exactly_once("c", 1, 1, 0):
        push(store, "a")
    expected = {h.key: (h.values.copy(), h.state.slots["v"].copy()) for h in store.held()}
    outcome = save(store, ledger, tmp_path, "s", epoch=1, memory_bytes=memory_bytes)
    assert {f.name for f in outcome.files} == {"s.safetensors", "s.ledger.json"}
    assert outcome.pushes_recorded == 1
    tensors = TensorFile(tmp_path / "s.safetensors")
    for (name, index), (values, v) in expected.items():
        np.testing.assert_array_equal(tensors.array(values_name(name, index)), values)
        np.testing.assert_array_equal(tensors.array(slot_name(name, index, "v")), v)
    assert {s.variable: s.optimizer_steps for s in outcome.shards} == {"a": 1, "b": 0}


def test_a_shard_nobody_pushes_to_is_written_without_a_copy_and_a_push_mid_write_gets_one(
        tmp_path, monkeypatch):
    """The writer reads live values a block at a time; a push landing while it is half way
    through a shard preserves the shard, and the rest is written from that copy: the file
    holds the cut either way, and only pushed-to shards are ever copied."""
    import ps_server.snapshots as snapshots

    monkeypatch.setattr(snapshots, "BLOCK_ELEMENTS", 2)  # several blocks per tensor
    store = store_with("a", "b", rows=8)
    ledger = PushLedger()
    push(store, "a")
    at_cut = {h.key: h.values.copy() for h in store.held()}
    copies = []
    real_of = snapshots.ShardCopy.of

    def counting_of(held):
        copies.append(held.key)
        return real_of(held)

    monkeypatch.setattr(snapshots.ShardCopy, "of", staticmethod(counting_of))
    writer_append = snapshots.TensorFileWriter.append
    pushed = []

    def append_then_push(self, array):
        writer_append(self, array)
        if not pushed:  # half way through shard "a": a push lands
            pushed.append(True)
            push(store, "a")

    monkeypatch.setattr(snapshots.TensorFileWriter, "append", append_then_push)
    save(store, ledger, tmp_path, "s", epoch=1, memory_bytes=1 << 20)
    tensors = TensorFile(tmp_path / "s.safetensors")
    for (name, index), values in at_cut.items():
        np.testing.assert_array_equal(tensors.array(values_name(name, index)), values)
    assert copies == [("a", 0)]


# ---- a dynamic table that grows right after the cut ------------------------------------

def pull_table_rows(store: ShardStore, ids) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    ((_, _, rows),) = store.plan_pull(store.epoch, [("t", 0)], None, [ids])
    return rows


def test_a_dynamic_table_growing_right_after_the_cut_is_saved_as_of_the_cut(tmp_path):
    spec = VariableSpec("t", (0, 4), kind="embedding", initializer=Component.of("zeros"),
                        optimizer=Component.of({"name": "sgd", "lr": 1.0}))
    store = ShardStore()
    store.assign(1, {"t": spec}, [Shard("t", 0, 0, 0, "s", 1)])
    pull_table_rows(store, np.arange(64))  # the pool's first 64 rows: full
    (held,) = store.held()
    at_cut = (held.values.copy(), held.state.slots["ids"].copy())
    assert len(at_cut[0]) == 64

    real_begin = store.begin_capture

    def begin_then_pull(capture):
        real_begin(capture)
        # A pull of new ids lands right after the cut: the pool grows (a copy is kept first).
        pull_table_rows(store, np.arange(1000, 1010))

    store.begin_capture = begin_then_pull
    save(store, PushLedger(), tmp_path, "s", epoch=1)

    tensors = TensorFile(tmp_path / "s.safetensors")
    np.testing.assert_array_equal(tensors.array(values_name("t", 0)), at_cut[0])
    np.testing.assert_array_equal(tensors.array(slot_name("t", 0, "ids")), at_cut[1])


def test_prune_keeps_every_protected_checkpoint_whatever_keep_says(tmp_path):
    from ps_common.checkpoints import MANIFEST, checkpoint_ids, new_checkpoint_dir, prune

    made = []
    for _ in range(4):
        directory = new_checkpoint_dir(tmp_path)
        (directory / MANIFEST).write_text("{}")
        made.append(directory.name)
    # The newest is kept by `keep`; the oldest (restores come from it after a fall-back)
    # and the second by `protect`.
    removed = prune(tmp_path, 1, protect=[made[0], made[1]])
    assert removed == [made[2]]
    assert checkpoint_ids(tmp_path) == [made[0], made[1], made[3]]
    assert prune(tmp_path, 1, protect=made[1]) == [made[0]]


def test_a_dynamic_table_saves_its_rows_last_use_as_of_the_cut(tmp_path, monkeypatch):
    """Seconds and requests from each row's last use to the cut, not clock readings: rows
    touched and made after the cut (the shard is then written from its copy) are saved as
    they were, a block at a time."""
    import ps_server.snapshots as snapshots

    monkeypatch.setattr(snapshots, "BLOCK_ELEMENTS", 2)
    now = [100.0]
    spec = VariableSpec("t", (0, 4), kind="embedding", initializer=Component.of("zeros"),
                        optimizer=Component.of({"name": "sgd", "lr": 1.0}))
    store = ShardStore(clock=lambda: now[0])
    store.assign(1, {"t": spec}, [Shard("t", 0, 0, 0, "s", 1)])
    pull_table_rows(store, np.arange(32))
    now[0] = 102.0
    pull_table_rows(store, np.arange(32, 64))
    now[0] = 103.0
    real_begin = store.begin_capture

    def begin_then_pull(capture):
        real_begin(capture)
        pull_table_rows(store, np.r_[np.arange(10), np.arange(1000, 1010)])

    store.begin_capture = begin_then_pull
    save(store, PushLedger(), tmp_path, "s", epoch=1)

    tensors = TensorFile(tmp_path / "s.safetensors")
    ids = tensors.array(slot_name("t", 0, "ids"))
    assert sorted(ids.tolist()) == list(range(64))
    age = tensors.array(slot_name("t", 0, "last_use_age"))
    ago = tensors.array(slot_name("t", 0, "last_use_ago"))
    np.testing.assert_array_equal(age, np.where(ids < 32, 3.0, 1.0))
    np.testing.assert_array_equal(ago, np.where(ids < 32, 1, 0))
