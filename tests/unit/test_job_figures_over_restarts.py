"""The figures a job reports at its end: the whole job's staleness and late gradients over a
coordinator restart, and ps-cluster's epoch lines of a job that failed. Each docstring says
what was reported before."""

from __future__ import annotations

import json
import signal

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_common.progress import epoch_line
from ps_server.coordinator.jobs import JobRunner, StepReport
from ps_worker import cluster

# ---- the job's staleness and late gradients over a coordinator restart ------------------


def _runner_with_a_gone_incarnations_steps() -> JobRunner:
    """A sync job whose first incarnation of w0 had 4 gradients dropped as late and let a
    gap of 2 steps through, then was replaced (it re-registered after a fence)."""
    runner = JobRunner(JobSpec(epochs=2, tasks_per_epoch=2, mode="ssp:2"), FakeClock(),
                       heartbeat_timeout_s=10.0)
    first = runner.register_worker("w0")
    runner.heartbeat("w0", first, steps=StepReport(wait_s=1.5, staleness_max=2, dropped_stale=4))
    second = runner.register_worker("w0")  # the first incarnation is gone
    runner.heartbeat("w0", second, steps=StepReport(wait_s=0.0, staleness_max=1, dropped_stale=0))
    return runner


def test_staleness_and_dropped_gradients_of_the_whole_job_survive_a_coordinator_restart():
    """README (Consistency modes): `job.staleness.max` is the largest gap let through "over the
    whole job", and the outcome line carries `staleness_max` and `dropped_stale_gradients`;
    a coordinator restarted on its state "reloads the job's progress". export_state() keeps no
    StepReport, so what incarnations gone before the restart reported is lost: the restored
    job says 1 and 0 where it had said 2 and 4."""
    runner = _runner_with_a_gone_incarnations_steps()
    before = runner.summary()
    assert (before["staleness_max"], before["dropped_stale_gradients"]) == (2, 4)

    restored = JobRunner(JobSpec(epochs=2, tasks_per_epoch=2, mode="ssp:2"), FakeClock(),
                         heartbeat_timeout_s=10.0)
    restored.restore_state(json.loads(json.dumps(runner.export_state())))
    # The live incarnation reports its cumulative figures again, as its heartbeat does.
    live = max(w["incarnation"] for w in restored.snapshot()["workers"])
    restored.heartbeat("w0", live, steps=StepReport(wait_s=0.0, staleness_max=1,
                                                    dropped_stale=0))

    after = restored.summary()
    assert (after["staleness_max"], after["dropped_stale_gradients"]) == (2, 4)


# ---- ps-cluster's epoch lines of a job that failed ---------------------------------------


class _FakeChild:
    """Stands in for a child process: nothing is started."""

    def __init__(self, name, argv, log_dir, env=None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log_path.write_text("")
        self.returncode = 0
        self.address = None
        self.restarts = 0

    def wait_for_address(self, deadline):
        return "127.0.0.1:1"

    def stop(self, grace_s=5.0, impatient=None):
        pass


def test_ps_cluster_shows_no_epoch_line_for_the_epoch_a_failed_job_stopped_in(
        tmp_path, monkeypatch, capsys):
    """README: each epoch's line comes once the epoch is over (its evaluation done;
    `held-out: not evaluated` only for an epoch the job does not evaluate, once its training
    is done). A job that failed in epoch 3 of 10 (epochs 1 and 2 over and shown) ends with the
    coordinator's outcome: `"epochs": 3` and the training loss of what epoch 3 had done. The
    fallback after the monitor (ps_worker/cluster.py, "the monitor missed the last status")
    takes it for a missed line and prints `epoch 3/10 ... held-out: not evaluated` for an epoch
    that never ended and that the job evaluates."""
    failed = {"state": "failed", "epochs": 3, "steps": 130, "loss": 0.4, "accuracy": None,
              "test_loss": None, "auc": None, "train_accuracy": 0.9,
              "failure": "task 20 (train, epoch 3) lost 5 workers; giving up"}

    def monitor(address, coordinator, workers, progress, *rest):
        for epoch, steps in ((1, 48), (2, 96)):  # the lines of the epochs that are over
            progress.reported.add(epoch)
            progress.note(epoch_line(epoch, 10, loss=0.5, accuracy=0.8, test_accuracy=0.85,
                                     test_auc=None, steps=steps))
        return dict(failed)

    monkeypatch.setattr(cluster, "Child", _FakeChild)
    monkeypatch.setattr(cluster, "_monitor", monitor)
    monkeypatch.setattr(cluster, "_stop_all",
                        lambda children, *_: {c.name: 0 for c in children})
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # leave pytest's handlers be

    code = cluster.main(["--servers", "1", "--workers", "1", "--epochs", "10",
                         "--log-dir", str(tmp_path / "logs")])

    out = capsys.readouterr().out
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["1/10", "2/10"], out
    assert json.loads(out.splitlines()[-1])["state"] == "failed"
