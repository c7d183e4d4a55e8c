"""GetStatus and the status watchers: the coordinator must stay up for a watcher until the
watcher has been SENT a status that says the job is over. The job ending between the status's
snapshot and the watcher's bookkeeping is forced by wrapping JobRunner.snapshot."""

from __future__ import annotations

import threading

from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_worker.coordinator_client import CoordinatorClient

BOUND_S = 30.0


def test_a_watcher_whose_status_said_running_is_waited_for_when_the_job_ends_meanwhile():
    """README (ps-ctl status --watch): "a coordinator stays up after its job, at most 15 s,
    until each watcher that read the status in the last 30 s ... has read the outcome".
    Here the job ends between GetStatus's snapshot (running) and its call to
    StatusWatchers.read, which re-reads runner.over (now True): the watcher is booked as
    having read the outcome although the reply it gets says "running"."""
    config = CoordinatorConfig(job=JobSpec(epochs=1, tasks_per_epoch=1, evaluate_every=0),
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0,
                               grace_s=1.0, recovery_grace_s=0.0)
    coordinator = Coordinator(config).start()
    try:
        with CoordinatorClient(coordinator.address, give_up_after_s=5) as worker, \
                CoordinatorClient(coordinator.address, give_up_after_s=5) as watcher:
            w0 = worker.register_worker("w0").incarnation
            outcome, task = worker.lease("w0", w0)
            assert outcome == "task"

            runner = coordinator.runner
            snapshot = runner.snapshot
            armed = threading.Event()
            fired = threading.Event()

            def snapshot_then_the_job_ends():
                snap = snapshot()
                if armed.is_set() and not fired.is_set():
                    fired.set()
                    # The last task's report lands right after the watcher's snapshot.
                    worker.complete("w0", w0, task.task_id, loss_sum=1.0, examples=4,
                                    correct=2, steps=1, seconds=0.1)
                return snap

            runner.snapshot = snapshot_then_the_job_ends
            armed.set()
            try:
                seen = watcher.status(watching=True)
            finally:
                armed.clear()
                runner.snapshot = snapshot
            assert fired.is_set()
            assert seen["job"]["state"] == "running"  # what the watcher was shown
            assert runner.over  # and the job is over now

            # The watcher has not been shown the outcome: the coordinator must wait for it.
            assert coordinator.watchers.waiting(), (
                "the watcher was booked as having read the outcome, but its reply said "
                "'running': the coordinator may exit before it reads 'done'")
            assert worker.lease("w0", w0) == ("done", None)  # every member told
            assert watcher.status(watching=True)["job"]["state"] == "done"
        assert coordinator.wait(BOUND_S)
    finally:
        coordinator.stop(grace_s=0.5)
