"""The coordinator's job outcome carries the last evaluation's AUC (None without one), it
survives the state file, and ps-cluster's epoch lines say what chance is."""

from __future__ import annotations

import json

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, Metrics
from ps_worker.cluster import epoch_line

TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=1, seconds=0.1)


def finish_one_epoch(eval_metrics: Metrics) -> JobRunner:
    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), FakeClock(), heartbeat_timeout_s=10)
    incarnation = runner.register_worker("w0")
    for metrics in (TRAIN, eval_metrics):
        _, task = runner.lease("w0", incarnation)
        runner.complete("w0", incarnation, task.task_id, metrics)
    return runner


def test_the_outcome_has_the_last_evaluations_auc_or_none():
    with_auc = finish_one_epoch(Metrics(1.0, 10, 8, 0, 0.1, auc=0.78)).summary()
    without = finish_one_epoch(Metrics(1.0, 10, 8, 0, 0.1)).summary()
    assert (with_auc["state"], with_auc["auc"], with_auc["accuracy"]) == ("done", 0.78, 0.8)
    assert without["auc"] is None and "auc" in without
    json.dumps(with_auc, allow_nan=False)


def test_auc_is_not_summed_and_survives_export_and_restore():
    assert (TRAIN + Metrics(auc=0.7)).auc is None
    runner = finish_one_epoch(Metrics(1.0, 10, 8, 0, 0.1, auc=0.78))
    state = json.loads(json.dumps(runner.export_state()))
    restored = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), FakeClock(),
                         heartbeat_timeout_s=10)
    restored.restore_state(state)
    assert restored.summary()["auc"] == 0.78


def test_epoch_lines_show_auc_beside_accuracy_only_when_there_is_one():
    line = epoch_line(2, 5, loss=0.45, accuracy=0.79, test_accuracy=0.8, test_auc=0.8123,
                      steps=640)
    assert line == ("epoch 2/5  train loss 0.4500  train acc 0.7900  held-out acc 0.8000  "
                    "held-out AUC 0.8123 (chance 0.5)  steps 640")
    assert "auc" not in epoch_line(1, 5, loss=0.4, accuracy=0.9, test_accuracy=0.9,
                                   test_auc=None, steps=10).lower()
