"""The status ps-ctl prints is strict JSON, with the keys the README promises."""

from __future__ import annotations

import json

from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_worker.coordinator_client import CoordinatorClient


def test_status_of_a_job_with_no_progress_is_strict_json():
    config = CoordinatorConfig(job=JobSpec(epochs=2), heartbeat_interval_s=0.2,
                               heartbeat_timeout_s=2.0, grace_s=0.5)
    with Coordinator(config) as coordinator, \
            CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        client.register_worker("w0")
        status = client.status()
    text = json.dumps(status, allow_nan=False)  # NaN is not JSON
    job = json.loads(text)["job"]
    assert (job["state"], job["epoch"], job["tasks_done"], job["tasks_total"]) == (
        "running", 1, 0, 2 * (JobSpec().tasks_per_epoch + 1))
    assert job["metrics"][0]["loss"] is None and job["metrics"][0]["test_accuracy"] is None
    assert [(w["id"], w["state"]) for w in status["workers"]] == [("w0", "alive")]


def test_status_counts_the_tasks_of_a_job_that_evaluates_every_other_epoch():
    job = JobSpec(epochs=3, tasks_per_epoch=2, evaluate_every=2)
    config = CoordinatorConfig(job=job, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0,
                               grace_s=0.5)
    with Coordinator(config) as coordinator, \
            CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        client.register_worker("w0")
        status = client.status()["job"]
    # Epochs 2 and 3 (the last) are evaluated; epoch 1 is two training tasks and no more.
    assert (status["tasks_total"], status["epoch_tasks"], status["epoch_tasks_done"]) == (
        3 * 2 + 2, 2, 0)
    assert status["metrics"][0]["over"] is False
    assert status["spec"]["evaluate_every"] == 2
