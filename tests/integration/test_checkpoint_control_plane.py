"""Checkpoints through a cluster when parts of them fail: a server's checkpoint writer that
cannot be started, a fall-back to the previous good checkpoint while another server needs
its shard map, and an old checkpoint that cannot be removed."""

from __future__ import annotations

import errno
import pathlib
import threading

import numpy as np

from ps_common.checkpoints import MANIFEST, checkpoint_ids
from ps_common.errors import CheckpointFailed
from ps_server import snapshots
from ps_server.coordinator import checkpointer as checkpointer_module
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

SHARED_MEMORY = False
SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 20.0  # bound of every wait; never reached when the code is right


def test_a_checkpoint_whose_server_writer_thread_cannot_start_does_not_block_later_ones(
        make_cluster, tmp_path, monkeypatch, unstartable_threads):
    """Only a write stuck on the disk makes a server's later checkpoints fail, and only until
    it returns. A writer thread that could not be started (a pids limit for a moment) left
    the store's saving lock held for good: that checkpoint answered INTERNAL, and every later
    one on the server failed as if its disk were stuck."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path, checkpoint_stall_timeout_s=WAIT_S)
    store = cluster.servers[0].store

    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        unstartable_threads(snapshots, "ps-checkpoint-write")
        try:
            cluster.checkpoint()  # refused, or written some other way
        except CheckpointFailed:
            pass
        monkeypatch.undo()  # threads can be started again

        assert not store.saving.locked(), (
            "the server still holds its saving lock for a checkpoint writer that never "
            "started: its every later checkpoint fails after --checkpoint-stall-timeout")
        ps.push({"w": np.ones(4, np.float32)})
        manifest = cluster.checkpoint()
        assert manifest is not None and manifest.step >= 0


def test_a_fall_back_does_not_hold_up_the_shard_map_of_another_server(
        make_cluster, tmp_path, monkeypatch):
    """A fall-back reads the previous checkpoint whole (minutes for a large model) within the
    delivery to the server whose restore failed. That delivery was part of the one
    background sync heartbeats start, and while it ran no other was started: a server that
    restarted meanwhile got no shard map, although its part of the checkpoint was good. The
    verification is held here (a slow disk) until that server has its shards or the bound
    passes."""
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path, split_threshold_bytes=64)
    first, second = cluster.servers
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(32,), init="zeros", optimizer=SGD1)  # 128 bytes: two shards
        shard_map = ps.refresh()
        assert shard_map.shards_on(first.server_id) and shard_map.shards_on(second.server_id)
        ps.push({"w": np.ones(32, np.float32)})
        cluster.checkpoint()
        ps.push({"w": np.ones(32, np.float32)})
        bad = cluster.checkpoint()
    # The first server's part of the newest checkpoint rots; the second server's stays good.
    part = bad.directory / f"{first.server_id}.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))

    verifying, release = threading.Event(), threading.Event()
    real_verify = checkpointer_module.verify

    def slow_verify(directory):
        verifying.set()
        assert release.wait(WAIT_S + 10), "the test never let the verification end"
        return real_verify(directory)

    monkeypatch.setattr(checkpointer_module, "verify", slow_verify)
    try:
        cluster.restart_server(0)  # its restore from `bad` fails: the coordinator falls back
        assert verifying.wait(WAIT_S), "the coordinator never fell back"
        restarted = cluster.restart_server(1)  # its own part of `bad` is good

        def second_holds_its_shards() -> bool:
            epoch = cluster.coordinator.state.shard_map.epoch
            mine = cluster.coordinator.state.shard_map.shards_on(restarted.server_id)
            return restarted.store.epoch >= epoch and len(restarted.store.held()) == len(mine)

        try:
            wait_until(second_holds_its_shards,
                       "the restarted second server gets its shard map", WAIT_S)
            delivered = True
        except TimeoutError:
            delivered = False
    finally:
        release.set()
    cluster.wait_until_synced(WAIT_S)
    assert delivered, ("while the coordinator verified the previous checkpoint for one "
                       "server's fall-back, another server that restarted got no shard map")


def test_one_old_checkpoint_that_cannot_be_removed_does_not_stop_pruning_the_others(
        make_cluster, tmp_path, monkeypatch):
    """The coordinator keeps the newest --keep-checkpoints (3). Pruning stopped at the first
    checkpoint it could not remove (EACCES: a directory restored from a backup by another
    user), so with one such old checkpoint none was ever removed again, until the disk was
    full."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        stuck = cluster.checkpoint()
        refused = stuck.directory / MANIFEST
        real_unlink = pathlib.Path.unlink

        def unlink(path, *args, **kwargs):
            if path == refused:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "unlink", unlink)
        taken = []
        for _ in range(5):
            ps.push({"w": np.ones(4, np.float32)})
            taken.append(cluster.checkpoint().id)
    kept = checkpoint_ids(tmp_path)
    # The stuck one stays (it cannot go); the newest three stay; the two between must go.
    assert stuck.id in kept and set(taken[-3:]) <= set(kept)
    assert not set(taken[:2]) & set(kept), (
        f"--keep-checkpoints 3 keeps {kept}: one old checkpoint that cannot be removed stops "
        "every later one from being pruned")
