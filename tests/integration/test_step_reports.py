"""What workers report of their steps (ssp:K, sync) through the coordinator: ps-ctl
status --json's job.mode, job.staleness.max, job.dropped_stale_gradients and per worker
wait_s, the terminal view, and refusal of a report that cannot be true."""

from __future__ import annotations

import grpc
import pytest

from ps_common.job import JobSpec
from ps_common.status import RemoteError
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_worker.client import StepStats
from ps_worker.coordinator_client import CoordinatorClient
from ps_worker.ctl import render


@pytest.fixture
def coordinator_of():
    made = []

    def make(mode: str) -> CoordinatorClient:
        config = CoordinatorConfig(job=JobSpec(epochs=2, tasks_per_epoch=2, mode=mode),
                                   heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0,
                                   grace_s=0.5)
        coordinator = Coordinator(config).start()
        client = CoordinatorClient(coordinator.address, give_up_after_s=5)
        made.append((coordinator, client))
        return client

    yield make
    for coordinator, client in made:
        client.close()
        coordinator.stop()


def train_one_task(client: CoordinatorClient, worker: str, incarnation: int,
                   stats: StepStats) -> None:
    outcome, task = client.lease(worker, incarnation)
    assert (outcome, task.kind) == ("task", "train")
    client.complete(worker, incarnation, task.task_id, loss_sum=1.0, examples=4, correct=3,
                    steps=2, seconds=0.1, step_stats=stats)


def test_step_reports_reach_the_status_the_json_and_the_terminal_view(coordinator_of):
    client = coordinator_of("ssp:2")
    fast = client.register_worker("fast").incarnation
    slow = client.register_worker("slow").incarnation
    train_one_task(client, "fast", fast, StepStats(wait_s=1.25, staleness_max=2))
    train_one_task(client, "slow", slow, StepStats(wait_s=0.0, staleness_max=0,
                                                    dropped_stale=1))
    # A heartbeat's newer, cumulative report replaces the incarnation's older one.
    assert client.heartbeat("slow", slow, step_stats=StepStats(wait_s=0.5, staleness_max=1,
                                                               dropped_stale=3)) == "continue"
    status = client.status()
    job, workers = status["job"], {w["id"]: w for w in status["workers"]}
    assert job["mode"] == "ssp:2"
    assert job["staleness"] == {"max": 2}
    assert job["dropped_stale_gradients"] == 3
    assert workers["fast"]["wait_s"] == 1.25 and workers["slow"]["wait_s"] == 0.5
    assert workers["fast"]["steps"] == 2
    text = render(status)
    assert "ssp:2, largest gap let through 2 step(s)" in text
    assert "stale gradients dropped 3" in text
    header = next(line for line in text.splitlines() if line.split()[:1] == ["worker"])
    fast = next(line for line in text.splitlines() if line.split()[:1] == ["fast"])
    assert header.split()[-1] == "waited" and fast.endswith("1.25 s")


def test_an_async_job_shows_its_mode_and_no_step_figures(coordinator_of):
    client = coordinator_of("async")
    incarnation = client.register_worker("w0").incarnation
    train_one_task(client, "w0", incarnation, None)
    status = client.status()
    assert status["job"]["mode"] == "async"
    assert status["job"]["staleness"] == {"max": 0}
    assert status["job"]["dropped_stale_gradients"] == 0
    text = render(status)
    assert ["mode", "async"] in [line.split() for line in text.splitlines()]
    assert "waited" not in text and "largest gap" not in text


def test_a_step_report_with_negative_figures_is_refused(coordinator_of):
    client = coordinator_of("sync")
    incarnation = client.register_worker("w0").incarnation
    with pytest.raises(RemoteError) as refused:
        client.heartbeat("w0", incarnation, step_stats=StepStats(wait_s=-1.0))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step_report" in refused.value.details()
    assert client.status()["job"]["staleness"] == {"max": 0}
