"""What happens when a resource runs out, and after: a server's memory budget beside an
uncapped dynamic table, a disk that fills up under a checkpoint, and /dev/shm without room
for a push slot. Each test names the promise it checks. Resources
run out by monkeypatching the call that would fail (ENOSPC), never by filling a real disk, so
that nothing here depends on the machine's sizes or on timing."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_common import checkpoints
from ps_common import shm
from ps_common.checkpoints import MANIFEST, checkpoint_ids, write_file
from ps_common.errors import CheckpointFailed
from ps_common.shardmap import owners_of
from ps_server import shared_memory as server_shm
from ps_server import snapshots
from ps_server.coordinator.placement import footprint
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError

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

def test_placement_counts_what_an_uncapped_table_holds_and_picks_the_server_with_room(
        make_cluster):
    """README: new variables are placed "least loaded first (values plus optimizer slots),
    never past a server's --memory-budget". An uncapped dynamic table's rows are values on
    its server like any other, but placement charges them nothing (server_loads ->
    shard_rows is 0 for an uncapped table), so a server whose table filled half of its
    budget still looks empty: the next variable lands there, past the budget, although the
    other server holds nothing."""
    cluster = make_cluster(servers=2, memory_budget_bytes=BUDGET)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("open", dim=DIM, init="zeros", optimizer=SGD1)  # uncapped
        spec = ps.shard_map.variables["open"]
        (on_first,) = [s.index for s in ps.shard_map.shards_of("open")
                       if s.server_id == "ps-0"]
        ids = np.arange(20_000, dtype=np.int64)
        mine = ids[owners_of(spec, ids, 2) == on_first][:2048]
        push_new_rows(ps, "open", mine)  # 2,048 rows on ps-0 only: 542,720 bytes held
        first = next(s for s in cluster.servers if s.server_id == "ps-0")
        assert first.store.nbytes() > BUDGET // 2
        wait_until_reported(cluster, "ps-0", len(mine))
        ps.declare("w", shape=(150_000,), init="zeros", optimizer=SGD1)  # 600,000 bytes
        holder = ps.shard_map.shards_of("w")[0].server_id
        held = {s.server_id: s.store.nbytes() for s in cluster.servers}
    assert all(b <= BUDGET for b in held.values()), (
        f"bytes held per server {held} with --memory-budget {BUDGET}: 'w' was placed on "
        f"{holder}")
    assert holder == "ps-1"


def test_a_declare_onto_a_server_an_uncapped_table_filled_is_refused(make_cluster):
    """README: "A declare no server can hold is refused with RESOURCE_EXHAUSTED before the
    shard map changes". One server, whose uncapped table holds 542,720 of its 1,000,000
    bytes: a variable of 600,000 bytes does not fit, yet it is placed and created."""
    cluster = make_cluster(servers=1, memory_budget_bytes=BUDGET)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("open", dim=DIM, init="zeros", optimizer=SGD1)
        push_new_rows(ps, "open", np.arange(2048, dtype=np.int64))
        wait_until_reported(cluster, "ps-0", 2048)
        try:
            ps.declare("w", shape=(150_000,), init="zeros", optimizer=SGD1)
            outcome = "declared"
        except RemoteError as error:
            outcome = error.code()
        held = cluster.servers[0].store.nbytes()
    assert outcome == grpc.StatusCode.RESOURCE_EXHAUSTED, (outcome, held)
    assert held <= BUDGET


def test_an_uncapped_table_grows_until_the_budget_is_full(make_cluster):
    """README: an uncapped table "grows until the rest of its server's budget is full, after
    which requests that need new rows get RESOURCE_EXHAUSTED". Its pool grows by doubling
    (DynamicRows._grow), and a doubling the budget refuses is not tried smaller: with 2,048
    rows held (542,720 of 1,000,000 bytes) a push of 256 new rows is refused, although the
    server has room for them (and for twice as many) at placement's own charge per row."""
    cluster = make_cluster(servers=1, memory_budget_bytes=BUDGET)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("open", dim=DIM, init="zeros", optimizer=SGD1)
        spec = ps.shard_map.variables["open"]
        refused = None
        for start in range(0, 64 * BATCH, BATCH):
            try:
                push_new_rows(ps, "open", np.arange(start, start + BATCH, dtype=np.int64))
            except RemoteError as error:
                refused = error
                break
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (stats,) = cluster.servers[0].store.table_stats()
    room_for_two_more = footprint(spec, stats.rows + 2 * BATCH)
    assert room_for_two_more > BUDGET, (
        f"refused at {stats.rows} rows ({cluster.servers[0].store.nbytes()} bytes held): "
        f"{stats.rows + 2 * BATCH} rows cost {room_for_two_more} bytes at placement's "
        f"charge, within the budget of {BUDGET}")


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

        def full_for_ps1(path: Path, doc, **kwargs):
            if path.name.startswith("ps-1."):
                raise no_space(path)
            return real(path, doc, **kwargs)

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
