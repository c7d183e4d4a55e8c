"""Checkpoints when things go wrong while restoring: a checkpoint found unreadable by the
server that reads it, a passing failure (memory), a ledger file altered, and a server that
was only out of reach while its shards moved."""

from __future__ import annotations


import errno
import threading

import grpc
import numpy as np
import pytest

from ps_common.checkpoints import MANIFEST, checkpoint_ids
from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from ps_server.testing import cut_off_from_coordinator, wait_until
import ps_server.restore as restore_module
from ps_worker import PSClient, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0


def test_two_reports_about_one_unreadable_checkpoint_fall_back_once(make_cluster, tmp_path):
    """(E.g. a lost server's shards moved to two servers, both reading its one bad file.)"""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        cluster.checkpoint()
        ps.push({"w": np.ones(5, np.float32)})
        good = cluster.checkpoint()
        bad = cluster.checkpoint()
    state = cluster.coordinator.state
    for target in ("target-1", "target-2"):
        state.restore_failed(target, bad.directory, f"{bad.directory}: sha256 mismatch")
    assert cluster.coordinator.checkpointer.catalog.current().id == good.id


def test_a_passing_failure_while_restoring_restores_nothing_of_the_cut_then_all_of_it(
        make_cluster, tmp_path, monkeypatch):
    """A server restores all of its shards from one checkpoint or none: one push is in both
    shards or in neither, and a failure that is not the checkpoint's keeps the checkpoint."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("a", shape=(4,), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
        cluster.checkpoint()
        ps.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})  # in both
        newest = cluster.checkpoint()
        real, failures = restore_module.make_state, [1]

        def out_of_memory_once(spec, shape):
            if spec.name == "b" and failures:
                failures.pop()
                raise MemoryError
            return real(spec, shape)

        monkeypatch.setattr(restore_module, "make_state", out_of_memory_once)
        cluster.restart_server(0)
        wait_until(lambda: cluster.coordinator.state.shards_restored == 2, "the restore")
        cluster.wait_until_synced()
        np.testing.assert_array_equal(ps.pull("a"), np.full(4, -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull("b"), np.full(4, -2.0, np.float32))
    assert not failures
    assert cluster.coordinator.checkpointer.catalog.current().id == newest.id


def test_an_altered_ledger_file_falls_back_to_the_previous_checkpoint(make_cluster, tmp_path):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, client_id="c", retry=PATIENT) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(5, np.float32)})
        good = cluster.checkpoint()
        ps.push({"w": np.ones(5, np.float32)})
        bad = cluster.checkpoint()
        path = next(bad.directory.glob("*.ledger.json"))
        path.write_text(path.read_text().replace('"c"', '"x"'))  # same size, other bytes
        cluster.restart_server(0)
        wait_until(lambda: cluster.coordinator.state.shards_restored == 1, "the restore")
        np.testing.assert_array_equal(ps.pull("w"), np.full(5, -1.0, np.float32))
    assert cluster.coordinator.checkpointer.catalog.current().id == good.id


def test_with_reinitialize_a_shard_no_checkpoint_can_give_is_created_again(make_cluster,
                                                                          tmp_path):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path, reinitialize_lost_shards=True)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(5, np.float32)})
        only = cluster.checkpoint()
        path = next(only.directory.glob("*.safetensors"))
        path.write_bytes(path.read_bytes()[:-4])
        cluster.restart_server(0)
        wait_until(lambda: [h.key for h in cluster.servers[0].store.held()] == [("w", 0)],
                   "the shard to be created again")
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(5, np.float32))
    assert cluster.coordinator.checkpointer.catalog.current() is None


def test_a_server_back_after_its_shards_moved_drops_its_old_copy(make_cluster, tmp_path):
    """A server only out of reach (a partition, a long pause) past --server-timeout: its
    shards move to a live server from the checkpoint; when it is back it drops its copies
    (trained or not), and a client that still used the old map follows the move."""
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path, server_timeout_s=0.5)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps, \
            PSClient(cluster.coordinator_address, client_id="stale", retry=PATIENT) as stale:
        ps.declare("a", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"a": np.ones(4, np.float32)})
        cluster.checkpoint()
        stale.pull("a")  # its map places "a" on the old holder
        holder_id = ps.shard_map.shards_of("a")[0].server_id
        holder = next(s for s in cluster.servers if s.server_id == holder_id)
        reachable = cut_off_from_coordinator(holder)
        wait_until(lambda: ps.refresh().shards_of("a")[0].server_id != holder_id,
                   "the shard to move")
        reachable.set()
        wait_until(lambda: holder.store.epoch == cluster.coordinator.state.shard_map.epoch
                   and not holder.store.held(), "the old holder to drop its copy")
        stale.push({"a": np.ones(4, np.float32)})
        np.testing.assert_array_equal(ps.pull("a"), np.full(4, -2.0, np.float32))
        np.testing.assert_array_equal(stale.pull("a"), np.full(4, -2.0, np.float32))


def test_a_checkpoint_the_coordinator_cannot_write_names_the_cause(make_cluster, tmp_path,
                                                                    monkeypatch):
    """A server that cannot write its part says so (FAILED_PRECONDITION, path and cause);
    so does the coordinator when its own manifest write hits a full disk, not INTERNAL. The
    checkpoint before it stays."""
    from ps_server.coordinator import checkpointer

    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        cluster.checkpoint()  # the variable is covered: no periodic one races ours
        (kept,) = checkpoint_ids(tmp_path)

        def disk_full(manifest):
            raise OSError(errno.ENOSPC, "No space left on device",
                          str(manifest.directory / MANIFEST))

        monkeypatch.setattr(checkpointer, "write_manifest", disk_full)
        with grpc.insecure_channel(cluster.coordinator_address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Checkpoint(coordinator_pb2.CheckpointRequest(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (
        caught.value.code(), caught.value.details())
    assert "No space left on device" in caught.value.details(), caught.value.details()
    assert str(tmp_path) in caught.value.details()
    assert kept in checkpoint_ids(tmp_path) and (tmp_path / kept / MANIFEST).exists()


def test_a_checkpoint_whose_disk_hangs_fails_and_training_goes_on(make_cluster, tmp_path,
                                                                  monkeypatch):
    """A server's write that makes no progress for --checkpoint-stall-timeout is given up:
    the coordinator's checkpoint fails naming the flag (FAILED_PRECONDITION through the
    Checkpoint call), pushes and pulls go on meanwhile, and once the disk answers again the
    next checkpoint is whole and restores."""
    from ps_common import checkpoints

    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path, checkpoint_stall_timeout_s=0.5)
    hung, answer = threading.Event(), threading.Event()
    real = checkpoints.TensorFileWriter.append

    def append(writer, array):
        if not hung.is_set():
            hung.set()
            assert answer.wait(WAIT_S), "the test never let the disk answer"
        return real(writer, array)

    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        monkeypatch.setattr(checkpoints.TensorFileWriter, "append", append)
        try:
            with grpc.insecure_channel(cluster.coordinator_address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Checkpoint(coordinator_pb2.CheckpointRequest(), timeout=WAIT_S)
            assert hung.is_set()
            ps.push({"w": np.ones(4, np.float32)})
            np.testing.assert_array_equal(ps.pull("w"), np.full(4, -1.0, np.float32))
        finally:
            answer.set()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (
            caught.value.code(), caught.value.details())
        assert "--checkpoint-stall-timeout" in caught.value.details(), caught.value.details()
        store = cluster.servers[0].store
        wait_until(lambda: not store.saving.locked(), "the stuck writer to return")
        # A checkpoint that must succeed: no 0.5 s pause of a loaded machine gives it up.
        cluster.servers[0]._servicer.checkpoint_stall_timeout_s = WAIT_S
        cluster.checkpoint()
        ps.push({"w": np.ones(4, np.float32)})
        cluster.restart_server(0)
        wait_until(lambda: cluster.coordinator.state.shards_restored == 1, "the restore")
        cluster.wait_until_synced()
        np.testing.assert_array_equal(ps.pull("w"), np.full(4, -1.0, np.float32))
