"""JobRunner: an epoch's evaluation runs beside the next epoch once it has read its
parameters (`parameters_read`), and still measures exactly the epoch it follows."""

from __future__ import annotations

import logging

import pytest

from ps_common.clock import FakeClock
from ps_common.errors import FencedIncarnation, InvalidArgument, NotFound
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics

TIMEOUT_S = 10.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)


class Job:
    """A runner with a FakeClock, workers w0 and w1, and the epochs it reported evaluated."""

    def __init__(self, epochs: int = 3, tasks_per_epoch: int = 2):
        self.clock = FakeClock()
        self.evaluated: list[tuple[int, int]] = []  # (epoch, steps)
        self.runner = JobRunner(
            JobSpec(epochs=epochs, tasks_per_epoch=tasks_per_epoch), self.clock,
            heartbeat_timeout_s=TIMEOUT_S,
            on_epoch_done=lambda s, steps: self.evaluated.append((s.epoch, steps)))
        self.tasks_per_epoch = tasks_per_epoch
        self.w = {name: self.runner.register_worker(name) for name in ("w0", "w1")}

    def lease(self, worker: str):
        outcome, task = self.runner.lease(worker, self.w[worker])
        assert outcome == "task", (outcome, task)
        return task

    def idle(self, worker: str) -> bool:
        return self.runner.lease(worker, self.w[worker]) == ("wait", None)

    def complete(self, worker: str, task, metrics: Metrics | None = None) -> None:
        metrics = metrics or (TRAIN if task.kind == "train" else EVAL)
        assert self.runner.complete(worker, self.w[worker], task.task_id, metrics) is False

    def read(self, worker: str, task) -> bool:
        return self.runner.parameters_read(worker, self.w[worker], task.task_id)

    def train_epoch(self, worker: str, epoch: int):
        """`worker` trains every task of `epoch`; its evaluation is pending then."""
        for _ in range(self.tasks_per_epoch):
            task = self.lease(worker)
            assert (task.kind, task.epoch) == ("train", epoch)
            self.complete(worker, task)

    def epoch_two_beside_the_first_evaluation(self):
        """w0 trains epoch 1; w1 leases its evaluation and reads; w0 trains epoch 2 while
        w1 still evaluates. Returns epoch 1's evaluation (epoch 2's is pending)."""
        self.train_epoch("w0", 1)
        first = self.lease("w1")
        assert self.read("w1", first) is True
        self.train_epoch("w0", 2)
        return first

    def summary(self, epoch: int):
        return self.runner.snapshot()["metrics"][epoch - 1]


def test_the_next_epoch_starts_once_the_evaluation_has_read_its_parameters():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 1)
    assert job.idle("w0")  # before the read, epoch 2 waits
    assert job.read("w1", evaluation) is True
    assert job.runner.snapshot()["epoch"] == 2
    epoch2 = job.lease("w0")
    assert (epoch2.kind, epoch2.epoch) == ("train", 2)
    job.complete("w0", epoch2)  # epoch 2 trains on while epoch 1 is evaluated
    assert job.summary(1).test is None and job.evaluated == []
    job.complete("w1", evaluation)
    # The evaluation fills its own epoch, and its steps are those epoch 1 ended with.
    assert job.summary(1).test == EVAL and job.summary(2).test is None
    assert job.summary(2).train.steps == TRAIN.steps
    assert job.evaluated == [(1, 2 * TRAIN.steps)]
    assert job.runner.snapshot()["steps"] == 3 * TRAIN.steps


def test_a_read_from_anyone_but_the_holder_releases_nothing():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    with pytest.raises(FencedIncarnation):
        job.read("w0", evaluation)
    with pytest.raises(FencedIncarnation):
        job.runner.parameters_read("w1", job.w["w1"] - 1, evaluation.task_id)
    with pytest.raises(InvalidArgument, match="training task"):
        job.runner.parameters_read("w1", job.w["w1"], evaluation.task_id - 1)
    with pytest.raises(NotFound):
        job.runner.parameters_read("w1", job.w["w1"], evaluation.task_id + 100)
    assert job.idle("w0") and job.runner.snapshot()["epoch"] == 1
    assert job.read("w1", evaluation) is True
    assert job.read("w1", evaluation) is False  # a repeat changes nothing
    job.complete("w1", evaluation)
    assert job.read("w1", evaluation) is False  # done and dropped: nothing to do


