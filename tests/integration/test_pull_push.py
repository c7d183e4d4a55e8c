"""Pull and push against an in-process cluster: values, chunking, dtypes, concurrency, and
every kind of bad input (through PSClient and straight to a server with a raw stub)."""

from __future__ import annotations

import threading
import uuid

import grpc
import numpy as np
import pytest

from ps_common.tensors import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_proto.v1 import tensor_pb2
from ps_server import servicer
from ps_server.initializers import initialize_rows
from ps_server.store import ShardStore
from ps_worker import PSClient, RemoteError

SGD1 = {"name": "sgd", "lr": 1.0}
JOIN_TIMEOUT_S = 30.0


@pytest.fixture(params=["grpc", "shm", "grpc-staged"])
def data_path(request):
    """Every test here runs three times: with servers that offer shared memory to this
    process (pulls and pushes go through it), with servers started --no-shm (all over gRPC),
    and over gRPC with --push-memory 0 (every streamed push waits in a file until all of it
    has arrived). Bad input reaches a server the same way on all; errors and values must be
    equal."""
    return request.param


pytestmark = pytest.mark.usefixtures("data_path")


# ---- helpers ------------------------------------------------------------------------------

def pull_all(ps: PSClient) -> dict[str, np.ndarray]:
    names = sorted(ps.refresh().variables)
    return ps.pull(names) if names else {}


