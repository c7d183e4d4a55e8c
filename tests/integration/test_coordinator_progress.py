"""A coordinator with a job shows the job's progress by itself (what a coordinator started by
hand prints): an epoch line, as ps-cluster's, as each evaluation arrives, and a line when the
job ends. `ps-ctl status --watch` follows the same coordinator until the job is over."""

from __future__ import annotations

import logging
import time

import pytest

from ps_common.job import JobSpec
from ps_common.progress import epoch_line
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_worker import ctl
from ps_worker.coordinator_client import CoordinatorClient

LOGGER = "ps_server.coordinator.app"
WAIT_S = 10.0  # the coordinator notices the end of a job within 0.1 s; bounded all the same


def run_task(client: CoordinatorClient, worker: str, incarnation: int, kind: str, *,
             examples: int, correct: int, steps: int) -> None:
    outcome, task = client.lease(worker, incarnation)
    assert (outcome, task.kind) == ("task", kind)
    client.complete(worker, incarnation, task.task_id, loss_sum=examples / 2, examples=examples,
                    correct=correct, steps=steps, seconds=0.1)


def logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def wait_for_line(caplog, prefix: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = [line for line in logged(caplog) if line.startswith(prefix)]
        if found:
            return found[-1]
        time.sleep(0.02)
    pytest.fail(f"no line starting {prefix!r} within {WAIT_S:g} s: {logged(caplog)}")


@pytest.fixture
def coordinator():
    config = CoordinatorConfig(job=JobSpec(epochs=2, tasks_per_epoch=2), keep_serving=True,
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, grace_s=0.5,
                               recovery_grace_s=0.0)
    with Coordinator(config) as started:
        yield started


def test_the_coordinator_logs_each_epoch_and_the_end_of_the_job(coordinator, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        for epoch in (1, 2):
            run_task(client, "w0", w0, "train", examples=8, correct=6, steps=3)
            run_task(client, "w0", w0, "train", examples=8, correct=4, steps=4)
            run_task(client, "w0", w0, "evaluate", examples=10, correct=9, steps=0)
            # Logged before the worker's report is answered.
            assert logged(caplog)[-1] == epoch_line(
                epoch, 2, loss=0.5, accuracy=0.625, test_accuracy=0.9, test_auc=None,
                steps=7 * epoch)
    last = wait_for_line(caplog, "job done: ")
    assert last.startswith("job done: 2 epoch(s), 14 step(s) in ")
    assert "train acc 0.6250, held-out acc 0.9000" in last


def test_a_failed_job_ends_with_an_error_line_naming_the_failure(coordinator, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert coordinator.runner.fail("parameter server ps-0 lost its shards")
    line = wait_for_line(caplog, "job failed: ")
    assert line.endswith("; parameter server ps-0 lost its shards")
    assert [r.levelno for r in caplog.records if r.getMessage() == line] == [logging.ERROR]


def test_ps_ctl_status_watch_follows_the_job_until_it_ends(coordinator, capsys):
    argv = ["--coordinator", coordinator.address, "--timeout", "5", "status"]
    assert ctl.main([*argv, "--watch", "0.01", "--count", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("workers (0)") == 2 and shown.count("-" * 80) == 1  # piped
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as client:
        w0 = client.register_worker("w0").incarnation
        for _ in (1, 2):
            for kind in ("train", "train", "evaluate"):
                run_task(client, "w0", w0, kind, examples=8, correct=8, steps=1)
    # The job is over: the watch ends after one refresh, with the job's outcome.
    assert ctl.main([*argv, "--watch", "60"]) == 0
    assert capsys.readouterr().out.count("workers (1)") == 1
    assert ctl.main([*argv, "--json", "--watch"]) == 0


def test_ps_ctl_status_watch_exits_1_for_a_failed_job(coordinator, capsys):
    assert coordinator.runner.fail("no worker could load the data")
    argv = ["--coordinator", coordinator.address, "--timeout", "5", "status", "--watch", "60"]
    assert ctl.main(argv) == 1
    assert "no worker could load the data" in capsys.readouterr().out
