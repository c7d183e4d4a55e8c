"""JobRunner.export_state / restore_state: a restarted coordinator resumes the job where it
was, driven by FakeClocks (the restored runner gets a new clock, as a new process would)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from ps_common.clock import FakeClock
from ps_common.errors import FencedIncarnation
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics

# Local helpers: test modules are not a package here, so test_jobs' are not importable
# without depending on pytest's import mode.
TIMEOUT_S = 10.0
FORGET_AFTER_S = 60.0
TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=5, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)
JOB = JobSpec(epochs=3, tasks_per_epoch=6)
TOTAL_TASKS = JOB.epochs * (JOB.tasks_per_epoch + 1)


def make_runner(job: JobSpec | None = JOB, first_incarnation: int = 100, start: float = 1000.0,
                gone: list | None = None) -> tuple[JobRunner, FakeClock]:
    clock = FakeClock(start)
    on_gone = (lambda w, i: gone.append((w, i))) if gone is not None else None
    return JobRunner(job, clock, heartbeat_timeout_s=TIMEOUT_S, forget_after_s=FORGET_AFTER_S,
                     first_incarnation=first_incarnation, on_worker_gone=on_gone), clock


def restored(state: dict, job: JobSpec | None = JOB,
             gone: list | None = None) -> tuple[JobRunner, FakeClock]:
    """A new process: a new clock far from the old one, incarnations above the old ones (as
    the coordinator's generation-based source guarantees), the state through JSON."""
    runner, clock = make_runner(job, first_incarnation=10_000, start=50_000.0, gone=gone)
    runner.restore_state(json.loads(json.dumps(state)))
    return runner, clock


def lease_task(runner: JobRunner, worker_id: str, incarnation: int):
    outcome, task = runner.lease(worker_id, incarnation)
    assert outcome == "task", outcome
    return task


def finish(runner: JobRunner, worker_id: str, incarnation: int, task) -> int:
    metrics = TRAIN if task.kind == "train" else EVAL
    assert runner.complete(worker_id, incarnation, task.task_id, metrics) is False
    return task.task_id


def worker_row(runner: JobRunner, worker_id: str) -> dict:
    [row] = [w for w in runner.snapshot()["workers"] if w["worker_id"] == worker_id]
    return row


@dataclass
class PartWay:
    """Epoch 2 of 3 under way: one task done, w1 and w0 holding one each, w2 dead (its task
    back in the queue) and three tasks pending."""
    runner: JobRunner
    clock: FakeClock
    incarnations: dict[str, int]
    done: list[int]  # task ids completed so far
    w0_holds: int
    w1_holds: int
    pending: list[int]  # in the order they will be handed out


def part_way() -> PartWay:
    runner, clock = make_runner()
    inc = {w: runner.register_worker(w) for w in ("w0", "w1", "w2")}
    done = [finish(runner, "w0", inc["w0"], lease_task(runner, "w0", inc["w0"]))
            for _ in range(JOB.tasks_per_epoch + 1)]  # all of epoch 1, its evaluation last
    done.append(finish(runner, "w0", inc["w0"], lease_task(runner, "w0", inc["w0"])))
    w1_holds = lease_task(runner, "w1", inc["w1"]).task_id
    w2_held = lease_task(runner, "w2", inc["w2"]).task_id
    w0_holds = lease_task(runner, "w0", inc["w0"]).task_id
    clock.advance(TIMEOUT_S / 2)
    assert runner.heartbeat("w0", inc["w0"]) == runner.heartbeat("w1", inc["w1"]) == "continue"
    clock.advance(TIMEOUT_S / 2 + 1)  # w2 has missed its heartbeats
    assert worker_row(runner, "w2")["state"] == "dead"
    # Ids are issued in order: the dead worker's task first, then the two never leased.
    pending = [w2_held, w0_holds + 1, w0_holds + 2]
    return PartWay(runner, clock, inc, done, w0_holds, w1_holds, pending)


def comparable(snapshot: dict) -> dict:
    """The snapshot without what depends on the clock reading."""
    out = {k: v for k, v in snapshot.items() if k not in ("elapsed_s", "workers")}
    out["workers"] = sorted(({k: v for k, v in w.items() if k != "heartbeat_age_s"}
                             for w in snapshot["workers"]), key=lambda w: w["worker_id"])
    return out


# ---- the export ------------------------------------------------------------------------------

def test_export_is_plain_json_and_versioned():
    state = part_way().runner.export_state()
    assert json.loads(json.dumps(state)) == state  # no tuples, enums or dataclasses
    assert state["version"] == 1 and state["job"] == JOB.to_json()
    assert len(state["tasks"]) == JOB.tasks_per_epoch  # the current epoch's tasks only


# ---- restoring -------------------------------------------------------------------------------

def test_restored_runner_shows_the_same_progress():
    p = part_way()
    before = p.runner.snapshot()
    runner, clock = restored(p.runner.export_state())
    after = runner.snapshot()
    # Leases are not resumed (their tasks are handed out again); everything else is.
    for w in before["workers"]:
        w["leased_tasks"] = []
    assert comparable(after) == comparable(before)
    assert (after["epoch"], after["tasks_done"], after["steps"]) == (2, 8, 7 * TRAIN.steps)
    assert after["elapsed_s"] == pytest.approx(before["elapsed_s"])
    assert runner.summary() | {"job_elapsed_s": 0, "steps_per_s": 0} == \
        p.runner.summary() | {"job_elapsed_s": 0, "steps_per_s": 0}
    assert (runner.live_workers(), runner.tracked_tasks(), runner.tracked_workers()) == (2, 6, 3)
    clock.advance(4.0)  # elapsed time goes on from the saved value
    assert runner.snapshot()["elapsed_s"] == pytest.approx(before["elapsed_s"] + 4.0)


def test_a_lease_is_handed_out_again_and_the_old_holders_late_report_still_counts_once():
    """The saved state lags: a holder may have finished its task with the old coordinator,
    whose report is lost with it. The task goes out again; whichever report comes first wins."""
    p = part_way()
    runner, _ = restored(p.runner.export_state())
    w0, w1 = p.incarnations["w0"], p.incarnations["w1"]
    assert runner.heartbeat("w0", w0) == "continue"
    assert worker_row(runner, "w0")["leased_tasks"] == []
    with pytest.raises(FencedIncarnation):
        runner.complete("w1", w1, p.w0_holds, TRAIN)  # never held it
    again = [lease_task(runner, "w1", w1) for _ in range(len(p.pending) + 2)]
    assert {t.task_id for t in again} == {*p.pending, p.w0_holds, p.w1_holds}
    assert runner.complete("w0", w0, p.w0_holds, TRAIN) is False  # its late report
    assert p.w0_holds not in worker_row(runner, "w1")["leased_tasks"]
    assert runner.complete("w1", w1, p.w0_holds, TRAIN) is True  # the re-run: a duplicate
    assert runner.snapshot()["tasks_done"] == len(p.done) + 1


def test_a_resumed_task_reported_done_before_it_is_handed_out_again_is_skipped():
    p = part_way()
    runner, _ = restored(p.runner.export_state())
    w0, w1 = p.incarnations["w0"], p.incarnations["w1"]
    assert runner.complete("w1", w1, p.w1_holds, TRAIN) is False
    handed = [lease_task(runner, "w0", w0).task_id for _ in range(len(p.pending) + 1)]
    assert p.w1_holds not in handed and sorted(handed) == sorted([*p.pending, p.w0_holds])
    assert runner.lease("w0", w0) == ("wait", None)


def test_pending_tasks_are_handed_out_in_the_original_order():
    p = part_way()
    runner, _ = restored(p.runner.export_state())
    w0 = p.incarnations["w0"]

    def drain(r: JobRunner, count: int) -> list[tuple]:
        tasks = [lease_task(r, "w0", w0) for _ in range(count)]
        assert r.lease("w0", w0) == ("wait", None)
        return [(t.task_id, t.kind, t.epoch, t.index, t.attempts) for t in tasks]

    original = drain(p.runner, 3)
    resumed = drain(runner, 5)  # the two leases go out again, in task id order
    assert [t for t in resumed if t[0] in p.pending] == original
    assert [t[0] for t in original] == p.pending
    assert original[0][4] == 2  # the dead worker's task: its attempt survived the restart


def test_a_restored_worker_that_never_heartbeats_is_reaped_and_its_task_leased_again():
    p = part_way()
    gone: list = []
    runner, clock = restored(p.runner.export_state(), gone=gone)
    w0, w1 = p.incarnations["w0"], p.incarnations["w1"]
    clock.advance(TIMEOUT_S)
    assert runner.heartbeat("w0", w0) == "continue"  # exactly at the timeout: still alive
    assert worker_row(runner, "w1")["state"] == "alive"
    clock.advance(1.0)  # w1 never came back
    assert runner.heartbeat("w1", w1) == "reregister"
    assert worker_row(runner, "w1")["state"] == "dead"
    assert gone == [("w1", w1)]  # w2 was gone before the restart: not reported again
    assert runner.live_workers() == 1
    again = lease_task(runner, "w0", w0)  # the oldest pending task is w1's
    assert again.task_id == p.w1_holds and again.holder == ("w0", w0)


def test_restored_dead_worker_is_forgotten_after_forget_after():
    p = part_way()
    runner, clock = restored(p.runner.export_state())
    w2 = p.incarnations["w2"]
    assert worker_row(runner, "w2")["state"] == "dead"
    clock.advance(FORGET_AFTER_S + 1)
    assert all(w["worker_id"] != "w2" for w in runner.snapshot()["workers"])
    assert runner.heartbeat("w2", w2) == "reregister"


def test_restored_job_runs_to_done_with_every_task_done_once():
    p = part_way()
    runner, _ = restored(p.runner.export_state())
    w0, w1 = p.incarnations["w0"], p.incarnations["w1"]
    done = list(p.done)
    for worker_id, incarnation, task_id in (("w1", w1, p.w1_holds), ("w0", w0, p.w0_holds)):
        assert runner.complete(worker_id, incarnation, task_id, TRAIN) is False
        done.append(task_id)
    for _ in range(TOTAL_TASKS):  # bounded: more than the tasks left
        outcome, task = runner.lease("w0", w0)
        if outcome != "task":
            break
        done.append(finish(runner, "w0", w0, task))
    assert outcome == "done" and runner.state is JobState.DONE
    assert sorted(done) == list(range(1, TOTAL_TASKS + 1))  # none twice, none skipped
    snap = runner.snapshot()
    assert snap["tasks_done"] == TOTAL_TASKS == snap["tasks_total"]
    assert snap["steps"] == JOB.epochs * JOB.tasks_per_epoch * TRAIN.steps
    assert [s.test for s in snap["metrics"]] == [EVAL] * JOB.epochs


def test_a_finished_job_restores_finished():
    runner, clock = make_runner(JobSpec(epochs=1, tasks_per_epoch=2))
    w = runner.register_worker("w0")
    for _ in range(3):
        clock.advance(2.0)
        finish(runner, "w0", w, lease_task(runner, "w0", w))
    assert runner.state is JobState.DONE
    assert runner.lease("w0", w) == ("done", None)  # w0 is told, and is DONE
    clock.advance(30.0)  # after the end: not part of the job's elapsed time
    back, back_clock = restored(runner.export_state(), job=JobSpec(epochs=1, tasks_per_epoch=2))
    assert back.state is JobState.DONE and back.over
    assert back.summary() == runner.summary()
    assert worker_row(back, "w0")["state"] == "done"
    assert back.heartbeat("w0", w) == "stop"
    back_clock.advance(100.0)
    assert back.snapshot()["elapsed_s"] == pytest.approx(6.0)


def test_a_failed_job_restores_failed_with_its_failure():
    runner, _ = make_runner()
    assert runner.fail("operator said so")
    back, _ = restored(runner.export_state())
    assert (back.state, back.failure) == (JobState.FAILED, "operator said so")


def test_no_job_round_trips():
    runner, _ = make_runner(job=None)
    back, _ = restored(runner.export_state(), job=None)
    assert back.state is JobState.NONE


# ---- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("job", [JobSpec(epochs=4, tasks_per_epoch=6), JobSpec(lr=0.5), None])
def test_state_of_a_different_job_is_refused(job):
    state = part_way().runner.export_state()
    fresh, _ = make_runner(job)
    with pytest.raises(ValueError):
        fresh.restore_state(state)
    assert fresh.snapshot()["tasks_done"] == 0  # nothing half-restored


def test_another_version_is_refused():
    state = part_way().runner.export_state()
    fresh, _ = make_runner()
    with pytest.raises(ValueError):
        fresh.restore_state({**state, "version": 2})


@pytest.mark.parametrize("damage", [
    lambda s: s.pop("tasks"),
    lambda s: s["workers"][0].update(state="zombie"),
    lambda s: s["tasks"][0].update(metrics={"loss": 1.0}),
    lambda s: s["workers"][1]["leased"].append(10**6),
])
def test_a_malformed_state_is_refused_and_changes_nothing(damage):
    state = json.loads(json.dumps(part_way().runner.export_state()))
    damage(state)
    fresh, _ = make_runner()
    before = fresh.snapshot()
    with pytest.raises(ValueError):
        fresh.restore_state(state)
    assert fresh.snapshot() == before


def test_restoring_into_a_runner_already_in_use_is_refused():
    state = part_way().runner.export_state()
    busy, _ = make_runner()
    busy.register_worker("w9")
    with pytest.raises(RuntimeError):
        busy.restore_state(state)


def test_an_epoch_ended_by_resumed_holders_reports_goes_on_to_the_next():
    """Every task of the epoch was leased when the state was saved, and their old holders
    report them all done after the restart, while they still wait in the queue to be handed
    out again: the epoch's evaluation, then the next epoch's tasks are handed out."""
    p = part_way()
    w0, w1 = p.incarnations["w0"], p.incarnations["w1"]
    held = [lease_task(p.runner, "w0", w0).task_id for _ in p.pending]
    runner, _ = restored(p.runner.export_state())
    runner.complete("w1", w1, p.w1_holds, TRAIN)
    for task_id in (p.w0_holds, *held):
        runner.complete("w0", w0, task_id, TRAIN)
    evaluation = lease_task(runner, "w0", w0)
    assert (evaluation.kind, evaluation.epoch) == ("evaluate", 2)
    finish(runner, "w0", w0, evaluation)
    nxt = lease_task(runner, "w0", w0)
    assert (nxt.kind, nxt.epoch) == ("train", 3)


def test_a_retried_ask_after_a_restart_gets_the_task_its_lost_answer_carried():
    runner, _ = make_runner()
    w = runner.register_worker("w0")
    outcome, task = runner.lease("w0", w, lease_id=3)  # saved; the answer is lost
    assert outcome == "task"
    again, _ = restored(runner.export_state())
    outcome, retried = again.lease("w0", w, lease_id=3)
    assert outcome == "task" and retried.task_id == task.task_id
    assert worker_row(again, "w0")["leased_tasks"] == [task.task_id]