def assert_same_values(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert sorted(before) == sorted(after)
    for name in before:
        assert after[name].dtype == before[name].dtype, name
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def initial(ps: PSClient, name: str) -> np.ndarray:
    spec = ps.shard_map.spec(name)
    return initialize_rows(spec, 0, spec.rows)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return bfloat16_bits_to_float32(float32_to_bfloat16_bits(x.astype(np.float32)))


def expect_error(code: grpc.StatusCode, fn, *args, **kwargs) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        fn(*args, **kwargs)
    assert caught.value.code() == code, caught.value
    return caught.value


# ---- initial values, splitting --------------------------------------------------------------

INITS = [
    "zeros",
    {"name": "constant", "value": 0.25},
    {"name": "uniform", "minval": -2.0, "maxval": 3.0},
    {"name": "normal", "mean": 1.0, "stddev": 0.5},
    "glorot_uniform",
]


@pytest.mark.parametrize("client_chunk", [64, 1024, 3 * 2**20])
def test_client_and_server_chunk_sizes_need_not_agree(make_cluster, client_chunk):
    """A client picks one message or a stream by its own chunk size; a server with a
    smaller --chunk-bytes still answers a one-message pull and push."""
    cluster = make_cluster(servers=1, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=client_chunk) as ps:
        start = ps.declare("w", shape=(100,), init="normal", optimizer=SGD1, seed=3)
        values = ps.pull("w")
        np.testing.assert_array_equal(values, initialize_rows(start, 0, 100))
        ps.push({"w": np.ones(100, np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), values - 1)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_initial_values_equal_initialize_rows(make_cluster, dtype):
    cluster = make_cluster(servers=3, split_threshold_bytes=150, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        for i, init in enumerate(INITS):
            ps.declare(f"v{i}", shape=(37, 5), dtype=dtype, init=init, seed=11 + i)
        ps.declare("vec", shape=(3,), dtype=dtype, init="glorot_uniform", seed=5)
        shard_map = ps.shard_map
        assert all(len(shard_map.shards[f"v{i}"]) == 3 for i in range(len(INITS)))
        values = ps.pull([f"v{i}" for i in range(len(INITS))] + ["vec"])
        for name, value in values.items():
            spec = shard_map.spec(name)
            assert value.dtype == np.dtype(dtype)
            assert value.shape == spec.shape
            np.testing.assert_array_equal(value, initialize_rows(spec, 0, spec.rows), err_msg=name)
        # Seeded initializers give different values for different seeds.
        assert not np.array_equal(values["v2"], values["v3"])


@pytest.mark.parametrize("optimizer", [
    SGD1,
    {"name": "adam", "lr": 0.01},
    {"name": "adam", "lr": 0.01, "weight_decay": 0.1},
    {"name": "momentum", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"name": "adagrad", "lr": 0.1},
], ids=["sgd", "adam", "adam-wd", "nesterov", "adagrad"])
def test_split_variable_behaves_like_unsplit(make_cluster, optimizer):
    split = make_cluster(servers=3, split_threshold_bytes=1000, chunk_bytes=64)
    whole = make_cluster(servers=1)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((61, 10)).astype(np.float32) for _ in range(4)]
    with PSClient(split.coordinator_address, chunk_bytes=64) as a, \
            PSClient(whole.coordinator_address) as b:
        for ps in (a, b):
            ps.declare("w", shape=(61, 10), init="glorot_uniform", optimizer=optimizer, seed=7)
        assert len(a.shard_map.shards["w"]) == 3
        assert len({s.server_id for s in a.shard_map.shards["w"]}) == 3
        assert len(b.shard_map.shards["w"]) == 1
        np.testing.assert_array_equal(a.pull("w"), b.pull("w"))
        for g in grads:
            a.push({"w": g})
            b.push({"w": g})
        after_a, after_b = a.pull("w"), b.pull("w")
        np.testing.assert_array_equal(after_a, after_b)
        assert not np.array_equal(after_a, initial(a, "w"))


# ---- chunking -------------------------------------------------------------------------------

def test_tensors_larger_than_one_chunk(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=1500, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=(53, 13), init="uniform", optimizer=SGD1, seed=1)  # split, 2756 B
        ps.declare("b", shape=(13,), init="normal", optimizer=SGD1, seed=2)  # 52 B: one chunk
        ps.declare("c", shape=(29, 3), init="normal", optimizer=SGD1, seed=3)
        assert len(ps.shard_map.shards["w"]) == 2
        before = ps.pull(["w", "b", "c"])
        for name in before:
            np.testing.assert_array_equal(before[name], initial(ps, name))
        rng = np.random.default_rng(1)
        grads = {n: rng.integers(-4, 5, v.shape).astype(np.float32) for n, v in before.items()}
        ps.push(grads)
        after = ps.pull(["w", "b", "c"])
        for name in before:
            np.testing.assert_array_equal(after[name], before[name] - grads[name])


def test_tensor_larger_than_grpc_message_limit(make_cluster):
    cluster = make_cluster(servers=1)  # default chunk size (2 MiB) on both sides
    n = 1_500_000  # 6 MB of float32: more than gRPC's 4 MiB message limit
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("big", shape=(n,), init={"name": "uniform", "minval": 0.0, "maxval": 1.0},
                   optimizer=SGD1, seed=9)
        value = ps.pull("big")
        np.testing.assert_array_equal(value, initial(ps, "big"))
        grad = np.full(n, 0.5, np.float32)
        grad[::7] = -2.0
        ps.push({"big": grad})
        expected = value - grad
        del grad
        np.testing.assert_array_equal(ps.pull("big"), expected)


def test_client_refuses_chunks_over_the_message_limit(cluster):
    try:
        client = PSClient(cluster.coordinator_address, chunk_bytes=8 * 1024 * 1024)
    except ValueError:
        return
    client.close()
    pytest.fail("PSClient accepted chunk_bytes=8 MiB, more than gRPC's 4 MiB message limit")


# ---- dtypes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_stored_dtypes_pull_and_push(make_cluster, dtype):
    cluster = make_cluster(servers=2, split_threshold_bytes=100, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("v", shape=(20, 6), dtype=dtype, init="uniform", optimizer=SGD1, seed=4)
        assert len(ps.shard_map.shards["v"]) == 2
        value = ps.pull("v")
        assert value.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(value, initial(ps, "v"))
        grad = np.random.default_rng(2).standard_normal((20, 6)).astype(dtype)
        ps.push({"v": grad})
        after = ps.pull("v")
        assert after.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(after, value - grad)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_pull_in_narrow_wire_dtype(make_cluster, wire):
    cluster = make_cluster(servers=2, split_threshold_bytes=500, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=(30, 7), init={"name": "normal", "stddev": 3.0}, seed=8)
        assert len(ps.shard_map.shards["w"]) == 2
        exact = ps.pull("w")
        narrow = ps.pull("w", wire_dtype=wire)
        assert narrow.dtype == np.float32
        if wire == "float16":
            rounded, rtol = exact.astype(np.float16).astype(np.float32), 2.0 ** -11
        else:
            rounded, rtol = bf16_round(exact), 2.0 ** -8
        np.testing.assert_array_equal(narrow, rounded)
        np.testing.assert_allclose(narrow, exact, rtol=rtol, atol=0)
        assert not np.array_equal(narrow, exact)  # the transfer really was narrowed


def test_pull_float64_variable_as_float32(make_cluster):
    cluster = make_cluster(servers=1, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("d", shape=(9, 4), dtype="float64", init="normal", seed=1)
        exact = ps.pull("d")
        narrow = ps.pull("d", wire_dtype="float32")
        assert narrow.dtype == np.float64
        np.testing.assert_array_equal(narrow, exact.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("chunk", [64, 1 << 20])  # streamed and one-message answers
def test_pull_beyond_the_wire_dtypes_range_is_out_of_range(make_cluster, chunk):
    """A value that the pull's narrower wire dtype cannot hold is refused, never sent as an
    infinity (a push narrowed so is refused too), each time it is asked for: the error
    names the variable and the dtype. A wire dtype that holds it still pulls it."""
    cluster = make_cluster(servers=2, split_threshold_bytes=500, chunk_bytes=chunk)
    with PSClient(cluster.coordinator_address, chunk_bytes=chunk) as ps:
        ps.declare("w", shape=(30, 7), init={"name": "constant", "value": 7e4})
        ps.declare("t", shape=(20, 3), init={"name": "constant", "value": 0.5})
        assert len(ps.shard_map.shards["w"]) == 2
        for _ in range(2):  # a repeated pull is answered from what the server kept of it
            err = expect_error(grpc.StatusCode.OUT_OF_RANGE, ps.pull, ["t", "w"],
                               wire_dtype="float16")
            assert "'w'" in str(err) and "float16" in str(err)
        np.testing.assert_array_equal(ps.pull("w", wire_dtype="bfloat16"),
                                      bf16_round(np.full((30, 7), 7e4)))
        np.testing.assert_array_equal(ps.pull("t", wire_dtype="float16"), np.full((20, 3), 0.5))


def test_a_push_pull_whose_pull_is_out_of_range_applies_its_push_once(make_cluster):
    """push_pull in float16 whose push takes the values past float16's range: the push is
    applied (once, whatever call carried it), and the pull is refused with OUT_OF_RANGE, as
    the two calls in turn would do."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8,), init={"name": "constant", "value": 6e4}, optimizer=SGD1)
        err = expect_error(grpc.StatusCode.OUT_OF_RANGE, ps.push_pull,
                           {"w": np.full(8, -1e4, np.float32)}, "w", wire_dtype="float16")
        assert "'w'" in str(err) and "float16" in str(err)
        np.testing.assert_array_equal(ps.pull("w"), np.full(8, 7e4, np.float32))


def test_rows_beyond_the_wire_dtypes_range_are_out_of_range(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("e", dim=4, num_rows=50, init={"name": "constant", "value": 1e5})
        err = expect_error(grpc.StatusCode.OUT_OF_RANGE, ps.pull_rows, "e", [3, 4, 9],
                           wire_dtype="float16")
        assert "'e'" in str(err) and "float16" in str(err)
        np.testing.assert_array_equal(ps.pull_rows("e", [3, 4], wire_dtype="bfloat16"),
                                      bf16_round(np.full((2, 4), 1e5)))


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_push_in_narrow_wire_dtype_is_applied(make_cluster, wire):
    cluster = make_cluster(servers=2, split_threshold_bytes=500, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=(30, 7), init="uniform", optimizer=SGD1, seed=3)
        before = ps.pull("w")
        grad = np.random.default_rng(5).standard_normal((30, 7)).astype(np.float32)
        decoded = grad.astype(np.float16).astype(np.float32) if wire == "float16" \
            else bf16_round(grad)
        assert not np.array_equal(decoded, grad)  # rounding is visible
        ps.push({"w": grad}, wire_dtype=wire)
        np.testing.assert_array_equal(ps.pull("w"), before - decoded)


def test_push_float32_gradient_to_float64_variable(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("d", shape=(5, 3), dtype="float64", init="normal", optimizer=SGD1, seed=2)
        before = ps.pull("d")
        grad = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
        ps.push({"d": grad})
        np.testing.assert_array_equal(ps.pull("d"), before - grad.astype(np.float64))


def test_pull_wider_wire_dtype_than_stored_is_invalid_argument(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("h", shape=(4, 3), dtype="float16")
        err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.pull, "h", wire_dtype="float32")
        assert "h" in str(err)


def test_pull_unknown_wire_dtype_is_invalid_argument(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4, 3))
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.pull, "w", wire_dtype="int8")


def test_push_wider_wire_dtype_than_stored_is_invalid_argument(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("h", shape=(4, 3), dtype="float16", optimizer=SGD1)
        before = pull_all(ps)
        for grad, wire in [(np.ones((4, 3), np.float32), None),
                           (np.ones((4, 3), np.float16), "float32")]:
            err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push, {"h": grad},
                               wire_dtype=wire)
            assert "h" in str(err)
        assert_same_values(before, pull_all(ps))


# ---- concurrency ----------------------------------------------------------------------------

def _run_threads(targets) -> None:
    errors: list[BaseException] = []

    def guard(fn):
        try:
            fn()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=guard, args=(fn,), name=f"test-pusher-{i}")
               for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "pusher threads did not finish in time"
    assert not errors, errors


@pytest.mark.parametrize("shared", [False, True], ids=["own-clients", "shared-client"])
def test_concurrent_pushes_sum_exactly(make_cluster, shared):
    cluster = make_cluster(servers=3, split_threshold_bytes=500, chunk_bytes=64)
    threads, pushes, shape = 8, 25, (48, 8)
    address = cluster.coordinator_address
    with PSClient(address, chunk_bytes=64) as main:
        main.declare("w", shape=shape, init={"name": "constant", "value": 1000.0},
                     optimizer=SGD1)
        assert len(main.shard_map.shards["w"]) == 3
        start = main.pull("w")
        barrier = threading.Barrier(threads, timeout=JOIN_TIMEOUT_S)
        rows = np.arange(shape[0], dtype=np.float32)[:, None] % 5 - 2  # -2..2 per row

        def grad(t: int, i: int) -> np.ndarray:
            return np.broadcast_to(rows * (t + 1) + (i % 3), shape).astype(np.float32)

        def pusher(t: int):
            def run():
                client = main if shared else PSClient(address, chunk_bytes=64)
                try:
                    barrier.wait()
                    for i in range(pushes):
                        client.push({"w": grad(t, i)})
                finally:
                    if not shared:
                        client.close()
            return run

        _run_threads([pusher(t) for t in range(threads)])
        total = sum(grad(t, i).astype(np.float64) for t in range(threads) for i in range(pushes))
        np.testing.assert_array_equal(main.pull("w"), start - total.astype(np.float32))


def test_push_async_and_flush(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=500, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64, max_in_flight_pushes=3) as ps:
        ps.declare("w", shape=(40, 5), optimizer=SGD1)
        ps.declare("b", shape=(5,), optimizer=SGD1)
        grads = {"w": np.ones((40, 5), np.float32), "b": np.full(5, 2.0, np.float32)}
        pending = [ps.push_async(grads) for _ in range(20)]
        ps.flush(timeout=JOIN_TIMEOUT_S)
        assert all(f.done() and f.exception() is None for f in pending)
        values = ps.pull(["w", "b"])
        np.testing.assert_array_equal(values["w"], np.full((40, 5), -20.0, np.float32))
        np.testing.assert_array_equal(values["b"], np.full(5, -40.0, np.float32))


def test_push_async_error_surfaces_in_its_future(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        bad = ps.push_async({"nope": np.ones(4, np.float32)})
        good = ps.push_async({"w": np.ones(4, np.float32)})
        error = bad.exception(timeout=JOIN_TIMEOUT_S)
        assert isinstance(error, RemoteError)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert good.result(timeout=JOIN_TIMEOUT_S) is None
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(4, np.float32))
        # Its error is the flush's too (or close's, without a flush).
        expect_error(grpc.StatusCode.NOT_FOUND, ps.flush, timeout=JOIN_TIMEOUT_S)


def test_flush_raises_error_of_push_async_that_already_finished(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        bad = ps.push_async({"nope": np.ones(4, np.float32)})
        bad.exception(timeout=JOIN_TIMEOUT_S)  # wait until it has failed
        with pytest.raises(RemoteError) as caught:
            ps.flush(timeout=JOIN_TIMEOUT_S)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_close_raises_the_error_of_a_push_async_never_flushed(make_cluster):
    """close() waits for the push, releases everything, then raises its error (a server's
    refusal here) instead of dropping it; only once."""
    cluster = make_cluster(servers=1)
    ps = PSClient(cluster.coordinator_address)
    try:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        cluster.faults.fail_next("Push", 1, code=grpc.StatusCode.INVALID_ARGUMENT)
        ps.push_async({"w": np.ones(4, np.float32)})
        error = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.close)
        assert error.target == "ps-0"
        ps.close()  # idempotent: nothing more to raise
    finally:
        ps.close()


def test_a_failed_push_async_does_not_replace_the_exception_leaving_the_with_block(make_cluster):
    cluster = make_cluster(servers=1)
    with pytest.raises(KeyError):
        with PSClient(cluster.coordinator_address) as ps:
            ps.declare("w", shape=(4,), optimizer=SGD1)
            ps.push_async({"nope": np.ones(4, np.float32)})
            raise KeyError("the block's own error")


# ---- push_pull: a step's push and a later step's pull -----------------------------------

def test_push_pull_equals_a_push_then_a_pull_in_one_call_per_server(make_cluster, data_path):
    cluster = make_cluster(servers=3, split_threshold_bytes=1000)
    rng = np.random.default_rng(11)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(60, 10), init="glorot_uniform", optimizer=SGD1, seed=1)
        ps.declare("b", shape=(10,), init="normal", optimizer=SGD1, seed=2)
        ps.declare("frozen", shape=(7,), init="uniform", optimizer=SGD1, seed=3)
        assert len(ps.shard_map.shards["w"]) == 3
        reference = ps.pull(["w", "b", "frozen"])
        out = {name: np.empty_like(value) for name, value in reference.items()}
        for _ in range(4):
            grads = {"w": rng.normal(size=(60, 10)).astype(np.float32),
                     "b": rng.normal(size=10).astype(np.float32)}
            calls = dict(cluster.faults.calls)
            # "frozen" gets no gradient, but its server gets part of w's: it comes along.
            got = ps.push_pull(grads, ["w", "b", "frozen"], out=out)
            assert all(got[name] is out[name] for name in out)
            assert cluster.faults.calls.get("Pull", 0) == calls.get("Pull", 0)
            if data_path != "shm":  # one call per server for both
                assert cluster.faults.calls["Push"] - calls.get("Push", 0) == 3
            for name, grad in grads.items():
                reference[name] = reference[name] - grad
            assert_same_values(reference, got)
        assert_same_values(reference, ps.pull(["w", "b", "frozen"]))
        assert ps.push_pull({"b": np.ones(10, np.float32)}, "b").shape == (10,)


def test_a_server_with_nothing_pushed_to_it_is_pulled_from_after_the_push(make_cluster,
                                                                          data_path):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("a", shape=(10,), init="uniform", optimizer=SGD1, seed=1)
        ps.declare("b", shape=(10,), init="uniform", optimizer=SGD1, seed=2)
        shards = ps.shard_map.shards
        assert shards["a"][0].server_id != shards["b"][0].server_id  # placed apart
        before = ps.pull(["a", "b"])
        calls = dict(cluster.faults.calls)
        got = ps.push_pull({"a": np.ones(10, np.float32)}, ["a", "b"])
        np.testing.assert_array_equal(got["a"], before["a"] - 1.0)
        np.testing.assert_array_equal(got["b"], before["b"])
        if data_path != "shm":  # a's values come with its push, b's in a pull of their own
            assert cluster.faults.calls["Pull"] - calls.get("Pull", 0) == 1
            assert cluster.faults.calls["Push"] - calls.get("Push", 0) == 1


def test_push_pull_larger_than_a_message_is_a_push_then_a_pull(make_cluster, data_path):
    cluster = make_cluster(servers=2, split_threshold_bytes=500, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=(40, 5), init="uniform", optimizer=SGD1)
        before = ps.pull("w")
        calls = dict(cluster.faults.calls)
        got = ps.push_pull({"w": np.ones((40, 5), np.float32)}, ["w"])
        np.testing.assert_array_equal(got["w"], before - 1.0)
        np.testing.assert_array_equal(ps.pull("w"), before - 1.0)
        if data_path != "shm":  # each server's push and pull went as calls of their own
            servers = len({s.server_id for s in ps.shard_map.shards["w"]})
            assert cluster.faults.calls["Pull"] - calls.get("Pull", 0) == 2 * servers


def test_push_pull_through_a_narrower_wire_dtype(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), init="uniform", optimizer=SGD1, seed=5)
        before = ps.pull("w")
        grad = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
        got = ps.push_pull({"w": grad}, "w", wire_dtype="bfloat16")
        after = before - bf16_round(grad)
        np.testing.assert_array_equal(ps.pull("w"), after)
        np.testing.assert_array_equal(got, bf16_round(after))


def test_push_pull_refuses_a_bad_pull_before_it_sends_anything(populated):
    _, ps = populated
    before = pull_all(ps)
    grads = {"b": np.ones(10, np.float32)}
    expect_error(grpc.StatusCode.NOT_FOUND, ps.push_pull, grads, ["b", "nope"])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push_pull, grads, ["h"],
                 wire_dtype="float32")  # wider than h's float16
    with pytest.raises(ValueError, match="out"):
        ps.push_pull(grads, ["b"], out={"b": np.empty(9, np.float32)})
    # and a bad push, as push refuses it
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push_pull,
                 {"b": np.full(10, np.nan, np.float32)}, ["b"])
    assert_same_values(before, pull_all(ps))


def test_a_lost_push_pull_answer_is_retried_and_the_push_applied_once(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(6,), optimizer=SGD1)
        cluster.faults.drop_response_next("Push", 1)
        got = ps.push_pull({"w": np.ones(6, np.float32)}, ["w"])
        np.testing.assert_array_equal(got["w"], -np.ones(6, np.float32))
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(6, np.float32))


def test_push_pull_async_is_in_the_push_window_and_flushed(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=100)
    with PSClient(cluster.coordinator_address, max_in_flight_pushes=2) as ps:
        ps.declare("w", shape=(10, 5), optimizer=SGD1)
        pending = [ps.push_pull_async({"w": np.ones((10, 5), np.float32)}, ["w"])
                   for _ in range(6)]
        ps.flush(timeout=JOIN_TIMEOUT_S)
        # With two in flight at most, push i went out after all but one of pushes 0..i-1
        # were applied: each server's values show at least i pushes (1 for the first).
        seen = [f.result(timeout=JOIN_TIMEOUT_S)["w"] for f in pending]
        for i, values in enumerate(seen):
            assert ((-6 <= values) & (values <= -max(i, 1))).all(), (i, values)
        np.testing.assert_array_equal(ps.pull("w"), np.full((10, 5), -6.0, np.float32))
        bad = ps.push_pull_async({"nope": np.ones(3, np.float32)}, ["w"])
        assert bad.exception(timeout=JOIN_TIMEOUT_S).code() == grpc.StatusCode.NOT_FOUND
        expect_error(grpc.StatusCode.NOT_FOUND, ps.flush, timeout=JOIN_TIMEOUT_S)


# ---- bad input through the client -------------------------------------------------------------

@pytest.fixture
def populated(make_cluster):
    """(cluster, client) with a split float32 'w', and 'b', 'h' (float16), 'd' (float64)."""
    cluster = make_cluster(servers=3, split_threshold_bytes=1000, chunk_bytes=64)
    with PSClient(cluster.coordinator_address, chunk_bytes=64) as ps:
        ps.declare("w", shape=(60, 10), init="glorot_uniform", optimizer=SGD1, seed=1)
        ps.declare("b", shape=(10,), init="normal", optimizer=SGD1, seed=2)
        ps.declare("h", shape=(4, 3), dtype="float16", init="uniform", optimizer=SGD1, seed=3)
        ps.declare("d", shape=(5,), dtype="float64", init="uniform", optimizer=SGD1, seed=4)
        assert len(ps.shard_map.shards["w"]) == 3
        yield cluster, ps


def _nan_in_first_shard() -> np.ndarray:
    g = np.ones((60, 10), np.float32)
    g[3, 4] = np.nan  # rows 0:20 are shard 0
    return g


BAD_PUSHES = {
    "unknown-variable": (grpc.StatusCode.NOT_FOUND, "nope",
                         lambda: {"b": np.ones(10, np.float32), "nope": np.ones(3, np.float32)}),
    "int-gradient": (grpc.StatusCode.INVALID_ARGUMENT, "w",
                     lambda: {"b": np.ones(10, np.float32), "w": np.ones((60, 10), np.int32)}),
    "float64-to-float32": (grpc.StatusCode.INVALID_ARGUMENT, "w",
                           lambda: {"w": np.ones((60, 10), np.float64)}),
    "wrong-shape": (grpc.StatusCode.INVALID_ARGUMENT, "w",
                    lambda: {"b": np.ones(10, np.float32), "w": np.ones((60, 9), np.float32)}),
    "wrong-rank": (grpc.StatusCode.INVALID_ARGUMENT, "b",
                   lambda: {"b": np.ones((10, 1), np.float32)}),
    "nan-in-one-shard": (grpc.StatusCode.INVALID_ARGUMENT, "w",
                         lambda: {"b": np.ones(10, np.float32), "w": _nan_in_first_shard()}),
    "inf": (grpc.StatusCode.INVALID_ARGUMENT, "d",
            lambda: {"d": np.array([1, 2, np.inf, 4, 5], np.float64)}),
}


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_bad_push_is_refused_and_changes_nothing(populated, case):
    _, ps = populated
    code, name, grads = BAD_PUSHES[case]
    before = pull_all(ps)
    err = expect_error(code, ps.push, grads())
    assert name in str(err)
    assert_same_values(before, pull_all(ps))
    # The client still works afterwards.
    ps.push({"b": np.ones(10, np.float32)})
    np.testing.assert_array_equal(ps.pull("b"), before["b"] - 1)


def test_pull_unknown_variable_is_not_found(populated):
    _, ps = populated
    err = expect_error(grpc.StatusCode.NOT_FOUND, ps.pull, ["w", "nope"])
    assert "nope" in str(err)


def test_server_side_non_finite_check_refuses_its_whole_part(populated):
    """A client that skips the finiteness check (allow_non_finite=True) against strict
    servers: the server holding the NaN refuses its whole part, including another
    variable's valid gradient in the same push."""
    cluster, ps = populated
    shard_map = ps.shard_map
    (b_shard,) = shard_map.shards["b"]
    # A shard of 'w' on the server that holds 'b' gets the NaN; the other rows get zeros, so
    # that nothing may change anywhere.
    w_shard = next(s for s in shard_map.shards["w"] if s.server_id == b_shard.server_id)
    g = np.zeros((60, 10), np.float32)
    g[w_shard.row_start, 0] = np.nan
    before = pull_all(ps)
    with PSClient(cluster.coordinator_address, chunk_bytes=64, allow_non_finite=True) as lax:
        err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, lax.push,
                           {"w": g, "b": np.ones(10, np.float32)})
        assert "w" in str(err)
    assert_same_values(before, pull_all(ps))


def test_a_push_to_one_server_is_checked_there_and_refused_whole(make_cluster, data_path):
    """A push whose parts all go to one server leaves its NaN check to that server (once
    the server has said it honours the ask), which refuses all of it; a push over two
    servers is checked by the client before it goes. Through shared memory the client
    checks the slot it writes, and sends nothing."""
    cluster = make_cluster(servers=2, split_threshold_bytes=100)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("x", shape=(6,), optimizer=SGD1)
        ps.declare("y", shape=(3, 4), optimizer=SGD1)
        ps.declare("w", shape=(10, 4), optimizer=SGD1)
        shard_map = ps.shard_map
        assert len({s.server_id for s in shard_map.shards["w"]}) == 2
        alone = [n for n in ("x", "y") if shard_map.shards[n][0].server_id
                 == shard_map.shards["y"][0].server_id]
        grads = {n: np.ones(shard_map.spec(n).shape, np.float32) for n in alone}
        ps.push(grads)  # the server's reply says it refuses what the client asks it to
        before = pull_all(ps)
        grads["y"][1, 2] = np.nan
        err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push, grads)
        assert err.target == ("client" if data_path == "shm"
                              else shard_map.shards["y"][0].server_id)
        assert "'y'" in err.details() and "nothing was applied" in err.details()
        assert_same_values(before, pull_all(ps))
        split = np.ones((10, 4), np.float32)
        split[0, 0] = np.inf
        err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push, {"w": split})
        assert err.target == "client"
        assert_same_values(before, pull_all(ps))


def test_a_server_that_accepts_non_finite_refuses_them_for_a_client_that_does_not(
        make_cluster, data_path):
    cluster = make_cluster(servers=1, allow_non_finite=True)
    g = np.ones((3, 4), np.float32)
    g[2, 3] = np.nan
    with PSClient(cluster.coordinator_address) as strict:
        strict.declare("w", shape=(3, 4), optimizer=SGD1)
        strict.push({"w": np.zeros((3, 4), np.float32)})
        err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, strict.push, {"w": g})
        if data_path == "shm":  # checked in the slot, never sent
            assert err.target == "client" and "nothing was applied" in err.details()
        else:
            assert "PSClient(allow_non_finite=True)" in err.details()
        np.testing.assert_array_equal(strict.pull("w"), np.zeros((3, 4), np.float32))
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as lax:
        lax.push({"w": g})
        value = lax.pull("w")
    assert np.isnan(value[2, 3]) and (value[np.isfinite(g)] == -1).all()


def test_a_server_that_does_not_say_it_honours_the_ask_gets_pushes_checked_by_the_client(
        make_cluster, monkeypatch):
    """A server of a version before PushHeader.refuse_non_finite ignores it: started with
    --allow-non-finite, it would apply a NaN that the client refuses. Its replies do not
    say that it honours the ask, so the client goes on checking pushes to it itself."""
    monkeypatch.setattr(servicer, "_push_reply", lambda outcome: ps_pb.PushReply(
        duplicate=outcome.duplicate, next_step=outcome.next_step))
    monkeypatch.setattr(ShardStore, "refuses_non_finite",
                        lambda self, client_refuses: not self.allow_non_finite)
    cluster = make_cluster(servers=1, allow_non_finite=True)
    g = np.ones((3, 4), np.float32)
    g[0, 0] = np.inf
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(3, 4), optimizer=SGD1)
        for _ in range(2):
            ps.push({"w": np.ones((3, 4), np.float32)})
            err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push, {"w": g})
            assert err.target == "client"
        np.testing.assert_array_equal(ps.pull("w"), -2 * np.ones((3, 4), np.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("grad_dtype,wire,big", [
    ("float32", "float16", 1e5), ("float64", "float32", 1e39), ("float32", "bfloat16", 3.4e38),
], ids=["f32-as-f16", "f64-as-f32", "f32-as-bf16"])
def test_push_overflowing_the_wire_dtype_changes_nothing(make_cluster, grad_dtype, wire, big):
    cluster = make_cluster(servers=2, split_threshold_bytes=100)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(10, 4), optimizer=SGD1)
        assert len(ps.shard_map.shards["w"]) == 2
        before = pull_all(ps)
        grad = np.ones((10, 4), grad_dtype)
        grad[9, 0] = big  # finite here, Inf once narrowed; in the last shard only
        expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.push, {"w": grad}, wire_dtype=wire)
        assert_same_values(before, pull_all(ps))


