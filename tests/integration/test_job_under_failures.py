"""The job's life as ps-worker, the coordinator and a restarting supervisor see it, with real
in-process daemons on OS-chosen ports (and one ps-coordinator process): what happens to the
job, to the worker's exit status and to the coordinator's when a model's gradients are not
finite, when a peer in a sync step is slow, when one coordinator call goes unanswered, and
when a coordinator is restarted on a job that failed.

Every wait is bounded; every worker, daemon and process started here is ended."""

from __future__ import annotations

import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.jobs import JobState
from ps_server.testing import wait_until
from ps_worker import PSClient
from ps_worker.coordinator_client import CoordinatorClient
from ps_worker.models.example_user_model import SoftmaxRegression
from worker_threads import WAIT_S, Cluster, RunningWorker
MODELS = "job_under_failures_models"


# ---- user models, importable as job_under_failures_models:<name> -----------------------

class AlwaysNonFinite(SoftmaxRegression):
    """A model that diverged: its loss and every gradient are NaN."""

    def loss_and_grads(self, params, batch):
        _, grads = super().loss_and_grads(params, batch)
        return float("nan"), {name: np.full_like(g, np.nan) for name, g in grads.items()}


class Straggler(SoftmaxRegression):
    """On the thread named "slow-worker", the first step blocks until `release` is set
    (a straggler: --step-delay, a slower device); elsewhere an ordinary model."""

    blocked = threading.Event()
    release = threading.Event()

    def loss_and_grads(self, params, batch):
        if threading.current_thread().name == "slow-worker" and not Straggler.release.is_set():
            Straggler.blocked.set()
            Straggler.release.wait(WAIT_S)
        return super().loss_and_grads(params, batch)


@pytest.fixture
def user_models(monkeypatch):
    module = types.ModuleType(MODELS)
    module.AlwaysNonFinite = AlwaysNonFinite
    module.Straggler = Straggler
    monkeypatch.setitem(sys.modules, MODELS, module)
    Straggler.blocked.clear()
    Straggler.release.clear()
    yield
    Straggler.release.set()  # whatever happened, no worker stays blocked


# ---- a model that diverges to NaN ------------------------------------------------------------

def test_a_model_whose_gradients_are_not_finite_fails_the_job_with_why(user_models):
    """README, The job: "A model that diverges (its gradients NaN or Inf, refused with
    nothing applied) fails the job at once, whatever its progress". The worker whose push is
    refused reports it (ReportJobError, diverged), and the job fails naming the refusal,
    instead of the worker exiting without a word (the job RUNNING with its task leased to a
    worker that is gone, the next holder dying the same way)."""
    job = JobSpec(model=f"{MODELS}:AlwaysNonFinite", data="synthetic:256", epochs=1,
                  tasks_per_epoch=2)
    cluster = Cluster(job, heartbeat_timeout_s=30.0)
    worker = None
    try:
        worker = RunningWorker(cluster.coordinator.address, "w0", "nan-worker")
        outcome = worker.join()
        assert outcome, "the worker did not end"
        snap = cluster.coordinator.runner.snapshot()
        assert snap["tasks_done"] == 0  # nobody has shown that the job can run
        states = {w["worker_id"]: (w["state"], w["leased_tasks"]) for w in snap["workers"]}
        assert (snap["state"], states) == (JobState.FAILED, {"w0": ("dead", [])}), (
            f"job {snap['state'].value} (failure {snap['failure']!r}), workers {states}; "
            f"the worker ended with {outcome}")
        assert "non-finite" in snap["failure"], snap["failure"]
    finally:
        if worker is not None:
            worker.end()
        cluster.stop()


# ---- a straggler in a sync step --------------------------------------------------------------

def test_a_worker_waiting_in_a_sync_step_for_a_straggler_does_not_die(user_models):
    """README: a push "waits at most 30 s; past that it fails with DEADLINE_EXCEEDED"; a
    ps-worker "waits on, under the same push (counted once), until the straggler comes or is
    declared dead", rather than exiting 1 (ps-cluster: "worker-1 exited with 1"; restart:
    on-failure restarting it into the same wait). The server's 30 s wait is shortened to 0.5
    s here; the straggler is held by an event until the fast worker's step has timed out
    once, then goes on: both workers finish the job and exit 0."""
    job = JobSpec(model=f"{MODELS}:Straggler", data="synthetic:2048", epochs=1,
                  tasks_per_epoch=2, mode="sync", evaluate_every=0)
    cluster = Cluster(job)
    gate = cluster.server.steps
    gate._wait_s = 0.5  # README's 30 s, shortened
    timed_out = threading.Event()
    raise_timeout = gate._timeout

    def observed_timeout(*args):
        timed_out.set()
        return raise_timeout(*args)

    gate._timeout = observed_timeout
    slow = fast = None
    try:
        slow = RunningWorker(cluster.coordinator.address, "slow", "slow-worker")
        assert Straggler.blocked.wait(WAIT_S), "the straggler never reached its first step"
        fast = RunningWorker(cluster.coordinator.address, "fast", "fast-worker")
        assert timed_out.wait(WAIT_S), "the fast worker's step never waited its longest"
        Straggler.release.set()
        wait_until(lambda: cluster.coordinator.runner.over, "the job over", WAIT_S)
        assert cluster.coordinator.runner.state is JobState.DONE
        assert (fast.join(), slow.join()) == ({"rc": 0}, {"rc": 0})
    finally:
        Straggler.release.set()
        for running in (fast, slow):
            if running is not None:
                running.end()
        cluster.stop()


