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



def test_a_retried_ask_gets_the_task_its_lost_answer_carried_while_it_holds_it():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=4)
    w = runner.register_worker("w0")
    outcome, first = runner.lease("w0", w, lease_id=7)
    assert outcome == "task"
    assert runner.lease("w0", w, lease_id=7) == ("task", first)  # the answer was lost
    assert worker_row(runner, "w0")["leased_tasks"] == [first.task_id]
    second = runner.lease("w0", w, lease_id=8)[1]  # a new ask: a new task
    assert second.task_id != first.task_id
    runner.complete("w0", w, second.task_id, TRAIN)
    assert runner.lease("w0", w, lease_id=8)[1].task_id not in (first.task_id,
                                                                  second.task_id)
    # Without a lease_id (an older worker) every ask is a new one.
    assert lease_task(runner, "w0", w).task_id != first.task_id


def test_a_retried_ask_of_a_replaced_incarnation_gets_nothing_of_its_old_task():
    runner, _ = make_runner(epochs=1, tasks_per_epoch=2)
    old = runner.register_worker("w0")
    task = runner.lease("w0", old, lease_id=1)[1]
    new = runner.register_worker("w0")  # the old incarnation's task goes back in the queue
    assert runner.lease("w0", old, lease_id=1) == ("reregister", None)
    assert runner.lease("w0", new, lease_id=1)[1].task_id == task.task_id  # handed out anew

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


# ---- bounded state -----------------------------------------------------------------------

def make_observed_runner(epochs: int = 2, tasks_per_epoch: int = 2, **kwargs):
    """A runner whose on_worker_gone calls are recorded, each with the number of live
    workers the runner reports from inside the callback (so it also shows the lock is
    free: the lock is not reentrant, and a call made under it would hang)."""
    clock = FakeClock()
    gone: list[tuple[str, int, int]] = []
    runner = JobRunner(JobSpec(epochs=epochs, tasks_per_epoch=tasks_per_epoch), clock,
                       heartbeat_timeout_s=TIMEOUT_S,
                       on_worker_gone=lambda w, i: gone.append((w, i, runner.live_workers())),
                       **kwargs)
    return runner, clock, gone


def test_tracked_tasks_stay_within_one_epoch_however_many_epochs_run():
    epochs, per_epoch = 40, 5
    runner, _ = make_runner(epochs=epochs, tasks_per_epoch=per_epoch)
    workers = [(w, runner.register_worker(w)) for w in ("a", "b", "c")]
    most = 0
    turn = 0
    while runner.state is JobState.RUNNING:
        worker_id, incarnation = workers[turn % len(workers)]
        turn += 1
        outcome, task = runner.lease(worker_id, incarnation)
        assert outcome == "task", outcome  # one task at a time: never a wait
        most = max(most, runner.tracked_tasks())
        runner.complete(worker_id, incarnation, task.task_id, EVAL if task.kind == "evaluate"
                        else TRAIN)
    assert runner.state is JobState.DONE
    assert most <= per_epoch + 1
    snap = runner.snapshot()
    assert snap["tasks_done"] == snap["tasks_total"] == epochs * (per_epoch + 1)
    assert snap["steps"] == epochs * per_epoch * TRAIN.steps
    assert [e.epoch for e in snap["metrics"]] == list(range(1, epochs + 1))
    assert all(e.train.examples == per_epoch * TRAIN.examples and e.test == EVAL
               for e in snap["metrics"])
    assert sum(row["tasks_done"] for row in snap["workers"]) == epochs * (per_epoch + 1)