def test_non_finite_accepted_when_allowed(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=100, allow_non_finite=True)
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as ps:
        ps.declare("w", shape=(10, 4), optimizer=SGD1)
        assert len(ps.shard_map.shards["w"]) == 2
        g = np.ones((10, 4), np.float32)
        g[1, 1], g[8, 2] = np.nan, np.inf
        ps.push({"w": g})
        value = ps.pull("w")
        assert np.isnan(value[1, 1]) and value[8, 2] == -np.inf
        finite = np.isfinite(g)
        np.testing.assert_array_equal(value[finite], -1.0)


def test_redeclare_with_other_spec_is_failed_precondition(populated):
    _, ps = populated
    epoch = ps.shard_map.epoch
    before = pull_all(ps)
    err = expect_error(grpc.StatusCode.FAILED_PRECONDITION, ps.declare, "w", shape=(60, 11),
                       init="glorot_uniform", optimizer=SGD1, seed=1)
    assert "w" in err.details()
    assert "[60, 10]" in err.details() and "[60, 11]" in err.details()
    for other in [dict(shape=(60, 10), optimizer="adam"), dict(shape=(60, 10), seed=2)]:
        spec = {"init": "glorot_uniform", "optimizer": SGD1, "seed": 1, **other}
        expect_error(grpc.StatusCode.FAILED_PRECONDITION, ps.declare, "w", **spec)
    assert ps.refresh().epoch == epoch
    assert_same_values(before, pull_all(ps))


