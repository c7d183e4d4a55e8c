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


class FakeClient:
    """Stands in for the CoordinatorClient class and its instances alike."""

    def __call__(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FinishingCluster(FakeClient):
    """Answers one status saying the job is running; by the time the caller looks at its
    workers (it was descheduled in between), they have finished the job and exited, and the
    coordinator has printed its summary and exited too."""

    def __init__(self, coordinator, workers):
        self.coordinator, self.workers = coordinator, workers

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


def test_a_failed_job_is_reported_with_the_coordinators_outcome(tmp_path, monkeypatch):
    # The coordinator of a failed job prints its outcome, then exits 1: the outcome (its
    # reason, its figures) is the job's, not "exited before the job ended".
    coordinator = FakeChild("coordinator", tmp_path / "coordinator.log")
    summary = {"state": "failed", "failure": "worker w0 cannot run the job: bad model"}
    coordinator.log_path.write_text(cluster.FINISHED_PREFIX + json.dumps(summary) + "\n")
    coordinator.returncode = 1
    progress = SimpleNamespace(update=lambda status: None, note=lambda line: None)

    outcome = cluster._monitor("127.0.0.1:1", coordinator, [], progress, keep_serving=False)

    assert outcome == summary


def test_a_worker_that_exits_while_the_job_runs_is_named_with_its_error(tmp_path, monkeypatch):
    coordinator = FakeChild("coordinator", tmp_path / "coordinator.log")
    coordinator.log_path.write_text("")
    workers = [FakeChild(f"worker-{i}", tmp_path / f"worker-{i}.log") for i in range(2)]
    workers[0].returncode = 1
    workers[0].log_path.write_text("ps-worker: --metrics-port 9103: address in use\n")
    notes = []

    class RunsThenEnds(FinishingCluster):
        calls = 0

        def status(self, *, watching: bool = False):
            RunsThenEnds.calls += 1
            if RunsThenEnds.calls == 2:
                return super().status(watching=watching)  # the job ends
            return {"job": {"state": "running", "steps": 3, "metrics": []}}

    monkeypatch.setattr(cluster, "CoordinatorClient", RunsThenEnds(coordinator, workers))
    progress = SimpleNamespace(update=lambda status: None, note=notes.append)

    cluster._monitor("127.0.0.1:1", coordinator, workers, progress, keep_serving=False)

    assert notes == ["ps-cluster: worker-0 exited with 1: worker-0: ps-worker: --metrics-port "
                     "9103: address in use"]


@pytest.mark.parametrize("user, expected", [
    ({}, {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}),
    ({"OMP_NUM_THREADS": "1"},
     {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
    ({"OPENBLAS_NUM_THREADS": "2", "MKL_NUM_THREADS": "3"},
     {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2", "MKL_NUM_THREADS": "3"}),
])
def test_a_blas_thread_count_the_user_set_wins_in_every_library(monkeypatch, user, expected):
    # OpenBLAS reads OPENBLAS_NUM_THREADS before OMP_NUM_THREADS: a share filled in beside a
    # user's OMP_NUM_THREADS=1 would overrule it.
    for name in cluster.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 8)
    env = cluster.worker_environment(2)
    assert {k: env[k] for k in cluster.BLAS_THREAD_VARIABLES} == expected


# ---- the outcome when the coordinator's own line is not whole in its log (a full --log-dir)

def _status(state: str) -> dict:
    """A status as CoordinatorClient.status() gives it, of a job that is over."""
    return {
        "job": {"state": state, "epoch": 2, "epochs": 2, "tasks_done": 6, "tasks_total": 6,
                "steps": 48, "elapsed_s": 2.0, "failure": "", "mode": "async",
                "staleness": {"max": 3}, "dropped_stale_gradients": 1,
                "epoch_tasks": 3, "epoch_tasks_done": 3, "spec": None,
                "metrics": [{"epoch": 2, "loss": 0.5, "accuracy": 0.8, "test_loss": 0.6,
                             "test_accuracy": 0.75, "test_auc": None, "steps": 24,
                             "examples": 100, "over": True}]},
        "workers": [{"id": "worker-0", "incarnation": 1, "state": "done", "heartbeat_age_s": 0.1,
                     "reason": "", "died_at_s": None, "tasks_done": 6, "steps": 48,
                     "leased_tasks": [], "data_path": "shm", "wait_s": 0.0}],
        "servers": [], "generation": 1, "awaiting_servers": [], "last_checkpoint": None,
    }


class EndsWithLog(FakeClient):
    """Answers one status saying the job is over; then the coordinator exits having written
    `log_text` (what reached its log) to its log."""

    def __init__(self, coordinator, log_text, returncode=0):
        self.coordinator, self.log_text, self.returncode = coordinator, log_text, returncode

    def status(self, *, watching: bool = False):
        assert self.coordinator.returncode is None, "status asked of an exited coordinator"
        self.coordinator.log_path.write_text(self.log_text)
        self.coordinator.returncode = self.returncode
        return _status("done")


def _monitor(tmp_path, monkeypatch, log_text):
    coordinator = FakeChild("coordinator", tmp_path / "coordinator.log")
    coordinator.log_path.write_text("")
    monkeypatch.setattr(cluster, "CoordinatorClient", EndsWithLog(coordinator, log_text))
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    progress = SimpleNamespace(update=lambda status: None, note=lambda line: None)
    return cluster._monitor("127.0.0.1:1", coordinator, [], progress, keep_serving=False)


def test_an_outcome_line_cut_short_by_a_full_log_dir_still_gives_the_jobs_outcome(
        tmp_path, monkeypatch):
    # A full disk (or a file-size limit) lets the last write land in part: the log ends in
    # the middle of the coordinator's outcome line. The job is done and the monitor saw it.
    cut = cluster.FINISHED_PREFIX + '{"state": "done", "epochs": 2, "ste'
    outcome = _monitor(tmp_path, monkeypatch, "some log line\n" + cut)
    assert outcome["state"] == "done", outcome


def test_the_outcome_read_from_the_last_status_has_the_documented_keys(tmp_path, monkeypatch):
    # No outcome line at all in the log: ps-cluster falls back on the last status.
    outcome = _monitor(tmp_path, monkeypatch, "some log line\n")
    assert outcome["state"] == "done"
    missing = [key for key in ("mode", "staleness_max", "dropped_stale_gradients",
                               "data_paths", "steps_per_s") if key not in outcome]
    assert not missing, f"the final line lacks {missing}: {outcome}"
