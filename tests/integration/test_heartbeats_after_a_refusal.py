"""A worker's heartbeats survive one failed heartbeat call (in-process coordinator and
server).

Every wait is bounded; every worker and daemon started here is ended."""

from __future__ import annotations

import sys
import threading
import types

import grpc
import pytest

from ps_common.job import JobSpec
from ps_server.testing import wait_until
from ps_worker.models.example_user_model import SoftmaxRegression
from worker_threads import WAIT_S, Cluster, RunningWorker

MODELS = "heartbeat_refusal_models"


class Blocking(SoftmaxRegression):
    """A training step that waits until `release` is set: a worker busy with a long task."""

    training = threading.Event()
    release = threading.Event()

    def loss_and_grads(self, params, batch):
        Blocking.training.set()
        Blocking.release.wait(WAIT_S)
        return super().loss_and_grads(params, batch)


@pytest.fixture
def user_models(monkeypatch):
    module = types.ModuleType(MODELS)
    module.Blocking = Blocking
    monkeypatch.setitem(sys.modules, MODELS, module)
    Blocking.training.clear()
    Blocking.release.clear()
    yield
    Blocking.release.set()  # whatever happened, no worker stays blocked


def test_one_failed_heartbeat_does_not_end_the_workers_heartbeats(user_models):
    """A live worker is not declared dead while it works. One heartbeat answered INTERNAL
    (or UNKNOWN, RESOURCE_EXHAUSTED) ended the heartbeat thread for good while the main
    thread trained on: the coordinator declared the busy worker dead after
    --heartbeat-timeout and handed its task out again, and so for every later incarnation."""
    cluster = Cluster(JobSpec(model=f"{MODELS}:Blocking", data="synthetic:64", epochs=1,
                              tasks_per_epoch=1))
    worker = None
    try:
        # The worker's first heartbeat is answered INTERNAL (a coordinator's bad moment).
        cluster.faults.fail_next("WorkerHeartbeat", 1, grpc.StatusCode.INTERNAL)
        worker = RunningWorker(cluster.coordinator.address, "w0")
        assert Blocking.training.wait(WAIT_S), "the worker never started its task"
        runner = cluster.coordinator.runner

        def state_of_w0() -> str:
            return next(w["state"] for w in runner.snapshot()["workers"]
                        if w["worker_id"] == "w0")

        # Heartbeats go on every 0.2 s; a worker without them is dead after 5 s.
        wait_until(lambda: cluster.faults.calls.get("WorkerHeartbeat", 0) >= 6
                   or state_of_w0() != "alive",
                   "more heartbeats, or w0 declared dead", WAIT_S)
        died = [w["reason"] for w in runner.snapshot()["workers"] if w["state"] == "dead"]
        assert state_of_w0() == "alive" and not died, (
            f"one failed heartbeat ended w0's heartbeats: it was declared dead while busy "
            f"with its task ({died}); heartbeat calls: "
            f"{cluster.faults.calls.get('WorkerHeartbeat', 0)}")
        assert cluster.faults.calls["WorkerHeartbeat"] >= 6
    finally:
        Blocking.release.set()
        if worker is not None:
            worker.end()
        cluster.stop()
