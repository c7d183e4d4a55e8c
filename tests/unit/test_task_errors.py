"""A task whose every holder reports that the model breaks on it (ReportJobError, after the
job has made progress) is retried on other workers up to MAX_TASK_ATTEMPTS ("A task that
loses 5 holders fails the job", docs/architecture.md 5.4), and the job then fails. Its
failure must say why: the model's message, which every holder reported (README, The job:
"a model that breaks this, or raises ValueError while training, has its message reported to
the coordinator, which fails the job as it does for a model that does not load"), not only
"lost 5 workers", which reads as five crashed machines."""

from __future__ import annotations

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import MAX_TASK_ATTEMPTS, JobRunner, JobState, Metrics

TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=1, seconds=0.1)
MODEL_ERROR = ("train task of epoch 1: model 'mine:Net': loss_and_grads returned a gradient "
               "of shape (3,) for 'w', whose shape is (4, 3)")


def test_a_task_every_holder_reports_an_error_on_fails_the_job_with_that_error():
    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=2), FakeClock(),
                       heartbeat_timeout_s=10.0)
    good = runner.register_worker("good")
    outcome, first = runner.lease("good", good)
    assert outcome == "task"
    assert runner.complete("good", good, first.task_id, TRAIN) is False  # progress made
    for attempt in range(1, MAX_TASK_ATTEMPTS + 1):
        name = f"w{attempt}"
        incarnation = runner.register_worker(name)
        outcome, task = runner.lease(name, incarnation)
        assert (outcome, task.index, task.attempts) == ("task", 1, attempt)
        runner.report_job_error(name, incarnation, MODEL_ERROR)
    assert runner.state is JobState.FAILED
    assert MODEL_ERROR in runner.failure, runner.failure
