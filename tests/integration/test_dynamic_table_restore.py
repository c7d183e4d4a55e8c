"""A dynamic table restored from a checkpoint keeps when each row was last used: it evicts
the rows least recently used before the checkpoint, on as many servers as before or not, and
its rows keep what was left of their ttl. A checkpoint written before that was saved still
restores, every row as used at its cut."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.checkpoints import (
    Manifest, ShardRecord, TensorFile, checkpoint_ids, new_checkpoint_dir, slot_name,
    write_manifest,
)
from ps_common.shardmap import Component, Shard, VariableSpec, owners_of
from ps_server import snapshots
from ps_server.dynamic_rows import AGE_SLOT, AGO_SLOT, HELD_SLOT, IDS_SLOT
from ps_server.ledger import PushLedger
from ps_server.restore import ShardRestore
from ps_server.store import ShardStore
from ps_worker import PSClient, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)


def test_a_restored_dynamic_table_still_evicts_its_least_recently_used_rows(make_cluster,
                                                                            tmp_path):
    """README: "`capacity` (rows, shared by the table's shards) evicts the least recently
    used rows". A server restarted and restored from a checkpoint must evict the rows least
    recently used before the checkpoint, not the ones just trained."""
    uniform = {"name": "uniform", "minval": -1.0, "maxval": 1.0}

    def run(cluster, restart: bool) -> set[int]:
        with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
            ps.declare_embedding("dyn", dim=2, init=uniform, optimizer=SGD1, capacity=8)
            for i in range(8):  # ids 0..7, id 0 first: the oldest
                ps.push_rows("dyn", np.array([i], np.int64), np.ones((1, 2), np.float32))
            for i in range(4):  # ids 0..3 used again: 4..7 are now the least recent
                ps.push_rows("dyn", np.array([i], np.int64), np.ones((1, 2), np.float32))
            if restart:
                cluster.checkpoint()
                cluster.restart_server(0)
                cluster.wait_until_synced()
            ps.push_rows("dyn", np.array([100], np.int64), np.ones((1, 2), np.float32))
        (held,) = [h for h in cluster.servers[0].store.held() if h.key[0] == "dyn"]
        with held.lock:
            return set(held.dynamic._index)

    reference = run(make_cluster(servers=1), restart=False)
    assert reference == {0, 1, 2, 3, 5, 6, 7, 100}  # id 4, the least recently used, went
    restored = run(make_cluster(servers=1, checkpoint_dir=tmp_path), restart=True)
    assert restored == reference
    assert checkpoint_ids(tmp_path)


# ---- servers' stores on fake clocks, checkpointed and restored as the services do ----------

class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def table_spec(capacity: int = 0, ttl_s: float = 0.0) -> VariableSpec:
    return VariableSpec("t", (0, 2), kind="embedding", initializer=Component.of("zeros"),
                        optimizer=Component.of(SGD1), capacity=capacity, ttl_seconds=ttl_s)


def shards_of(stride: int, server_id: str = "s") -> list[Shard]:
    return [Shard("t", i, i, 0, server_id, stride) for i in range(stride)]


def server(spec: VariableSpec, shards: list[Shard], clock: Clock) -> ShardStore:
    store = ShardStore(clock=clock)
    store.assign(1, {"t": spec}, shards)
    return store


def use(store: ShardStore, ids) -> None:
    """A pull of rows of `ids` (one shard's): it makes or touches them."""
    ids = np.asarray(ids, np.int64)
    (held,) = [h for h in store.held()
               if np.all(owners_of(h.spec, ids, h.shard.stride) == h.shard.index)]
    store.plan_pull(store.epoch, [held.key], None, [ids])


def push(store: ShardStore, ids, value: float) -> None:
    """A gradient of `value` for rows of `ids` (one shard's, distinct, sorted)."""
    ids = np.asarray(ids, np.int64)
    (held,) = store.lookup([("t", 0)])
    grad = np.full((len(ids), 2), value, np.float32)
    store.apply([held], [grad], rows=[(ids, grad)])


def held_ids(store: ShardStore) -> dict[int, set[int]]:
    """Per shard index, the ids it holds."""
    out = {}
    for held in store.held():
        with held.lock:
            slots = held.state.slots
            out[held.shard.index] = set(slots[IDS_SLOT][slots[HELD_SLOT] == 1].tolist())
    return out


def checkpoint(root, spec: VariableSpec, servers: dict[str, ShardStore]):
    """Every server's part (snapshots.save), then the manifest, as the coordinator writes
    them: the checkpoint's directory."""
    directory = new_checkpoint_dir(root)
    records, files = [], {}
    for server_id, store in servers.items():
        outcome = snapshots.save(store, PushLedger(), directory, server_id, epoch=1)
        files.update((f.name, f) for f in outcome.files)
        shards = {h.shard.index: h.shard for h in store.held()}
        records += [ShardRecord("t", s.index, shards[s.index].row_start,
                                shards[s.index].row_stop, server_id, s.file, s.updates,
                                s.optimizer_steps, shards[s.index].stride)
                    for s in outcome.shards]
    write_manifest(Manifest(id=directory.name, step=0, epoch=1, created_unix_s=0.0,
                            variables={"t": spec}, shards=records, files=files,
                            ledgers={sid: f"{sid}.ledger.json" for sid in servers},
                            directory=directory))
    return directory


def restored(directory, spec: VariableSpec, shards: list[Shard], clock: Clock) -> ShardStore:
    """A new server (another process: its clock reads anything) given `shards` from the
    checkpoint."""
    store = ShardStore(clock=clock)
    restore = ShardRestore(directory, {s.key for s in shards})
    restore.prepare({"t": spec}, shards, set(), store.memory, store.new_dynamic)
    assert not restore.error, restore.error
    outcome = store.assign(1, {"t": spec}, shards, restore=restore)
    assert outcome.created == len(shards) and not outcome.failed
    return store


def ids_owned(spec: VariableSpec, stride: int, index: int, count: int, start: int = 0):
    candidates = np.arange(start, start + 1000, dtype=np.int64)
    return candidates[owners_of(spec, candidates, stride) == index][:count].tolist()


@pytest.mark.parametrize("saved, restored_onto, clock_step", [
    (2, 1, 1.0),  # two saved shards merged into one: their rows' ages order them
    (1, 2, 1.0),  # one split over two
    (1, 1, 0.0),  # a clock that did not move (coarse): the requests' order orders them
])
def test_the_lru_order_survives_a_restore_onto_another_number_of_shards(
        tmp_path, saved, restored_onto, clock_step):
    spec = table_spec(capacity=10)
    # Five ids of each shard of two, so that no shard of one or two ever passes its share.
    ids = [i for pair in zip(ids_owned(spec, 2, 0, 5), ids_owned(spec, 2, 1, 5)) for i in pair]
    clocks = [Clock(100.0 + 7919.0 * k) for k in range(saved)]  # unrelated readings
    servers = {f"s{k}": server(spec, [Shard("t", k, k, 0, f"s{k}", saved)], clocks[k])
               for k in range(saved)}

    def owner(identifier: int, stride: int) -> int:
        return int(owners_of(spec, np.array([identifier], np.int64), stride)[0])

    for identifier in ids + ids[:5]:  # the first five used again: the rest are the oldest
        use(servers[f"s{owner(identifier, saved)}"], [identifier])
        for clock in clocks:
            clock.now += clock_step
    least_recent_first = ids[5:] + ids[:5]
    directory = checkpoint(tmp_path, spec, servers)

    store = restored(directory, spec, shards_of(restored_onto), Clock(50_000.0))
    for index in range(restored_onto):
        expected = [i for i in least_recent_first if owner(i, restored_onto) == index]
        evicted = []
        for new in ids_owned(spec, restored_onto, index, len(expected), start=10_000):
            before = held_ids(store)[index]
            use(store, [new])
            evicted += sorted(before - held_ids(store)[index])
        assert evicted == expected, index


def test_rows_keep_what_was_left_of_their_ttl_across_a_restore(tmp_path):
    spec = table_spec(ttl_s=10.0)
    clock = Clock(100.0)
    saving = server(spec, shards_of(1), clock)
    use(saving, [1])
    clock.now += 6.0
    use(saving, [2])
    clock.now += 1.0  # at the cut: 1 untouched for 7 s, 2 for 1 s
    directory = checkpoint(tmp_path, spec, {"s": saving})
    tensors = TensorFile(directory / "s.safetensors")
    saved_ids = tensors.array(slot_name("t", 0, IDS_SLOT))
    ages = dict(zip(saved_ids.tolist(), tensors.array(slot_name("t", 0, AGE_SLOT)).tolist()))
    assert (ages[1], ages[2]) == (7.0, 1.0)

    later = Clock(3.0)  # another process's clock, at any reading
    store = restored(directory, spec, shards_of(1), later)
    assert store.expire_rows() == 0 and held_ids(store) == {0: {1, 2}}
    later.now += 3.5  # 1 untouched for 10.5 s in all, 2 for 4.5 s
    assert store.expire_rows() == 1 and held_ids(store) == {0: {2}}
    later.now += 6.0
    assert store.expire_rows() == 1 and held_ids(store) == {0: set()}


def test_a_checkpoint_written_before_last_use_was_saved_restores_every_row_as_used_at_its_cut(
        tmp_path, monkeypatch):
    spec = table_spec(capacity=4, ttl_s=10.0)
    clock = Clock(100.0)
    saving = server(spec, shards_of(1), clock)
    push(saving, [1], 1.0)
    clock.now += 8.0
    push(saving, [2, 3], 2.0)
    old_tensors_of = snapshots._tensors_of

    def without_last_use(held, arrays, cut):  # the tensors a checkpoint held before
        return [t for t in old_tensors_of(held, arrays, cut)
                if not t[0].endswith((AGE_SLOT, AGO_SLOT))]

    monkeypatch.setattr(snapshots, "_tensors_of", without_last_use)
    directory = checkpoint(tmp_path, spec, {"s": saving})
    monkeypatch.undo()
    assert not TensorFile(directory / "s.safetensors").has(slot_name("t", 0, AGE_SLOT))

    later = Clock(5.0)
    store = restored(directory, spec, shards_of(1), later)
    assert held_ids(store) == {0: {1, 2, 3}}
    (held,) = store.held()
    rows = held.dynamic.find(np.array([1, 2, 3], np.int64))
    np.testing.assert_array_equal(held.values[rows][:, 0], [-1.0, -2.0, -2.0])  # trained
    later.now += 9.0  # a full ttl from the restore for every row, 1 (8 s old at the cut) too
    assert store.expire_rows() == 0 and held_ids(store) == {0: {1, 2, 3}}
    use(store, [4])  # under the capacity: nothing evicted
    later.now += 2.5  # a sweep (every quarter ttl) finds 1, 2 and 3 untouched for 11.5 s
    assert store.expire_rows() == 3 and held_ids(store) == {0: {4}}
