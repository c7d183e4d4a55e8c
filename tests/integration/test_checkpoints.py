"""Checkpoints on in-process clusters: what a restarted or lost server gets back, restores
onto another number of servers, corrupt checkpoints, and pushes in flight during a cut."""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

from ps_common.checkpoints import MANIFEST, RowSource, checkpoint_ids
from ps_common.errors import CheckpointFailed
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
ADAM = {"name": "adam", "lr": 0.01}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)


def holder_index(cluster, ps: PSClient, name: str) -> int:
    server_id = ps.shard_map.shards_of(name)[0].server_id
    return next(i for i, s in enumerate(cluster.servers) if s.server_id == server_id)


def test_a_restarted_server_gets_its_values_back_from_the_newest_checkpoint(
        make_cluster, tmp_path, caplog):
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(8, 4), init="zeros", optimizer=SGD1)
        for _ in range(3):
            ps.push({"w": np.ones((8, 4), np.float32)})
        manifest = cluster.checkpoint()
        ps.push({"w": np.ones((8, 4), np.float32)})  # after the checkpoint: lost with the server
        with caplog.at_level(logging.INFO):
            cluster.restart_server(holder_index(cluster, ps, "w"))
            cluster.wait_until_synced()
            # The server logs what it restored after its store is at the new epoch (which is
            # all wait_until_synced sees) and before it answers the assignment; the
            # coordinator counts the restore once it has the answer. Wait for that, inside
            # this block: an INFO record emitted after it ends is dropped.
            wait_until(lambda: cluster.coordinator.state.shards_restored == 1,
                       "the coordinator counts the restore")
        np.testing.assert_array_equal(ps.pull("w"), np.full((8, 4), -3.0, np.float32))
        ps.push({"w": np.ones((8, 4), np.float32)})  # training goes on from the restored values
        np.testing.assert_array_equal(ps.pull("w"), np.full((8, 4), -4.0, np.float32))
    restored = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert any("'w'" in line and manifest.id in line and "step" in line for line in restored), \
        restored
    assert cluster.coordinator.state.shards_restored == 1


def test_adam_slots_and_step_counts_come_back_too(make_cluster, tmp_path):
    """After restore, the next update equals the one the uninterrupted server would apply."""
    grads = [np.random.default_rng(i).normal(size=(6, 3)).astype(np.float32) for i in range(4)]
    reference = make_cluster(servers=1)
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(reference.coordinator_address) as ref, \
            PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        for client in (ref, ps):
            client.declare("w", shape=(6, 3), init={"name": "normal", "stddev": 1.0},
                           optimizer=ADAM, seed=3)
        for g in grads[:3]:
            ref.push({"w": g})
            ps.push({"w": g})
        cluster.checkpoint()
        cluster.restart_server(0)
        cluster.wait_until_synced()
        ref.push({"w": grads[3]})
        ps.push({"w": grads[3]})
        np.testing.assert_array_equal(ps.pull("w"), ref.pull("w"))


@pytest.mark.parametrize("servers_after", [2, 4])
def test_a_checkpoint_of_three_servers_restores_onto_another_count_with_identical_values(
        make_cluster, tmp_path, servers_after):
    rng = np.random.default_rng(0)
    first = make_cluster(servers=3, checkpoint_dir=tmp_path, split_threshold_bytes=256)
    with PSClient(first.coordinator_address) as ps:
        ps.declare("big", shape=(50, 7), init={"name": "normal", "stddev": 1.0},
                   optimizer=ADAM, seed=1)
        ps.declare("small", shape=(3,), init={"name": "constant", "value": 1.0},
                   optimizer={"name": "momentum", "lr": 0.1})
        assert len({s.server_id for s in ps.shard_map.shards_of("big")}) == 3
        for _ in range(3):
            ps.push({"big": rng.normal(size=(50, 7)).astype(np.float32),
                     "small": rng.normal(size=(3,)).astype(np.float32)})
        trained = {name: ps.pull(name) for name in ("big", "small")}
        first.checkpoint()
        grad = {"big": np.ones((50, 7), np.float32), "small": np.ones(3, np.float32)}
        ps.push(grad)
        expected_next = {name: ps.pull(name) for name in ("big", "small")}
    first.stop()

    second = make_cluster(servers=servers_after, checkpoint_dir=tmp_path,
                          split_threshold_bytes=256)
    with PSClient(second.coordinator_address) as ps:
        ps.declare("big", shape=(50, 7), init={"name": "normal", "stddev": 1.0},
                   optimizer=ADAM, seed=1)
        ps.declare("small", shape=(3,), init={"name": "constant", "value": 1.0},
                   optimizer={"name": "momentum", "lr": 0.1})
        for name, values in trained.items():
            np.testing.assert_array_equal(ps.pull(name), values)
        ps.push(grad)  # the optimizer state (adam's moments, momentum) came back as well
        for name, values in expected_next.items():
            np.testing.assert_array_equal(ps.pull(name), values)