def test_without_a_read_the_next_epoch_waits_for_the_evaluation_to_be_done():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    assert job.idle("w0")
    job.complete("w1", evaluation)
    assert (job.lease("w0").kind, job.runner.snapshot()["epoch"]) == ("train", 2)


def test_an_evaluation_lost_after_the_next_epoch_started_runs_again_first(caplog):
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    assert job.read("w1", evaluation) is True
    job.clock.advance(TIMEOUT_S / 2)
    assert job.runner.heartbeat("w0", job.w["w0"]) == "continue"
    job.clock.advance(TIMEOUT_S / 2 + 1)  # w1 dies holding the evaluation
    with caplog.at_level(logging.WARNING, logger="ps_server.coordinator.jobs"):
        again = job.lease("w0")
    assert again.task_id == evaluation.task_id  # before epoch 2's training tasks
    assert "evaluation of epoch 1 lost its worker" in caplog.text
    assert job.read("w0", again) is False  # epoch 2 is under way already
    job.complete("w0", again)
    assert job.summary(1).test == EVAL and job.evaluated == [(1, 2 * TRAIN.steps)]
    assert (job.lease("w0").kind, job.runner.snapshot()["epoch"]) == ("train", 2)


def test_an_epoch_that_ends_while_an_earlier_evaluation_runs_waits_for_it():
    job = Job(epochs=3)
    first = job.epoch_two_beside_the_first_evaluation()
    second = job.lease("w0")
    assert (second.kind, second.epoch) == ("evaluate", 2)
    # Epoch 3 would leave two evaluations behind the current epoch: it waits.
    assert job.read("w0", second) is False
    assert job.idle("w0") and job.runner.snapshot()["epoch"] == 2
    assert job.runner.tracked_tasks() == 4  # the two evaluations and epoch 2's tasks
    job.complete("w0", second)  # done before the older one: filed under its own epoch
    assert job.summary(2).test == EVAL and job.summary(1).test is None
    assert job.evaluated == []  # reported in epoch order: held back until epoch 1's
    assert job.idle("w0")
    job.complete("w1", first)
    assert job.runner.snapshot()["epoch"] == 3
    assert job.evaluated == [(1, 2 * TRAIN.steps), (2, 4 * TRAIN.steps)]
    assert job.lease("w0").epoch == 3


def kill(job: Job, dying: str) -> None:
    """Every worker but `dying` keeps sending heartbeats while `dying`'s lease runs out."""
    for _ in range(2):
        job.clock.advance(TIMEOUT_S / 2 + 1)
        for worker, incarnation in job.w.items():
            if worker != dying:
                assert job.runner.heartbeat(worker, incarnation) == "continue"


def test_a_read_that_waited_for_an_earlier_evaluation_is_void_once_its_holder_dies():
    job = Job(epochs=3)
    job.w["w2"] = job.runner.register_worker("w2")
    first = job.epoch_two_beside_the_first_evaluation()
    second = job.lease("w2")
    assert job.read("w2", second) is False  # epoch 3 waits for epoch 1's evaluation
    kill(job, "w2")  # before epoch 3 started: the next holder must read again
    job.complete("w1", first)
    assert job.runner.snapshot()["epoch"] == 2
    again = job.lease("w0")
    assert again.task_id == second.task_id and job.idle("w1")
    assert job.read("w0", again) is True
    assert job.runner.snapshot()["epoch"] == 3


