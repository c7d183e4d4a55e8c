"""The job runner reports each epoch once, as its evaluation is done, with the job's steps up
to the end of that epoch: what ps-coordinator logs as the job's progress."""

from __future__ import annotations

import pytest

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics


def run(runner: JobRunner, worker: str, incarnation: int, kind: str, metrics: Metrics) -> int:
    outcome, task = runner.lease(worker, incarnation)
    assert (outcome, task.kind) == ("task", kind)
    runner.complete(worker, incarnation, task.task_id, metrics)
    return task.task_id


def test_each_evaluated_epoch_is_reported_once_with_the_steps_up_to_its_end():
    reported = []
    runner = JobRunner(JobSpec(epochs=2, tasks_per_epoch=2), FakeClock(), heartbeat_timeout_s=10,
                       on_epoch_done=lambda summary, steps: reported.append((summary, steps)))
    w0 = runner.register_worker("w0")
    for epoch in (1, 2):
        run(runner, "w0", w0, "train", Metrics(2.0, 4, 3, steps=3))
        run(runner, "w0", w0, "train", Metrics(2.0, 4, 2, steps=4))
        assert len(reported) == epoch - 1  # training alone reports nothing
        task_id = run(runner, "w0", w0, "evaluate", Metrics(1.0, 10, 9, auc=0.7))
        # A duplicate report of the evaluation changes nothing and reports nothing.
        assert runner.complete("w0", w0, task_id, Metrics(1.0, 10, 9)) is True
    assert [(s.epoch, steps) for s, steps in reported] == [(1, 7), (2, 14)]
    first = reported[0][0]
    assert (first.train.mean_loss, first.train.accuracy) == (0.5, 5 / 8)
    assert (first.test.accuracy, first.test.auc) == (0.9, 0.7)
    assert runner.state is JobState.DONE


def test_a_failing_callback_changes_nothing_and_a_restored_job_does_not_report_again(caplog):
    def fail(summary, steps):
        raise RuntimeError("the log is gone")

    runner = JobRunner(JobSpec(epochs=2, tasks_per_epoch=1), FakeClock(), heartbeat_timeout_s=10,
                       on_epoch_done=fail)
    w0 = runner.register_worker("w0")
    run(runner, "w0", w0, "train", Metrics(1.0, 2, 1, steps=1))
    run(runner, "w0", w0, "evaluate", Metrics(1.0, 2, 1))
    assert runner.snapshot()["epoch"] == 2 and "on_epoch_done" in caplog.text
    reported = []
    restored = JobRunner(JobSpec(epochs=2, tasks_per_epoch=1), FakeClock(),
                         heartbeat_timeout_s=10,
                         on_epoch_done=lambda summary, steps: reported.append(summary.epoch))
    restored.restore_state(runner.export_state())
    w1 = restored.register_worker("w1")
    run(restored, "w1", w1, "train", Metrics(1.0, 2, 1, steps=1))
    run(restored, "w1", w1, "evaluate", Metrics(1.0, 2, 2))
    assert reported == [2]
    assert restored.summary()["state"] == "done"


@pytest.mark.parametrize("auc", [0.8123, None])
def test_the_summary_line_names_each_figure(auc):
    from ps_common.progress import job_over_line

    line = job_over_line({"state": "done", "epochs": 3, "steps": 300, "job_elapsed_s": 2.0,
                          "loss": 0.25, "train_accuracy": 0.9, "accuracy": 0.875, "auc": auc})
    assert line.startswith("job done: 3 epoch(s), 300 step(s) in 2.0 s, 150.0 steps/s; "
                           "train loss 0.2500, train acc 0.9000, held-out acc 0.8750")
    assert ("held-out AUC 0.8123" in line) == (auc is not None)
    failed = job_over_line({"state": "failed", "epochs": 1, "steps": 0, "job_elapsed_s": 0.5,
                            "loss": None, "accuracy": None, "failure": "worker w0 cannot run "
                            "the job: no module named mymodel"})
    assert failed == ("job failed: 1 epoch(s), 0 step(s) in 0.5 s, 0.0 steps/s; worker w0 "
                      "cannot run the job: no module named mymodel")
