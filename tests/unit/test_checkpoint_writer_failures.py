"""Failures of a server's watched checkpoint writer (ps_server.snapshots.save with a stall
timeout): a writer thread that cannot start, and one given up while it makes its file
durable."""

from __future__ import annotations

import threading

from ps_common import checkpoints
from ps_common.errors import CheckpointFailed
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_server import snapshots
from ps_server.ledger import PushLedger
from ps_server.store import ShardStore

WAIT_S = 30.0  # bound of every wait; never reached when the code is right
STALL_S = 0.2  # the stall timeout of saves that are meant to be given up
SGD = Component("sgd", (("lr", 1.0),))
ROWS = 256


def store_with(*names: str) -> ShardStore:
    store = ShardStore()
    specs = {n: VariableSpec(n, (ROWS, 2), optimizer=SGD) for n in names}
    store.assign(1, specs, [Shard(n, 0, 0, ROWS, "s") for n in names])
    return store


def test_a_checkpoint_whose_writer_thread_cannot_start_leaves_the_server_able_to_checkpoint(
        monkeypatch, tmp_path, unstartable_threads):
    """Only a writer stuck on the disk holds later checkpoints back. When the writer thread
    could not be started (a pids limit for a moment), the store's saving lock, which only the
    thread releases, stayed held: every later checkpoint on the server failed."""
    store = store_with("a")
    unstartable_threads(snapshots, "ps-checkpoint-write")
    (tmp_path / "first").mkdir()
    try:  # refused, or written some other way
        snapshots.save(store, PushLedger(), tmp_path / "first", "s", 1,
                       stall_timeout_s=WAIT_S)
    except Exception:  # noqa: BLE001 - what follows matters
        pass
    monkeypatch.undo()  # threads can be started again

    assert not store.saving.locked(), (
        "a checkpoint whose writer thread never started still holds the store's saving lock: "
        "every later checkpoint on this server fails after --checkpoint-stall-timeout")
    (tmp_path / "second").mkdir()
    saved = snapshots.save(store, PushLedger(), tmp_path / "second", "s", 1,
                           stall_timeout_s=WAIT_S)
    assert [f.name for f in saved.files] == ["s.safetensors", "s.ledger.json"]


def test_a_writer_given_up_while_it_makes_its_file_durable_commits_nothing_when_it_gets_on(
        monkeypatch, tmp_path):
    """Once a checkpoint is given up, what the stuck writer does when the disk answers again
    is thrown away. A hung disk blocks most often in the flush and fsync of a file (writes
    go to the page cache): the writer, past its last check, renamed `<server>.safetensors`
    into the checkpoint directory when the disk answered."""
    store = store_with("a", "b")
    hung, answer = threading.Event(), threading.Event()
    real_commit = checkpoints._HashingFile.commit

    def commit(out):
        if out.path.suffix == ".safetensors" and not hung.is_set():
            hung.set()  # the flush of the tensor file: the disk stops answering here
            assert answer.wait(WAIT_S), "the test never let the disk answer"
        return real_commit(out)

    monkeypatch.setattr(checkpoints._HashingFile, "commit", commit)
    outcome: dict = {}

    def run():
        try:
            outcome["saved"] = snapshots.save(store, PushLedger(), tmp_path, "s", 1,
                                              stall_timeout_s=STALL_S)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcome["error"] = error

    saver = threading.Thread(target=run)
    saver.start()
    try:
        assert hung.wait(WAIT_S), "the writer never reached the commit of its tensor file"
        saver.join(WAIT_S)  # returns once the handler gives the checkpoint up
        assert not saver.is_alive(), "the checkpoint was never given up"
        assert isinstance(outcome.get("error"), CheckpointFailed), outcome
    finally:
        answer.set()  # the disk answers again
        saver.join(WAIT_S)
    # The stuck writer returns (it releases the saving lock as it does).
    assert store.saving.acquire(timeout=WAIT_S), "the stuck writer never returned"
    store.saving.release()
    left = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert not left, (f"the writer of a checkpoint given up committed {left} into "
                      f"{tmp_path} once the disk answered")
