"""JobRunner: the coordinator's job as pure state, driven by a FakeClock (no sleeping)."""

from __future__ import annotations

import math

import pytest

from ps_common.clock import FakeClock
from ps_common.errors import FencedIncarnation, InvalidArgument, NotFound
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import (
    MAX_TASK_ATTEMPTS,
    JobRunner,
    JobState,
    Metrics,
    TaskState,
)

TIMEOUT_S = 10.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=1, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)


def make_runner(epochs: int = 2, tasks_per_epoch: int = 3) -> tuple[JobRunner, FakeClock]:
    clock = FakeClock()
    job = JobSpec(epochs=epochs, tasks_per_epoch=tasks_per_epoch)
    return JobRunner(job, clock, heartbeat_timeout_s=TIMEOUT_S), clock


def lease_task(runner: JobRunner, worker_id: str, incarnation: int):
    outcome, task = runner.lease(worker_id, incarnation)
    assert outcome == "task", outcome
    return task


def worker_row(runner: JobRunner, worker_id: str) -> dict:
    rows = [w for w in runner.snapshot()["workers"] if w["worker_id"] == worker_id]
    assert len(rows) == 1
    return rows[0]


def run_epoch(runner: JobRunner, worker_id: str, incarnation: int, tasks: int) -> None:
    """Lease and complete one epoch's train tasks, then its evaluation."""
    for _ in range(tasks):
        task = lease_task(runner, worker_id, incarnation)
        assert task.kind == "train"
        assert runner.complete(worker_id, incarnation, task.task_id, TRAIN) is False
    task = lease_task(runner, worker_id, incarnation)
    assert task.kind == "evaluate"
    assert runner.complete(worker_id, incarnation, task.task_id, EVAL) is False


# ---- scheduling --------------------------------------------------------------------------

def test_train_tasks_are_leased_in_order_with_epoch_and_index():
    runner, _ = make_runner(epochs=2, tasks_per_epoch=3)
    w = runner.register_worker("w0")
    tasks = [lease_task(runner, "w0", w) for _ in range(3)]
    assert [(t.kind, t.epoch, t.index) for t in tasks] == [
        ("train", 1, 0), ("train", 1, 1), ("train", 1, 2)]
    assert [t.task_id for t in tasks] == sorted(t.task_id for t in tasks)
    assert all(t.state is TaskState.LEASED and t.holder == ("w0", w) for t in tasks)
    # Everything of epoch 1 is leased and epoch 2 has not started: nothing to hand out.
    assert runner.lease("w0", w) == ("wait", None)
    assert worker_row(runner, "w0")["leased_tasks"] == [t.task_id for t in tasks]


def test_evaluation_appears_when_train_tasks_are_done_and_is_leased_first():
    runner, _ = make_runner(epochs=2, tasks_per_epoch=2)
    w = runner.register_worker("w0")
    first = lease_task(runner, "w0", w)
    second = lease_task(runner, "w0", w)
    runner.complete("w0", w, first.task_id, TRAIN)
    assert runner.lease("w0", w) == ("wait", None)  # no evaluation while a train task runs
    runner.complete("w0", w, second.task_id, TRAIN)
    evaluation = lease_task(runner, "w0", w)
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 1)
    # Epoch 2 waits for the evaluation, which must see exactly epoch 1's parameters.
    assert runner.snapshot()["epoch"] == 1
    assert runner.lease("w0", w) == ("wait", None)
    runner.complete("w0", w, evaluation.task_id, TRAIN)
    nxt = lease_task(runner, "w0", w)
    assert (nxt.kind, nxt.epoch, nxt.index) == ("train", 2, 0)


