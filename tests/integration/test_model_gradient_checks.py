"""The gradients a model's loss_and_grads returns are its contract with the trainer
(ps_worker/models/base.py: "Mean loss over batch and its gradient for every variable"): the
Trainer checks them on the first step of every task, and a gradient that is missing, not
declared, or of the wrong shape or dtype is a ValueError naming the model and the variable
(not a job that ends 'done' with that variable never trained, nor NOT_FOUND from a server)."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_worker import PSClient
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models.example_user_model import SoftmaxRegression
from ps_worker.runtime import Trainer

SHARED_MEMORY = False


class ForgetsTheBias(SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        loss, grads = super().loss_and_grads(params, batch)
        del grads["bias"]
        return loss, grads


def test_a_gradient_missing_from_loss_and_grads_is_an_error_naming_the_variable(cluster):
    data = load_dataset("digits")
    model = ForgetsTheBias(data.num_features, data.num_classes)
    job = JobSpec(model="user_models:ForgetsTheBias", epochs=1, tasks_per_epoch=8)
    trainer = Trainer(job, data, model, NumpyBackend())
    task = LeasedTask(task_id=1, kind="train", epoch=1, index=0, tasks_per_epoch=8)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        before = ps.pull("bias").copy()
        try:
            result = trainer.train(ps, task, lambda: False)
        except (ValueError, RuntimeError) as error:
            assert "bias" in str(error)
            return
        after = ps.pull("bias")
    pytest.fail(f"a task of {result.steps} steps ended without error, and variable 'bias' "
                f"was never trained (unchanged: {np.array_equal(before, after)})")


class MisnamesTheWeights(SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        loss, grads = super().loss_and_grads(params, batch)
        grads["wieghts"] = grads.pop("weights")
        return loss, grads


class FlattensTheWeights(SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        loss, grads = super().loss_and_grads(params, batch)
        grads["weights"] = grads["weights"].ravel()
        return loss, grads


class DoublesTheBias(SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        loss, grads = super().loss_and_grads(params, batch)
        grads["bias"] = grads["bias"].astype(np.float64)
        return loss, grads


@pytest.mark.parametrize("model, message", [
    (MisnamesTheWeights, "a gradient for 'wieghts', which the model does not declare"),
    (FlattensTheWeights, "gradient of shape (640,) for 'weights', whose shape is (64, 10)"),
    (DoublesTheBias, "a float64 gradient for 'bias'"),
], ids=["misnamed", "shape", "dtype"])
def test_a_gradient_the_model_does_not_declare_as_given_is_an_error_before_any_push(
        cluster, model, message):
    data = load_dataset("digits")
    job = JobSpec(model=f"user_models:{model.__name__}", epochs=1, tasks_per_epoch=8)
    trainer = Trainer(job, data, model(data.num_features, data.num_classes), NumpyBackend())
    task = LeasedTask(task_id=1, kind="train", epoch=1, index=0, tasks_per_epoch=8)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        before = {name: ps.pull(name).copy() for name in ("weights", "bias")}
        with pytest.raises(ValueError) as refused:
            trainer.train(ps, task, lambda: False)
        after = {name: ps.pull(name) for name in ("weights", "bias")}
    assert f"model 'user_models:{model.__name__}'" in str(refused.value)
    assert message in str(refused.value)
    # Checked on the task's first step, before its push: no variable changed.
    assert all(np.array_equal(before[name], after[name]) for name in before)