def test_completing_a_task_of_an_ended_epoch_is_a_duplicate():
    runner, _ = make_runner(epochs=3, tasks_per_epoch=2)
    w0 = runner.register_worker("w0")
    first, second = lease_task(runner, "w0", w0), lease_task(runner, "w0", w0)
    for task in (first, second):
        runner.complete("w0", w0, task.task_id, TRAIN)
    evaluation = lease_task(runner, "w0", w0)
    runner.complete("w0", w0, evaluation.task_id, EVAL)
    run_epoch(runner, "w0", w0, 2)
    assert runner.snapshot()["epoch"] == 3
    before = runner.snapshot()
    other = Metrics(loss_sum=999.0, examples=1, correct=1, steps=50)
    assert runner.complete("w0", w0, first.task_id, other) is True
    assert runner.complete("w0", w0, evaluation.task_id, other) is True
    assert runner.complete("stranger", 1, first.task_id, other) is True  # as for any done task
    after = runner.snapshot()
    assert (after["tasks_done"], after["steps"], after["metrics"]) == (
        before["tasks_done"], before["steps"], before["metrics"])
    assert worker_row(runner, "w0")["tasks_done"] == before["workers"][0]["tasks_done"]
    # An id never issued is still unknown, below and above the issued ones.
    nxt = lease_task(runner, "w0", w0)
    for never in (0, -1, nxt.task_id + 10_000):
        with pytest.raises(NotFound):
            runner.complete("w0", w0, never, TRAIN)


def test_dead_workers_are_forgotten_after_forget_after_s_and_told_to_reregister():
    runner, clock, _ = make_observed_runner(forget_after_s=60.0)
    w0 = runner.register_worker("w0")
    w1 = runner.register_worker("w1")
    lease_task(runner, "w0", w0)
    clock.advance(TIMEOUT_S / 2)
    assert runner.heartbeat("w1", w1) == "continue"
    clock.advance(TIMEOUT_S / 2 + 1)
    assert runner.heartbeat("w1", w1) == "continue"
    assert worker_row(runner, "w0")["state"] == "dead"
    assert runner.tracked_workers() == 2
    for _ in range(10):  # 59 s after its death it is still shown as dead
        clock.advance(5.9)
        assert runner.heartbeat("w1", w1) == "continue"
    assert worker_row(runner, "w0")["state"] == "dead"
    clock.advance(1.5)  # 60.5 s after its death: forgotten
    assert runner.heartbeat("w1", w1) == "continue"
    assert [w["worker_id"] for w in runner.snapshot()["workers"]] == ["w1"]
    assert runner.tracked_workers() == 1
    assert runner.heartbeat("w0", w0) == "reregister"
    assert runner.lease("w0", w0) == ("reregister", None)
    again = runner.register_worker("w0")
    assert again > w0 and worker_row(runner, "w0")["state"] == "alive"


def test_done_workers_are_forgotten_too():
    runner, clock, _ = make_observed_runner(epochs=1, tasks_per_epoch=1, forget_after_s=30.0)
    w0 = runner.register_worker("w0")
    run_epoch(runner, "w0", w0, 1)
    assert runner.lease("w0", w0) == ("done", None)
    clock.advance(29.0)
    assert runner.heartbeat("w0", w0) == "stop"  # a done worker is not reaped as dead
    clock.advance(1.5)
    assert runner.tracked_workers() == 0
    assert runner.heartbeat("w0", w0) == "reregister"


def test_the_default_forget_after_is_six_heartbeat_timeouts_or_a_minute():
    runner, clock = make_runner()  # TIMEOUT_S = 10: max(60, 60) = 60 s
    w0 = runner.register_worker("w0")
    clock.advance(TIMEOUT_S + 1)
    assert worker_row(runner, "w0")["state"] == "dead"
    clock.advance(59.0)  # 70 s after the last heartbeat, 59 s after its death
    assert runner.tracked_workers() == 1
    clock.advance(1.5)
    assert runner.tracked_workers() == 0
    assert runner.heartbeat("w0", w0) == "reregister"
    clock = FakeClock()
    slow = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), clock, heartbeat_timeout_s=20.0)
    slow.register_worker("w0")
    clock.advance(20.5)
    assert slow.live_workers() == 0  # declared dead now, on this read
    clock.advance(119.0)  # forgotten 120 s after that
    assert slow.tracked_workers() == 1
    clock.advance(1.5)
    assert slow.tracked_workers() == 0


