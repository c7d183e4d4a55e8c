"""The CuPy backend on a real GPU; skipped without CuPy or a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from ps_worker.backend import array_module, select_backend  # noqa: E402
from ps_worker.data import load_dataset  # noqa: E402
from ps_worker.models import MLP, initial_values  # noqa: E402


def _device_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


if _device_count() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)


CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked (pinned) host memory


@pytest.fixture
def backend():
    return select_backend("cuda:0")


def test_auto_picks_cupy_on_cuda0() -> None:
    messages: list[str] = []
    backend = select_backend("auto", log=messages.append)
    assert (backend.name, backend.device, backend.xp) == ("cupy", "cuda:0", cupy)
    assert len(messages) == 1


def test_mlp_on_cupy_matches_numpy(backend) -> None:
    digits = load_dataset("digits")
    model = MLP(digits.num_features, digits.num_classes, hidden=(128, 64))
    host_params = initial_values(model.variables(), seed=1)
    batch = (digits.x_train[:256], digits.y_train[:256])
    device_params = {}
    for name, value in host_params.items():
        pinned = backend.host_buffer(f"params/{name}", value.shape, value.dtype)
        pinned[...] = value
        device_params[name] = backend.to_device(pinned)
    device_batch = (backend.to_device(batch[0]), backend.to_device(batch[1]))

    cpu_loss, cpu_grads = model.loss_and_grads(host_params, batch)
    gpu_loss, gpu_grads = model.loss_and_grads(device_params, device_batch)

    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5)
    host_grads = {}
    for name, grad in gpu_grads.items():
        assert array_module(grad) is cupy and grad.dtype == np.float32
        out = backend.host_buffer(f"grads/{name}", grad.shape, grad.dtype)
        host_grads[name] = backend.to_host(grad, out=out)
    backend.synchronize()
    for name, grad in cpu_grads.items():
        np.testing.assert_allclose(host_grads[name], grad, rtol=1e-4, atol=1e-5, err_msg=name)
    cpu_eval = model.evaluate(host_params, batch)
    gpu_eval = model.evaluate(device_params, device_batch)
    assert gpu_eval[1] == cpu_eval[1] and gpu_eval[0] == pytest.approx(cpu_eval[0], rel=1e-5)


def test_pinned_async_copies_round_trip_in_order(backend) -> None:
    host = backend.host_buffer("big", (1 << 20,), np.float32)
    attributes = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data)
    # The field is `type` in recent CuPy, `memoryType` in older releases.
    memory_type = getattr(attributes, "type", getattr(attributes, "memoryType", None))
    assert memory_type == CUDA_MEMORY_TYPE_HOST
    results = []
    for round_index in range(5):
        host[...] = round_index
        on_device = backend.to_device(host)
        # Work queued on the current stream must see the copied data without a synchronize.
        summed = on_device + 1
        out = backend.host_buffer(f"out{round_index}", summed.shape, summed.dtype)
        results.append(backend.to_host(summed, out=out))
        backend.synchronize()  # before the host buffer is rewritten
    for round_index, result in enumerate(results):
        assert (result == round_index + 1).all()


def test_sum_rows_on_the_device_equals_numpys(backend) -> None:
    """A batch's row gradients are summed per distinct id on the GPU (the trainer then
    moves only the distinct rows to the host)."""
    rng = np.random.default_rng(0)
    inverse = rng.integers(0, 50, 4096)
    grads = rng.normal(size=(4096, 8)).astype(np.float32)
    summed = backend.sum_rows(backend.to_device(grads), backend.to_device(inverse), 50)
    assert array_module(summed) is cupy and summed.shape == (50, 8)
    expected = np.zeros((50, 8), np.float64)
    np.add.at(expected, inverse, grads)
    np.testing.assert_allclose(cupy.asnumpy(summed), expected, rtol=1e-4, atol=1e-4)