# ---- a server whose steps are full (--max-streams) -------------------------------------------

def test_a_join_refused_for_want_of_room_is_not_taken_for_a_fence(user_models):
    """README: "a server takes at most --max-streams clients in its steps (FAILED_PRECONDITION
    for the next join_steps, naming the flag)". That refusal is no fence: the worker does not
    register again (which would release its task as a lost holder, lease it again, be
    refused again, and after five rounds fail the job with "lost 5 workers ... replaced by a
    new incarnation", naming neither the refusal nor --max-streams). Here the one place in
    the server's steps (--max-streams 1) is held by a PSClient user in the same mode."""
    job = JobSpec(model="logreg", data="synthetic:256", epochs=1, tasks_per_epoch=1,
                  mode="ssp:1")
    cluster = Cluster(job, max_streams=1)
    worker = None
    try:
        with PSClient(cluster.coordinator.address, client_id="holder") as holder:
            holder.declare("h", shape=(4,))  # on ps-0, the one server
            holder.join_steps("ssp:1")  # the one place in its steps
            joins = lambda: cluster.server_faults.calls.get("JoinSteps", 0)  # noqa: E731
            assert joins() == 1
            worker = RunningWorker(cluster.coordinator.address, "w0", "refused-worker")
            # The worker's join is refused (once at least): then it either ends, or asks again.
            wait_until(lambda: not worker.thread.is_alive() or joins() >= 3,
                       "the worker refused twice, or ended", WAIT_S)
            registrations = cluster.faults.calls.get("RegisterWorker", 0)
            snap = cluster.coordinator.runner.snapshot()
            holder.leave_steps()
        assert registrations == 1, (
            f"the worker registered {registrations} times: a refusal for want of room taken "
            f"for a fence; job {snap['state'].value}: {snap['failure']!r}")
        assert "lost 5 workers" not in snap["failure"], snap["failure"]
    finally:
        if worker is not None:
            worker.end()
        cluster.stop()


# ---- one coordinator call that goes unanswered -----------------------------------------------

def test_one_unanswered_coordinator_call_is_retried_until_the_coordinator_timeout(tmp_path):
    """ps-worker --coordinator-timeout: "give up when the coordinator is unreachable this
    long (default 30)". A call the coordinator does not answer within the per-call deadline
    (a coordinator paused, swapping, a partitioned host) is tried again within that time, not
    given up at once. Here the per-call deadline is 0.5 s and the coordinator-timeout 30 s:
    the first heartbeat is held, the next is answered at once."""
    cluster = Cluster(JobSpec(model="logreg", data="synthetic:64", epochs=1, tasks_per_epoch=1))
    held = threading.Event()
    try:
        with CoordinatorClient(cluster.coordinator.address, give_up_after_s=30.0,
                               rpc_timeout_s=0.5) as client:
            incarnation = client.register_worker("w0").incarnation
            cluster.faults.hold_next("WorkerHeartbeat", held)
            assert client.heartbeat("w0", incarnation) == "continue"
    finally:
        held.set()
        cluster.stop()


# ---- a coordinator restarted on a failed job (docker compose: restart: on-failure) ------------

def test_a_coordinator_restarted_on_a_job_that_failed_does_not_fail_again(tmp_path):
    """deploy/docker-compose.yml runs every service with restart: on-failure, and a failed
    job's coordinator exits 1. The coordinator restarted so (same command, same
    --checkpoint-dir) on a job that failed for good restores it failed and reports it again,
    but exits 0: else compose would restart it for ever, and `docker compose up` would never
    return (the servers and workers, told the job is over, exited 0 long before)."""
    job = JobSpec(model="logreg", data="synthetic:64", epochs=1, tasks_per_epoch=1)
    config = CoordinatorConfig(job=job, checkpoint_dir=tmp_path / "ckpt",
                               checkpoint_every=None, heartbeat_interval_s=0.2,
                               heartbeat_timeout_s=1.0, grace_s=0.5, recovery_grace_s=0.0)
    first = Coordinator(config).start()
    try:
        with CoordinatorClient(first.address, give_up_after_s=5) as client:
            incarnation = client.register_worker("w0").incarnation
            # A job nobody can run: the only worker cannot load it.
            assert client.report_job_error("w0", incarnation, "data set file 'x.npz' does "
                                           "not exist")
        wait_until(lambda: first.wait(0.05), "the first coordinator stopped", WAIT_S)
    finally:
        first.stop(grace_s=0)
    assert first.runner.state is JobState.FAILED
    job_file = tmp_path / "job.json"
    job_file.write_text(job.to_json())
    # The same command again, as restart: on-failure runs it.
    process = subprocess.Popen(
        [sys.executable, "-m", "ps_server.coordinator.cli", "--port", "0", "--job",
         str(job_file), "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "off",
         "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", "--recovery-grace", "0",
         "--grace", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        output, _ = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)
    text = output.decode(errors="replace")
    assert 'ps-coordinator finished: {"state": "failed"' in text, text
    assert process.returncode == 0, (
        f"the restarted coordinator exited {process.returncode} on a job that had already "
        f"failed (and been reported): restart: on-failure starts it again, for ever\n{text}")