def test_forgetting_an_old_incarnation_keeps_the_new_one_of_the_same_id():
    runner, clock, _ = make_observed_runner(forget_after_s=30.0)
    old = runner.register_worker("w0")
    clock.advance(TIMEOUT_S + 1)
    assert runner.heartbeat("w0", old) == "reregister"  # dead
    new = runner.register_worker("w0")
    for _ in range(8):  # well past the old incarnation's forgetting
        clock.advance(TIMEOUT_S / 2)
        assert runner.heartbeat("w0", new) == "continue"
    assert runner.tracked_workers() == 1
    row = worker_row(runner, "w0")
    assert (row["incarnation"], row["state"]) == (new, "alive")


def test_workers_coming_and_going_stay_bounded_in_memory():
    """A worker id per restart (as pods get): only those gone within forget_after_s stay."""
    runner, clock, gone = make_observed_runner(forget_after_s=30.0)
    most = 0
    for n in range(500):
        runner.register_worker(f"pod-{n}")  # then never heard from again
        clock.advance(1.0)
        most = max(most, runner.tracked_workers())
    # Alive for TIMEOUT_S, then remembered as dead for 30 s more: about 41 at any time.
    assert most <= TIMEOUT_S + 30.0 + 2
    assert len(gone) >= 500 - TIMEOUT_S - 2
    assert len({(w, i) for w, i, _ in gone}) == len(gone)


# ---- on_worker_gone, fail, incarnations --------------------------------------------------

def test_on_worker_gone_once_for_a_worker_declared_dead():
    runner, clock, gone = make_observed_runner()
    w0 = runner.register_worker("w0")
    w1 = runner.register_worker("w1")
    clock.advance(TIMEOUT_S / 2)
    runner.heartbeat("w1", w1)
    clock.advance(TIMEOUT_S / 2 + 1)
    assert gone == []  # nothing is reaped until someone calls
    runner.heartbeat("w1", w1)
    assert gone == [("w0", w0, 1)]  # called after the change, with the lock free
    runner.snapshot()
    runner.heartbeat("w0", w0)
    runner.report_job_error("w0", w0, "late")  # already gone: not again
    assert gone == [("w0", w0, 1)]


def test_on_worker_gone_once_for_a_replaced_incarnation():
    runner, _, gone = make_observed_runner()
    old = runner.register_worker("w0")
    new = runner.register_worker("w0")
    assert gone == [("w0", old, 1)]  # the new one is already live when it is called
    runner.heartbeat("w0", old)
    assert gone == [("w0", old, 1)]
    runner.register_worker("w0")
    assert [g[:2] for g in gone] == [("w0", old), ("w0", new)]


def test_on_worker_gone_once_for_a_worker_reporting_a_job_error():
    runner, _, gone = make_observed_runner()
    runner.register_worker("ok")
    bad = runner.register_worker("bad")
    assert runner.report_job_error("bad", bad, "no such file") is False
    assert gone == [("bad", bad, 1)]
    runner.report_job_error("bad", bad, "again")
    assert gone == [("bad", bad, 1)]


def test_on_worker_gone_once_for_a_worker_told_the_job_is_over():
    runner, _, gone = make_observed_runner(epochs=1, tasks_per_epoch=1)
    w0 = runner.register_worker("w0")
    w1 = runner.register_worker("w1")
    run_epoch(runner, "w0", w0, 1)
    assert gone == []  # done, but nobody has been told yet
    assert runner.lease("w0", w0) == ("done", None)
    assert gone == [("w0", w0, 1)]
    assert runner.heartbeat("w1", w1) == "stop"
    assert gone == [("w0", w0, 1), ("w1", w1, 0)]
    assert runner.heartbeat("w0", w0) == "stop"
    assert runner.lease("w1", w1) == ("done", None)
    runner.report_job_error("w0", w0, "after the end")  # done -> dead is no second goodbye
    assert gone == [("w0", w0, 1), ("w1", w1, 0)]


