"""What happens when a resource runs out, and after: a disk that fills up under a checkpoint,
and /dev/shm without room for a push slot. Each test names the promise it checks. Resources
run out by monkeypatching the call that would fail (ENOSPC), never by filling a real disk, so
that nothing here depends on the machine's sizes or on timing."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest

from ps_common import checkpoints
from ps_common import shm
from ps_common.checkpoints import MANIFEST, checkpoint_ids, write_file
from ps_common.errors import CheckpointFailed
from ps_server import shared_memory as server_shm
from ps_server import snapshots
from ps_server.testing import wait_until
from ps_worker import PSClient

SGD1 = {"name": "sgd", "lr": 1.0}
BUDGET = 1_000_000
DIM = 64
BATCH = 256  # distinct ids per row push


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def push_new_rows(ps: PSClient, table: str, ids: np.ndarray) -> None:
    for start in range(0, len(ids), BATCH):
        batch = ids[start:start + BATCH]
        ps.push_rows(table, batch, np.ones((len(batch), DIM), np.float32))


def wait_until_reported(cluster, server_id: str, rows: int) -> None:
    """Until the coordinator has heard (heartbeats) that `server_id`'s table shards hold
    `rows` rows: whatever placement may know of them, it knows by then."""
    def reported() -> int:
        return sum(r for m in cluster.coordinator.state.servers() if m.server_id == server_id
                   for _, (r, _, _) in m.tables)
    wait_until(lambda: reported() >= rows, f"{server_id} to report {rows} table rows")


# ---- the memory budget and uncapped dynamic tables ----------------------------------------

def test_a_checkpoint_that_fails_on_a_full_disk_leaves_none_of_its_files(make_cluster, tmp_path,
                                                                        monkeypatch):
    """A checkpoint whose second server finds the disk full fails (the job goes on, the
    previous checkpoint stays); but what the first server wrote stays on that full disk,
    in a directory that `prune` removes only once a later checkpoint is finished. On a disk
    that filled for a while, those files keep it full: every later attempt fails too, and
    leaves more (each attempt makes a new directory)."""
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("a", shape=(4096,), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(4096,), init="zeros", optimizer=SGD1)
        assert {ps.shard_map.shards_of(n)[0].server_id for n in "ab"} == {"ps-0", "ps-1"}
        kept = cluster.checkpoint()

        real = snapshots.write_json

        def full_for_ps1(path: Path, doc):
            if path.name.startswith("ps-1."):
                raise no_space(path)
            return real(path, doc)

        monkeypatch.setattr(snapshots, "write_json", full_for_ps1)
        with pytest.raises(CheckpointFailed) as failed:
            cluster.checkpoint()
        assert "No space left on device" in failed.value.message
    assert (tmp_path / kept.id / MANIFEST).exists()  # the checkpoint before it stays
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.is_file() and p.parent != tmp_path and p.parent.name != kept.id)
    assert left == [], f"the failed checkpoint left {left} (ids: {checkpoint_ids(tmp_path)})"


class _FullDiskFile(io.FileIO):
    """A file on a full disk: every write fails with ENOSPC."""

    def write(self, data):
        raise no_space(self.name)


class _OsOnAFullDisk:
    """`os` for ps_common.checkpoints, whose files are on a full disk."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def fdopen(fd, mode="r", *args, **kwargs):
        return io.BufferedWriter(_FullDiskFile(fd, "wb"))


def test_a_checkpoint_file_that_meets_a_full_disk_leaves_no_temporary_file(tmp_path,
                                                                          monkeypatch):
    """ps_common.checkpoints: "Every file is written to a temporary name ... a directory
    without a manifest is an unfinished checkpoint". A small file (a ledger, the manifest)
    is buffered, so the disk's ENOSPC comes from the flush in commit(); abort() then closes
    the file, which flushes the same bytes again and raises before it unlinks the
    temporary: `.ps-0.ledger.json.*.tmp` stays behind, holding what was written of it."""
    monkeypatch.setattr(checkpoints, "os", _OsOnAFullDisk())
    with pytest.raises(OSError) as raised:
        write_file(tmp_path / "ps-0.ledger.json", b'{"clients": {}}')
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


# ---- /dev/shm without room ------------------------------------------------------------------

@pytest.mark.skipif(shm.supported() is not None, reason=shm.supported() or "")
def test_dev_shm_without_room_for_a_push_slot_is_asked_once_not_on_every_push(make_cluster,
                                                                            monkeypatch):
    """README: with /dev/shm full, pushes go over gRPC. A server that cannot make a push
    slot answers an empty reply, which the client takes as "not this time": every later
    push asks for a slot again, an extra PushShared call per push (and a WARNING line per
    push on the server). A server that refuses a slot because the connection holds its
    eight already answers RESOURCE_EXHAUSTED, and that client stops asking
    (test_shared_memory.test_a_client_refused_more_slots_pushes_over_grpc)."""
    cluster = make_cluster(servers=1)
    made = server_shm.shm.create

    def no_room_for_slots(name, *args, **kwargs):
        if name.endswith(".slot"):
            raise no_space(name)
        return made(name, *args, **kwargs)

    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), init="zeros", optimizer=SGD1)
        ps.pull("w")  # the handshake: pulls go through shared memory
        monkeypatch.setattr(server_shm.shm, "create", no_room_for_slots)
        for _ in range(4):
            ps.push({"w": np.ones((8, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), np.full((8, 4), -4.0, np.float32))
    assert cluster.faults.calls.get("Push", 0) == 4  # each went over gRPC
    assert cluster.faults.calls.get("PushSharedSlot", 0) == 1, cluster.faults.calls
