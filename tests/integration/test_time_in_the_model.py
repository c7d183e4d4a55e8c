"""Trainer.in_model_s, which `ps-worker --stall-timeout` watches: how long the current step
has been in the model's or the device's code without a break. It grows while the model
computes (or hangs) and is 0 while the trainer waits in paramserve's own calls, which have
deadlines of their own: a sync step waiting for a slower worker is no hung step."""

from __future__ import annotations

import threading

import numpy as np

from ps_common.job import JobSpec
from ps_server.testing import wait_until
from ps_worker import PSClient
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models.example_user_model import SoftmaxRegression
from ps_worker.runtime import Trainer

SHARED_MEMORY = False
WAIT_S = 60.0  # bound of every wait; never reached when the code is right
TASK = LeasedTask(task_id=1, kind="train", epoch=1, index=0, tasks_per_epoch=8)


class Held(SoftmaxRegression):
    """Its first step waits until `release` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def loss_and_grads(self, params, batch):
        self.release.wait(WAIT_S)
        return super().loss_and_grads(params, batch)


def run_in_thread(fn) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(fn()), daemon=True)
    thread.start()
    return thread, results


def test_the_time_in_the_model_grows_while_a_step_computes_and_is_0_after(cluster):
    data = load_dataset("digits")
    model = Held(data.num_features, data.num_classes)
    trainer = Trainer(JobSpec(epochs=1, tasks_per_epoch=8), data, model, NumpyBackend())
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        assert trainer.in_model_s() == 0.0
        training, results = run_in_thread(lambda: trainer.train(ps, TASK, lambda: False))
        first = [0.0]
        wait_until(lambda: first.__setitem__(0, trainer.in_model_s()) or first[0] > 0,
                   "the first step in the model")
        wait_until(lambda: trainer.in_model_s() > first[0], "its time in the model grows")
        model.release.set()
        training.join(WAIT_S)
        assert not training.is_alive() and results[0].steps > 0
        assert trainer.in_model_s() == 0.0


def test_a_sync_step_waiting_for_another_worker_is_not_time_in_the_model(cluster):
    data = load_dataset("digits")
    trainer = Trainer(JobSpec(epochs=1, tasks_per_epoch=8, mode="sync"), data,
                      SoftmaxRegression(data.num_features, data.num_classes), NumpyBackend())
    with PSClient(cluster.coordinator_address) as ps, \
            PSClient(cluster.coordinator_address) as peer:
        ps.declare_many(trainer.specs)
        peer.join_steps("sync")  # a member that does not push: the trainer's step waits
        training, results = run_in_thread(lambda: trainer.train(ps, TASK, lambda: False))
        gates = [server._servicer.steps for server in cluster.servers]
        wait_until(lambda: any((ps.client_id, ps.incarnation) in gate._pending.clients
                               for gate in gates), "the trainer's first push waits for peer")
        assert trainer.in_model_s() == 0.0
        peer.leave_steps()
        training.join(WAIT_S)
        assert not training.is_alive() and results[0].steps > 0
        assert np.isfinite(results[0].loss_sum)
