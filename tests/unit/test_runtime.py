"""The training step's host-side buffers: what may be reused when, with a stand-in for a
GPU backend (the real one runs in tests/gpu where a GPU is lent)."""

from __future__ import annotations

import numpy as np

from ps_common.job import JobSpec
from ps_worker.backend import NumpyBackend
from ps_worker.data import load_dataset
from ps_worker.models import build_model
from ps_worker.runtime import Trainer


class PinnedLikeBackend(NumpyBackend):
    """NumPy arrays, but named like the GPU backend so the trainer copies gradients out."""

    name = "cupy"


def make_trainer(backend, window: int) -> tuple[Trainer, dict]:
    data = load_dataset("digits")
    model = build_model("logreg", num_features=data.num_features, num_classes=data.num_classes)
    trainer = Trainer(JobSpec(model="logreg"), data, model, backend, push_window=window)
    grads = {v.name: np.full(v.shape, 1.0, np.float32) for v in model.variables()}
    return trainer, grads


def test_gpu_gradients_use_a_ring_of_buffers_one_longer_than_the_push_window():
    window = 2
    trainer, grads = make_trainer(PinnedLikeBackend(), window)
    seen = [trainer.grads_to_host(grads, step) for step in range(2 * (window + 1))]
    name = next(iter(grads))
    buffers = [host[name] for host in seen]
    for step, buffer in enumerate(buffers):
        np.testing.assert_array_equal(buffer, grads[name])
        assert buffer is not grads[name]
        # never shared with the `window` pushes that may still be in flight before it
        assert all(buffer is not buffers[step - k] for k in range(1, window + 1) if step >= k)
    assert buffers[window + 1] is buffers[0]  # and then reused


def test_numpy_gradients_go_out_without_a_copy():
    trainer, grads = make_trainer(NumpyBackend(), 2)
    host = trainer.grads_to_host(grads, 0)
    assert all(host[n] is grads[n] for n in grads)
