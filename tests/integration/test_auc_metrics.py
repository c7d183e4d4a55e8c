"""Held-out AUC from an evaluation task to the coordinator, ps-ctl status and the job's
outcome; absent for evaluations that report none."""

from __future__ import annotations

import grpc
import pytest

from ps_common.job import JobSpec
from ps_common.status import RemoteError
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_worker.coordinator_client import CoordinatorClient
from ps_worker.ctl import render


def run_task(client: CoordinatorClient, worker: str, incarnation: int, kind: str,
             auc: float | None = None) -> None:
    outcome, task = client.lease(worker, incarnation)
    assert (outcome, task.kind) == ("task", kind)
    client.complete(worker, incarnation, task.task_id, loss_sum=1.0, examples=4, correct=3,
                    steps=1 if kind == "train" else 0, seconds=0.1, auc=auc)


def test_an_evaluations_auc_shows_in_the_status_and_ps_ctl_and_none_means_absent():
    config = CoordinatorConfig(job=JobSpec(epochs=3, tasks_per_epoch=1), heartbeat_interval_s=0.2,
                               heartbeat_timeout_s=5.0, grace_s=0.5)
    with Coordinator(config) as coordinator, \
            CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        incarnation = client.register_worker("w0").incarnation
        run_task(client, "w0", incarnation, "train")
        run_task(client, "w0", incarnation, "evaluate", auc=0.8125)
        run_task(client, "w0", incarnation, "train")
        run_task(client, "w0", incarnation, "evaluate", auc=None)
        run_task(client, "w0", incarnation, "train")
        _, evaluation = client.lease("w0", incarnation)
        with pytest.raises(RemoteError) as refused:
            client.complete("w0", incarnation, evaluation.task_id, loss_sum=1.0, examples=4,
                            correct=3, steps=0, seconds=0.1, auc=1.5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = client.status()
    metrics = status["job"]["metrics"]
    assert [m["test_auc"] for m in metrics] == [0.8125, None, None]
    assert metrics[2]["test_accuracy"] is None  # the refused report changed nothing
    text = render(status)
    assert "held-out AUC" in text and "0.8125" in text and "chance is 0.5" in text


def test_ps_ctl_shows_no_auc_column_when_no_evaluation_had_one():
    config = CoordinatorConfig(job=JobSpec(epochs=1, tasks_per_epoch=1), heartbeat_interval_s=0.2,
                               heartbeat_timeout_s=5.0, grace_s=0.5)
    with Coordinator(config) as coordinator, \
            CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        incarnation = client.register_worker("w0").incarnation
        run_task(client, "w0", incarnation, "train")
        run_task(client, "w0", incarnation, "evaluate")
        status = client.status()
    assert status["job"]["metrics"][0]["test_auc"] is None
    assert "AUC" not in render(status)
