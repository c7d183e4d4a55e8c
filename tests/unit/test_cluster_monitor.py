"""ps-cluster's monitor decides a job's outcome from the coordinator, never from a stale view."""

import json
from types import SimpleNamespace

import pytest

from ps_worker import cluster


class FakeChild:
    def __init__(self, name, log_path):
        self.name = name
        self.log_path = log_path
        self.returncode = None


class FinishingCluster:
    """Answers one status saying the job is running; by the time the caller looks at its
    workers (it was descheduled in between), they have finished the job and exited, and the
    coordinator has printed its summary and exited too."""

    def __init__(self, coordinator, workers):
        self.coordinator, self.workers = coordinator, workers

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def status(self, *, watching: bool = False):
        if self.coordinator.returncode is not None:
            raise AssertionError("status asked of a coordinator that has exited")
        for worker in self.workers:
            worker.returncode = 0
        summary = {"state": "done", "epochs": 1, "accuracy": 0.97}
        self.coordinator.log_path.write_text(cluster.FINISHED_PREFIX + json.dumps(summary) + "\n")
        self.coordinator.returncode = 0
        return {"job": {"state": "running", "steps": 10, "metrics": []}}


def test_workers_that_exit_after_a_running_status_do_not_fail_a_finished_job(tmp_path, monkeypatch):
    coordinator = FakeChild("coordinator", tmp_path / "coordinator.log")
    coordinator.log_path.write_text("")
    workers = [FakeChild(f"worker-{i}", tmp_path / f"worker-{i}.log") for i in range(2)]
    monkeypatch.setattr(cluster, "CoordinatorClient", FinishingCluster(coordinator, workers))
    progress = SimpleNamespace(update=lambda status: None, note=lambda line: None)

    outcome = cluster._monitor("127.0.0.1:1", coordinator, workers, progress, keep_serving=False)

    assert outcome["state"] == "done"


def test_workers_gone_while_the_job_still_runs_is_an_error(tmp_path, monkeypatch):
    coordinator = FakeChild("coordinator", tmp_path / "coordinator.log")
    workers = [FakeChild("worker-0", tmp_path / "worker-0.log")]
    workers[0].returncode = 1

    class StillRunning(FinishingCluster):
        def status(self, *, watching: bool = False):
            return {"job": {"state": "running", "steps": 3, "metrics": []}}

    monkeypatch.setattr(cluster, "CoordinatorClient", StillRunning(coordinator, workers))
    progress = SimpleNamespace(update=lambda status: None, note=lambda line: None)

    with pytest.raises(cluster.ClusterError, match="every worker exited before the job ended"):
        cluster._monitor("127.0.0.1:1", coordinator, workers, progress, keep_serving=False)
