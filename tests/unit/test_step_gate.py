"""StepGate (ps_server.consistency) on its own: ssp:K holds a member that would get more
than K steps ahead of the slowest, sync averages one gradient per member and applies it once
per step, membership (join, leave, retirement by incarnation, mode conflicts), and the
errors (non-members, steps ahead, failed updates, a wait that lasts too long).

`apply_average` is a recorder; targets are anything with a `.key`. A call that must block
is run in a thread and seen waiting on the gate's condition (WatchedCondition), so no
assertion rests on how long something took."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest

from ps_common.consistency import parse_mode
from ps_common.errors import FailedPrecondition, FencedIncarnation, InvalidArgument, PSError
from ps_common.errors import StepTimeout
from ps_server.consistency import Contribution, StepGate
from ps_server.testing import wait_until

WAIT_S = 30.0  # bound of every wait; never reached when the code is right

SYNC = parse_mode("sync")


def ssp(k: int):
    return parse_mode(f"ssp:{k}")


@dataclass(frozen=True)
class Target:
    """A stand-in for a held shard: the gate only reads `.key`."""
    key: tuple


T0, T1 = Target(("w", 0)), Target(("w", 1))


class Recorder:
    """A fake apply_average: records (contributions, targets, grads) of each call; raises
    the errors in `fail` (one per call, in order) before recording anything."""

    def __init__(self, fail: list[BaseException] | None = None):
        self.calls: list[tuple[list[Contribution], list, list[np.ndarray]]] = []
        self._fail = list(fail or [])

    def __call__(self, contributions, targets, grads):
        if self._fail:
            raise self._fail.pop(0)
        self.calls.append((list(contributions), list(targets),
                           [np.array(g, copy=True) for g in grads]))


class WatchedCondition(threading.Condition):
    """The gate's condition, counting the threads that wait on it: a test sees a call
    blocked in the gate (not merely "not returned yet")."""

    def __init__(self):
        super().__init__()
        self.waiting = 0  # changed with the lock held

    def wait(self, timeout=None):
        self.waiting += 1
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def make_gate(apply_average=None, **kwargs) -> StepGate:
    gate = StepGate(apply_average or Recorder(), **kwargs)
    assert isinstance(gate._changed, threading.Condition)  # the attribute replaced below
    gate._changed = WatchedCondition()  # before any thread uses the gate
    return gate


def sync_gate(clients: str) -> tuple[Recorder, StepGate]:
    """A gate each of `clients` (one-letter ids) joined in sync mode, and its recorder."""
    recorder = Recorder()
    gate = make_gate(recorder)
    for client in clients:
        gate.join(client, 1, SYNC)
    return recorder, gate


def blocked(gate: StepGate, n: int, what: str) -> None:
    wait_until(lambda: gate._changed.waiting == n, f"{n} call(s) waiting in the gate ({what})")


def contribution(client: str, sequence: int = 1, incarnation: int = 1,
                 acked_through: int = 0) -> Contribution:
    return Contribution(client, incarnation, sequence, acked_through)


def grads(*rows) -> list[np.ndarray]:
    return [np.asarray(r, np.float32) for r in rows]


# ---- ssp:K ----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2])
def test_ssp_a_member_runs_k_steps_ahead_then_waits_for_the_slowest(spawn, k):
    gate = make_gate()
    assert gate.join("a", 1, ssp(k)) == 0
    assert gate.join("b", 1, ssp(k)) == 0
    for step in range(k):  # within the bound: back at once
        outcome = gate.finish_step("a", 1, step)
        assert (outcome.next_step, outcome.staleness) == (step + 1, step + 1)
    ahead = spawn(gate.finish_step, "a", 1, k)  # would be k + 1 ahead of b
    blocked(gate, 1, "a, k + 1 steps ahead")
    assert not ahead.done.is_set()
    slow = gate.finish_step("b", 1, 0)
    assert (slow.next_step, slow.staleness) == (1, 0)  # the slowest is never held
    outcome = ahead.result()
    assert (outcome.next_step, outcome.staleness) == (k + 1, k)
    assert outcome.waited_s > 0
    assert gate.staleness_max == k
    assert gate.kind_of("a") == gate.kind_of("b") == "ssp" and gate.mode() == f"ssp:{k}"


def test_ssp_staleness_max_is_the_largest_gap_let_through_not_the_bound():
    gate = make_gate()
    for client in "ab":
        gate.join(client, 1, ssp(3))
    assert gate.finish_step("a", 1, 0).staleness == 1
    assert gate.finish_step("a", 1, 1).staleness == 2
    assert gate.finish_step("b", 1, 0).staleness == 0  # b: 1 done, a: 2
    assert gate.finish_step("a", 1, 2).staleness == 2  # a: 3 done, b: 1
    assert gate.staleness_max == 2


@pytest.mark.parametrize("how", ["leave", "retired"])
def test_ssp_a_member_that_leaves_or_is_retired_releases_those_waiting_for_it(spawn, how):
    gate = make_gate()
    for client in "abc":
        gate.join(client, 1, ssp(0))
    a = spawn(gate.finish_step, "a", 1, 0)
    b = spawn(gate.finish_step, "b", 1, 0)
    blocked(gate, 2, "a and b wait for c")
    if how == "leave":
        gate.leave("c")  # LeaveSteps
    else:
        gate.leave("c", 1)  # the coordinator retired incarnation 1 (declared dead)
    assert a.result().next_step == 1 and b.result().next_step == 1
    assert gate.kind_of("c") is None
    with pytest.raises(FailedPrecondition):
        gate.check_member("c", 1)
    assert gate.staleness_max == 0


def test_ssp_a_member_retired_while_it_waits_returns(spawn):
    gate = make_gate()
    for client in "ab":
        gate.join(client, 1, ssp(0))
    waiter = spawn(gate.finish_step, "a", 1, 0)
    blocked(gate, 1, "a waits for b")
    gate.leave("a", 1)
    assert waiter.result().next_step == 1


def test_ssp_a_joiner_enters_at_the_slowest_members_step():
    gate = make_gate()
    for client in "ab":
        gate.join(client, 1, ssp(5))
    for step in range(3):
        gate.finish_step("a", 1, step)  # a: 3 done
    gate.finish_step("b", 1, 0)  # b: 1 done
    assert gate.join("c", 1, ssp(5)) == 1  # it holds nobody back
    assert gate.finish_step("c", 1, 1).next_step == 2
    assert gate.finish_step("a", 1, 3).staleness == 3  # a: 4 done, slowest (b): 1
    # With nobody left, a joiner starts at the furthest step any member reached.
    for client in "abc":
        gate.leave(client)
    assert gate.mode() == ""
    assert gate.join("d", 1, ssp(5)) == 4


def test_an_older_incarnations_leave_does_not_remove_the_newer_one(spawn):
    gate = make_gate()
    gate.join("a", 1, ssp(0))
    gate.join("b", 1, ssp(0))
    gate.join("a", 2, ssp(0))  # a restarted: its new incarnation replaces the old one
    with pytest.raises(FailedPrecondition, match="replaced"):
        gate.join("a", 1, ssp(0))
    gate.leave("a", 1)  # the retirement of the old incarnation arrives late
    gate.check_member("a", 2)
    with pytest.raises(FailedPrecondition):
        gate.check_member("a", 1)
    assert gate.kind_of("a") == "ssp"
    waiter = spawn(gate.finish_step, "b", 1, 0)  # still held by incarnation 2
    blocked(gate, 1, "b waits for a's incarnation 2")
    assert not waiter.done.is_set()
    gate.leave("a", 2)
    assert waiter.result().next_step == 1


def test_a_client_cannot_join_steps_that_run_in_another_mode():
    gate = make_gate()
    gate.join("a", 1, ssp(1))
    for other in (SYNC, ssp(2)):
        with pytest.raises(FailedPrecondition) as caught:
            gate.join("b", 1, other)
        assert caught.value.code == "FAILED_PRECONDITION"
        assert "ssp:1" in caught.value.message and "a" in caught.value.message
        assert gate.kind_of("b") is None
    assert gate.join("b", 1, ssp(1)) == 0
    gate.leave("a")
    gate.leave("b")
    assert gate.join("c", 1, SYNC) == 0  # nobody left in ssp:1: the mode may change
    assert gate.mode() == "sync" and gate.kind_of("c") == "sync"


def test_join_refuses_the_async_mode_and_replicas_below_one():
    gate = make_gate()
    with pytest.raises(FailedPrecondition, match="async"):
        gate.join("a", 1, parse_mode("async"))
    with pytest.raises(FailedPrecondition, match="replicas"):
        gate.join("a", 1, SYNC, replicas=0)
    assert gate.kind_of("a") is None and gate.mode() == ""


def test_a_push_from_a_client_that_has_not_joined_is_refused():
    for mode in (SYNC, ssp(1)):
        gate = make_gate()
        with pytest.raises(FailedPrecondition, match="JoinSteps"):
            gate.check_member("x", 1)
        gate.join("a", 1, mode)
        with pytest.raises(FailedPrecondition):
            gate.check_member("a", 2)  # another incarnation of a
        with pytest.raises(FailedPrecondition):
            gate.check_member("x", 1)
        gate.check_member("a", 1)
    ssp_gate = make_gate()
    ssp_gate.join("a", 1, ssp(1))
    # finish_step comes after a push was admitted and applied: a client gone since is not
    # refused (its push was applied), and nobody waits for it.
    assert ssp_gate.finish_step("x", 1, 0).next_step == 1
    recorder = Recorder()
    sync_gate = make_gate(recorder)
    sync_gate.join("a", 1, SYNC)
    with pytest.raises(FailedPrecondition):
        sync_gate.contribute(contribution("x"), 0, [T0], grads([1.0]))
    assert recorder.calls == [] and sync_gate.current_step() == 0


# ---- sync -----------------------------------------------------------------------------------

def test_sync_calls_copied_once_the_gradients_are_summed_before_it_waits(spawn):
    """A push read from a shared-memory slot is dropped from the server's memory by
    `copied`: it must come before the wait for the other clients, once per push."""
    recorder, gate = sync_gate("ab")
    copied = []
    a = spawn(lambda: gate.contribute(contribution("a"), 0, [T0], grads([1.0]),
                                      copied=lambda: copied.append("a")))
    blocked(gate, 1, "a waits for b's gradient")
    assert copied == ["a"] and not a.done.is_set()
    gate.contribute(contribution("b"), 0, [T0], grads([3.0]), copied=lambda: copied.append("b"))
    assert a.result().next_step == 1
    assert copied == ["a", "b"]
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_sync_applies_the_average_of_both_members_gradients_once_per_step(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("a", 1, SYNC) == 0
    assert gate.join("b", 1, SYNC) == 0
    ga, gb = grads([1.0, 2.0], [10.0]), grads([3.0, 6.0], [30.0])
    a = spawn(gate.contribute, contribution("a", 4, acked_through=3), 0, [T0, T1], ga)
    blocked(gate, 1, "a waits for b's gradient")
    assert recorder.calls == [] and gate.current_step() == 0
    outcome_b = gate.contribute(contribution("b", 9, acked_through=8), 0, [T0, T1], gb)
    outcome_a = a.result()
    assert outcome_a.next_step == outcome_b.next_step == 1
    assert not (outcome_a.stale_dropped or outcome_b.stale_dropped)
    assert outcome_a.waited_s > 0
    assert gate.current_step() == 1
    (contributions, targets, averages), = recorder.calls
    assert sorted((c.client_id, c.incarnation, c.sequence, c.acked_through)
                  for c in contributions) == [("a", 1, 4, 3), ("b", 1, 9, 8)]
    assert targets == [T0, T1]
    np.testing.assert_array_equal(averages[0], np.float32([2.0, 4.0]))
    np.testing.assert_array_equal(averages[1], np.float32([20.0]))
    assert averages[0].dtype == np.float32
    # The gradients were copied: the push buffers they came in are left as they were.
    np.testing.assert_array_equal(ga[0], [1.0, 2.0])
    np.testing.assert_array_equal(gb[0], [3.0, 6.0])

    b = spawn(gate.contribute, contribution("b", 10), 1, [T0, T1], grads([0.0, 0.0], [1.0]))
    blocked(gate, 1, "b waits for a's gradient of step 1")
    assert len(recorder.calls) == 1
    assert gate.contribute(contribution("a", 5), 1, [T0, T1],
                           grads([4.0, 8.0], [3.0])).next_step == 2
    assert b.result().next_step == 2
    np.testing.assert_array_equal(recorder.calls[1][2][0], np.float32([2.0, 4.0]))
    np.testing.assert_array_equal(recorder.calls[1][2][1], np.float32([2.0]))
    assert gate.current_step() == 2 and gate.staleness_max == 0 and gate.dropped_stale == 0


def test_sync_a_late_gradient_is_dropped_counted_and_never_applied(spawn):
    recorder, gate = sync_gate("ab")
    a = spawn(gate.contribute, contribution("a", 1), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    gate.contribute(contribution("b", 1), 0, [T0], grads([3.0]))
    a.result()
    late = gate.contribute(contribution("a", 2), 0, [T0], grads([100.0]))  # step 0 is over
    assert late.stale_dropped and late.next_step == 1
    assert gate.dropped_stale == 1 and gate.current_step() == 1
    assert len(recorder.calls) == 1
    b = spawn(gate.contribute, contribution("b", 2), 1, [T0], grads([5.0]))
    blocked(gate, 1, "b waits for a")
    gate.contribute(contribution("a", 3), 1, [T0], grads([7.0]))
    b.result()
    np.testing.assert_array_equal(recorder.calls[1][2][0], np.float32([6.0]))  # no 100
    assert gate.dropped_stale == 1


def test_sync_a_push_of_a_step_ahead_is_refused(spawn):
    recorder, gate = sync_gate("ab")
    with pytest.raises(FailedPrecondition) as caught:
        gate.contribute(contribution("a", 1), 1, [T0], grads([100.0]))
    assert "step 1" in caught.value.message and "step 0" in caught.value.message
    assert gate.current_step() == 0 and recorder.calls == []
    a = spawn(gate.contribute, contribution("a", 2), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    gate.contribute(contribution("b", 1), 0, [T0], grads([3.0]))
    assert a.result().next_step == 1
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_sync_replicas_make_the_first_step_wait_for_the_later_joiners(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("a", 1, SYNC, replicas=2) == 0
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for a second replica")
    assert recorder.calls == [] and not a.done.is_set()  # every member gave, but only one
    assert gate.join("b", 1, SYNC) == 0
    assert recorder.calls == []
    assert gate.contribute(contribution("b"), 0, [T0], grads([3.0])).next_step == 1
    assert a.result().next_step == 1
    (contributions, _, averages), = recorder.calls
    assert sorted(c.client_id for c in contributions) == ["a", "b"]
    np.testing.assert_array_equal(averages[0], np.float32([2.0]))
    # Only the first step waits for replicas: alone again, a's steps go on at once.
    gate.leave("b")
    assert gate.contribute(contribution("a", 2), 1, [T0], grads([5.0])).next_step == 2
    np.testing.assert_array_equal(recorder.calls[1][2][0], np.float32([5.0]))


def test_sync_a_single_member_with_one_replica_applies_each_step_at_once():
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC)
    for step in range(3):
        assert gate.contribute(contribution("a", step + 1), step, [T0],
                               grads([float(step)])).next_step == step + 1
    assert [c[2][0][0] for c in recorder.calls] == [0.0, 1.0, 2.0]


def test_sync_a_retried_contribution_in_the_same_step_is_counted_once(spawn):
    recorder, gate = sync_gate("ab")
    first = spawn(gate.contribute, contribution("a", 7), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a's push waits for b")
    retry = spawn(gate.contribute, contribution("a", 7), 0, [T0], grads([1.0]))  # same push
    blocked(gate, 2, "a's retry waits for b too")
    assert gate.contribute(contribution("b", 1), 0, [T0], grads([3.0])).next_step == 1
    assert first.result().next_step == retry.result().next_step == 1
    (contributions, _, averages), = recorder.calls
    assert sorted(c.client_id for c in contributions) == ["a", "b"]
    np.testing.assert_array_equal(averages[0], np.float32([2.0]))  # not (1 + 1 + 3) / 3


@pytest.mark.parametrize("how", ["leave", "retired"])
def test_sync_a_member_gone_while_the_others_wait_completes_the_step(spawn, how):
    recorder, gate = sync_gate("abc")
    a = spawn(gate.contribute, contribution("a"), 0, [T0, T1], grads([1.0], [2.0]))
    b = spawn(gate.contribute, contribution("b"), 0, [T0, T1], grads([3.0], [6.0]))
    blocked(gate, 2, "a and b wait for c")
    assert recorder.calls == []
    if how == "leave":
        gate.leave("c")
    else:
        gate.leave("c", 1)  # retired by the coordinator: declared dead
    assert a.result().next_step == b.result().next_step == 1
    (contributions, _, averages), = recorder.calls
    assert sorted(c.client_id for c in contributions) == ["a", "b"]
    np.testing.assert_array_equal(averages[0], np.float32([2.0]))
    np.testing.assert_array_equal(averages[1], np.float32([4.0]))
    # The next step needs a and b only.
    a = spawn(gate.contribute, contribution("a", 2), 1, [T0, T1], grads([0.0], [0.0]))
    blocked(gate, 1, "a waits for b")
    assert gate.contribute(contribution("b", 2), 1, [T0, T1],
                           grads([2.0], [2.0])).next_step == 2
    assert a.result().next_step == 2


def test_sync_a_failed_update_is_raised_by_every_contributor(spawn):
    error = InvalidArgument("the update failed")
    recorder = Recorder(fail=[error, RuntimeError("bug")])
    gate = make_gate(recorder)
    for client in "ab":
        gate.join(client, 1, SYNC)
    a = spawn(gate.contribute, contribution("a", 1), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    with pytest.raises(InvalidArgument) as caught_b:
        gate.contribute(contribution("b", 1), 0, [T0], grads([3.0]))
    with pytest.raises(InvalidArgument) as caught_a:
        a.result()
    assert caught_a.value is error and caught_b.value is error
    assert recorder.calls == [] and gate.current_step() == 1
    # Anything else is reported as a PSError (INTERNAL) naming the step, not lost.
    a = spawn(gate.contribute, contribution("a", 2), 1, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    with pytest.raises(PSError) as caught_b:
        gate.contribute(contribution("b", 2), 1, [T0], grads([3.0]))
    with pytest.raises(PSError) as caught_a:
        a.result()
    for caught in (caught_a, caught_b):
        assert caught.value.code == "INTERNAL"
        assert "step 1" in caught.value.message and "RuntimeError" in caught.value.message
    # The steps go on.
    a = spawn(gate.contribute, contribution("a", 3), 2, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    assert gate.contribute(contribution("b", 3), 2, [T0], grads([3.0])).next_step == 3
    assert a.result().next_step == 3
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_a_step_that_waits_too_long_raises_deadline_exceeded_naming_whom_it_waited_for():
    gate = make_gate(wait_s=0.2)
    for client in ("a", "slowpoke"):
        gate.join(client, 1, SYNC)
    with pytest.raises(StepTimeout) as caught:
        gate.contribute(contribution("a"), 0, [T0], grads([1.0]))
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert "slowpoke" in caught.value.message and "step 0" in caught.value.message
    # The push stays in its step: the caller must not push it again.
    assert "stays in step 0 and counts when the step is applied" in caught.value.message

    gate = make_gate(wait_s=0.2)
    for client in ("a", "slowpoke"):
        gate.join(client, 1, ssp(0))
    with pytest.raises(StepTimeout) as caught:
        gate.finish_step("a", 1, 0)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert "slowpoke" in caught.value.message and "ssp:0" in caught.value.message
    assert "This push was applied: pushed again, it would count twice" in caught.value.message


# ---- found wanting once: a refused join, two pushes of one step, a replica that left ------

def test_sync_replicas_do_not_hold_the_first_step_for_a_joiner_that_left(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC, replicas=2)
    gate.join("b", 1, SYNC)  # the second replica joined...
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    gate.leave("b", 1)  # ...and was declared dead before its first push
    try:
        assert len(recorder.calls) == 1  # leave() applies what the step has
        assert a.result().next_step == 1
    finally:
        if not a.done.is_set():  # release a: a second replica's gradient ends the step
            gate.join("c", 1, SYNC)
            gate.contribute(contribution("c"), 0, [T0], grads([1.0]))


def test_a_client_that_joins_steps_nobody_takes_part_in_starts_a_new_run(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC)
    assert gate.contribute(contribution("a"), 0, [T0], grads([1.0])).next_step == 1
    gate.leave("a", 1)
    # A new run, of two replicas: its first step waits for the second to join.
    gate.join("b", 1, SYNC, replicas=2)
    b = spawn(gate.contribute, contribution("b"), 1, [T0], grads([2.0]))
    blocked(gate, 1, "b waits for the second replica")
    assert len(recorder.calls) == 1
    gate.join("c", 1, SYNC, replicas=2)
    assert gate.contribute(contribution("c"), 1, [T0], grads([6.0])).next_step == 2
    assert b.result().next_step == 2
    np.testing.assert_array_equal(recorder.calls[1][2][0], np.float32([4.0]))


def test_a_fenced_incarnation_cannot_join():
    fenced = FencedIncarnation("client 'a' incarnation 1 is gone")

    def check_live(client_id, incarnation):
        if (client_id, incarnation) == ("a", 1):
            raise fenced

    gate = make_gate(check_live=check_live)
    with pytest.raises(FencedIncarnation) as caught:
        gate.join("a", 1, SYNC)
    assert caught.value is fenced and gate.stats().members == 0
    assert gate.join("a", 2, SYNC) == 0  # its newer incarnation may


def test_sync_a_contribution_the_update_leaves_out_raises_its_error_the_others_return(spawn):
    fenced = FencedIncarnation("client 'b' incarnation 1 is gone")
    calls = []

    def apply_average(contributions, targets, averages):
        calls.append(sorted(c.client_id for c in contributions))
        return {("b", 1, 1): fenced}  # (client, incarnation, sequence)

    gate = make_gate(apply_average)
    for client in "ab":
        gate.join(client, 1, SYNC)
    b = spawn(gate.contribute, contribution("b"), 0, [T0], grads([3.0]))
    blocked(gate, 1, "b waits for a")
    assert gate.contribute(contribution("a"), 0, [T0], grads([1.0])).next_step == 1
    with pytest.raises(FencedIncarnation) as caught:
        b.result()
    assert caught.value is fenced and calls == [["a", "b"]]


def test_close_wakes_every_waiting_push_with_unavailable_and_refuses_the_next(spawn):
    gate = make_gate()
    for client in "abc":
        gate.join(client, 1, SYNC)
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b and c")
    ssp_gate = make_gate()
    for client in "xy":
        ssp_gate.join(client, 1, ssp(0))
    x = spawn(ssp_gate.finish_step, "x", 1, 0)
    blocked(ssp_gate, 1, "x waits for y")
    for closing in (gate, ssp_gate):
        closing.close()
    for waiting in (a, x):
        with pytest.raises(PSError) as caught:
            waiting.result()
        assert caught.value.code == "UNAVAILABLE"
    with pytest.raises(PSError) as caught:
        gate.contribute(contribution("b"), 0, [T0], grads([1.0]))
    assert caught.value.code == "UNAVAILABLE"
    with pytest.raises(PSError) as caught:
        gate.join("d", 1, SYNC)
    assert caught.value.code == "UNAVAILABLE"
    assert gate.current_step() == 0  # the pending step was dropped, never applied


# ---- what metrics read ---------------------------------------------------------------------

def test_stats_count_every_answered_stepped_push_and_sum_their_waits(spawn):
    now = [100.0]
    gate = make_gate(clock=lambda: now[0])
    assert gate.stats().mode == "" and gate.stats().waits == 0
    for client in "ab":
        gate.join(client, 1, ssp(0))
    ahead = spawn(gate.finish_step, "a", 1, 0)  # one step ahead of b: waits for it
    blocked(gate, 1, "a waits for b")
    now[0] += 2.5
    gate.finish_step("b", 1, 0)  # the slowest: answered at once
    assert ahead.result().waited_s == 2.5
    stats = gate.stats()
    assert (stats.mode, stats.members, stats.waits, stats.waited_s) == ("ssp:0", 2, 2, 2.5)
    assert stats.staleness_max == 0 and stats.dropped_stale == 0


def test_sync_a_retry_of_a_push_whose_step_was_refused_gets_its_error_again(spawn):
    """A push whose step's update was refused whole, and whose answer was lost, is sent
    again under its sequence: it gets the step's error, not a 'dropped as late' success
    (nothing of it was applied). A new push of that old step is dropped as late."""
    error = InvalidArgument("the average is not finite")
    gate = make_gate(Recorder(fail=[error]))
    for client in "ab":
        gate.join(client, 1, SYNC)
    a = spawn(gate.contribute, contribution("a", 1), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    with pytest.raises(InvalidArgument):
        gate.contribute(contribution("b", 1), 0, [T0], grads([3.0]))
    with pytest.raises(InvalidArgument):
        a.result()
    with pytest.raises(InvalidArgument) as retried:
        gate.contribute(contribution("a", 1), 0, [T0], grads([1.0]))  # the same sequence
    assert retried.value is error
    late = gate.contribute(contribution("a", 2), 0, [T0], grads([1.0]))  # a new push
    assert late.stale_dropped and late.next_step == 1
