"""JobRunner with `evaluate_every`: an epoch that is not evaluated does not hold up the next
one (its tasks are handed out as soon as the last of the epoch's is), at most one epoch runs
behind the current one, an evaluated epoch is measured once every training step up to it is
done, and epochs are over (and reported) in order, across a restart too."""

from __future__ import annotations

import pytest

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics

TIMEOUT_S = 10.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)


class Job:
    """A runner with a FakeClock and workers w0, w1, w2; `over`: (epoch, evaluated, steps)
    as on_epoch_done reported them."""

    def __init__(self, *, epochs: int = 4, tasks_per_epoch: int = 2, evaluate_every: int = 0):
        self.clock = FakeClock()
        self.over: list[tuple[int, bool, int]] = []
        self.spec = JobSpec(epochs=epochs, tasks_per_epoch=tasks_per_epoch,
                            evaluate_every=evaluate_every)
        self.runner = self._runner()
        self.w = {name: self.runner.register_worker(name) for name in ("w0", "w1", "w2")}

    def _runner(self) -> JobRunner:
        return JobRunner(self.spec, self.clock, heartbeat_timeout_s=TIMEOUT_S,
                         on_epoch_done=lambda s, steps: self.over.append(
                             (s.epoch, s.test is not None, steps)))

    def restored(self) -> Job:
        """A new runner for the same job, restored from this one's state."""
        new = Job.__new__(Job)
        new.clock, new.over, new.spec, new.w = self.clock, [], self.spec, dict(self.w)
        new.runner = new._runner()
        new.runner.restore_state(self.runner.export_state())
        return new

    def lease(self, worker: str):
        outcome, task = self.runner.lease(worker, self.w[worker])
        assert outcome == "task", (outcome, task)
        return task

    def idle(self, worker: str) -> bool:
        return self.runner.lease(worker, self.w[worker]) == ("wait", None)

    def complete(self, worker: str, task) -> None:
        metrics = TRAIN if task.kind == "train" else EVAL
        assert self.runner.complete(worker, self.w[worker], task.task_id, metrics) is False

    def epoch(self) -> int:
        return self.runner.snapshot()["epoch"]


def test_the_next_epoch_is_handed_out_while_the_last_task_of_one_not_evaluated_runs():
    job = Job()
    job.complete("w0", job.lease("w0"))
    tail = job.lease("w0")  # epoch 1's last task: every one of them is handed out
    assert job.epoch() == 2
    following = job.lease("w1")  # not idle until w0 is done
    assert (following.kind, following.epoch) == ("train", 2)
    job.complete("w1", following)
    job.complete("w0", tail)
    assert job.over == [(1, False, 2 * TRAIN.steps)]
    assert job.runner.snapshot()["metrics"][1].train.steps == TRAIN.steps


def test_at_most_one_epoch_runs_behind_the_current_one():
    job = Job()
    job.complete("w0", job.lease("w0"))
    tail = job.lease("w0")  # epoch 1's last, held on
    job.train = [job.lease("w1"), job.lease("w1")]  # all of epoch 2 handed out
    assert job.epoch() == 2 and job.idle("w2")  # epoch 3 waits for epoch 1 to be over
    for task in job.train:
        job.complete("w1", task)
    assert job.over == [] and job.idle("w2")  # epoch 2 is over only after epoch 1
    job.complete("w0", tail)
    assert [epoch for epoch, _, _ in job.over] == [1, 2]
    assert [steps for _, _, steps in job.over] == [2 * TRAIN.steps, 4 * TRAIN.steps]
    assert job.epoch() == 3 and job.lease("w2").epoch == 3


def test_a_task_of_the_epoch_behind_whose_worker_died_is_handed_out_first():
    job = Job()
    job.lease("w0")
    job.lease("w0")  # epoch 1 all handed out to w0, which then dies
    assert job.lease("w1").epoch == 2
    for _ in range(2):
        job.clock.advance(TIMEOUT_S / 2 + 1)
        for worker in ("w1", "w2"):
            assert job.runner.heartbeat(worker, job.w[worker]) == "continue"
    again = job.lease("w2")
    assert (again.kind, again.epoch) == ("train", 1)  # before epoch 2's second task
    assert job.lease("w2").epoch == 1
    assert job.lease("w2").epoch == 2


def test_an_evaluated_epoch_is_measured_once_the_epoch_behind_it_is_trained_too():
    job = Job(epochs=4, evaluate_every=2)
    job.complete("w0", job.lease("w0"))
    tail = job.lease("w0")  # epoch 1 (not evaluated): its last task runs on
    for task in (job.lease("w1"), job.lease("w1")):
        assert task.epoch == 2
        job.complete("w1", task)
    # Epoch 2's evaluation would measure a step of epoch 1 still to come: it waits.
    assert job.idle("w1")
    snap = job.runner.snapshot()
    assert (snap["epoch_tasks"], snap["epoch_tasks_done"]) == (3, 2)
    job.complete("w0", tail)
    assert job.over == [(1, False, 2 * TRAIN.steps)]
    evaluation = job.lease("w1")
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 2)
    assert job.idle("w0")  # an evaluated epoch holds the next until its evaluation reads
    assert job.runner.parameters_read("w1", job.w["w1"], evaluation.task_id) is True
    assert job.lease("w0").epoch == 3
    job.complete("w1", evaluation)
    assert job.over[1] == (2, True, 4 * TRAIN.steps)


