"""A restarted coordinator takes its job up from its state file, and from the newest
checkpoint's progress when the state file cannot be used: corrupt, or another job's."""

from __future__ import annotations

import time

import pytest

from ps_common.checkpoints import Manifest, new_checkpoint_dir, write_manifest
from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.jobs import JobRunner, Metrics
from ps_server.coordinator.persistence import StateFile

THIS_JOB = JobSpec(epochs=3, tasks_per_epoch=2)
OTHER_JOB = JobSpec(epochs=5, tasks_per_epoch=1)
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)


def progress_of(job: JobSpec, tasks: int) -> dict:
    runner = JobRunner(job, FakeClock(1000.0), heartbeat_timeout_s=10.0)
    incarnation = runner.register_worker("w0")
    for _ in range(tasks):
        outcome, task = runner.lease("w0", incarnation)
        assert outcome == "task"
        assert runner.complete("w0", incarnation, task.task_id, TRAIN) is False
    return runner.export_state()


def write_checkpoint_with(root, job_progress: dict) -> None:
    directory = new_checkpoint_dir(root)
    write_manifest(Manifest(id=directory.name, step=int(job_progress["steps"]), epoch=1,
                            created_unix_s=time.time(), variables={}, shards=[], files={},
                            ledgers={}, job=job_progress, directory=directory))


@pytest.fixture
def dirs(tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state"
    ckpt.mkdir()
    state.mkdir()
    write_checkpoint_with(ckpt, progress_of(THIS_JOB, tasks=2))  # this job: 2 tasks done
    return ckpt, state


def resumed_tasks_done(ckpt, state) -> int:
    coordinator = Coordinator(CoordinatorConfig(job=THIS_JOB, checkpoint_dir=ckpt,
                                                state_dir=state, checkpoint_every=None))
    try:
        return coordinator.runner.snapshot()["tasks_done"]
    finally:
        coordinator.stop(grace_s=0)


def test_a_corrupt_state_file_resumes_from_the_checkpoint(dirs):
    ckpt, state = dirs
    (state / "coordinator-state.json").write_text('{"sha256": "00", "state": {}}')
    assert resumed_tasks_done(ckpt, state) == 2


def test_a_state_file_of_another_job_resumes_from_the_checkpoint(dirs):
    ckpt, state = dirs
    StateFile(state / "coordinator-state.json").save({"job": progress_of(OTHER_JOB, tasks=1)})
    assert resumed_tasks_done(ckpt, state) == 2


def test_a_state_file_of_this_job_wins_over_an_older_checkpoint(dirs):
    ckpt, state = dirs
    StateFile(state / "coordinator-state.json").save({"job": progress_of(THIS_JOB, tasks=3)})
    assert resumed_tasks_done(ckpt, state) == 3


def test_workers_gone_before_the_restart_are_retired_again_for_the_servers(dirs):
    """The predecessor logged w1's retirement in memory only: the servers may not have read
    it, and a dead worker left among a server's sync step members holds every step there.
    The restarted coordinator's log (which servers read from the start) has it again."""
    ckpt, state = dirs
    clock = FakeClock(1000.0)
    runner = JobRunner(THIS_JOB, clock, heartbeat_timeout_s=10.0)
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    clock.advance(6.0)
    assert runner.heartbeat("w0", w0) == "continue"
    clock.advance(6.0)
    assert runner.heartbeat("w0", w0) == "continue"  # w1 missed its heartbeats
    StateFile(state / "coordinator-state.json").save({"job": runner.export_state()})
    coordinator = Coordinator(CoordinatorConfig(job=THIS_JOB, checkpoint_dir=ckpt,
                                                state_dir=state, checkpoint_every=None))
    try:
        retired, _ = coordinator.clients._retired.since(0)  # what servers read
        assert [(r.client_id, r.incarnation) for r in retired] == [("w1", w1)]
    finally:
        coordinator.stop(grace_s=0)
