"""Pushes in a narrower wire dtype than their variable's: applied exactly, converted a block
at a time by the server, never whole (no temporary the size of the variable's values beside
them, ps_server.wire_gradients; measured with tracemalloc, which sees numpy's arrays and
Python's bytes, around the server's handling of each push), and refused when a value
overflows the variable's dtype."""

from __future__ import annotations

import tracemalloc

import grpc
import numpy as np
import pytest

from ps_common.tensors import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from ps_server.pushes import PushReceiver
from ps_worker import PSClient, RemoteError

SGD1 = {"name": "sgd", "lr": 1.0}
ELEMENTS = 1 << 23  # 32 MiB of float32 values
VALUE_BYTES = 4 * ELEMENTS


@pytest.fixture(params=["shm", "grpc", "grpc-staged"])
def data_path(request):
    return request.param


@pytest.fixture
def server_growth(monkeypatch):
    """The most traced memory each push's handling on the server added, in bytes, in the
    order the pushes came."""
    growth: list[int] = []

    def measured(handle):
        def wrapper(self, *args, **kwargs):
            start, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            try:
                return handle(self, *args, **kwargs)
            finally:
                growth.append(tracemalloc.get_traced_memory()[1] - start)
        return wrapper

    # receive_whole hands over to receive_shared: only the outermost of them is measured.
    monkeypatch.setattr(PushReceiver, "receive", measured(PushReceiver.receive))
    monkeypatch.setattr(PushReceiver, "receive_shared", measured(PushReceiver.receive_shared))
    tracemalloc.start()
    try:
        yield growth
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_narrowed_push_is_applied_exactly_without_a_full_size_temporary(
        make_cluster, data_path, server_growth, wire):
    cluster = make_cluster(servers=1)
    rng = np.random.default_rng(7)
    grad = rng.standard_normal(ELEMENTS).astype(np.float32)
    # Values the wire dtype holds exactly, so that the update's result is exact too.
    if wire == "float16":
        grad = grad.astype(np.float16).astype(np.float32)
    else:
        grad = bfloat16_bits_to_float32(float32_to_bfloat16_bits(grad))
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(ELEMENTS,), init="zeros", optimizer=SGD1)
        ps.push({"w": grad}, wire_dtype=wire)
        server_growth_of_push = max(server_growth)
        np.testing.assert_array_equal(ps.pull("w"), -grad)
    # Over gRPC within --push-memory the push's own bytes wait in the server's memory (half
    # the values' size, in the narrower dtype); the blocks converted and the messages the
    # push came in take a few MiB. A whole conversion adds the values' size (32 MiB) to
    # that; half of it is the bound.
    waiting = VALUE_BYTES // 2 if data_path == "grpc" else 0
    assert server_growth_of_push < waiting + VALUE_BYTES // 2, (
        f"the server's handling of a {wire} push grew traced memory by "
        f"{server_growth_of_push / 2**20:.1f} MiB, for {VALUE_BYTES / 2**20:.0f} MiB of values")


def test_one_push_of_narrowed_and_unconverted_gradients_applies_each_exactly(make_cluster,
                                                                             data_path):
    """Each gradient of a push is converted to its own variable's dtype, or not at all."""
    cluster = make_cluster(servers=1)
    rng = np.random.default_rng(8)
    grads = {
        "f32_as_f16": rng.standard_normal(1 << 20).astype(np.float16).astype(np.float32),
        "f32_as_bf16": bfloat16_bits_to_float32(float32_to_bfloat16_bits(
            rng.standard_normal(1 << 20).astype(np.float32))),
        "f64_as_f32": rng.standard_normal(1 << 20).astype(np.float32).astype(np.float64),
        "f16": rng.standard_normal(1 << 20).astype(np.float16),
    }
    declared = {"f32_as_f16": "float32", "f32_as_bf16": "float32", "f64_as_f32": "float64",
                "f16": "float16"}
    wires = {"f32_as_f16": "float16", "f32_as_bf16": "bfloat16", "f64_as_f32": "float32",
             "f16": "float16"}
    with PSClient(cluster.coordinator_address) as ps:
        for name, dtype in declared.items():
            ps.declare(name, shape=(1 << 20,), dtype=dtype, init="zeros", optimizer=SGD1)
        for name, grad in grads.items():  # one push per wire dtype, several tensors apiece
            if wires[name] == "float16":
                continue
            ps.push({name: grad}, wire_dtype=wires[name])
        ps.push({name: grad for name, grad in grads.items() if wires[name] == "float16"},
                wire_dtype="float16")
        for name, grad in grads.items():
            pulled = ps.pull(name)
            assert pulled.dtype == np.dtype(declared[name])
            np.testing.assert_array_equal(pulled, -grad.astype(declared[name]))