def test_evaluation_whose_holder_died_is_leased_again():
    runner, clock = make_runner(epochs=3, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    for _ in range(2):
        runner.complete("w0", w0, lease_task(runner, "w0", w0).task_id, TRAIN)
    w1 = runner.register_worker("w1")
    evaluation = lease_task(runner, "w1", w1)
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 1)
    assert runner.lease("w0", w0) == ("wait", None)  # epoch 2 waits for the evaluation
    clock.advance(TIMEOUT_S / 2)
    runner.heartbeat("w0", w0)
    clock.advance(TIMEOUT_S / 2 + 1)  # w1 dies holding the evaluation
    again = lease_task(runner, "w0", w0)
    assert again.task_id == evaluation.task_id and again.kind == "evaluate"


def test_epochs_advance_and_job_is_done_after_last_evaluation():
    runner, _ = make_runner(epochs=2, tasks_per_epoch=2)
    w = runner.register_worker("w0")
    assert runner.state is JobState.RUNNING
    run_epoch(runner, "w0", w, 2)
    snap = runner.snapshot()
    assert (snap["epoch"], snap["tasks_done"], snap["tasks_total"]) == (2, 3, 6)
    assert runner.state is JobState.RUNNING
    for _ in range(2):
        task = lease_task(runner, "w0", w)
        runner.complete("w0", w, task.task_id, TRAIN)
    assert runner.state is JobState.RUNNING  # the last evaluation is still to do
    evaluation = lease_task(runner, "w0", w)
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 2)
    runner.complete("w0", w, evaluation.task_id, EVAL)
    assert runner.state is JobState.DONE and runner.over
    snap = runner.snapshot()
    assert snap["state"] is JobState.DONE
    assert (snap["epoch"], snap["epochs"], snap["tasks_done"], snap["tasks_total"]) == (
        2, 2, 6, 6)
    assert snap["steps"] == 4 * TRAIN.steps
    assert snap["failure"] == ""


def test_elapsed_stops_at_the_end_of_the_job():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=1)
    w = runner.register_worker("w0")
    clock.advance(3.0)
    run_epoch(runner, "w0", w, 1)
    clock.advance(100.0)
    assert runner.snapshot()["elapsed_s"] == pytest.approx(3.0)


def test_epoch_metrics_are_weighted_means_of_task_metrics():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=2)
    w = runner.register_worker("w0")
    a, b = lease_task(runner, "w0", w), lease_task(runner, "w0", w)
    runner.complete("w0", w, a.task_id, Metrics(loss_sum=10.0, examples=10, correct=5, steps=2,
                                                seconds=1.0))
    runner.complete("w0", w, b.task_id, Metrics(loss_sum=3.0, examples=30, correct=30, steps=6,
                                                seconds=2.0))
    (epoch,) = runner.snapshot()["metrics"]
    assert epoch.epoch == 1
    assert epoch.train.mean_loss == pytest.approx(13.0 / 40)  # not (1.0 + 0.1) / 2
    assert epoch.train.accuracy == pytest.approx(35 / 40)
    assert (epoch.train.examples, epoch.train.steps) == (40, 8)
    assert epoch.test is None  # evaluated only once its task is done
    ev = lease_task(runner, "w0", w)
    runner.complete("w0", w, ev.task_id, Metrics(loss_sum=5.0, examples=20, correct=19))
    (epoch,) = runner.snapshot()["metrics"]
    assert epoch.test.mean_loss == pytest.approx(0.25)
    assert epoch.test.accuracy == pytest.approx(0.95)
    assert runner.snapshot()["steps"] == 8  # evaluation steps do not count


def test_empty_metrics_are_nan_not_an_error():
    assert math.isnan(Metrics().mean_loss) and math.isnan(Metrics().accuracy)


def test_duplicate_completion_returns_true_and_changes_nothing():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=2)
    w = runner.register_worker("w0")
    task = lease_task(runner, "w0", w)
    assert runner.complete("w0", w, task.task_id, TRAIN) is False
    before = runner.snapshot()
    other = Metrics(loss_sum=999.0, examples=1, correct=1, steps=50)
    assert runner.complete("w0", w, task.task_id, other) is True
    after = runner.snapshot()
    assert after["tasks_done"] == before["tasks_done"] == 1
    assert after["steps"] == before["steps"]
    assert after["metrics"] == before["metrics"]
    assert worker_row(runner, "w0")["tasks_done"] == 1
    assert worker_row(runner, "w0")["steps"] == TRAIN.steps
    assert task.metrics == TRAIN


