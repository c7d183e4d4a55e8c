"""A checkpoint whose disk stops answering (a hung network mount under --checkpoint-dir):
the pushes it holds back go on once its write has made no progress for the stall timeout,
the checkpoint fails naming the flag, and nothing the stuck writer does later is kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_common import checkpoints
from ps_common.errors import CheckpointFailed
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_server import snapshots
from ps_server.ledger import PushLedger
from ps_server.store import ShardStore

WAIT_S = 30.0
STALL_S = 0.5
SGD = Component("sgd", (("lr", 1.0),))
ROWS = 1 << 12


def store_with(*names: str) -> ShardStore:
    store = ShardStore()
    specs = {n: VariableSpec(n, (ROWS, 2), optimizer=SGD) for n in names}
    store.assign(1, specs, [Shard(n, 0, 0, ROWS, "s") for n in names])
    return store


def push(store: ShardStore, name: str) -> None:
    (held,) = store.lookup([(name, 0)])
    store.apply([held], [np.ones(held.shape, np.float32)])


def values(store: ShardStore, name: str) -> np.ndarray:
    (held,) = store.lookup([(name, 0)])
    with held.lock:
        return held.values.copy()


class HungDisk:
    """TensorFileWriter.append blocks on its first call until `answer()`, as a write to a
    mount that stopped answering does."""

    def __init__(self, monkeypatch):
        self.hung, self._answer = threading.Event(), threading.Event()
        real = checkpoints.TensorFileWriter.append

        def append(writer, array):
            if not self.hung.is_set():
                self.hung.set()
                assert self._answer.wait(WAIT_S), "the test never let the disk answer"
            return real(writer, array)

        monkeypatch.setattr(checkpoints.TensorFileWriter, "append", append)

    def answer(self) -> None:
        self._answer.set()


def save_in_thread(store, directory, stall_timeout_s):
    outcome: dict = {}

    def run():
        try:
            outcome["saved"] = snapshots.save(store, PushLedger(), directory, "s", 1,
                                              memory_bytes=0,
                                              stall_timeout_s=stall_timeout_s)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def wait_for_writer(store: ShardStore) -> None:
    """Until the stuck writer has returned (it holds the store's saving lock until then)."""
    assert store.saving.acquire(timeout=WAIT_S), "the checkpoint's writer never returned"
    store.saving.release()


def test_a_push_held_by_a_hung_checkpoint_goes_on_and_the_checkpoint_is_given_up(
        monkeypatch, tmp_path):
    store = store_with("a", "b")
    disk = HungDisk(monkeypatch)
    saver, outcome = save_in_thread(store, tmp_path, STALL_S)
    assert disk.hung.wait(WAIT_S)

    # No memory for copies: a push to b, not written yet, waits for the writer to reach it.
    pushed = threading.Event()
    pusher = threading.Thread(target=lambda: (push(store, "b"), pushed.set()))
    pusher.start()
    try:
        assert pushed.wait(WAIT_S), "the push waits for a checkpoint whose disk hangs"
        saver.join(WAIT_S)
        assert not saver.is_alive()
        error = outcome.get("error")
        assert isinstance(error, CheckpointFailed), outcome
        assert "--checkpoint-stall-timeout" in str(error) and "no progress" in str(error)
        np.testing.assert_array_equal(values(store, "b"), np.full((ROWS, 2), -1.0))
    finally:
        disk.answer()
        pusher.join(WAIT_S)
    wait_for_writer(store)
    # b changed after the cut: whatever the writer went on to write is not a checkpoint.
    assert not list(tmp_path.glob("*.safetensors"))
    assert not list(tmp_path.glob(".*.tmp"))
    # The next checkpoint is a whole one.
    saved = snapshots.save(store, PushLedger(), tmp_path, "s", 1, stall_timeout_s=WAIT_S)
    assert [f.name for f in saved.files] == ["s.safetensors", "s.ledger.json"]
    read = checkpoints.TensorFile(tmp_path / "s.safetensors")
    np.testing.assert_array_equal(read.array(checkpoints.values_name("b", 0)),
                                  np.full((ROWS, 2), -1.0, np.float32))


def test_a_checkpoint_behind_a_stuck_one_fails_instead_of_waiting_for_it(
        monkeypatch, tmp_path):
    store = store_with("a")
    disk = HungDisk(monkeypatch)
    (tmp_path / "first").mkdir()
    saver, outcome = save_in_thread(store, tmp_path / "first", STALL_S)
    try:
        assert disk.hung.wait(WAIT_S)
        saver.join(WAIT_S)
        assert isinstance(outcome.get("error"), CheckpointFailed), outcome
        (tmp_path / "second").mkdir()
        with pytest.raises(CheckpointFailed, match="earlier checkpoint's write has not returned"):
            snapshots.save(store, PushLedger(), tmp_path / "second", "s", 1,
                           stall_timeout_s=STALL_S)
    finally:
        disk.answer()
    wait_for_writer(store)
    saved = snapshots.save(store, PushLedger(), tmp_path / "second", "s", 1,
                           stall_timeout_s=WAIT_S)
    assert saved.files[0].name == "s.safetensors"


class SteppedClock:
    """time.monotonic for ps_server.snapshots that moves only when the writer writes."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_a_slow_write_that_keeps_making_progress_is_not_given_up(monkeypatch, tmp_path):
    """Each block takes most of the stall timeout, the whole write many times it."""
    store = store_with(*(f"v{k}" for k in range(6)))
    clock = SteppedClock()
    monkeypatch.setattr(snapshots, "time", clock)
    real = checkpoints.TensorFileWriter.append

    def slow_append(writer, array):
        clock.now += 0.8 * STALL_S
        return real(writer, array)

    monkeypatch.setattr(checkpoints.TensorFileWriter, "append", slow_append)
    saved = snapshots.save(store, PushLedger(), tmp_path, "s", 1, stall_timeout_s=STALL_S)
    assert clock.now > 4 * STALL_S
    assert len(saved.shards) == 6


def test_large_files_are_flushed_to_the_disk_as_they_are_written(monkeypatch, tmp_path):
    """So that the flush at the end waits for a bounded amount, and a writer watched for
    progress shows some while a large part goes to a slow disk."""
    monkeypatch.setattr(checkpoints, "SYNC_EVERY_BYTES", 1 << 16)
    synced = []
    monkeypatch.setattr(checkpoints.os, "fdatasync", lambda fd: synced.append(fd))
    progress = []
    record = checkpoints.write_file(tmp_path / "f", bytes(5 << 16),
                                    on_progress=lambda: progress.append(1))
    assert record.bytes == 5 << 16
    # One write of 5 blocks' bytes: flushed once after it; progress after the write, the
    # flush, the fsync at the commit and the rename.
    assert len(synced) == 1
    assert len(progress) == 4


def test_the_flag_sets_the_stall_timeout_and_a_bad_one_exits_naming_it(capsys):
    from ps_server.app import ServerConfig
    from ps_server.cli import build_parser, config_from_args

    parser = build_parser()
    args = ["--coordinator", "127.0.0.1:1"]
    assert config_from_args(parser, parser.parse_args(args), environ={}) \
        .checkpoint_stall_timeout_s == ServerConfig().checkpoint_stall_timeout_s == 300.0
    for given, expected in (("45", 45.0), ("0", 0.0)):
        config = config_from_args(parser, parser.parse_args(
            [*args, "--checkpoint-stall-timeout", given]), environ={})
        assert config.checkpoint_stall_timeout_s == expected
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exited:
            config_from_args(parser, parser.parse_args(
                [*args, "--checkpoint-stall-timeout", bad]), environ={})
        assert exited.value.code == 2
        assert "--checkpoint-stall-timeout" in capsys.readouterr().err
