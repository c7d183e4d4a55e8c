"""The click-through model on a real GPU gives what it gives on NumPy; skipped without CuPy
or a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

from ps_worker.backend import array_module, select_backend  # noqa: E402
from ps_worker.data import Features, load_dataset  # noqa: E402
from ps_worker.models import EmbeddingMLP, initial_values  # noqa: E402


def _device_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


if _device_count() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)


def test_embedding_mlp_on_cupy_matches_numpy() -> None:
    backend = select_backend("cuda:0")
    data = load_dataset("synthetic_ctr:2000")
    model = EmbeddingMLP(data.num_features, data.field_sizes, hidden=(32, 16))
    batch = (Features(data.x_train[:256], data.c_train[:256]), data.y_train[:256])
    ids = model.row_ids(batch)["embedding"]
    rng = np.random.default_rng(0)
    host_params = initial_values(model.variables(), seed=1)
    host_params["embedding"] = rng.uniform(-0.05, 0.05, (len(ids), model.dim)).astype(np.float32)
    device_params = {name: backend.to_device(value) for name, value in host_params.items()}

    cpu_loss, cpu_grads, cpu_correct = model.loss_grads_and_correct(host_params, batch)
    gpu_loss, gpu_grads, gpu_correct = model.loss_grads_and_correct(device_params, batch)
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5) and gpu_correct == cpu_correct
    for name, grad in gpu_grads.items():
        assert array_module(grad) is cupy and grad.dtype == np.float32
        np.testing.assert_allclose(cupy.asnumpy(grad), cpu_grads[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    cpu_sum, _, cpu_scores = model.evaluate_and_scores(host_params, batch)
    gpu_sum, _, gpu_scores = model.evaluate_and_scores(device_params, batch)
    assert gpu_sum == pytest.approx(cpu_sum, rel=1e-5)
    np.testing.assert_allclose(cupy.asnumpy(gpu_scores), cpu_scores, rtol=1e-5)