def test_completing_an_unknown_task_is_not_found():
    runner, _ = make_runner()
    w = runner.register_worker("w0")
    with pytest.raises(NotFound) as caught:
        runner.complete("w0", w, 999, TRAIN)
    assert caught.value.code == "NOT_FOUND"


def test_register_needs_an_id():
    runner, _ = make_runner()
    with pytest.raises(InvalidArgument):
        runner.register_worker("")


# ---- failure detection -------------------------------------------------------------------

def test_silent_worker_is_dead_and_its_task_goes_to_another_worker():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    w1 = runner.register_worker("w1")
    lost = lease_task(runner, "w0", w0)
    clock.advance(TIMEOUT_S / 2)
    assert runner.heartbeat("w1", w1) == "continue"
    assert worker_row(runner, "w0")["state"] == "alive"  # within its lease still
    clock.advance(TIMEOUT_S / 2 + 0.5)  # w0 is now past its timeout, w1 is not
    assert runner.heartbeat("w1", w1) == "continue"
    row = worker_row(runner, "w0")
    assert row["state"] == "dead"
    assert row["reason"]  # says why
    assert row["died_at_s"] == pytest.approx(TIMEOUT_S + 0.5)
    assert row["leased_tasks"] == []
    assert lost.state is TaskState.PENDING and lost.holder is None
    assert runner.live_workers() == 1
    again = lease_task(runner, "w1", w1)
    assert again.task_id == lost.task_id  # the oldest pending task: the lost one
    assert again.holder == ("w1", w1) and again.attempts == 2
    assert runner.complete("w1", w1, again.task_id, TRAIN) is False
    assert worker_row(runner, "w1")["tasks_done"] == 1


def test_worker_exactly_at_the_timeout_is_still_alive():
    runner, clock = make_runner()
    w = runner.register_worker("w0")
    clock.advance(TIMEOUT_S)
    assert runner.heartbeat("w0", w) == "continue"
    clock.advance(TIMEOUT_S + 0.001)
    assert runner.heartbeat("w0", w) == "reregister"


def test_leasing_counts_as_a_heartbeat():
    runner, clock = make_runner()
    w = runner.register_worker("w0")
    for _ in range(3):
        clock.advance(TIMEOUT_S * 0.9)
        assert runner.lease("w0", w)[0] == "task"
    assert worker_row(runner, "w0")["state"] == "alive"


def test_dead_worker_is_told_to_reregister_and_its_completion_is_fenced():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    task = lease_task(runner, "w0", w0)
    clock.advance(TIMEOUT_S + 1)
    assert runner.heartbeat("w0", w0) == "reregister"
    assert runner.lease("w0", w0) == ("reregister", None)
    with pytest.raises(FencedIncarnation) as caught:
        runner.complete("w0", w0, task.task_id, TRAIN)
    assert caught.value.code == "FAILED_PRECONDITION"
    snap = runner.snapshot()
    assert snap["tasks_done"] == 0 and snap["steps"] == 0
    assert task.state is TaskState.PENDING
    # Registering again gives a higher incarnation, alive, and the task can be run again.
    w0_again = runner.register_worker("w0")
    assert w0_again > w0
    row = worker_row(runner, "w0")
    assert (row["state"], row["incarnation"]) == ("alive", w0_again)
    assert runner.heartbeat("w0", w0_again) == "continue"
    assert runner.heartbeat("w0", w0) == "reregister"  # the old one stays fenced
    again = lease_task(runner, "w0", w0_again)
    assert again.task_id == task.task_id
    assert runner.complete("w0", w0_again, again.task_id, TRAIN) is False


