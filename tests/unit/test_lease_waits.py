"""JobRunner.lease(wait_s=): a worker with nothing to run waits at the coordinator and gets
a task the moment one is pending, instead of polling."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobRunner, Metrics
from ps_server.testing import wait_until

TRAIN = Metrics(loss_sum=2.0, examples=4, correct=3, steps=1, seconds=0.1)
EVAL = Metrics(loss_sum=1.0, examples=10, correct=9, steps=0, seconds=0.1)
LONG_S = 60.0  # a wait that must end by an event, long before this
BOUND_S = 30.0  # every join and result is bounded


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def worker_leases(runner: JobRunner, worker_id: str) -> list[int]:
    (row,) = [w for w in runner.snapshot()["workers"] if w["worker_id"] == worker_id]
    return row["leased_tasks"]


def make_runner(*, epochs: int = 2, tasks_per_epoch: int = 1,
                max_waiting: int = 4) -> JobRunner:
    return JobRunner(JobSpec(epochs=epochs, tasks_per_epoch=tasks_per_epoch), FakeClock(),
                     heartbeat_timeout_s=10.0, max_waiting_leases=max_waiting)


def waiting_lease(pool, runner: JobRunner, worker_id: str, incarnation: int,
                  waiting_before: int = 0):
    """A lease with a long wait, started in `pool`; returns once it is waiting."""
    future = pool.submit(runner.lease, worker_id, incarnation, LONG_S)
    wait_until(lambda: runner.waiting_leases == waiting_before + 1 or future.done(),
               "the lease to wait", timeout_s=BOUND_S)
    assert not future.done(), future.result()
    return future


def test_a_waiting_lease_is_answered_when_a_task_becomes_pending_and_its_next_gets_it():
    runner = make_runner()
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    train = runner.lease("w0", w0)[1]
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = waiting_lease(pool, runner, "w1", w1)
        runner.complete("w0", w0, train.task_id, TRAIN)  # the epoch's evaluation is pending
        # Not handed over in the answer to a call that waited (its caller may have stalled
        # meanwhile): ask again now.
        assert waiting.result(timeout=BOUND_S) == ("wait", 0.0)
    assert runner.waiting_leases == 0
    outcome, task = runner.lease("w1", w1, LONG_S)
    assert outcome == "task" and (task.kind, task.epoch, task.holder) == ("evaluate", 1,
                                                                           ("w1", w1))


def test_a_caller_that_stalled_in_a_wait_holds_no_task(pool):
    runner = make_runner()
    w0, w1, w2 = (runner.register_worker(w) for w in ("w0", "w1", "w2"))
    train = runner.lease("w0", w0)[1]
    stalled = waiting_lease(pool, runner, "w1", w1)  # its answer is never read, say
    runner.complete("w0", w0, train.task_id, TRAIN)
    assert stalled.result(timeout=BOUND_S) == ("wait", 0.0)
    outcome, evaluation = runner.lease("w2", w2)  # the task is still there for the others
    assert outcome == "task" and evaluation.kind == "evaluate"
    assert worker_leases(runner, "w1") == []


def test_a_wait_that_runs_out_says_ask_again_now():
    runner = make_runner()
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    runner.lease("w0", w0)
    assert runner.lease("w1", w1, 0.01) == ("wait", 0.0)
    assert runner.lease("w1", w1) == ("wait", None)  # no wait asked: pause before asking


def test_waits_past_the_bound_answer_at_once(pool):
    runner = make_runner(max_waiting=1)
    w0, w1, w2 = (runner.register_worker(w) for w in ("w0", "w1", "w2"))
    runner.lease("w0", w0)
    first = waiting_lease(pool, runner, "w1", w1)
    assert runner.lease("w2", w2, LONG_S) == ("wait", None)
    runner.stop_waiting()
    assert first.result(timeout=BOUND_S) == ("wait", None)


def test_a_fenced_incarnation_stops_waiting_and_is_told_to_register(pool):
    runner = make_runner()
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    runner.lease("w0", w0)
    waiting = waiting_lease(pool, runner, "w1", w1)
    runner.register_worker("w1")  # a new incarnation fences the waiting one
    assert waiting.result(timeout=BOUND_S) == ("reregister", None)


def test_the_job_ending_ends_the_wait(pool):
    runner = make_runner(epochs=1)
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    runner.complete("w0", w0, runner.lease("w0", w0)[1].task_id, TRAIN)
    evaluation = runner.lease("w0", w0)[1]
    waiting = waiting_lease(pool, runner, "w1", w1)
    runner.complete("w0", w0, evaluation.task_id, EVAL)  # the last epoch's evaluation
    assert waiting.result(timeout=BOUND_S) == ("done", None)


def test_stop_waiting_wakes_every_wait_and_later_leases_do_not_wait(pool):
    runner = make_runner()
    w0, w1, w2 = (runner.register_worker(w) for w in ("w0", "w1", "w2"))
    runner.lease("w0", w0)
    waits = [waiting_lease(pool, runner, "w1", w1),
             waiting_lease(pool, runner, "w2", w2, waiting_before=1)]
    runner.stop_waiting()
    assert [w.result(timeout=BOUND_S) for w in waits] == [("wait", None)] * 2
    assert runner.lease("w1", w1, LONG_S) == ("wait", None)


def test_an_abandoned_wait_ends_when_woken(pool):
    runner = make_runner()
    w0, w1 = runner.register_worker("w0"), runner.register_worker("w1")
    runner.lease("w0", w0)
    gone = threading.Event()
    waiting = pool.submit(runner.lease, "w1", w1, LONG_S, abandoned=gone.is_set)
    wait_until(lambda: runner.waiting_leases == 1, "the lease to wait", timeout_s=BOUND_S)
    gone.set()
    runner.wake_waiting()
    assert waiting.result(timeout=BOUND_S) == ("wait", None)
    assert runner.waiting_leases == 0


def test_a_caller_gone_gets_no_task_that_became_pending_meanwhile(pool):
    runner = make_runner()
    w0, w1, w2 = (runner.register_worker(w) for w in ("w0", "w1", "w2"))
    train = runner.lease("w0", w0)[1]
    gone = threading.Event()
    waiting = pool.submit(runner.lease, "w1", w1, LONG_S, abandoned=gone.is_set)
    wait_until(lambda: runner.waiting_leases == 1, "the lease to wait", timeout_s=BOUND_S)
    gone.set()
    runner.complete("w0", w0, train.task_id, TRAIN)  # the evaluation is pending now
    assert waiting.result(timeout=BOUND_S) == ("wait", None)
    outcome, evaluation = runner.lease("w2", w2)  # still there for a worker that asks
    assert outcome == "task" and evaluation.kind == "evaluate"


def test_workers_found_dead_by_a_waiting_lease_are_reported_at_once(pool):
    clock = FakeClock()
    gone: list[tuple[str, int]] = []
    runner = JobRunner(JobSpec(epochs=2, tasks_per_epoch=1), clock, heartbeat_timeout_s=10.0,
                       max_waiting_leases=4, on_worker_gone=lambda w, i: gone.append((w, i)))
    w0, w1, w2 = (runner.register_worker(w) for w in ("w0", "w1", "w2"))
    runner.lease("w0", w0)
    clock.advance(6.0)
    runner.heartbeat("w0", w0)
    runner.heartbeat("w1", w1)
    clock.advance(5.0)  # w2's heartbeats stopped 11 s ago: the next call reaps it
    waiting = pool.submit(runner.lease, "w1", w1, LONG_S)
    # Reported by the lease that reaped it, while that lease still waits for a task.
    wait_until(lambda: gone == [("w2", w2)], "w2 to be reported gone", timeout_s=BOUND_S)
    assert not waiting.done()
    runner.stop_waiting()
    assert waiting.result(timeout=BOUND_S) == ("wait", None)


def test_waiting_leases_sleep_until_something_may_end_their_wait(pool):
    clock = FakeClock()
    runner = JobRunner(JobSpec(epochs=2, tasks_per_epoch=1), clock, heartbeat_timeout_s=10.0,
                       max_waiting_leases=4)
    w0, w1, w2, w3 = (runner.register_worker(w) for w in ("w0", "w1", "w2", "w3"))
    runner.lease("w0", w0)
    clock.advance(6.0)
    runner.heartbeat("w0", w0)  # w3 sends none: it is dead from t = 10
    looks = {"w1": [], "w2": []}

    def counting(worker_id):
        def abandoned() -> bool:  # asked each time the wait wakes up
            looks[worker_id].append(1)
            return False
        return abandoned

    waits = [pool.submit(runner.lease, w, i, LONG_S, abandoned=counting(w))
             for w, i in (("w1", w1), ("w2", w2))]
    wait_until(lambda: all(looks.values()), "both leases to wait", timeout_s=BOUND_S)
    # Nothing that could end a wait happened since: one look each, not a loop of them (a
    # lease's look must not wake the other, whose look would wake it again).
    assert {w: len(n) for w, n in looks.items()} == {"w1": 1, "w2": 1}
    assert runner.waiting_leases == 2
    runner.heartbeat("w0", w0)  # no task, nobody gone: nothing to look at
    clock.advance(5.0)
    runner.heartbeat("w0", w0)  # reaps w3: a worker gone, so each looks again, then sleeps
    wait_until(lambda: all(len(n) >= 3 for n in looks.values()), "both to look again",
               timeout_s=BOUND_S)
    assert {w: len(n) for w, n in looks.items()} == {"w1": 3, "w2": 3}
    assert not any(w.done() for w in waits)
    runner.stop_waiting()
    assert [w.result(timeout=BOUND_S) for w in waits] == [("wait", None)] * 2
