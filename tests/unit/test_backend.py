"""The ArrayBackend contract, run against every backend available here, and select_backend."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker.backend import (
    ArrayBackend,
    BackendUnavailable,
    NumpyBackend,
    array_module,
    cuda_device_count,
    select_backend,
)

HAVE_GPU = cuda_device_count() > 0


@pytest.fixture(
    params=["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not HAVE_GPU, reason="no CuPy or GPU"))]
)
def backend(request: pytest.FixtureRequest) -> ArrayBackend:
    return select_backend(request.param)


class TestArrayBackendContract:
    def test_satisfies_the_protocol(self, backend: ArrayBackend) -> None:
        assert isinstance(backend, ArrayBackend)
        assert backend.name in ("numpy", "cupy")
        assert backend.device == "cpu" or backend.device.startswith("cuda:")

    def test_host_to_device_to_host_round_trip(self, backend: ArrayBackend) -> None:
        host = backend.host_buffer("params", (3, 4), np.float32)
        host[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
        on_device = backend.to_device(host)
        assert array_module(on_device) is backend.xp
        doubled = on_device * 2
        out = backend.host_buffer("grads", (3, 4), np.float32)
        result = backend.to_host(doubled, out=out)
        backend.synchronize()
        assert result is out
        np.testing.assert_array_equal(result, np.arange(12, dtype=np.float32).reshape(3, 4) * 2)

    def test_to_host_without_out_returns_a_host_copy(self, backend: ArrayBackend) -> None:
        on_device = backend.to_device(np.array([1.5, -2.0], dtype=np.float64))
        result = backend.to_host(on_device)
        backend.synchronize()
        assert isinstance(result, np.ndarray) and result.dtype == np.float64
        np.testing.assert_array_equal(result, [1.5, -2.0])

    def test_host_buffer_is_reused_per_key_shape_and_dtype(self, backend: ArrayBackend) -> None:
        first = backend.host_buffer("w", (5,), np.float32)
        assert backend.host_buffer("w", (5,), np.float32) is first
        assert backend.host_buffer("other", (5,), np.float32) is not first
        resized = backend.host_buffer("w", (6,), np.float32)
        assert resized.shape == (6,) and resized.dtype == np.float32
        assert backend.host_buffer("w", (6,), np.float64).dtype == np.float64

    def test_synchronize_without_pending_copies_returns(self, backend: ArrayBackend) -> None:
        backend.synchronize()


def test_numpy_backend_to_device_is_zero_copy() -> None:
    backend = NumpyBackend()
    host = np.ones(3)
    assert backend.to_device(host) is host
    assert backend.xp is np and array_module(host) is np


def test_select_cpu_gives_numpy() -> None:
    backend = select_backend("cpu")
    assert (backend.name, backend.device, backend.xp) == ("numpy", "cpu", np)


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", "cuda:3"])
def test_select_cuda_without_gpu_raises_naming_the_device(device: str) -> None:
    with pytest.raises(BackendUnavailable) as raised:
        select_backend(device)
    assert isinstance(raised.value, ValueError)
    assert ("cuda:0" if device == "cuda" else device) in str(raised.value)


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present")
def test_auto_falls_back_to_numpy_and_logs_its_choice() -> None:
    messages: list[str] = []
    backend = select_backend("auto", log=messages.append)
    assert backend.name == "numpy"
    assert len(messages) == 1 and "numpy" in messages[0]


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu0", ""])
def test_select_rejects_unknown_devices_naming_them(device: str) -> None:
    with pytest.raises(ValueError) as raised:
        select_backend(device)
    assert not isinstance(raised.value, BackendUnavailable)
    assert repr(device) in str(raised.value)