def test_on_worker_gone_is_called_even_when_the_call_that_reaped_raises():
    runner, clock, gone = make_observed_runner()
    w0 = runner.register_worker("w0")
    clock.advance(TIMEOUT_S + 1)
    with pytest.raises(NotFound):
        runner.complete("other", 1, 10_000, TRAIN)
    assert gone == [("w0", w0, 0)]


def test_a_failing_on_worker_gone_does_not_fail_the_call_that_reaped(caplog):
    clock = FakeClock()
    calls = []

    def broken(worker_id, incarnation):
        calls.append(worker_id)
        raise RuntimeError("listener bug")

    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), clock,
                       heartbeat_timeout_s=TIMEOUT_S, on_worker_gone=broken)
    runner.register_worker("a")
    runner.register_worker("b")
    c = runner.register_worker("c")
    clock.advance(TIMEOUT_S / 2)
    runner.heartbeat("c", c)
    clock.advance(TIMEOUT_S / 2 + 1)
    assert runner.heartbeat("c", c) == "continue"
    assert sorted(calls) == ["a", "b"]  # the second is called although the first raised
    assert runner.live_workers() == 1
    assert any(r.levelname == "ERROR" for r in caplog.records)


def test_fail_fails_a_running_job_once():
    runner, clock, gone = make_observed_runner(epochs=1, tasks_per_epoch=1)
    w0 = runner.register_worker("w0")
    task = lease_task(runner, "w0", w0)
    clock.advance(2.0)
    assert runner.fail("parameter server lost its shards") is True
    assert runner.state is JobState.FAILED and runner.over
    assert runner.failure == "parameter server lost its shards"
    assert runner.fail("second opinion") is False
    assert runner.failure == "parameter server lost its shards"
    # The late report of the task it was running is recorded, but the failed job stays
    # failed: no evaluation, no end of the job as DONE.
    assert runner.complete("w0", w0, task.task_id, TRAIN) is False
    assert runner.state is JobState.FAILED
    assert runner.tracked_tasks() == 1
    assert runner.lease("w0", w0) == ("done", None)
    assert gone == [("w0", w0, 0)]
    clock.advance(50.0)
    snap = runner.snapshot()
    assert snap["state"] is JobState.FAILED and snap["elapsed_s"] == pytest.approx(2.0)
    assert runner.summary()["failure"] == "parameter server lost its shards"


def test_fail_is_false_unless_the_job_is_running():
    done, _ = make_runner(epochs=1, tasks_per_epoch=1)
    w = done.register_worker("w0")
    run_epoch(done, "w0", w, 1)
    assert done.fail("too late") is False
    assert (done.state, done.failure) == (JobState.DONE, "")
    idle = JobRunner(None, FakeClock(), heartbeat_timeout_s=TIMEOUT_S)
    assert idle.fail("nothing to fail") is False
    assert idle.state is JobState.NONE


def test_a_forgotten_holder_reporting_after_the_job_failed_changes_nothing_else():
    runner, clock, _ = make_observed_runner(epochs=1, tasks_per_epoch=2, forget_after_s=30.0)
    w0 = runner.register_worker("w0")
    task = lease_task(runner, "w0", w0)
    runner.fail("stopped by the operator")
    assert runner.heartbeat("w0", w0) == "stop"
    clock.advance(31.0)
    assert runner.tracked_workers() == 0
    assert runner.complete("w0", w0, task.task_id, TRAIN) is False
    assert runner.snapshot()["tasks_done"] == 1
    assert runner.state is JobState.FAILED


def test_the_injected_incarnation_source_is_used():
    source = iter([7, 9, 40])
    clock = FakeClock()
    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), clock,
                       heartbeat_timeout_s=TIMEOUT_S, incarnations=lambda: next(source))
    assert [runner.register_worker(w) for w in ("a", "b", "a")] == [7, 9, 40]
    assert runner.heartbeat("a", 40) == "continue"
    assert runner.heartbeat("a", 7) == "reregister"
    with pytest.raises(ValueError):
        JobRunner(None, clock, heartbeat_timeout_s=TIMEOUT_S, first_incarnation=1,
                  incarnations=lambda: 1)
