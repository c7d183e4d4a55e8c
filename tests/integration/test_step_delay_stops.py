"""`ps-worker --step-delay` (a deliberately slow worker) pauses after each step, and a stop
asked for meanwhile (SIGTERM, the job over, a fence) ends the pause: the task ends after
the step, not after the whole delay."""

from __future__ import annotations

import threading

from ps_common.job import JobSpec
from ps_worker import PSClient
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models.example_user_model import SoftmaxRegression
from ps_worker.runtime import Trainer

SHARED_MEMORY = False
WAIT_S = 60.0  # bound of the wait; never reached when the code is right


def test_a_stop_during_the_step_delay_ends_the_task_after_that_step(cluster):
    data = load_dataset("digits")
    job = JobSpec(epochs=1, tasks_per_epoch=8)
    trainer = Trainer(job, data, SoftmaxRegression(data.num_features, data.num_classes),
                      NumpyBackend(), step_delay_s=3600.0)
    task = LeasedTask(task_id=1, kind="train", epoch=1, index=0, tasks_per_epoch=8)
    asked = []

    def should_stop() -> bool:  # asked before the first step, then during its delay: stop
        asked.append(True)
        return len(asked) > 1

    results = []
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        training = threading.Thread(target=lambda: results.append(
            trainer.train(ps, task, should_stop)), daemon=True)
        training.start()
        training.join(WAIT_S)
        assert not training.is_alive(), "the task sat out its hour-long step delay"
    assert [r.steps for r in results] == [1]
