"""A coordinator restarted on a failed job's state: a failure that a restart cures (a lost
server's shards fit on no live server within its --memory-budget; the README says "add
servers or raise the budget and restart the job, which resumes from that checkpoint")
resumes the job with the progress made; a failure for good (a task that lost its holders, an
operator's) stays failed."""

from __future__ import annotations

import dataclasses
import json

from ps_common.job import JobSpec
from ps_server.coordinator.app import STATE_FILE, Coordinator, CoordinatorConfig
from ps_server.coordinator.jobs import JobState
from ps_server.testing import wait_until
from ps_worker.coordinator_client import CoordinatorClient

JOB = JobSpec(epochs=3, tasks_per_epoch=2)
# As CoordinatorState._no_room words it when a lost server's shard fits on no survivor.
LOSS = ("parameter server ps-1 is lost: the current checkpoint ckpt-000000000001 (step 6) "
        "holds them, but no live server has room for b[0:153600] (1228800 bytes with "
        "optimizer slots) within its --memory-budget (bytes placed of budget: ps-0 1000 of "
        "1200): they are lost to this run. Add servers or raise --memory-budget and restart "
        "the job, which resumes from that checkpoint")


def config(tmp_path) -> CoordinatorConfig:
    return CoordinatorConfig(job=JOB, checkpoint_dir=tmp_path, checkpoint_every=None,
                             keep_serving=True, heartbeat_interval_s=0.2,
                             heartbeat_timeout_s=5.0, grace_s=0.5, recovery_grace_s=0.0)


def saved_state(tmp_path) -> str | None:
    try:
        return json.loads((tmp_path / STATE_FILE).read_text())["state"]["job"]["state"]
    except (OSError, ValueError, KeyError):
        return None


def test_restarting_a_job_failed_by_a_memory_budget_loss_resumes_it(tmp_path):
    first = Coordinator(config(tmp_path)).start()
    try:
        with CoordinatorClient(first.address, give_up_after_s=5) as client:
            w0 = client.register_worker("w0").incarnation
            for _ in range(3):  # epoch 1 trained, one task of epoch 2 (or its evaluation)
                outcome, task = client.lease("w0", w0)
                assert outcome == "task"
                client.complete("w0", w0, task.task_id, loss_sum=1.0, examples=4,
                                correct=2, steps=3, seconds=0.1)
        # What Coordinator._watch_servers does with the data loss.
        assert first.runner.fail(LOSS, resumable=True)
        wait_until(lambda: saved_state(tmp_path) == "failed", "the failed job saved")
    finally:
        first.stop(grace_s=0)

    # The user raised the budget (or added servers) and restarted the same command.
    second = Coordinator(config(tmp_path))
    try:
        snap = second.runner.snapshot()
        assert snap["tasks_done"] == 3  # the progress made is kept...
        # ...and the job goes on from it, as the README promises.
        assert second.runner.state is JobState.RUNNING, (
            f"the restarted job is {second.runner.state.value}: {second.runner.failure}")
    finally:
        second.stop(grace_s=0)


def test_a_job_failed_for_good_stays_failed_after_a_restart(tmp_path):
    first = Coordinator(config(tmp_path)).start()
    try:
        assert first.runner.fail("task 2 (train, epoch 1) lost 5 workers; giving up")
        wait_until(lambda: saved_state(tmp_path) == "failed", "the failed job saved")
    finally:
        first.stop(grace_s=0)
    second = Coordinator(config(tmp_path))
    try:
        assert second.runner.state is JobState.FAILED
        assert "lost 5 workers" in second.runner.failure
    finally:
        second.stop(grace_s=0)


def test_a_coordinator_whose_outcome_cannot_be_told_still_exits(tmp_path):
    # ps-coordinator prints the outcome; a full disk or a closed pipe makes that raise. The
    # coordinator must stop all the same (ps-cluster waits for it to exit).
    def cannot_tell(summary):
        raise OSError(27, "File too large")

    told = dataclasses.replace(config(tmp_path), keep_serving=False, heartbeat_timeout_s=0.5)
    coordinator = Coordinator(told, on_job_over=cannot_tell).start()
    try:
        assert coordinator.runner.fail("the operator ended it")
        assert coordinator.wait(timeout=30), "the coordinator did not stop"
    finally:
        coordinator.stop(grace_s=0)