def test_a_narrowed_push_in_the_sync_mode_is_applied_exactly(make_cluster, data_path):
    cluster = make_cluster(servers=1)
    grad = np.random.default_rng(9).standard_normal(1 << 20).astype(np.float16)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(1 << 20,), init="zeros", optimizer=SGD1)
        ps.join_steps("sync")
        ps.push({"w": grad.astype(np.float32)}, wire_dtype="float16")
        ps.push({"w": grad.astype(np.float32)}, wire_dtype="float16")
        np.testing.assert_array_equal(ps.pull("w"), -2 * grad.astype(np.float32))


def overflowing_float16() -> np.ndarray:
    """Finite in float32 and in bfloat16, Inf in float16 (largest finite: 65504)."""
    grad = np.ones(4096, np.float32)
    grad[-1] = 1e5
    return grad


def test_a_bfloat16_push_overflowing_a_float16_variable_is_refused_by_client_and_server(
        make_cluster):
    """Before its first push a client does not know that the server honours its ask to
    refuse non-finite values, and checks the push itself; after it, it leaves that to the
    server. Either refuses the overflow."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("h", shape=(4096,), dtype="float16", init="zeros", optimizer=SGD1)
        with pytest.raises(RemoteError) as refused:
            ps.push({"h": overflowing_float16()}, wire_dtype="bfloat16")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in str(refused.value) and refused.value.target == "client"
        np.testing.assert_array_equal(ps.pull("h"), np.zeros(4096, np.float16))
        ps.push({"h": np.zeros(4096, np.float32)}, wire_dtype="bfloat16")
        with pytest.raises(RemoteError) as refused:
            ps.push({"h": overflowing_float16()}, wire_dtype="bfloat16")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in str(refused.value)
        assert refused.value.target == ps.shard_map.shards["h"][0].server_id
        np.testing.assert_array_equal(ps.pull("h"), np.zeros(4096, np.float16))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_bfloat16_push_overflowing_a_float16_variable_is_refused_by_the_server(
        make_cluster, data_path, mode):
    """bfloat16's finite values reach 3.4e38: the server checks such a push converted to the
    variable's dtype, not as it came (a client that allows non-finite values sends it)."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as ps:
        ps.declare("h", shape=(4096,), dtype="float16", init="zeros", optimizer=SGD1)
        ps.declare("w", shape=(4096,), init="zeros", optimizer=SGD1)
        if mode == "sync":
            ps.join_steps("sync")
        with pytest.raises(RemoteError) as refused:
            ps.push({"w": np.ones(4096, np.float32), "h": overflowing_float16()},
                    wire_dtype="bfloat16")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in str(refused.value)
        np.testing.assert_array_equal(ps.pull("h"), np.zeros(4096, np.float16))
        np.testing.assert_array_equal(ps.pull("w"), np.zeros(4096, np.float32))
        ps.push({"h": np.ones(4096, np.float32)}, wire_dtype="bfloat16")
        np.testing.assert_array_equal(ps.pull("h"), -np.ones(4096, np.float16))
