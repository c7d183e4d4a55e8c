"""LeaseTask with wait_ms, over gRPC: a worker with nothing to run waits at the coordinator,
gets its task the moment it is pending, and a stopping worker or coordinator ends the wait.
EvaluationReadParameters: an evaluation's read starts the next epoch for a waiting worker."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ps_common.job import JobSpec
from ps_common.rpc import make_channel
from ps_common.status import RemoteError
from ps_proto.v1 import coordinator_pb2 as pb
from ps_proto.v1 import coordinator_pb2_grpc as pb_grpc
from ps_server.coordinator import servicer as coordinator_servicer
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.testing import FaultInjector, wait_until
from ps_worker.coordinator_client import CoordinatorClient, LeaseRevoked

LONG_S = 60.0  # a wait that must end by an event, long before this
BOUND_S = 30.0


@pytest.fixture
def coordinator():
    config = CoordinatorConfig(job=JobSpec(epochs=2, tasks_per_epoch=1), keep_serving=True,
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, grace_s=5.0,
                               recovery_grace_s=0.0)
    with Coordinator(config) as started:
        yield started


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def start_waiting(pool, coordinator, client: CoordinatorClient, worker: str, incarnation: int):
    future = pool.submit(client.lease, worker, incarnation, wait_s=LONG_S)
    wait_until(lambda: coordinator.runner.waiting_leases == 1 or future.done(),
               "the lease to wait at the coordinator", timeout_s=BOUND_S)
    assert not future.done(), future.result()
    return future


def test_a_waiting_worker_hears_of_a_pending_task_at_once_and_gets_it_next(coordinator, pool):
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        w1 = client.register_worker("w1").incarnation
        outcome, train = client.lease("w0", w0)
        assert outcome == "task"
        waiting = start_waiting(pool, coordinator, client, "w1", w1)
        client.complete("w0", w0, train.task_id, loss_sum=1.0, examples=4, correct=2, steps=1,
                        seconds=0.1)
        # Answered at once, asked to ask again now (a worker does, then gets the task).
        assert waiting.result(timeout=BOUND_S) == ("wait", 0.0)
        outcome, task = client.lease("w1", w1, wait_s=LONG_S)
        assert outcome == "task" and (task.kind, task.epoch) == ("evaluate", 1)


def test_a_wait_that_runs_out_says_ask_again_now(coordinator):
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        w1 = client.register_worker("w1").incarnation
        client.lease("w0", w0)
        assert client.lease("w1", w1, wait_s=0.01) == ("wait", 0.0)
        outcome, pause = client.lease("w1", w1)
        assert outcome == "wait" and pause > 0  # asked not to wait: told to pause


def test_interrupt_waits_cancels_a_waiting_lease_and_frees_the_coordinator(coordinator, pool,
                                                                            monkeypatch):
    # The coordinator's own bound on a wait must not be what ends it here.
    monkeypatch.setattr(coordinator_servicer, "MAX_LEASE_WAIT_MS", int(LONG_S * 1000))
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        w1 = client.register_worker("w1").incarnation
        client.lease("w0", w0)
        waiting = start_waiting(pool, coordinator, client, "w1", w1)
        client.interrupt_waits()
        with pytest.raises(RemoteError) as raised:
            waiting.result(timeout=BOUND_S)
        assert raised.value.code() == grpc.StatusCode.CANCELLED
        # The coordinator's side of the call ends too: its thread is not held for LONG_S
        # (BOUND_S is shorter).
        wait_until(lambda: coordinator.runner.waiting_leases == 0,
                   "the coordinator to drop the abandoned wait", timeout_s=BOUND_S)


def test_a_stopping_coordinator_answers_its_waiting_leases(pool):
    config = CoordinatorConfig(job=JobSpec(epochs=2, tasks_per_epoch=1), keep_serving=True,
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0,
                               grace_s=LONG_S, recovery_grace_s=0.0)
    coordinator = Coordinator(config).start()
    try:
        with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
            w0 = client.register_worker("w0").incarnation
            w1 = client.register_worker("w1").incarnation
            client.lease("w0", w0)
            waiting = start_waiting(pool, coordinator, client, "w1", w1)
            stopped = threading.Thread(target=coordinator.stop)
            stopped.start()
            # Answered, not cut off: the drain would otherwise wait the whole LONG_S grace.
            outcome, pause = waiting.result(timeout=BOUND_S)
            assert outcome == "wait" and pause > 0
            stopped.join(timeout=BOUND_S)
            assert not stopped.is_alive()
    finally:
        coordinator.stop(0)


def test_a_negative_wait_is_refused(coordinator):
    with make_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.LeaseTask(pb.LeaseTaskRequest(worker_id="w0", incarnation=1, wait_ms=-1),
                           timeout=BOUND_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wait_ms" in raised.value.details()


# ---- an evaluation that has read its parameters lets the next epoch start ---------------

def complete(client, worker, incarnation, task, examples=4, correct=2, steps=1):
    return client.complete(worker, incarnation, task.task_id, loss_sum=1.0, examples=examples,
                           correct=correct, steps=steps, seconds=0.1)


def test_a_read_starts_the_next_epoch_for_a_waiting_worker(coordinator, pool):
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        w1 = client.register_worker("w1").incarnation
        outcome, train = client.lease("w0", w0)
        assert outcome == "task"
        complete(client, "w0", w0, train)
        outcome, evaluation = client.lease("w1", w1)
        assert outcome == "task" and (evaluation.kind, evaluation.epoch) == ("evaluate", 1)
        waiting = start_waiting(pool, coordinator, client, "w0", w0)
        assert client.evaluation_read_parameters("w1", w1, evaluation.task_id) is True
        assert waiting.result(timeout=BOUND_S) == ("wait", 0.0)
        outcome, epoch2 = client.lease("w0", w0)
        assert outcome == "task" and (epoch2.kind, epoch2.epoch) == ("train", 2)
        complete(client, "w1", w1, evaluation, examples=10, correct=7, steps=0)
        metrics = client.status()["job"]["metrics"]
        assert [m["test_accuracy"] for m in metrics] == [pytest.approx(0.7), None]


def test_a_read_from_a_worker_that_does_not_hold_the_evaluation_is_refused(coordinator):
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        w1 = client.register_worker("w1").incarnation
        outcome, train = client.lease("w0", w0)
        with pytest.raises(RemoteError) as refused:
            client.evaluation_read_parameters("w0", w0, train.task_id)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "training task" in refused.value.details()
        complete(client, "w0", w0, train)
        outcome, evaluation = client.lease("w1", w1)
        with pytest.raises(LeaseRevoked, match="does not hold task"):
            client.evaluation_read_parameters("w0", w0, evaluation.task_id)
        with pytest.raises(LeaseRevoked, match="does not exist"):
            client.evaluation_read_parameters("w1", w1, evaluation.task_id + 100)
        assert client.lease("w0", w0)[0] == "wait"  # epoch 2 did not start
        assert client.status()["job"]["epoch"] == 1


def test_a_lease_whose_answer_was_lost_gets_the_same_task_on_its_retry():
    """The coordinator handed the task out and its answer never arrived: the retry (same
    lease_id) gets that task again, not a second one that would stay leased for good."""
    faults = FaultInjector()
    config = CoordinatorConfig(job=JobSpec(epochs=1, tasks_per_epoch=2), keep_serving=True,
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, grace_s=5.0,
                               recovery_grace_s=0.0)
    with Coordinator(config, interceptors=[faults]) as coordinator, \
            CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        faults.drop_response_next("LeaseTask")
        outcome, task = client.lease("w0", w0)
        assert outcome == "task" and faults.calls["LeaseTask"] == 2  # one retry
        [row] = [w for w in coordinator.runner.snapshot()["workers"] if w["worker_id"] == "w0"]
        assert row["leased_tasks"] == [task.task_id]


def one_task_coordinator() -> Coordinator:
    """A started coordinator whose job is one task."""
    config = CoordinatorConfig(job=JobSpec(epochs=1, tasks_per_epoch=1, evaluate_every=0),
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0,
                               grace_s=1.0, recovery_grace_s=0.0)
    return Coordinator(config).start()


def test_a_coordinator_whose_job_is_over_waits_for_its_status_watcher_to_read_it():
    """ps-ctl status --watch: the coordinator exits soon after its job, once its members are
    told, but not before a caller watching the status has read the outcome."""
    coordinator = one_task_coordinator()
    try:
        with CoordinatorClient(coordinator.address, give_up_after_s=5) as worker, \
                CoordinatorClient(coordinator.address, give_up_after_s=5) as watcher:
            assert watcher.status(watching=True)["job"]["state"] == "running"
            w0 = worker.register_worker("w0").incarnation
            outcome, task = worker.lease("w0", w0)
            assert outcome == "task"
            worker.complete("w0", w0, task.task_id, loss_sum=1.0, examples=4, correct=2,
                            steps=1, seconds=0.1)
            assert worker.lease("w0", w0) == ("done", None)  # every member told
            assert watcher.status(watching=True)["job"]["state"] == "done"
        assert coordinator.wait(BOUND_S)  # then it exits
    finally:
        coordinator.stop(grace_s=0.5)


def test_a_watcher_whose_status_said_running_is_waited_for_when_the_job_ends_meanwhile():
    """The job ends between GetStatus's snapshot (running) and the watcher's booking: the
    watcher was sent "running", so the coordinator waits for it still (forced by wrapping
    JobRunner.snapshot)."""
    coordinator = one_task_coordinator()
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