def test_fenced_completion_after_another_worker_reran_it_is_a_duplicate():
    """At-least-once: the late report of a task another worker finished changes nothing."""
    runner, clock = make_runner(epochs=1, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    task = lease_task(runner, "w0", w0)
    clock.advance(TIMEOUT_S + 1)
    w1 = runner.register_worker("w1")
    again = lease_task(runner, "w1", w1)
    assert again.task_id == task.task_id
    runner.complete("w1", w1, again.task_id, TRAIN)
    before = runner.snapshot()
    assert runner.complete("w0", w0, task.task_id, Metrics(loss_sum=9, examples=9)) is True
    after = runner.snapshot()
    assert after["metrics"] == before["metrics"]
    assert worker_row(runner, "w0")["tasks_done"] == 0


def test_fenced_completion_while_another_worker_holds_it_raises():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    task = lease_task(runner, "w0", w0)
    clock.advance(TIMEOUT_S + 1)
    w1 = runner.register_worker("w1")
    assert lease_task(runner, "w1", w1).task_id == task.task_id
    with pytest.raises(FencedIncarnation):
        runner.complete("w0", w0, task.task_id, TRAIN)
    assert task.holder == ("w1", w1)


def test_registering_a_live_id_again_fences_the_old_incarnation():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=2)
    old = runner.register_worker("w0")
    task = lease_task(runner, "w0", old)
    new = runner.register_worker("w0")
    assert new > old
    assert task.state is TaskState.PENDING and task.holder is None
    assert runner.heartbeat("w0", old) == "reregister"
    assert runner.lease("w0", old) == ("reregister", None)
    with pytest.raises(FencedIncarnation):
        runner.complete("w0", old, task.task_id, TRAIN)
    assert runner.heartbeat("w0", new) == "continue"
    assert lease_task(runner, "w0", new).task_id == task.task_id
    assert runner.live_workers() == 1


def test_incarnations_are_unique_across_workers():
    runner, _ = make_runner()
    incarnations = [runner.register_worker(w) for w in ("a", "b", "a", "c", "b")]
    assert len(set(incarnations)) == len(incarnations)
    assert incarnations == sorted(incarnations)


def test_unknown_worker_is_told_to_reregister():
    runner, _ = make_runner()
    assert runner.heartbeat("ghost", 1) == "reregister"
    assert runner.lease("ghost", 1) == ("reregister", None)


def test_late_worker_registered_mid_job_gets_a_task_at_once():
    runner, clock = make_runner(epochs=3, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    run_epoch(runner, "w0", w0, 2)
    clock.advance(1.0)
    late = runner.register_worker("late")
    task = lease_task(runner, "late", late)
    assert (task.kind, task.epoch) == ("train", 2)
    runner.complete("late", late, task.task_id, TRAIN)
    assert worker_row(runner, "late")["tasks_done"] == 1


def test_task_losing_max_attempts_holders_fails_the_job():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=1)
    for attempt in range(1, MAX_TASK_ATTEMPTS + 1):
        w = runner.register_worker(f"w{attempt}")
        task = lease_task(runner, f"w{attempt}", w)
        assert task.attempts == attempt
        assert runner.state is JobState.RUNNING
        clock.advance(TIMEOUT_S + 1)
        runner.live_workers()  # any read reaps
    assert runner.state is JobState.FAILED and runner.over
    snap = runner.snapshot()
    assert snap["state"] is JobState.FAILED
    assert snap["failure"]  # says which task and why
    survivor = runner.register_worker("survivor")
    assert runner.lease("survivor", survivor) == ("done", None)
    assert runner.heartbeat("survivor", survivor) == "stop"
    assert worker_row(runner, "survivor")["state"] == "done"


def test_one_fewer_lost_holder_still_completes():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=1)
    for attempt in range(1, MAX_TASK_ATTEMPTS):
        w = runner.register_worker(f"w{attempt}")
        lease_task(runner, f"w{attempt}", w)
        clock.advance(TIMEOUT_S + 1)
        runner.live_workers()
    assert runner.state is JobState.RUNNING
    w = runner.register_worker("last")
    run_epoch(runner, "last", w, 1)
    assert runner.state is JobState.DONE