def test_a_truncated_checkpoint_is_skipped_for_the_previous_good_one(make_cluster, tmp_path,
                                                                      caplog):
    first = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(5, np.float32)})
        good = first.checkpoint()
        ps.push({"w": np.ones(5, np.float32)})
        bad = first.checkpoint()
    first.stop()
    tensors = next(p for p in (tmp_path / bad.id).iterdir() if p.suffix == ".safetensors"
                   and p.stat().st_size > 100)
    tensors.write_bytes(tensors.read_bytes()[:-7])

    with caplog.at_level(logging.INFO):
        second = make_cluster(servers=2, checkpoint_dir=tmp_path)
    skipped = [r.getMessage() for r in caplog.records if bad.id in r.getMessage()]
    assert any("truncated" in line and "skipping" in line for line in skipped), skipped
    with PSClient(second.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        np.testing.assert_array_equal(ps.pull("w"), np.full(5, -1.0, np.float32))
    assert second.coordinator.checkpointer.catalog.current().id == good.id


def test_an_altered_file_is_caught_by_its_checksum(make_cluster, tmp_path, caplog):
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        good = first.checkpoint()
        ps.push({"w": np.ones(5, np.float32)})
        bad = first.checkpoint()
    first.stop()
    path = next((tmp_path / bad.id).glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        second = make_cluster(servers=1, checkpoint_dir=tmp_path)
    assert any("checksum" in r.getMessage() and bad.id in r.getMessage() for r in caplog.records)
    assert second.coordinator.checkpointer.catalog.current().id == good.id


def test_only_the_newest_checkpoints_are_kept_and_each_has_a_manifest(make_cluster, tmp_path):
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        taken = [cluster.checkpoint().id for _ in range(5)]
    assert checkpoint_ids(tmp_path) == taken[-3:]
    for cid in taken[-3:]:
        manifest = json.loads((tmp_path / cid / MANIFEST).read_text())
        assert set(manifest["files"]) == {p.name for p in (tmp_path / cid).iterdir()
                                          if p.name != MANIFEST}


def test_pushes_during_a_checkpoint_are_in_it_with_their_ledger_entries_or_not_at_all(
        make_cluster, tmp_path):
    """A counter (every push adds 1, SGD lr 1) checkpointed while pushes stream in: its
    checkpointed value equals the pushes its checkpointed ledger records as applied."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    stop = threading.Event()
    with PSClient(cluster.coordinator_address, client_id="counter") as ps:
        ps.declare("count", shape=(1,), init="zeros", optimizer=SGD1)

        def pusher():
            while not stop.is_set():
                ps.push({"count": -np.ones(1, np.float32)})

        thread = threading.Thread(target=pusher)
        thread.start()
        try:
            manifests = [cluster.checkpoint() for _ in range(5)]
        finally:
            stop.set()
            thread.join(30)
    server_id = cluster.servers[0].server_id
    for manifest in manifests[-3:]:
        source = RowSource(manifest.directory)
        spec = manifest.variables["count"]
        value, _, _ = source.load(spec, 0, 1, {})
        ledger = source.ledger(server_id)
        # (A cut before the first push holds no record of the client, and a zero.)
        _, floor, applied = ledger["clients"].get("counter", (0, 0, []))
        assert value[0] == floor + len(applied), (manifest.id, value, ledger)


def test_a_server_gone_past_the_server_timeout_has_its_shards_moved_from_the_checkpoint(
        make_cluster, tmp_path, caplog):
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path, server_timeout_s=0.5)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("a", shape=(6,), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(6,), init="zeros", optimizer=SGD1)
        lost = ps.shard_map.shards_of("a")[0].server_id
        b_lost = ps.shard_map.shards_of("b")[0].server_id == lost
        for _ in range(2):
            ps.push({"a": np.ones(6, np.float32), "b": np.ones(6, np.float32)})
        cluster.checkpoint()
        ps.push({"a": np.ones(6, np.float32), "b": np.ones(6, np.float32)})
        epoch = ps.shard_map.epoch
        with caplog.at_level(logging.WARNING):
            next(s for s in cluster.servers if s.server_id == lost).stop(grace_s=0.5)
            moved = cluster.coordinator.state
            deadline = time.monotonic() + 30  # heartbeat timeout + server timeout, polled
            while ps.refresh().epoch == epoch or any(
                    s.server_id == lost for n in ("a", "b") for s in ps.shard_map.shards_of(n)):
                assert time.monotonic() < deadline, "the lost server's shards never moved"
                time.sleep(0.05)
        survivor = next(s for s in cluster.servers if s.server_id != lost)
        assert {s.server_id for n in ("a", "b") for s in ps.shard_map.shards_of(n)} == {
            survivor.server_id}
        # "a" comes back as checkpointed (-2; the push after it was lost with its server);
        # "b", unless it was on the same server, never left its live one (-3).
        np.testing.assert_array_equal(ps.pull("a"), np.full(6, -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull("b"), np.full(6, -2.0 if b_lost else -3.0,
                                                            np.float32))
        ps.push({"a": np.ones(6, np.float32)})
        np.testing.assert_array_equal(ps.pull("a"), np.full(6, -3.0, np.float32))
    assert moved.data_loss == ""
    assert any("move to live servers from checkpoint" in r.getMessage() for r in caplog.records)


def test_without_a_checkpoint_a_lost_server_still_fails_the_job_with_data_loss(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        cluster.restart_server(holder_index(cluster, ps, "w"))
    assert "has no --checkpoint-dir" in cluster.coordinator.state.data_loss


def test_a_checkpoint_corrupted_after_it_was_checked_falls_back_when_a_server_reads_it(
        make_cluster, tmp_path, caplog):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(5, np.float32)})
        good = cluster.checkpoint()
        ps.push({"w": np.ones(5, np.float32)})
        bad = cluster.checkpoint()
        path = next((tmp_path / bad.id).glob("*.safetensors"))
        path.write_bytes(path.read_bytes()[:-4])
        with caplog.at_level(logging.ERROR):
            cluster.restart_server(0)
            deadline = time.monotonic() + 30
            while cluster.coordinator.state.shards_restored < 1:
                assert time.monotonic() < deadline, "never restored"
                time.sleep(0.05)
        np.testing.assert_array_equal(ps.pull("w"), np.full(5, -1.0, np.float32))
    assert cluster.coordinator.checkpointer.catalog.current().id == good.id
    assert any(bad.id in r.getMessage() and good.id in r.getMessage() for r in caplog.records)


def test_an_altered_manifest_is_caught_by_its_own_checksum(make_cluster, tmp_path, caplog):
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init="zeros", optimizer=SGD1)
        good = first.checkpoint()
        bad = first.checkpoint()
    first.stop()
    manifest = tmp_path / bad.id / MANIFEST
    manifest.write_text(manifest.read_text().replace('"step": 0', '"step": 7'))
    with caplog.at_level(logging.INFO):
        second = make_cluster(servers=1, checkpoint_dir=tmp_path)
    assert any("manifest does not match" in r.getMessage() for r in caplog.records)
    assert second.coordinator.checkpointer.catalog.current().id == good.id


def test_checkpoint_every_off_still_checkpoints_new_variables_at_once(make_cluster, tmp_path):
    """README (Checkpoints): the coordinator has every server write its shards "every
    `--checkpoint-every`, as soon as new variables are declared, on `ps-ctl checkpoint`, and
    at the end of the job"; `ps-coordinator --help`: "--checkpoint-every ... or off (only
    ps-ctl checkpoint); one is also taken at the end of the job and as soon as new variables
    are declared". With `off` too: else a server that restarts before the end of the job
    would have nothing to restore its shards from (DATA_LOSS)."""
    from ps_server.coordinator.cli import checkpoint_interval

    assert checkpoint_interval("off") is None  # what `--checkpoint-every off` configures
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path, checkpoint_every=None)
    checkpointer = cluster.coordinator.checkpointer
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        wait_until(lambda: checkpointer.last is not None and not checkpointer.uncovered(),
                   "a checkpoint holding the newly declared variable", timeout_s=10.0)
        assert "w" in checkpointer.last.variables


def test_a_checkpoint_dir_the_coordinator_does_not_share_with_a_server_is_refused_by_name(
        make_cluster, tmp_path):
    """A --checkpoint-dir that is a directory of its own in each container: the server's
    files are not where the coordinator looks. The checkpoint fails naming the flag and the
    file, instead of passing for one no restore could read."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "coordinator-view")
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", (4,), optimizer=SGD1)
        checkpointer = cluster.coordinator.checkpointer
        wait_until(lambda: checkpointer.last is not None and checkpointer.wait_idle(0),
                   "the checkpoint of the new variable")
        save_on = checkpointer._save_on
        elsewhere = tmp_path / "server-view"

        def in_a_directory_of_its_own(server_id, address, directory, epoch):
            own = elsewhere / directory.name  # the server's mount of "the same" path
            own.mkdir(parents=True, exist_ok=True)
            return save_on(server_id, address, own, epoch)

        checkpointer._save_on = in_a_directory_of_its_own
        before = checkpointer.last.id  # the one taken when "w" was declared
        with pytest.raises(CheckpointFailed) as failed:
            cluster.checkpoint()
        assert "--checkpoint-dir must be one directory shared" in str(failed.value)
        assert f"{cluster.servers[0].server_id}.safetensors" in str(failed.value)
        assert checkpointer.last.id == before
        assert checkpoint_ids(tmp_path / "coordinator-view") == [before]  # none half-made
