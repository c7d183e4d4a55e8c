"""Embedding tables against an in-process cluster, over both data paths: rows pulled and
pushed by id against a single-table NumPy reference, dynamic tables (seeded rows, eviction),
sparse optimizers through the servers, checkpoints, exactly-once, and every bad input."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ps_common.rows import hash_ids
from ps_common.shardmap import Component, VariableSpec
from ps_common.tensors import TensorMeta
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.initializers import initialize_ids
from ps_worker import PSClient, RemoteError
from ps_worker.coordinator_client import CoordinatorClient
from ps_worker.ctl import render

SGD1 = {"name": "sgd", "lr": 1.0}
UNIFORM = {"name": "uniform", "minval": -1.0, "maxval": 1.0}


@pytest.fixture(params=["grpc", "shm"])
def data_path(request):
    """Every test here runs over gRPC and with shared memory offered (see test_pull_push)."""
    return request.param


pytestmark = pytest.mark.usefixtures("data_path")


def expect_error(code: grpc.StatusCode, fn, *args, **kwargs) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        fn(*args, **kwargs)
    assert caught.value.code() == code, caught.value
    return caught.value


def initial_rows(spec: VariableSpec, ids) -> np.ndarray:
    return initialize_ids(spec.initializer, spec.seed, np.asarray(ids, np.int64),
                          spec.shape[1], spec.dtype, num_rows=spec.rows or None)


def zipf_ids(rng, n: int, rows: int) -> np.ndarray:
    return (rng.zipf(1.2, n) % rows).astype(np.int64)


# ---- fixed tables ----------------------------------------------------------------------

def test_rows_with_duplicates_and_any_order_equal_a_numpy_table_on_three_servers(make_cluster):
    cluster = make_cluster(servers=3)
    rng = np.random.default_rng(0)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("emb", dim=8, num_rows=1000, init=UNIFORM, optimizer=SGD1,
                                    seed=3)
        assert {s.server_id for s in ps.shard_map.shards_of("emb")} == {"ps-0", "ps-1", "ps-2"}
        reference = initial_rows(spec, np.arange(1000))
        np.testing.assert_array_equal(ps.pull("emb"), reference)  # a fixed table pulls whole
        for _ in range(5):
            ids = rng.permutation(np.concatenate([zipf_ids(rng, 300, 1000), [0, 0, 999]]))
            # Summed duplicates round differently from np.add.at's one at a time.
            np.testing.assert_allclose(ps.pull_rows("emb", ids), reference[ids], rtol=1e-5,
                                       atol=1e-5)
            grads = rng.normal(size=(len(ids), 8)).astype(np.float32)
            ps.push_rows("emb", ids, grads)
            np.add.at(reference, ids, -grads)  # duplicates summed, lr 1
            np.testing.assert_allclose(ps.pull_rows("emb", ids), reference[ids], rtol=1e-5,
                                       atol=1e-5)
        np.testing.assert_allclose(ps.pull("emb"), reference, rtol=1e-5, atol=1e-5)


def test_pull_rows_into_out_and_through_a_narrower_wire_dtype(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("emb", dim=4, num_rows=50, init=UNIFORM)
        ids = np.array([7, 3, 7, 49], np.int64)
        out = np.empty((4, 4), np.float32)
        assert ps.pull_rows("emb", ids, out=out) is out
        np.testing.assert_array_equal(out, initial_rows(spec, ids))
        narrow = ps.pull_rows("emb", ids, wire_dtype="float16")
        assert narrow.dtype == np.float32
        np.testing.assert_array_equal(narrow, initial_rows(spec, ids).astype(np.float16))
        ps.push_rows("emb", ids, np.ones((4, 4), np.float32), wire_dtype="bfloat16")
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, "emb", ids,
                     out=np.empty((3, 4), np.float32))


def test_zipf_ids_spread_evenly_over_the_servers(make_cluster):
    """The hot ids of a skewed distribution are the small ones: placement by id modulo the
    server count gives every server its share of the rows a step touches."""
    cluster = make_cluster(servers=2)
    rng = np.random.default_rng(1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=4, num_rows=1_000_000)
        shards = ps.shard_map.shards_of("emb")
        unique = np.unique(zipf_ids(rng, 4096, 1_000_000))
        per_shard = np.bincount(unique % shards[0].stride)
        assert per_shard.min() >= 0.45 * len(unique), per_shard
        held = sorted(s.store.table_stats()[0].rows for s in cluster.servers)
        assert held == [500_000, 500_000]


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_requests_of_more_ids_than_one_message_holds(make_cluster, dynamic):
    """The ids travel in a call's first message: a server's part of a larger request is
    split into several calls, transparently."""
    cluster = make_cluster(servers=1)
    count = 9 * 65_536 + 7  # 4.6 MB of ids: more than a 4 MiB message
    ids = np.arange(count, dtype=np.int64)[::-1].copy()
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("t", dim=3, num_rows=None if dynamic else count,
                                    init=UNIFORM, optimizer=SGD1)
        np.testing.assert_array_equal(ps.pull_rows("t", ids), initial_rows(spec, ids))
        ps.push_rows("t", ids, np.ones((count, 3), np.float32))
        np.testing.assert_allclose(ps.pull_rows("t", ids), initial_rows(spec, ids) - 1.0,
                                   rtol=1e-6)


def test_sparse_adam_through_the_servers_touches_only_the_rows_pushed(cluster):
    adam = {"name": "adam", "lr": 0.1}
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("emb", dim=3, num_rows=20, init=UNIFORM, optimizer=adam)
        before = ps.pull("emb")
        w, m, v = before.astype(np.float64), np.zeros((20, 3)), np.zeros((20, 3))
        steps = np.zeros(20)
        for ids in ([1, 2, 2], [2, 5], [5, 5, 19]):
            ids = np.array(ids, np.int64)
            grads = np.arange(len(ids) * 3, dtype=np.float32).reshape(-1, 3) - 2.0
            ps.push_rows("emb", ids, grads)
            g = np.zeros((20, 3))
            np.add.at(g, ids, grads)
            touched = np.unique(ids)
            steps[touched] += 1
            t = steps[touched][:, None]
            m[touched] = 0.9 * m[touched] + 0.1 * g[touched]
            v[touched] = 0.999 * v[touched] + 0.001 * g[touched] ** 2
            w[touched] -= (0.1 * m[touched] / (1 - 0.9 ** t)
                           / (np.sqrt(v[touched] / (1 - 0.999 ** t)) + 1e-8))
        after = ps.pull("emb")
        np.testing.assert_allclose(after, w, rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(20), [1, 2, 5, 19])
        np.testing.assert_array_equal(after[untouched], before[untouched])
        assert spec.optimizer.name == "adam"


def test_a_retried_row_push_is_applied_once(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        cluster.faults.drop_response_next("Push", 2)
        ps.push_rows("emb", np.array([1, 2, 3, 4], np.int64), np.ones((4, 2), np.float32))
        np.testing.assert_array_equal(ps.pull_rows("emb", np.arange(6)),
                                      [[0, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1], [0, 0]])


# ---- push_pull_rows: a step's push and the next step's pull ---------------------------

def test_push_pull_rows_equals_a_push_then_a_pull_in_one_call_per_server(make_cluster):
    cluster = make_cluster(servers=3)
    rng = np.random.default_rng(5)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("emb", dim=8, num_rows=1000, init=UNIFORM, optimizer=SGD1,
                                    seed=3)
        reference = initial_rows(spec, np.arange(1000))
        ids = rng.permutation(zipf_ids(rng, 300, 1000))
        rows = ps.pull_rows("emb", ids)
        out = np.empty((250, 8), np.float32)
        for _ in range(5):
            # The duplicates of both id arrays in any order; every server has a part of both.
            next_ids = rng.permutation(np.concatenate([zipf_ids(rng, 247, 1000), [0, 1, 2]]))
            grads = rows.astype(np.float32) * 0.5 + rng.normal(size=rows.shape).astype(np.float32)
            calls = dict(cluster.faults.calls)
            rows = ps.push_pull_rows("emb", ids, grads, next_ids, out=out)
            assert rows is out
            # One call per server for both, over gRPC; over shared memory no pull is a call.
            assert cluster.faults.calls.get("Pull", 0) == calls.get("Pull", 0)
            assert cluster.faults.calls["Push"] - calls.get("Push", 0) == 3
            np.add.at(reference, ids, -grads)
            np.testing.assert_allclose(rows, reference[next_ids], rtol=1e-5, atol=1e-5)
            ids = next_ids
        np.testing.assert_allclose(ps.pull("emb"), reference, rtol=1e-5, atol=1e-5)


def test_push_pull_rows_on_a_dynamic_table_and_through_a_narrower_wire_dtype(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("dyn", dim=4, init=UNIFORM, optimizer=SGD1, seed=9)
        ids, next_ids = np.array([10**12, 7, 7], np.int64), np.array([7, -5, 10**12], np.int64)
        grads = np.ones((3, 4), np.float32)
        rows = ps.push_pull_rows("dyn", ids, grads, next_ids, wire_dtype="bfloat16")
        expected = initial_rows(spec, next_ids)
        expected[0] -= 2.0  # id 7 twice
        expected[2] -= 1.0
        np.testing.assert_allclose(rows, expected, atol=2e-2)  # bfloat16 both ways
        np.testing.assert_allclose(ps.pull_rows("dyn", next_ids), expected, atol=2e-2)


def test_push_pull_rows_refuses_bad_next_ids_before_it_sends_anything(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=4, num_rows=10, init=UNIFORM, optimizer=SGD1)
        ps.declare("dense", shape=(10, 4), init="zeros", optimizer=SGD1)
        before = ps.pull("emb")
        ids, grads = np.array([1, 2], np.int64), np.ones((2, 4), np.float32)
        for code, next_ids, kwargs in (
                (grpc.StatusCode.OUT_OF_RANGE, np.array([3, 10], np.int64), {}),
                (grpc.StatusCode.INVALID_ARGUMENT, np.array([3], np.int32), {}),
                (grpc.StatusCode.INVALID_ARGUMENT, np.array([3], np.int64),
                 {"out": np.empty((2, 4), np.float32)}),
                (grpc.StatusCode.INVALID_ARGUMENT, np.array([3], np.int64),
                 {"wire_dtype": "float64"})):
            expect_error(code, ps.push_pull_rows, "emb", ids, grads, next_ids, **kwargs)
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push_pull_rows, "dense", ids, grads,
                     ids)
        np.testing.assert_array_equal(ps.pull("emb"), before)


def test_no_ids_push_and_pull_nothing(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=4, num_rows=10, init=UNIFORM, optimizer=SGD1)
        before = ps.pull("emb")
        none, two = np.array([], np.int64), np.array([3, 1], np.int64)
        ps.push_rows("emb", none, np.empty((0, 4), np.float32))
        assert ps.pull_rows("emb", none).shape == (0, 4)
        rows = ps.push_pull_rows("emb", none, np.empty((0, 4), np.float32), two)
        np.testing.assert_array_equal(rows, before[two])
        assert ps.push_pull_rows("emb", two, np.zeros((2, 4), np.float32), none).shape == (0, 4)
        np.testing.assert_array_equal(ps.pull("emb"), before)


def test_a_lost_push_then_pull_answer_is_retried_and_the_push_applied_once(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        cluster.faults.drop_response_next("Push", 2)
        rows = ps.push_pull_rows("emb", np.array([1, 2, 3, 4], np.int64),
                                 np.ones((4, 2), np.float32), np.arange(6))
        expected = [[0, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1], [0, 0]]
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_array_equal(ps.pull_rows("emb", np.arange(6)), expected)


def test_push_then_pull_straight_to_a_server(cluster):
    """The call as any gRPC client sends it (generated protobuf messages): the pull is checked
    before the push is applied, and a retry is deduplicated but pulls again."""
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        shard_map = ps.shard_map
    shard = shard_map.shards_of("emb")[0]
    mine = np.array([shard.index, shard.index + shard.stride], np.int64)
    channel = grpc.insecure_channel(shard_map.servers[shard.server_id])
    stub = ps_grpc.ParameterServerStub(channel)

    def call(pull_ids: np.ndarray | None, sequence: int = 1, pull_bytes: bytes | None = None):
        header = ps_pb.PushHeader(
            client_id="raw", incarnation=1, sequence=sequence, epoch=shard_map.epoch,
            shards=[ps_pb.ShardRef(variable="emb", index=shard.index, row_ids=mine.tobytes())],
            tensors=[TensorMeta("float32", (2, 2)).to_proto()])
        request = ps_pb.PushThenPullRequest(header=header,
                                            data=np.ones((2, 2), np.float32).tobytes())
        if pull_ids is not None:
            request.pull.CopyFrom(ps_pb.PullRequest(epoch=shard_map.epoch, shards=[
                ps_pb.ShardRef(variable="emb", index=shard.index, row_ids=pull_ids.tobytes())]))
        if pull_bytes is None:
            return stub.PushThenPull(request, timeout=10)
        raw = channel.unary_unary("/ps.v1.ParameterServer/PushThenPull",
                                  request_serializer=bytes,
                                  response_deserializer=ps_pb.PushThenPullReply.FromString)
        return raw(request.SerializeToString() + b"\x1a" + bytes([len(pull_bytes)])
                   + pull_bytes, timeout=10)

    def rows() -> np.ndarray:
        with PSClient(cluster.coordinator_address) as ps:
            return ps.pull_rows("emb", mine)

    try:
        for pull_ids, pull_bytes, code in (
                (np.array([12], np.int64), None, grpc.StatusCode.OUT_OF_RANGE),
                (np.array([shard.index + 1], np.int64), None, grpc.StatusCode.INVALID_ARGUMENT),
                (None, None, grpc.StatusCode.INVALID_ARGUMENT),  # no pull
                (None, b"\x12\x05ab", grpc.StatusCode.INVALID_ARGUMENT)):  # a malformed one
            with pytest.raises(grpc.RpcError) as caught:
                call(pull_ids, pull_bytes=pull_bytes)
            assert caught.value.code() == code, caught.value.details()
            np.testing.assert_array_equal(rows(), np.zeros((2, 2)))  # the push: not applied
        for duplicate in (False, True):
            answer = call(mine[::-1])
            assert answer.push.duplicate is duplicate
            assert [tuple(t.shape) for t in answer.header.tensors] == [(2, 2)]
            np.testing.assert_array_equal(np.frombuffer(answer.data, np.float32), [-1.0] * 4)
    finally:
        channel.close()


# ---- dynamic tables --------------------------------------------------------------------

@pytest.mark.parametrize("servers", [1, 3])
def test_a_dynamic_table_gives_an_id_the_same_initial_row_on_any_server_count(
        make_cluster, servers):
    cluster = make_cluster(servers=servers)
    ids = np.array([0, -5, 2**62 + 11, 42, 42, 123456789012], np.int64)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("ids", dim=6, num_rows=None,
                                    init={"name": "normal", "stddev": 0.5}, seed=9)
        np.testing.assert_array_equal(ps.pull_rows("ids", ids), initial_rows(spec, ids))
        # Once made, a row is held: the second pull reads the same values.
        np.testing.assert_array_equal(ps.pull_rows("ids", ids[::-1]),
                                      initial_rows(spec, ids[::-1]))
        held = sum(t.rows for s in cluster.servers for t in s.store.table_stats())
        assert held == 5


def test_a_push_to_an_id_never_seen_starts_from_its_initial_row(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("ids", dim=2, init=UNIFORM, optimizer=SGD1, seed=1)
        ids = np.array([77, -3], np.int64)
        ps.push_rows("ids", ids, np.ones((2, 2), np.float32))
        np.testing.assert_allclose(ps.pull_rows("ids", ids), initial_rows(spec, ids) - 1.0,
                                   rtol=1e-6)


def test_capacity_evicts_the_least_recently_used_rows_and_is_never_exceeded(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare_embedding("ids", dim=2, init=UNIFORM, optimizer=SGD1, capacity=4)
        ps.push_rows("ids", np.array([1, 2, 3, 4], np.int64), np.ones((4, 2), np.float32))
        ps.pull_rows("ids", np.array([1, 3], np.int64))  # 2 and 4 are now the oldest
        ps.pull_rows("ids", np.array([5, 6], np.int64))  # evicts 2 and 4
        stats = cluster.servers[0].store.table_stats()[0]
        assert (stats.rows, stats.evictions) == (4, 2)
        rows = ps.pull_rows("ids", np.array([1, 3], np.int64))  # kept, trained
        np.testing.assert_allclose(rows, initial_rows(spec, [1, 3]) - 1.0, rtol=1e-6)
        # 2 was evicted: it comes back as its initial row (evicting two more).
        np.testing.assert_array_equal(ps.pull_rows("ids", np.array([2], np.int64)),
                                      initial_rows(spec, [2]))
        assert cluster.servers[0].store.table_stats()[0].rows == 4
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, "ids",
                     np.arange(5, dtype=np.int64))  # more distinct ids than the capacity


def test_a_dynamic_tables_capacity_is_shared_by_its_shards(make_cluster):
    cluster = make_cluster(servers=3)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("ids", dim=2, capacity=10)
        for start in range(0, 300, 30):
            ps.pull_rows("ids", np.arange(start, start + 3, dtype=np.int64))
        held = [t.rows for s in cluster.servers for t in s.store.table_stats()]
        assert sum(held) <= 10


def test_rows_held_evictions_and_bytes_per_table_show_in_the_status(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps, \
            CoordinatorClient(cluster.coordinator_address, give_up_after_s=5) as coordinator:
        ps.declare_embedding("dyn", dim=4, capacity=6, ttl_seconds=3600)
        ps.declare_embedding("fixed", dim=2, num_rows=10)
        for start in range(0, 40, 2):  # 40 distinct ids through a table of 6 rows
            ps.pull_rows("dyn", np.arange(start, start + 2, dtype=np.int64))
        expected = sum(t.evictions for s in cluster.servers for t in s.store.table_stats())
        assert expected >= 34
        deadline = time.monotonic() + 10
        while True:  # the servers report with their next heartbeat
            tables = {t["name"]: t for t in coordinator.status()["tables"]}
            if tables["dyn"]["evictions"] == expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert tables["dyn"]["evictions"] == expected
        assert tables["dyn"]["rows_held"] <= 6 and tables["dyn"]["bytes"] > 0
        assert (tables["dyn"]["num_rows"], tables["dyn"]["capacity"],
                tables["dyn"]["ttl_seconds"]) == (None, 6, 3600)
        assert (tables["fixed"]["rows_held"], tables["fixed"]["evictions"]) == (10, 0)
        assert "dyn" in render(coordinator.status()) and "evictions" in render(
            coordinator.status())


def test_memory_budgets_hold_dynamic_tables(make_cluster):
    cluster = make_cluster(servers=2, memory_budget_bytes=1 << 20)
    with PSClient(cluster.coordinator_address) as ps:
        # Placement charges a capped table its capacity's rows with their bookkeeping:
        # 20,000 rows of 4 floats do not fit 2 x 1 MiB.
        expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, ps.declare_embedding, "large",
                     dim=4, capacity=20_000)
        # An uncapped one grows until its server's budget is full, then is refused room.
        ps.declare_embedding("open", dim=4, init=UNIFORM, optimizer=SGD1)
        ps.push_rows("open", np.arange(100, dtype=np.int64), np.ones((100, 4), np.float32))
        before = ps.pull_rows("open", np.arange(100, dtype=np.int64))
        error = expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, ps.push_rows, "open",
                             np.arange(100, 20_100, dtype=np.int64),
                             np.ones((20_000, 4), np.float32))
        assert "memory budget" in error.details()
        np.testing.assert_array_equal(ps.pull_rows("open", np.arange(100, dtype=np.int64)),
                                      before)


# ---- checkpoints -----------------------------------------------------------------------

@pytest.mark.parametrize("servers_after", [2, 3])
def test_tables_come_back_from_a_checkpoint_on_any_server_count(make_cluster, tmp_path,
                                                                servers_after):
    rng = np.random.default_rng(2)
    adagrad = {"name": "adagrad", "lr": 0.5}

    def declare(ps):
        ps.declare_embedding("fixed", dim=4, num_rows=100, init=UNIFORM, optimizer=adagrad)
        ps.declare_embedding("dyn", dim=3, init=UNIFORM, optimizer={"name": "adam"},
                             capacity=500)

    fixed_ids = zipf_ids(rng, 200, 100)
    dyn_ids = np.concatenate([[-1, 0], rng.integers(-2**40, 2**40, 48)])  # -1 is an id too
    first = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        declare(ps)
        for _ in range(3):
            ps.push_rows("fixed", fixed_ids, rng.normal(size=(200, 4)).astype(np.float32))
            ps.push_rows("dyn", dyn_ids, rng.normal(size=(50, 3)).astype(np.float32))
        first.checkpoint()
        trained = ps.pull("fixed"), ps.pull_rows("dyn", dyn_ids)
        ps.push_rows("fixed", fixed_ids, np.ones((200, 4), np.float32))
        ps.push_rows("dyn", dyn_ids, np.ones((50, 3), np.float32))
        expected = ps.pull("fixed"), ps.pull_rows("dyn", dyn_ids)
    first.stop()

    second = make_cluster(servers=servers_after, checkpoint_dir=tmp_path)
    with PSClient(second.coordinator_address) as ps:
        declare(ps)
        np.testing.assert_array_equal(ps.pull("fixed"), trained[0])
        np.testing.assert_array_equal(ps.pull_rows("dyn", dyn_ids), trained[1])
        # The optimizer's slots (adagrad's sums, adam's moments and per-row steps) too.
        ps.push_rows("fixed", fixed_ids, np.ones((200, 4), np.float32))
        ps.push_rows("dyn", dyn_ids, np.ones((50, 3), np.float32))
        np.testing.assert_allclose(ps.pull("fixed"), expected[0], rtol=1e-6)
        np.testing.assert_allclose(ps.pull_rows("dyn", dyn_ids), expected[1], rtol=1e-6)
        held = sum(t.rows for s in second.servers for t in s.store.table_stats()
                   if t.variable == "dyn")
        assert held == 50


def test_a_checkpoint_taken_while_a_dynamic_table_grows_holds_the_table_at_its_cut(
        make_cluster, tmp_path, monkeypatch):
    """A push between the cut and the writer reaching the table makes new rows (its pool
    is replaced by a larger one): the checkpoint still ends, with the rows of the cut."""
    from ps_server import snapshots

    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("dyn", dim=4, init=UNIFORM, optimizer=SGD1)
        ps.push_rows("dyn", np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32))
        at_cut = ps.pull_rows("dyn", np.arange(10, dtype=np.int64))
        write_shard = snapshots._write_shard

        def growing_first(writer, capture, held, *args):
            if held.key[0] == "dyn" and not growing_first.done:
                growing_first.done = True
                ps.push_rows("dyn", np.arange(1000, 1500, dtype=np.int64),
                             np.ones((500, 4), np.float32))
            return write_shard(writer, capture, held, *args)

        growing_first.done = False
        monkeypatch.setattr(snapshots, "_write_shard", growing_first)
        cluster.checkpoint()
        assert growing_first.done
    cluster.stop()

    again = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(again.coordinator_address) as ps:
        ps.declare_embedding("dyn", dim=4, init=UNIFORM, optimizer=SGD1)
        np.testing.assert_array_equal(ps.pull_rows("dyn", np.arange(10, dtype=np.int64)),
                                      at_cut)
        assert sum(t.rows for s in again.servers for t in s.store.table_stats()) == 10


def test_a_refused_request_over_a_shards_capacity_share_changes_no_shard(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("dyn", dim=2, init=UNIFORM, optimizer=SGD1, capacity=20)
        shards = ps.shard_map.shards_of("dyn")
        candidates = np.arange(10_000, dtype=np.int64)
        owners = (hash_ids(candidates) % np.uint64(2)).astype(int)
        on = [candidates[owners == i] for i in range(2)]
        ps.push_rows("dyn", np.concatenate([on[0][:10], on[1][:10]]),
                     np.ones((20, 2), np.float32))  # both shards full of trained rows
        before = [t for s in cluster.servers for t in s.store.table_stats()]
        # 15 distinct ids (under the capacity), but 11 on shard 0, whose share is 10.
        request = np.concatenate([on[0][10:21], on[1][10:14]])
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, "dyn", request)
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, "dyn", request,
                     np.ones((15, 2), np.float32))
        assert [t for s in cluster.servers for t in s.store.table_stats()] == before
        assert len(shards) == 2


# ---- bad input -------------------------------------------------------------------------

def test_bad_row_requests_get_their_code_and_change_nothing(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=4, num_rows=10, init=UNIFORM, optimizer=SGD1)
        ps.declare_embedding("dyn", dim=4, init=UNIFORM, optimizer=SGD1)
        ps.declare("dense", shape=(10, 4), init="zeros", optimizer=SGD1)
        dyn_ids = np.array([5, 6], np.int64)
        before = ps.pull("emb"), ps.pull("dense"), ps.pull_rows("dyn", dyn_ids)
        ids, grads = np.array([1, 2], np.int64), np.ones((2, 4), np.float32)
        bad = [
            (grpc.StatusCode.OUT_OF_RANGE, ps.pull_rows, ("emb", np.array([10], np.int64))),
            (grpc.StatusCode.OUT_OF_RANGE, ps.push_rows, ("emb", np.array([-1, 2], np.int64),
                                                          grads)),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, ("emb", ids, np.ones((3, 4),
                                                                                  np.float32))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, ("emb", ids, np.ones((2, 5),
                                                                                  np.float32))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, ("emb", ids, np.ones((2, 4),
                                                                                  np.int32))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, ("emb", ids, np.full((2, 4),
                                                                                  np.nan))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, ("emb", ids.astype(np.int32))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, ("emb", ids.astype(np.float64))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, ("emb", ids.reshape(2, 1))),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.pull_rows, ("dense", ids)),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push_rows, ("dense", ids, grads)),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.pull, ("dyn",)),
            (grpc.StatusCode.INVALID_ARGUMENT, ps.push, ({"emb": np.ones((10, 4),
                                                                         np.float32)},)),
            (grpc.StatusCode.NOT_FOUND, ps.pull_rows, ("nothing", ids)),
        ]
        for code, fn, args in bad:
            expect_error(code, fn, *args)
        for kwargs in ({"capacity": -1}, {"ttl_seconds": -1.0}, {"num_rows": 0},
                       {"capacity": 1},  # below the 2 servers that would share it
                       {"num_rows": 10, "capacity": 5}, {"init": "glorot_uniform"}):
            expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.declare_embedding, "new", 4,
                         **{"num_rows": None, **kwargs})
        after = ps.pull("emb"), ps.pull("dense"), ps.pull_rows("dyn", dyn_ids)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a, b)
        assert "new" not in ps.refresh().variables


def test_bad_row_requests_straight_to_a_server(cluster):
    """What a client other than PSClient may send: the server checks it all the same."""
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        shard_map = ps.shard_map
        before = ps.pull("emb")
    shard = shard_map.shards_of("emb")[0]
    channel = grpc.insecure_channel(shard_map.servers[shard.server_id])
    stub = ps_grpc.ParameterServerStub(channel)
    try:
        def pull(row_ids: bytes):
            return stub.PullUnary(ps_pb.PullRequest(epoch=shard_map.epoch, shards=[
                ps_pb.ShardRef(variable="emb", index=shard.index, row_ids=row_ids)]),
                timeout=10)

        other = np.array([shard.index + 1], np.int64)  # an id of the other shard
        for row_ids, code in ((b"\x01\x02\x03", grpc.StatusCode.INVALID_ARGUMENT),
                              (other.tobytes(), grpc.StatusCode.INVALID_ARGUMENT),
                              (np.array([12], np.int64).tobytes(), grpc.StatusCode.OUT_OF_RANGE)):
            with pytest.raises(grpc.RpcError) as caught:
                pull(row_ids)
            assert caught.value.code() == code, caught.value.details()
        answer = pull(np.array([shard.index, shard.index], np.int64).tobytes())
        assert len(answer.data) == 2 * 2 * 4
        # Two finite gradients of one id whose sum overflows: refused, nothing applied.
        ids = np.array([shard.index, shard.index], np.int64)
        header = ps_pb.PushHeader(
            client_id="raw", incarnation=1, sequence=1, epoch=shard_map.epoch,
            shards=[ps_pb.ShardRef(variable="emb", index=shard.index, row_ids=ids.tobytes())],
            tensors=[TensorMeta("float32", (2, 2)).to_proto()])
        grads = np.full((2, 2), 3e38, np.float32)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Push(iter([ps_pb.PushChunk(header=header, data=grads.tobytes())]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in caught.value.details()
    finally:
        channel.close()
    with PSClient(cluster.coordinator_address) as ps:
        np.testing.assert_array_equal(ps.pull("emb"), before)


def test_a_fixed_table_may_not_set_capacity_and_specs_check_their_shape():
    with pytest.raises(Exception, match="capacity"):
        VariableSpec("t", (10, 4), kind="embedding", capacity=3)
    with pytest.raises(Exception, match="num_rows, dim"):
        VariableSpec("t", (10,), kind="embedding")
    spec = VariableSpec("t", (0, 4), kind="embedding", capacity=3,
                        initializer=Component("zeros"))
    assert spec.dynamic and spec.is_table
