"""Falling back to the previous good checkpoint: a corrupt manifest (one flipped high bit)
at coordinator start and at a server's restore, the control plane answering while the
fall-back reads checkpoints, and a checkpoint whose old ones cannot be removed."""

from __future__ import annotations

import errno
import threading

import grpc
import numpy as np

from ps_common.checkpoints import MANIFEST
from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from ps_server.coordinator import checkpointer as checkpointer_module
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

SHARED_MEMORY = False
SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 20.0


def flip_a_high_bit(path) -> None:
    """Bit rot in one byte of the manifest: an ASCII byte becomes >= 0x80 (not UTF-8)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))


def two_checkpoints(cluster, ps):
    """w = -1 in the first checkpoint, -2 in the second. Returns (good, newest)."""
    ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
    ps.push({"w": np.ones(5, np.float32)})
    good = cluster.checkpoint()
    ps.push({"w": np.ones(5, np.float32)})
    return good, cluster.checkpoint()


def test_a_coordinator_starts_on_a_directory_whose_newest_manifest_is_corrupt(
        make_cluster, tmp_path):
    """A newest manifest with one bit flipped is skipped and the job resumes from the one
    before (the coordinator died at every start on that directory)."""
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        good, bad = two_checkpoints(first, ps)
    first.stop()
    flip_a_high_bit(bad.directory / MANIFEST)

    second = make_cluster(servers=1, checkpoint_dir=tmp_path)
    assert second.coordinator.checkpointer.catalog.current().id == good.id
    with PSClient(second.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        np.testing.assert_array_equal(ps.pull("w"), np.full(5, -1.0, np.float32))


def test_a_manifest_corrupted_after_it_was_checked_falls_back_when_a_server_reads_it(
        make_cluster, tmp_path):
    """As for a truncated tensor file, a restarted server that finds the newest manifest
    corrupt has the coordinator fall back to the previous good checkpoint, and gets its
    values from it."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        good, bad = two_checkpoints(cluster, ps)
        flip_a_high_bit(bad.directory / MANIFEST)
        cluster.restart_server(0)
        wait_until(lambda: cluster.coordinator.state.shards_restored >= 1,
                   "the restarted server restores w from the previous good checkpoint",
                   WAIT_S)
        np.testing.assert_array_equal(ps.pull("w"), np.full(5, -1.0, np.float32))
    assert cluster.coordinator.checkpointer.catalog.current().id == good.id


def test_a_fall_back_does_not_hold_server_heartbeats_while_it_verifies_a_checkpoint(
        make_cluster, spawn, tmp_path, monkeypatch):
    """When a server reports the current checkpoint unreadable, the coordinator falls back by
    reading the previous checkpoint whole (a sha256 of every file: minutes for a large
    model). It did so under its state's lock: every heartbeat, registration, declaration
    and status call waited for it. The verification is held here (a slow disk) until the
    heartbeat has been answered or the bound below passes."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        good, bad = two_checkpoints(cluster, ps)
    state = cluster.coordinator.state
    server_id = cluster.servers[0].server_id
    epoch = state.shard_map.epoch  # read now: reading it takes the lock in question

    verifying, release = threading.Event(), threading.Event()
    real_verify = checkpointer_module.verify

    def slow_verify(directory):
        verifying.set()
        assert release.wait(WAIT_S)
        return real_verify(directory)

    monkeypatch.setattr(checkpointer_module, "verify", slow_verify)
    falling_back = spawn(state.restore_failed, server_id, bad.directory,
                         f"{bad.directory}/{server_id}.safetensors does not match its sha256")
    try:
        assert verifying.wait(WAIT_S)
        heartbeat = spawn(state.server_heartbeat, server_id, epoch)
        answered = heartbeat.done.wait(WAIT_S)  # while the verification is held
    finally:
        release.set()
    falling_back.result()
    assert answered, ("a server heartbeat waited for the fall-back's verification of "
                      f"{good.id}")
    assert cluster.coordinator.checkpointer.catalog.current().id == good.id


def test_a_complete_checkpoint_is_not_reported_failed_when_an_old_one_cannot_be_removed(
        make_cluster, tmp_path, monkeypatch):
    """Once the manifest is written and the checkpoint adopted, `ps-ctl checkpoint` gets its
    id, even if removing an older checkpoint past --keep-checkpoints fails (EACCES, EROFS,
    an NFS error): it answered INTERNAL for a checkpoint that existed and that restores came
    from."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        old = cluster.checkpoint()

        def unlink_refused(root, keep, protect=()):
            raise PermissionError(errno.EACCES, "Permission denied",
                                  str(old.directory / MANIFEST))

        monkeypatch.setattr(checkpointer_module, "prune", unlink_refused)
        with grpc.insecure_channel(cluster.coordinator_address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            try:
                info = stub.Checkpoint(coordinator_pb2.CheckpointRequest(), timeout=60)
            except grpc.RpcError as error:
                raise AssertionError(f"{error.code()}: {error.details()}") from None
    current = cluster.coordinator.checkpointer.catalog.current()
    assert info.id == current.id != old.id
    assert (tmp_path / current.id / MANIFEST).exists()
