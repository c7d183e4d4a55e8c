"""`ps-cluster --chaos` decides a kill on one status and performs it later: the target may have
exited meanwhile (told the job is over, or crashed while the coordinator still shows it alive,
which it does until its heartbeat times out). The interleaving is forced by letting the real
`Child` exit before `ChaosMonkey.observe` acts on the status read while it was alive."""

from __future__ import annotations

import sys

from ps_worker.chaos import ChaosMonkey, plan
from ps_worker.cluster import Child

BOUND_S = 30.0


def make_status(*, tasks_done: int, steps: int, state: str = "running", incarnation: int = 1,
                worker_state: str = "alive") -> dict:
    """The parts of `ps-ctl status --json` that chaos reads: 1 worker, 1 server, 100 tasks."""
    return {
        "job": {"state": state, "tasks_done": tasks_done, "tasks_total": 100, "steps": steps,
                "failure": ""},
        "workers": [{"id": "worker-0", "incarnation": incarnation, "state": worker_state,
                     "leased_tasks": []}],
        "servers": [{"id": "ps-0", "state": "alive", "state_losses": 0}],
        "generation": 7,
        "last_checkpoint": None,
    }


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _monkey(worker: Child, clock: Clock, notes: list[str]) -> ChaosMonkey:
    targets = plan(3, workers={"worker-0": "worker-0"}, servers={})  # worker-0, coordinator
    return ChaosMonkey(3, targets, {"worker-0": worker}, clock=clock, note=notes.append,
                       recovery_timeout_s=60.0)


def test_a_worker_that_exited_by_itself_after_the_status_is_not_counted_as_killed(tmp_path):
    """README, Chaos run: ps-cluster "SIGKILLs a random worker ... Each is restarted as
    restart: on-failure ... would restart it", and `ps-cluster` exits 0 only if "every child
    exited 0". Here worker-0 crashed (exit 1) after the status that showed it alive was read:
    chaos records a SIGKILL that never happened and restarts it, so its exit code 1 is
    replaced by the new incarnation's and the crash is hidden."""
    worker = Child("worker-0", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path)
    try:
        before = make_status(tasks_done=10, steps=50)  # read while worker-0 ran
        assert worker.process.wait(BOUND_S) == 1  # ... then it crashed by itself
        notes: list[str] = []
        chaos = _monkey(worker, Clock(), notes)
        chaos.observe(before)
        assert worker.restarts == 0, (
            f"chaos restarted a worker that had exited with 1 by itself; notes: {notes}")
        assert chaos.report()["kills"] == [], "a SIGKILL was recorded that never happened"
        assert worker.returncode == 1  # ps-cluster's exit_codes must still show the crash
    finally:
        worker.kill()


def test_a_worker_that_exited_at_the_end_of_the_job_is_not_restarted_nor_counted_recovered(
        tmp_path):
    """The job ends (worker-0 told so, exits 0) between the status read at 10% and the kill:
    chaos "kills" the exited worker, restarts it after the job ended, and the next status (the
    new incarnation told the job is over) is counted as recovery from a kill that did not
    happen: the run claims a worker kill it never tested."""
    worker = Child("worker-0", [sys.executable, "-c", "pass"], tmp_path)
    try:
        before = make_status(tasks_done=10, steps=50)  # read while the job ran
        assert worker.process.wait(BOUND_S) == 0  # the job ended; worker-0 exited 0
        clock, notes = Clock(), []
        chaos = _monkey(worker, clock, notes)
        chaos.observe(before)
        clock.now += 1.0
        # What the coordinator (lingering for ps-cluster, its watcher) shows next: the job done,
        # and worker-0 under a new incarnation if the restart registered, told it is over.
        after = make_status(tasks_done=100, steps=500, state="done",
                            incarnation=1 + worker.restarts, worker_state="done")
        chaos.observe(after)
        assert worker.restarts == 0, f"worker-0 was restarted after the job ended: {notes}"
        assert chaos.recoveries == 0, f"a recovery counted from a kill that did not happen: {notes}"
        assert chaos.report()["kills"] == []
    finally:
        worker.kill()