def test_redeclare_identical_is_a_noop(populated):
    _, ps = populated
    ps.push({"w": np.ones((60, 10), np.float32)})
    epoch = ps.shard_map.epoch
    before = pull_all(ps)
    ps.declare("w", shape=(60, 10), init="glorot_uniform", optimizer=SGD1, seed=1)
    assert ps.refresh().epoch == epoch
    assert_same_values(before, pull_all(ps))  # values were not re-initialized


@pytest.mark.parametrize("optimizer", [
    {"name": "sgd", "lr": -1.0},
    {"name": "sgd", "lr": 0.0},
    {"name": "adam", "beta1": 1.0},
    {"name": "adam", "eps": float("nan")},
    {"name": "momentum", "nesterov": 0.5},
    {"name": "sgd", "momentum": 0.9},  # a knob sgd does not have
    {"name": "rmsprop"},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_bad_optimizer_is_invalid_argument(populated, optimizer):
    _, ps = populated
    epoch = ps.shard_map.epoch
    before = pull_all(ps)
    err = expect_error(grpc.StatusCode.INVALID_ARGUMENT, ps.declare, "fresh", shape=(3,),
                       optimizer=optimizer)
    assert "fresh" in str(err)
    assert ps.refresh().epoch == epoch
    assert "fresh" not in ps.shard_map.variables
    assert_same_values(before, pull_all(ps))


# ---- bad input straight to a server (what the client library never sends) --------------------

F32 = tensor_pb2.FLOAT32


@pytest.fixture
def raw(populated):
    """(client, stub_for): stub_for(variable, shard index) -> (ParameterServerStub of the
    server holding that shard, current epoch). Channels are closed after the test."""
    _, ps = populated
    channels: list[grpc.Channel] = []

    def stub_for(name: str, index: int = 0):
        shard_map = ps.shard_map
        channel = grpc.insecure_channel(shard_map.servers[shard_map.shards[name][index].server_id])
        channels.append(channel)
        return ps_grpc.ParameterServerStub(channel), shard_map.epoch

    yield ps, stub_for
    for channel in channels:
        channel.close()


def raw_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def header(epoch: int, parts, *, client_id: str | None = None, sequence: int = 1,
           incarnation: int = 1) -> ps_pb.PushHeader:
    """parts: [(variable, shard index, dtype enum, shape)]."""
    return ps_pb.PushHeader(
        client_id=uuid.uuid4().hex if client_id is None else client_id,
        incarnation=incarnation, sequence=sequence, acked_through=0, epoch=epoch,
        shards=[ps_pb.ShardRef(variable=v, index=i) for v, i, _, _ in parts],
        tensors=[tensor_pb2.TensorMeta(dtype=d, shape=s) for _, _, d, s in parts])


def shard_rows(ps: PSClient, name: str, index: int) -> int:
    s = ps.shard_map.shards[name][index]
    return s.row_stop - s.row_start


def push_raw(stub, chunks):
    return stub.Push(iter(chunks), timeout=10)


def test_raw_push_is_applied_and_deduplicated(raw):
    """Control for the raw-stub tests below: a well-formed raw push is applied once."""
    ps, stub_for = raw
    stub, epoch = stub_for("w", 0)
    rows = shard_rows(ps, "w", 0)
    data = np.full((rows, 10), 2.0, np.float32).tobytes()
    h = header(epoch, [("w", 0, F32, (rows, 10))])
    chunks = [ps_pb.PushChunk(header=h, data=data[:100]), ps_pb.PushChunk(data=data[100:])]
    before = ps.pull("w")
    assert push_raw(stub, chunks).duplicate is False
    assert push_raw(stub, chunks).duplicate is True
    expected = before.copy()
    expected[:rows] -= 2.0
    np.testing.assert_array_equal(ps.pull("w"), expected)


@pytest.mark.parametrize("call", ["Push", "PushUnary"])  # (PushThenPull: as PushUnary)
def test_a_raw_push_saying_it_was_checked_is_still_checked_over_grpc(raw, call):
    """finite_checked stands only for a check of a shared-memory slot: a push over gRPC
    that carries it, streamed or in one message, is checked by the server like any other."""
    ps, stub_for = raw
    stub, epoch = stub_for("w", 0)
    rows = shard_rows(ps, "w", 0)
    grad = np.ones((rows, 10), np.float32)
    grad[-1, -1] = np.nan
    h = header(epoch, [("w", 0, F32, (rows, 10))])
    h.finite_checked = True
    before = ps.pull("w")
    with pytest.raises(grpc.RpcError) as refused:
        if call == "Push":
            push_raw(stub, [ps_pb.PushChunk(header=h, data=grad.tobytes())])
        else:
            stub.PushUnary(ps_pb.PushChunk(header=h, data=grad.tobytes()), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-finite" in refused.value.details()
    assert_same_values({"w": before}, {"w": ps.pull("w")})


def bad_push_chunks(case: str, ps: PSClient, epoch: int) -> list[ps_pb.PushChunk]:
    """A malformed push stream aimed at shard 0 of 'w'."""
    rows = shard_rows(ps, "w", 0)
    good = np.ones((rows, 10), np.float32).tobytes()
    meta = ("w", 0, F32, (rows, 10))
    chunk = ps_pb.PushChunk
    if case == "fewer-bytes":
        return [chunk(header=header(epoch, [meta]), data=good[:-4])]
    if case == "more-bytes":
        return [chunk(header=header(epoch, [meta]), data=good[:64]),
                chunk(data=good[64:] + b"\0" * 4)]
    if case == "shape-mismatch":  # bytes agree with the header, the header not with the shard
        return [chunk(header=header(epoch, [("w", 0, F32, (rows, 9))]), data=good[:rows * 9 * 4])]
    if case == "no-header":
        return [chunk(data=good)]
    if case == "empty-stream":
        return []
    if case == "second-header":
        return [chunk(header=header(epoch, [meta]), data=good[:40]),
                chunk(header=header(epoch, [meta]), data=good[40:])]
    if case == "empty-client-id":
        return [chunk(header=header(epoch, [meta], client_id=""), data=good)]
    if case == "sequence-zero":
        return [chunk(header=header(epoch, [meta], sequence=0), data=good)]
    if case == "unspecified-dtype":
        return [chunk(header=header(epoch, [("w", 0, tensor_pb2.DTYPE_UNSPECIFIED, (rows, 10))]),
                      data=good)]
    if case == "float64-to-float32":
        return [chunk(header=header(epoch, [("w", 0, tensor_pb2.FLOAT64, (rows, 10))]),
                      data=good * 2)]
    if case == "more-shards-than-tensors":
        h = header(epoch, [meta])
        h.shards.append(ps_pb.ShardRef(variable="b", index=0))
        return [chunk(header=h, data=good)]
    if case == "same-shard-twice":
        return [chunk(header=header(epoch, [meta, meta]), data=good * 2)]
    if case == "shard-not-on-this-server":
        other = shard_rows(ps, "w", 1)
        return [chunk(header=header(epoch, [("w", 1, F32, (other, 10))]),
                      data=np.ones((other, 10), np.float32).tobytes())]
    raise AssertionError(case)


BAD_RAW_PUSHES = [
    "fewer-bytes", "more-bytes", "shape-mismatch", "no-header", "empty-stream", "second-header",
    "empty-client-id", "sequence-zero", "unspecified-dtype", "float64-to-float32",
    "more-shards-than-tensors", "same-shard-twice", "shard-not-on-this-server",
]


@pytest.mark.parametrize("case", BAD_RAW_PUSHES)
def test_raw_malformed_push_is_invalid_argument(raw, case):
    ps, stub_for = raw
    stub, epoch = stub_for("w", 0)
    chunks = bad_push_chunks(case, ps, epoch)
    before = pull_all(ps)
    err = raw_error(lambda: push_raw(stub, chunks))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert_same_values(before, pull_all(ps))


def test_raw_push_unknown_variable_is_not_found(raw):
    ps, stub_for = raw
    stub, epoch = stub_for("w", 0)
    before = pull_all(ps)
    h = header(epoch, [("nope", 0, F32, (2,))])
    err = raw_error(lambda: push_raw(stub, [ps_pb.PushChunk(header=h, data=b"\0" * 8)]))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in err.details()
    assert_same_values(before, pull_all(ps))


def b_and_its_servers_part_of_w(raw):
    """(stub, epoch, the index of w's shard on b's server, its rows): a push to b's server
    of b and that shard of w."""
    ps, stub_for = raw
    shard_map = ps.shard_map
    (b_shard,) = shard_map.shards["b"]
    w_shard = next(s for s in shard_map.shards["w"] if s.server_id == b_shard.server_id)
    stub, epoch = stub_for("b", 0)
    return stub, epoch, w_shard.index, w_shard.row_stop - w_shard.row_start


def test_raw_push_with_nan_refuses_every_shard_it_carries(raw):
    """One server, one push carrying a valid gradient for 'b' and a NaN for its shard of
    'w': nothing of it is applied."""
    ps, _ = raw
    stub, epoch, w_index, rows = b_and_its_servers_part_of_w(raw)
    w_grad = np.ones((rows, 10), np.float32)
    w_grad[-1, -1] = np.nan
    h = header(epoch, [("b", 0, F32, (10,)), ("w", w_index, F32, (rows, 10))])
    data = np.ones(10, np.float32).tobytes() + w_grad.tobytes()
    before = pull_all(ps)
    err = raw_error(lambda: push_raw(stub, [ps_pb.PushChunk(header=h, data=data[:96]),
                                            ps_pb.PushChunk(data=data[96:])]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_same_values(before, pull_all(ps))


@pytest.mark.parametrize("wire, infinity", [
    (tensor_pb2.FLOAT16, np.array([np.inf], np.float16).tobytes()),
    (tensor_pb2.BFLOAT16, np.array([0x7F80], "<u2").tobytes()),  # bfloat16 +Inf
], ids=["float16", "bfloat16"])
def test_raw_narrowed_push_with_an_infinity_refuses_every_shard_it_carries(raw, wire,
                                                                           infinity):
    """The server checks a narrowed gradient on its bit patterns, as it came: an infinity
    in the last element of the second tensor is found, and nothing is applied."""
    ps, _ = raw
    stub, epoch, w_index, rows = b_and_its_servers_part_of_w(raw)
    one = np.ones(1, np.float16).tobytes() if wire == tensor_pb2.FLOAT16 else \
        np.array([0x3F80], "<u2").tobytes()  # 1.0
    h = header(epoch, [("b", 0, wire, (10,)), ("w", w_index, wire, (rows, 10))])
    data = one * 10 + one * (rows * 10 - 1) + infinity
    before = pull_all(ps)
    err = raw_error(lambda: push_raw(stub, [ps_pb.PushChunk(header=h, data=data[:48]),
                                            ps_pb.PushChunk(data=data[48:])]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-finite" in err.details()
    assert_same_values(before, pull_all(ps))
    data = one * 10 + one * rows * 10  # control: the same push, finite, is applied
    h = header(epoch, [("b", 0, wire, (10,)), ("w", w_index, wire, (rows, 10))])
    push_raw(stub, [ps_pb.PushChunk(header=h, data=data)])
    np.testing.assert_array_equal(ps.pull("b"), before["b"] - 1.0)


def test_raw_push_older_incarnation_is_fenced(raw):
    ps, stub_for = raw
    stub, epoch = stub_for("b", 0)
    data = np.ones(10, np.float32).tobytes()

    def push(incarnation, sequence):
        h = header(epoch, [("b", 0, F32, (10,))], client_id="fenced",
                   incarnation=incarnation, sequence=sequence)
        return push_raw(stub, [ps_pb.PushChunk(header=h, data=data)])

    before = ps.pull("b")
    assert push(2, 1).duplicate is False
    err = raw_error(lambda: push(1, 2))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    np.testing.assert_array_equal(ps.pull("b"), before - 1)


@pytest.mark.parametrize("refs,wire,code", [
    ([("nope", 0)], 0, grpc.StatusCode.NOT_FOUND),
    ([("w", 0), ("nope", 0)], 0, grpc.StatusCode.NOT_FOUND),
    ([], 0, grpc.StatusCode.INVALID_ARGUMENT),
    ([("w", 0), ("w", 0)], 0, grpc.StatusCode.INVALID_ARGUMENT),
    ([("w", 1)], 0, grpc.StatusCode.INVALID_ARGUMENT),  # shard 1 lives on another server
    ([("w", 0)], tensor_pb2.FLOAT64, grpc.StatusCode.INVALID_ARGUMENT),  # wider than stored
    ([("w", 0)], 99, grpc.StatusCode.INVALID_ARGUMENT),  # no such dtype
], ids=["unknown", "unknown-among-known", "no-shards", "same-shard-twice", "other-server",
        "wider-wire-dtype", "bad-wire-dtype"])
@pytest.mark.parametrize("method", ["Pull", "PullUnary"])
def test_raw_bad_pull(raw, refs, wire, code, method):
    _, stub_for = raw
    stub, epoch = stub_for("w", 0)
    request = ps_pb.PullRequest(
        epoch=epoch, shards=[ps_pb.ShardRef(variable=v, index=i) for v, i in refs],
        wire_dtype=wire)
    call = ((lambda: list(stub.Pull(request, timeout=10))) if method == "Pull" else
            (lambda: stub.PullUnary(request, timeout=10)))
    for _ in range(2):  # a refused request is refused again: nothing of it is remembered
        err = raw_error(call)
        assert err.code() == code, err
    if code == grpc.StatusCode.NOT_FOUND:
        assert "nope" in err.details()