def test_after_a_restart_an_evaluation_that_had_read_must_read_again_or_report():
    job = Job(epochs=3)
    first = job.epoch_two_beside_the_first_evaluation()
    second = job.lease("w0")
    assert job.read("w0", second) is False  # waits for epoch 1's evaluation
    new = restored(job, job.runner.export_state())
    new.complete("w1", first)  # reported by its holder from before the restart
    assert new.runner.snapshot()["epoch"] == 2  # epoch 2's evaluation has to read again
    assert new.read("w0", second) is True  # its holder from before: it gets the task back
    assert new.runner.snapshot()["epoch"] == 3
    assert new.lease("w1").kind == "train"  # the evaluation is not handed out again
    new.complete("w0", second)
    assert new.summary(2).test == EVAL
    assert new.evaluated == [(1, 2 * TRAIN.steps), (2, 4 * TRAIN.steps)]


def test_a_holder_from_before_a_restart_does_not_take_back_a_task_leased_since():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    new = restored(job, job.runner.export_state())
    assert new.lease("w0").task_id == evaluation.task_id
    assert new.read("w1", evaluation) is False  # w0 holds it now: its read counts
    assert new.runner.snapshot()["epoch"] == 1
    assert new.read("w0", evaluation) is True


def test_the_job_is_done_only_when_every_evaluation_is_done():
    job = Job(epochs=2)
    first = job.epoch_two_beside_the_first_evaluation()
    last = job.lease("w0")
    assert job.read("w0", last) is False  # no epoch after the last
    job.complete("w0", last)
    assert job.runner.state is JobState.RUNNING  # epoch 1's evaluation still runs
    job.complete("w1", first)
    assert job.runner.state is JobState.DONE
    assert job.runner.summary()["accuracy"] == EVAL.accuracy
    assert job.runner.tracked_tasks() == 0


def restored(job: Job, state: dict) -> Job:
    """A new runner for the same job, restored from `state`, with the same workers."""
    new = Job.__new__(Job)
    new.clock, new.evaluated, new.tasks_per_epoch = job.clock, [], job.tasks_per_epoch
    new.runner = JobRunner(job.runner.job, job.clock, heartbeat_timeout_s=TIMEOUT_S,
                           on_epoch_done=lambda s, steps: new.evaluated.append(
                               (s.epoch, steps)))
    new.runner.restore_state(state)
    new.w = dict(job.w)
    return new


def test_a_restored_coordinator_takes_the_report_of_an_evaluation_behind_the_epoch():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    assert job.read("w1", evaluation) is True
    job.complete("w0", job.lease("w0"))  # one of epoch 2's tasks
    new = restored(job, job.runner.export_state())
    assert new.runner.snapshot()["epoch"] == 2
    new.complete("w1", evaluation)  # its holder from before the restart
    assert new.summary(1).test == EVAL and new.evaluated == [(1, 2 * TRAIN.steps)]
    rest = new.lease("w0")
    assert (rest.kind, rest.epoch) == ("train", 2)
    new.complete("w0", rest)
    assert new.lease("w0").kind == "evaluate"


def test_a_state_saved_before_evaluations_ran_beside_epochs_still_restores():
    job = Job()
    job.train_epoch("w0", 1)
    evaluation = job.lease("w1")
    state = job.runner.export_state()
    del state["epoch_released"]
    for task in state["tasks"]:
        del task["parameters_read"]
    new = restored(job, state)
    assert new.lease("w0").task_id == evaluation.task_id  # a lease is handed out again
    assert new.idle("w1")  # epoch 2 waits for the evaluation to be done
    new.complete("w1", evaluation)  # the first report wins
    assert new.summary(1).test == EVAL and new.evaluated == [(1, 2 * TRAIN.steps)]
    assert new.lease("w0").epoch == 2


def test_an_epoch_evaluated_and_held_back_before_a_restart_is_reported_after_it_in_order():
    job = Job(epochs=4)
    first = job.epoch_two_beside_the_first_evaluation()
    second = job.lease("w0")
    job.complete("w0", second)  # held back behind epoch 1's, then the coordinator restarts
    assert job.evaluated == []
    new = restored(job, job.runner.export_state())
    new.complete("w1", first)
    new.train_epoch("w0", 3)
    new.complete("w0", new.lease("w0"))
    # Epoch 2 was never reported (it waited for epoch 1): it is, once epoch 1 is over.
    assert new.evaluated == [(1, 2 * TRAIN.steps), (2, 4 * TRAIN.steps), (3, 6 * TRAIN.steps)]
