"""A job resumed after a resumable failure never hangs on a worker that was told the job was
over.

Deterministic: FakeClocks, each coordinator "process" a new JobRunner restored from the
previous one's export_state through JSON, as Coordinator._resume_job does."""

from __future__ import annotations

import json

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics

TIMEOUT_S = 10.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)
JOB = JobSpec(epochs=1, tasks_per_epoch=2)


def test_a_worker_told_the_job_was_over_cannot_hold_a_task_of_the_resumed_job_for_good():
    """A job failed resumably (lost shards that fit nowhere). Worker w0's heartbeat was
    answered "stop" (w0 marked DONE), but the answer was lost as the coordinator went down;
    w0 retries against the resumed coordinator, where the job runs again. w0 was taken as
    live and handed a task; a DONE worker has no heartbeat lease, so when w0 then died its
    task was never released and the job waited for it for ever. w0 is told to register
    anew instead."""
    first = JobRunner(JOB, FakeClock(), heartbeat_timeout_s=TIMEOUT_S, first_incarnation=1)
    w0 = first.register_worker("w0")
    assert first.fail("a lost server's shards fit on no live server", resumable=True)
    assert first.heartbeat("w0", w0) == "stop"  # the answer is lost with the coordinator
    state = json.loads(json.dumps(first.export_state()))

    clock = FakeClock(5000.0)
    second = JobRunner(JOB, clock, heartbeat_timeout_s=TIMEOUT_S, first_incarnation=1000)
    second.restore_state(state)
    assert second.state is JobState.RUNNING  # resumed
    # w0's heartbeat, retried, reaches the resumed coordinator; it leases as it is told.
    if second.heartbeat("w0", w0) == "continue":
        second.lease("w0", w0)
    # w0 now dies without a word. w1 joins and works through the job, heartbeating, while
    # time passes beyond any heartbeat timeout and forgetting delay.
    w1 = second.register_worker("w1")
    for _ in range(60):
        if second.state is not JobState.RUNNING:
            break
        outcome, task = second.lease("w1", w1)
        if outcome == "task":
            if task.kind == "evaluate":
                second.parameters_read("w1", w1, task.task_id)
            second.complete("w1", w1, task.task_id, TRAIN if task.kind == "train" else EVAL)
        clock.advance(TIMEOUT_S / 2)
        assert second.heartbeat("w1", w1) in ("continue", "stop")
    snap = second.snapshot()
    held = {w["worker_id"]: (w["state"], w["leased_tasks"]) for w in snap["workers"]}
    assert second.state is JobState.DONE, (
        f"the resumed job hangs in {second.state.value}: {snap['tasks_done']} of "
        f"{snap['tasks_total']} tasks done, workers {held}; the task leased to w0 (told the "
        "job was over before the restart) was never handed out again")
