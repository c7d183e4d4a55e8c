"""A task's holder from before a coordinator restart keeps its claim across a second restart.

`JobRunner.restore_state` turns every LEASED task into PENDING and remembers its holder as
a resumed holder, whose late report still counts (it may have finished the task with the
predecessor). That claim is saved with the task: a coordinator restarted again before the
holder reports (a crash loop) takes the report too, instead of fencing a worker that was
never told its lease was revoked; also when the task was handed out again in between.

Deterministic: FakeClocks, each "process" a new JobRunner restored from the previous one's
export_state through JSON, as Coordinator._resume_job does from coordinator-state.json."""

from __future__ import annotations

import json

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import MAX_TASK_ATTEMPTS, JobRunner, JobState, Metrics

TIMEOUT_S = 10.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)
JOB = JobSpec(epochs=2, tasks_per_epoch=4)


def new_process(first_incarnation: int, state: dict | None = None) -> tuple[JobRunner, FakeClock]:
    clock = FakeClock(1000.0 * first_incarnation)
    runner = JobRunner(JOB, clock, heartbeat_timeout_s=TIMEOUT_S,
                       first_incarnation=first_incarnation)
    if state is not None:
        runner.restore_state(json.loads(json.dumps(state)))
    return runner, clock


def test_a_holder_from_before_two_restarts_still_has_its_report_taken():
    first, _ = new_process(100)
    w0 = first.register_worker("w0")
    outcome, task = first.lease("w0", w0)
    assert outcome == "task"
    # LeaseTask saves before answering: the state on disk has the task leased to w0.
    saved_by_first = first.export_state()

    # Restart 1. w0 goes on training its task and heartbeats; the new coordinator's
    # periodic save writes its state.
    second, _ = new_process(10_000, saved_by_first)
    assert second.heartbeat("w0", w0) == "continue"
    saved_by_second = second.export_state()

    # Restart 2, before w0 has finished.
    third, _ = new_process(20_000, saved_by_second)
    assert third.heartbeat("w0", w0) == "continue"  # w0 is alive and known: no fence

    # w0 finishes the task it was handed and never lost: its report counts, as it would
    # have after one restart.
    duplicate = third.complete("w0", w0, task.task_id, TRAIN)
    assert duplicate is False
    assert third.snapshot()["tasks_done"] == 1


def test_a_holder_from_before_two_restarts_keeps_its_claim_when_the_task_was_leased_again():
    first, _ = new_process(100)
    w0 = first.register_worker("w0")
    outcome, task = first.lease("w0", w0)
    assert outcome == "task"
    saved_by_first = first.export_state()  # the task leased to w0

    # Restart 1: the task is pending again (w0 may have finished it) and goes to w1.
    second, _ = new_process(10_000, saved_by_first)
    assert second.heartbeat("w0", w0) == "continue"
    w1 = second.register_worker("w1")
    outcome, again = second.lease("w1", w1)
    assert outcome == "task" and again.task_id == task.task_id
    saved_by_second = second.export_state()

    # Restart 2, before either reports. w0's report would have been taken by `second`
    # (the first report wins); a second restart must not change that.
    third, _ = new_process(20_000, saved_by_second)
    assert third.heartbeat("w0", w0) == "continue"
    duplicate = third.complete("w0", w0, task.task_id, TRAIN)
    assert duplicate is False
    assert third.snapshot()["tasks_done"] == 1


def test_leases_that_coordinator_restarts_interrupted_count_as_no_lost_holder():
    """A task fails the job once it has lost MAX_TASK_ATTEMPTS holders ("lost N workers;
    giving up"). A lease that a coordinator restart turned back into a pending task lost no
    worker: a job whose coordinator restarted that often while one task ran (a crash loop,
    `ps-cluster --chaos`) failed at the first real loss of a worker."""
    runner, clock = new_process(100)
    w0 = runner.register_worker("w0")
    for restart in range(1, MAX_TASK_ATTEMPTS + 1):
        outcome, task = runner.lease("w0", w0)
        assert outcome == "task"
        runner, clock = new_process(10_000 * restart, runner.export_state())
        assert runner.heartbeat("w0", w0) == "continue"
    outcome, task = runner.lease("w0", w0)
    assert outcome == "task"
    clock.advance(TIMEOUT_S + 1)
    runner.live_workers()  # w0 is lost with its task: the first holder this task lost
    assert runner.state is JobState.RUNNING, runner.failure
    w1 = runner.register_worker("w1")
    outcome, again = runner.lease("w1", w1)
    assert (outcome, again.task_id) == ("task", task.task_id)
