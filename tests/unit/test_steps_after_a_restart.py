"""StepGate (ps_server.consistency) after its server restarted: clients that took part in
its steps before join again saying where they were (the step they compute next, the members
they last heard of), and the restarted server's steps wait for those members as they did
before: the first sync step combines one gradient from each, and in ssp:K the first client
back runs at most K steps ahead of where the others are taken to be. A member that left or
was retired is not waited for, nor is one that has not come back within the bound of a
step's wait; a resume is ignored by a gate whose steps have run.

Calls that must block run in threads and are seen waiting on the gate's condition, as in
test_step_gate; the bound on the wait for members is passed on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from test_step_gate import (
    SYNC, T0, Recorder, blocked, contribution, grads, make_gate, ssp,
)


def test_sync_the_first_step_after_a_restart_waits_for_the_members_from_before(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("a", 1, SYNC, resume_step=5, peers=["a", "b"]) == 5
    assert gate.members() == ["a", "b"]  # b is awaited
    a = spawn(gate.contribute, contribution("a"), 5, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b, a member before the restart")
    assert recorder.calls == []
    assert gate.join("b", 1, SYNC, resume_step=5, peers=["a", "b"]) == 5
    outcome = gate.contribute(contribution("b"), 5, [T0], grads([3.0]))
    assert outcome.next_step == a.result().next_step == 6
    assert outcome.members == ("a", "b")
    (contributions, _, averaged), = recorder.calls
    assert sorted(c.client_id for c in contributions) == ["a", "b"]
    np.testing.assert_array_equal(averaged[0], np.float32([2.0]))


def test_sync_a_member_back_late_joins_the_step_the_first_one_set(spawn):
    """The second client back may have lost the answer of the step before the restart: it
    computes the step the restarted server is at, whatever it says it was at."""
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC, resume_step=5, peers=["a", "b"])
    assert gate.join("b", 1, SYNC, resume_step=4, peers=["a", "b"]) == 5


@pytest.mark.parametrize("how", ["left", "retired", "left before"])
def test_sync_a_member_that_left_or_was_retired_is_not_awaited(spawn, how):
    recorder = Recorder()
    gate = make_gate(recorder)
    if how == "left before":  # its LeaveSteps reached the restarted server first
        gate.leave("b", 1)
    gate.join("a", 1, SYNC, resume_step=2, peers=["a", "b"])
    a = spawn(gate.contribute, contribution("a"), 2, [T0], grads([1.0]))
    if how != "left before":
        blocked(gate, 1, "a waits for b")
        gate.leave("b", None if how == "left" else 1)
    assert a.result().next_step == 3
    assert len(recorder.calls) == 1 and gate.members() == ["a"]


def test_sync_the_wait_for_members_from_before_ends_at_the_bound_of_a_steps_wait(spawn):
    now = [100.0]
    recorder = Recorder()
    gate = make_gate(recorder, clock=lambda: now[0], wait_s=30.0)
    gate.join("a", 1, SYNC, resume_step=0, peers=["a", "gone"])
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for a member from before the restart")
    now[0] += 29.0
    with gate._changed:
        gate._changed.notify_all()
    blocked(gate, 1, "a still waits: within the bound")
    assert recorder.calls == []
    now[0] += 1.0
    with gate._changed:
        gate._changed.notify_all()
    assert a.result().next_step == 1
    assert len(recorder.calls) == 1 and gate.members() == ["a"]


def test_a_resume_is_ignored_once_the_steps_have_run(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    for client in "ab":
        gate.join(client, 1, SYNC)
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    gate.contribute(contribution("b"), 0, [T0], grads([1.0]))
    a.result()
    # c says it was at step 9 with x: this server has not restarted since its steps ran.
    assert gate.join("c", 1, SYNC, resume_step=9, peers=["x"]) == 1
    assert gate.members() == ["a", "b", "c"]


def test_a_client_that_joins_anew_after_a_restart_still_waits_for_the_members_from_before(
        spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC, resume_step=3, peers=["a", "b"])
    assert gate.join("new", 1, SYNC) == 3
    a = spawn(gate.contribute, contribution("a"), 3, [T0], grads([1.0]))
    new = spawn(gate.contribute, contribution("new"), 3, [T0], grads([1.0]))
    blocked(gate, 2, "both wait for b")
    gate.join("b", 1, SYNC, resume_step=3, peers=["a", "b"])
    gate.contribute(contribution("b"), 3, [T0], grads([4.0]))
    assert a.result().next_step == new.result().next_step == 4
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_ssp_the_first_client_back_runs_at_most_k_steps_ahead_of_its_peers(spawn):
    gate = make_gate()
    assert gate.join("a", 1, ssp(1), resume_step=5, peers=["a", "b"]) == 5
    assert gate.finish_step("a", 1, 5).next_step == 6  # one ahead of b, taken to be at 5
    ahead = spawn(gate.finish_step, "a", 1, 6)
    blocked(gate, 1, "a, two steps ahead of b")
    assert gate.join("b", 1, ssp(1), resume_step=5, peers=["a", "b"]) == 5
    blocked(gate, 1, "a still two steps ahead of b, now back")
    assert gate.finish_step("b", 1, 5).next_step == 6
    outcome = ahead.result()
    assert (outcome.next_step, outcome.staleness) == (7, 1)


def test_stepped_answers_name_the_members_and_those_awaited():
    gate = make_gate()
    gate.join("a", 1, ssp(3), resume_step=0, peers=["a", "b"])
    assert gate.finish_step("a", 1, 0).members == ("a", "b")
    gate.leave("b")
    assert gate.finish_step("a", 1, 1).members == ("a",)


def test_sync_a_client_that_joined_first_anew_keeps_the_count_and_waits_for_the_resumed(
        spawn):
    """A worker between two tasks joins the restarted server afresh before any client
    back from the steps before: the steps count from its join, and still wait for the
    peers the resumed client names."""
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("new", 1, SYNC) == 0
    assert gate.join("a", 1, SYNC, resume_step=7, peers=["a", "b", "new"]) == 0
    new = spawn(gate.contribute, contribution("new"), 0, [T0], grads([1.0]))
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 2, "both wait for b")
    assert gate.join("b", 1, SYNC, resume_step=7, peers=["a", "b"]) == 0
    gate.contribute(contribution("b"), 0, [T0], grads([4.0]))
    assert a.result().next_step == new.result().next_step == 1
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_ssp_a_client_back_late_starts_where_it_was(spawn):
    """b computes step 6 (its answer for step 5 came before the restart): a, back first
    and taken to have b beside it at 5, waits after its step 5 until b says where it is."""
    gate = make_gate()
    gate.join("a", 1, ssp(0), resume_step=5, peers=["a", "b"])
    ahead = spawn(gate.finish_step, "a", 1, 5)
    blocked(gate, 1, "a waits for b")
    assert gate.join("b", 1, ssp(0), resume_step=6, peers=["a", "b"]) == 6
    assert ahead.result().next_step == 6


def test_no_more_peers_are_awaited_than_the_steps_take_members():
    gate = make_gate(max_members=3)
    gate.join("a", 1, SYNC, resume_step=0, peers=[f"p{i}" for i in range(10)])
    assert len(gate.members()) == 1 + 3
