"""A checkpoint completes between a declaration that restores a variable from the current
checkpoint and the assignment that carries that restore. That newer checkpoint was cut at
the map epoch before the variable was declared (it holds it only as carried over from the
one before): the restore comes from the checkpoint it was decided with, unless the current
one holds the variable too, pruning keeps that one (keep 1 too) until the restore is done,
and the newer checkpoint is never taken for an unreadable one.

The interleaving is forced: the checkpoint reads the map before `b` is declared, and the
declaration's sync waits until the checkpoint is adopted.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_worker import PSClient, RetryPolicy

SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0


@pytest.mark.parametrize("keep", [3, 1])
def test_a_checkpoint_adopted_between_a_restore_decision_and_its_assignment(
        make_cluster, spawn, tmp_path, keep):
    # A first run trains a and b and checkpoints them (ckpt-1), then stops.
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address, retry=PATIENT) as ps:
        ps.declare("a", shape=(4, 2), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(3,), init="zeros", optimizer=SGD1)
        for _ in range(2):
            ps.push({"a": np.ones((4, 2), np.float32), "b": np.ones(3, np.float32)})
        saved = first.checkpoint()
    assert set(saved.variables) == {"a", "b"}
    first.stop()

    # The job is resumed: a new coordinator and server on the same checkpoint directory.
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    coordinator = cluster.coordinator
    checkpointer = coordinator.checkpointer
    checkpointer._keep = keep  # --keep-checkpoints
    state = coordinator.state
    assigner = coordinator._assigner
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("a", shape=(4, 2), init="zeros", optimizer=SGD1)  # restored from ckpt-1
        np.testing.assert_array_equal(ps.pull("a"), np.full((4, 2), -2.0, np.float32))
        cluster.wait_until_synced(WAIT_S)

        map_read, declared = threading.Event(), threading.Event()
        progress = checkpointer._progress

        def progress_then_wait():
            # Called by the checkpoint right after it read the map (a only).
            map_read.set()
            assert declared.wait(WAIT_S)
            return progress()

        checkpointer._progress = progress_then_wait
        taking = spawn(checkpointer.take, "requested")
        assert map_read.wait(WAIT_S)

        sync = assigner.sync

        def sync_after_the_checkpoint(*args, **kwargs):
            if "b" in state.shard_map.variables:  # b is placed, its restore decided
                declared.set()
                assert taking.done.wait(WAIT_S)
            return sync(*args, **kwargs)

        assigner.sync = sync_after_the_checkpoint
        try:
            ps.declare("b", shape=(3,), init="zeros", optimizer=SGD1)
        finally:
            assigner.sync = sync
            checkpointer._progress = progress
            declared.set()
        newest = taking.result()
        # Taken at the epoch before b was declared: it holds b only as carried over from
        # the checkpoint before it (ps_common.checkpoints.carry_forward).
        assert newest.epoch < state.shard_map.epoch

        # Nothing was unreadable: the newest checkpoint stays the one to restore from, and b
        # comes back with its trained values.
        assert state.data_loss == ""
        assert checkpointer.catalog.current().id == newest.id
        cluster.wait_until_synced(WAIT_S)
        ps.refresh()
        np.testing.assert_array_equal(ps.pull("b"), np.full(3, -2.0, np.float32))