# ---- end of job --------------------------------------------------------------------------

def test_after_done_workers_are_told_to_stop_and_become_done():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=1)
    w0 = runner.register_worker("w0")
    w1 = runner.register_worker("w1")
    run_epoch(runner, "w0", w0, 1)
    assert runner.state is JobState.DONE
    assert runner.live_workers() == 2  # not told yet
    assert runner.lease("w0", w0) == ("done", None)
    assert runner.heartbeat("w1", w1) == "stop"
    assert runner.live_workers() == 0
    assert {w["worker_id"]: w["state"] for w in runner.snapshot()["workers"]} == {
        "w0": "done", "w1": "done"}
    assert runner.heartbeat("w0", w0) == "stop"


def test_done_workers_are_not_reaped_as_dead():
    runner, clock = make_runner(epochs=1, tasks_per_epoch=1)
    w0 = runner.register_worker("w0")
    run_epoch(runner, "w0", w0, 1)
    runner.lease("w0", w0)
    clock.advance(TIMEOUT_S * 5)
    assert worker_row(runner, "w0")["state"] == "done"


def test_no_job_means_nothing_to_run():
    clock = FakeClock()
    runner = JobRunner(None, clock, heartbeat_timeout_s=TIMEOUT_S)
    assert runner.state is JobState.NONE and not runner.over
    w = runner.register_worker("w0")
    assert runner.lease("w0", w) == ("done", None)
    assert runner.heartbeat("w0", w) == "stop"
    snap = runner.snapshot()
    assert snap["state"] is JobState.NONE
    assert (snap["epochs"], snap["tasks_done"], snap["tasks_total"], snap["metrics"]) == (
        0, 0, 0, [])


def test_a_job_no_worker_can_load_fails_with_the_workers_message():
    from ps_common.clock import FakeClock
    from ps_common.job import JobSpec
    from ps_server.coordinator.jobs import JobRunner, JobState

    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=2), FakeClock(),
                       heartbeat_timeout_s=5.0)
    incarnation = runner.register_worker("w0")
    assert runner.report_job_error("w0", incarnation, "data set file 'x.npz' does not exist")
    assert runner.state is JobState.FAILED
    assert "x.npz" in runner.failure
    worker = runner.snapshot()["workers"][0]
    assert worker["state"] == "dead" and "x.npz" in worker["reason"]


def test_a_worker_that_cannot_load_a_running_job_leaves_without_failing_it():
    from ps_common.clock import FakeClock
    from ps_common.job import JobSpec
    from ps_server.coordinator.jobs import JobRunner, JobState, Metrics

    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=2), FakeClock(),
                       heartbeat_timeout_s=5.0)
    good = runner.register_worker("good")
    outcome, task = runner.lease("good", good)
    runner.complete("good", good, task.task_id, Metrics(1.0, 10, 5, 1, 0.1))
    bad = runner.register_worker("bad")
    _, leased = runner.lease("bad", bad)
    assert not runner.report_job_error("bad", bad, "no module named 'mine'")
    assert runner.state is JobState.RUNNING
    outcome, again = runner.lease("good", good)
    assert outcome == "task" and again.task_id == leased.task_id  # its task went back


def test_one_broken_worker_among_live_ones_does_not_fail_the_job():
    from ps_common.clock import FakeClock
    from ps_common.job import JobSpec
    from ps_server.coordinator.jobs import JobRunner, JobState

    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=2), FakeClock(),
                       heartbeat_timeout_s=5.0)
    healthy = runner.register_worker("healthy")
    broken = runner.register_worker("broken")
    assert not runner.report_job_error("broken", broken, "no such file")
    assert runner.state is JobState.RUNNING
    assert runner.lease("healthy", healthy)[0] == "task"