def test_every_nth_epoch_and_the_last_are_evaluated_and_the_job_ends_with_the_last():
    job = Job(epochs=5, tasks_per_epoch=1, evaluate_every=2)
    while job.runner.state is JobState.RUNNING:
        task = job.lease("w0")
        job.complete("w0", task)
    assert [(epoch, evaluated) for epoch, evaluated, _ in job.over] == [
        (1, False), (2, True), (3, False), (4, True), (5, True)]
    snap = job.runner.snapshot()
    assert snap["tasks_done"] == snap["tasks_total"] == 5 + 3
    assert job.runner.summary()["accuracy"] == EVAL.accuracy
    assert job.runner.tracked_tasks() == 0


def test_a_job_never_evaluated_ends_with_no_held_out_figure():
    job = Job(epochs=3, evaluate_every=0)
    tasks = [job.lease("w0") for _ in range(4)]  # every task of epochs 1 and 2
    assert job.idle("w1")
    for task in reversed(tasks):  # epoch 2's first: it is over only after epoch 1
        job.complete("w0", task)
    assert [epoch for epoch, _, _ in job.over] == [1, 2]
    for _ in range(2):
        job.complete("w1", job.lease("w1"))
    assert [epoch for epoch, _, _ in job.over] == [1, 2, 3]
    assert job.runner.state is JobState.DONE and job.runner.tracked_tasks() == 0
    summary = job.runner.summary()
    assert summary["accuracy"] is None and summary["train_accuracy"] == TRAIN.accuracy
    assert job.runner.snapshot()["tasks_total"] == 6


def test_two_epochs_under_way_survive_a_restart():
    job = Job()
    job.complete("w0", job.lease("w0"))
    tail = job.lease("w0")
    done_in_two = job.lease("w1")
    job.complete("w1", done_in_two)
    new = job.restored()
    assert new.runner.snapshot()["over_through"] == 0
    assert new.lease("w2").task_id == tail.task_id  # leases are handed out again
    new.complete("w2", tail)
    assert new.over == [(1, False, 2 * TRAIN.steps)]
    assert new.lease("w2").epoch == 2  # epoch 2's second task: its first was done
    snap = new.runner.snapshot()
    assert (snap["epoch"], snap["epoch_tasks_done"]) == (3, 0)


def test_a_state_saved_before_epochs_ran_behind_one_another_still_restores():
    job = Job(epochs=3, evaluate_every=1)
    job.complete("w0", job.lease("w0"))
    held = job.lease("w0")
    state = job.runner.export_state()
    # The form of a state saved by a coordinator that held only a count for the epoch.
    assert state.pop("open_epochs") == [
        {"epoch": 1, "train_done": 1, "evaluation": None, "evaluated": False}]
    state["train_done"] = 1
    new = Job.__new__(Job)
    new.clock, new.over, new.spec, new.w = job.clock, [], job.spec, dict(job.w)
    new.runner = new._runner()
    new.runner.restore_state(state)
    assert new.lease("w1").task_id == held.task_id
    new.complete("w1", held)
    evaluation = new.lease("w1")
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 1)
    new.complete("w1", evaluation)
    assert new.over == [(1, True, 2 * TRAIN.steps)] and new.epoch() == 2


@pytest.mark.parametrize(("every", "evaluated"), [
    (0, []), (1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (3, [3, 5]), (5, [5]), (9, [5])])
def test_which_epochs_a_job_evaluates(every, evaluated):
    spec = JobSpec(epochs=5, evaluate_every=every)
    assert [e for e in range(1, 6) if spec.evaluates(e)] == evaluated
    assert spec.evaluations() == len(evaluated)


def test_a_state_saved_with_an_evaluated_epoch_held_back_reports_it_after_the_restart():
    """In the older form a state held no open epochs: an epoch evaluated while the
    evaluation before it still ran is rebuilt as over but for that one, and reported, with
    its own steps, once it is."""
    job = Job(epochs=3, tasks_per_epoch=1, evaluate_every=1)
    job.complete("w0", job.lease("w0"))
    first = job.lease("w1")
    assert job.runner.parameters_read("w1", job.w["w1"], first.task_id) is True
    job.complete("w0", job.lease("w0"))  # epoch 2's only task
    second = job.lease("w0")
    job.complete("w0", second)  # held back behind epoch 1's evaluation
    state = job.runner.export_state()
    del state["open_epochs"]
    state["train_done"] = 1
    new = Job.__new__(Job)
    new.clock, new.over, new.spec, new.w = job.clock, [], job.spec, dict(job.w)
    new.runner = new._runner()
    new.runner.restore_state(state)
    assert new.runner.snapshot()["over_through"] == 0
    new.complete("w1", first)
    assert new.over == [(1, True, TRAIN.steps), (2, True, 2 * TRAIN.steps)]
    assert new.lease("w0").epoch == 3


def test_a_task_its_holder_from_before_a_restart_reports_counts_as_handed_out():
    job = Job(epochs=3)
    held = job.lease("w0")
    new = job.restored()
    new.complete("w0", held)  # pending again after the restart, reported by its old holder
    assert new.lease("w1").epoch == 1  # epoch 1's last task: every one is handed out now
    assert new.lease("w2").epoch == 2
