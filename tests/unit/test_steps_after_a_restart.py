"""StepGate (ps_server.consistency), and the answers of PushReceiver, after their server
restarted: clients that took part in its steps before join again saying where they were
(the step they compute next, the members they last heard of), and the restarted server's
steps wait for those members as they did before: the first sync step combines one gradient
from each, and in ssp:K nobody runs more than K steps ahead of where the others are taken to
be. A member that left or was retired is not waited for, nor is one that has not come back
within the bound of a step's wait; a server running for longer than its restart window
ignores resumes. Every stepped answer names the members, and one to a client that takes no
part in the steps names none.

Calls that must block run in threads and are seen waiting on the gate's condition, as in
test_step_gate; the bound on the wait for members is passed on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.errors import FailedPrecondition, InvalidArgument
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.consistency import MAX_STEP_CLIENT_ID
from ps_server.ledger import PushLedger
from ps_server.push_staging import PushStaging
from ps_server.pushes import PushHeader, PushReceiver
from ps_server.store import ShardStore
from ps_server.testing import wait_until
from test_step_gate import (
    SYNC, T0, Recorder, blocked, contribution, grads, make_gate, ssp,
)


def ids(*client_ids: str) -> list[tuple[str, int]]:
    """(client_id, incarnation 1) of each: peers and members as the gate takes and gives."""
    return [(c, 1) for c in client_ids]


def clocked_gate(**kwargs):
    """(now, recorder, gate): a gate on a fake clock (`now[0]`, seconds) with the product's
    30 s bound on a step's wait, and the recorder of its applied steps."""
    now = [100.0]
    recorder = Recorder()
    return now, recorder, make_gate(recorder, clock=lambda: now[0], wait_s=30.0, **kwargs)


def test_sync_the_first_step_after_a_restart_waits_for_the_members_from_before(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("a", 1, SYNC, resume_step=5, peers=ids("a", "b")) == 5
    assert gate.members() == ids("a", "b")  # b is awaited
    a = spawn(gate.contribute, contribution("a"), 5, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b, a member before the restart")
    assert recorder.calls == []
    assert gate.join("b", 1, SYNC, resume_step=5, peers=ids("a", "b")) == 5
    outcome = gate.contribute(contribution("b"), 5, [T0], grads([3.0]))
    assert outcome.next_step == a.result().next_step == 6
    assert outcome.members == tuple(ids("a", "b"))
    (contributions, _, averaged), = recorder.calls
    assert sorted(c.client_id for c in contributions) == ["a", "b"]
    np.testing.assert_array_equal(averaged[0], np.float32([2.0]))


def test_sync_a_member_back_late_joins_the_step_the_first_one_set(spawn):
    """The second client back may have lost the answer of the step before the restart: it
    computes the step the restarted server is at, whatever it says it was at."""
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC, resume_step=5, peers=ids("a", "b"))
    assert gate.join("b", 1, SYNC, resume_step=4, peers=ids("a", "b")) == 5


@pytest.mark.parametrize("how", ["left", "retired", "left before"])
def test_sync_a_member_that_left_or_was_retired_is_not_awaited(spawn, how):
    recorder = Recorder()
    gate = make_gate(recorder)
    if how == "left before":  # its LeaveSteps reached the restarted server first
        gate.leave("b", 1)
    gate.join("a", 1, SYNC, resume_step=2, peers=ids("a", "b"))
    a = spawn(gate.contribute, contribution("a"), 2, [T0], grads([1.0]))
    if how != "left before":
        blocked(gate, 1, "a waits for b")
        gate.leave("b", None if how == "left" else 1)
    assert a.result().next_step == 3
    assert len(recorder.calls) == 1 and gate.members() == ids("a")


def test_sync_the_wait_for_members_from_before_ends_at_the_bound_of_a_steps_wait(spawn):
    now, recorder, gate = clocked_gate()
    gate.join("a", 1, SYNC, resume_step=0, peers=ids("a", "gone"))
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
    assert len(recorder.calls) == 1 and gate.members() == ids("a")


def test_a_resume_is_ignored_by_a_server_running_for_longer_than_the_restart_window(spawn):
    now, recorder, gate = clocked_gate()
    for client in "ab":
        gate.join(client, 1, SYNC)  # the first join opens the window: 30 s
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    gate.contribute(contribution("b"), 0, [T0], grads([1.0]))
    a.result()
    now[0] += 30.0
    # c says it was at step 9 with x: this server has not restarted lately.
    assert gate.join("c", 1, SYNC, resume_step=9, peers=ids("x")) == 1
    assert gate.members() == ids("a", "b", "c")


def test_a_client_back_after_another_made_steps_alone_still_brings_its_peers(spawn):
    """c joined the restarted server afresh (a worker between two tasks) and made a step
    there alone before anyone from before came back: a, back within the restart window,
    still names b, and the steps wait for b from then on."""
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("c", 1, SYNC)
    assert gate.contribute(contribution("c"), 0, [T0], grads([1.0])).next_step == 1
    assert gate.join("a", 1, SYNC, resume_step=7, peers=ids("a", "b", "c")) == 1
    assert gate.members() == ids("a", "b", "c")  # b awaited
    a = spawn(gate.contribute, contribution("a"), 1, [T0], grads([1.0]))
    c = spawn(gate.contribute, contribution("c", 2), 1, [T0], grads([1.0]))
    blocked(gate, 2, "a and c wait for b")
    gate.join("b", 1, SYNC, resume_step=7, peers=ids("a", "b", "c"))
    gate.contribute(contribution("b"), 1, [T0], grads([4.0]))
    assert a.result().next_step == c.result().next_step == 2
    np.testing.assert_array_equal(recorder.calls[1][2][0], np.float32([2.0]))


def test_the_newest_retirements_are_those_kept_when_there_are_many(spawn):
    """A restarted server reads the coordinator's retirements oldest first, up to the whole
    job's: it keeps as many as its steps take members, the newest, which are those a peers
    list may still name."""
    recorder = Recorder()
    gate = make_gate(recorder, max_members=4)
    for i in range(10):
        gate.leave(f"closed-long-ago-{i}", 1)
    gate.leave("c", 1)  # declared dead just before the restart
    gate.join("a", 1, SYNC, resume_step=3, peers=ids("a", "b", "c"))
    gate.join("b", 1, SYNC, resume_step=3, peers=ids("a", "b", "c"))
    assert gate.members() == ids("a", "b")
    a = spawn(gate.contribute, contribution("a"), 3, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b")
    assert gate.contribute(contribution("b"), 3, [T0], grads([3.0])).next_step == 4
    assert a.result().next_step == 4


def test_a_client_that_joins_anew_after_a_restart_still_waits_for_the_members_from_before(
        spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.join("a", 1, SYNC, resume_step=3, peers=ids("a", "b"))
    assert gate.join("new", 1, SYNC) == 3
    a = spawn(gate.contribute, contribution("a"), 3, [T0], grads([1.0]))
    new = spawn(gate.contribute, contribution("new"), 3, [T0], grads([1.0]))
    blocked(gate, 2, "both wait for b")
    gate.join("b", 1, SYNC, resume_step=3, peers=ids("a", "b"))
    gate.contribute(contribution("b"), 3, [T0], grads([4.0]))
    assert a.result().next_step == new.result().next_step == 4
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_ssp_the_first_client_back_runs_at_most_k_steps_ahead_of_its_peers(spawn):
    gate = make_gate()
    assert gate.join("a", 1, ssp(1), resume_step=5, peers=ids("a", "b")) == 5
    assert gate.finish_step("a", 1, 5).next_step == 6  # one ahead of b, taken to be at 5
    ahead = spawn(gate.finish_step, "a", 1, 6)
    blocked(gate, 1, "a, two steps ahead of b")
    assert gate.join("b", 1, ssp(1), resume_step=5, peers=ids("a", "b")) == 5
    blocked(gate, 1, "a still two steps ahead of b, now back")
    assert gate.finish_step("b", 1, 5).next_step == 6
    outcome = ahead.result()
    assert (outcome.next_step, outcome.staleness) == (7, 1)


def test_stepped_answers_name_the_members_and_those_awaited():
    gate = make_gate()
    gate.join("a", 1, ssp(3), resume_step=0, peers=ids("a", "b"))
    assert gate.finish_step("a", 1, 0).members == tuple(ids("a", "b"))
    gate.leave("b")
    assert gate.finish_step("a", 1, 1).members == tuple(ids("a"))


def test_sync_a_client_that_joined_first_anew_keeps_the_count_and_waits_for_the_resumed(
        spawn):
    """A worker between two tasks joins the restarted server afresh before any client
    back from the steps before: the steps count from its join, and still wait for the
    peers the resumed client names."""
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("new", 1, SYNC) == 0
    assert gate.join("a", 1, SYNC, resume_step=7, peers=ids("a", "b", "new")) == 0
    new = spawn(gate.contribute, contribution("new"), 0, [T0], grads([1.0]))
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 2, "both wait for b")
    assert gate.join("b", 1, SYNC, resume_step=7, peers=ids("a", "b")) == 0
    gate.contribute(contribution("b"), 0, [T0], grads([4.0]))
    assert a.result().next_step == new.result().next_step == 1
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_ssp_a_client_back_late_starts_where_it_was(spawn):
    """b computes step 6 (its answer for step 5 came before the restart): a, back first
    and taken to have b beside it at 5, waits after its step 5 until b says where it is."""
    gate = make_gate()
    gate.join("a", 1, ssp(0), resume_step=5, peers=ids("a", "b"))
    ahead = spawn(gate.finish_step, "a", 1, 5)
    blocked(gate, 1, "a waits for b")
    assert gate.join("b", 1, ssp(0), resume_step=6, peers=ids("a", "b")) == 6
    assert ahead.result().next_step == 6


def test_no_more_peers_are_awaited_than_the_steps_take_members():
    gate = make_gate(max_members=3)
    gate.join("a", 1, SYNC, resume_step=0, peers=[(f"p{i}", 1) for i in range(10)])
    assert len(gate.members()) == 1 + 3


def test_sync_a_member_joining_again_with_a_resume_keeps_the_first_steps_replicas(spawn):
    """A client whose first push timed out waiting for its second replica joins again
    saying where it was: this server counts it still (it never restarted), so the resume
    is no restart's and the first step still waits for both replicas."""
    recorder = Recorder()
    gate = make_gate(recorder)
    assert gate.join("a", 1, SYNC, replicas=2) == 0
    assert gate.join("a", 1, SYNC, replicas=2, resume_step=0, peers=ids("a")) == 0
    a = spawn(gate.contribute, contribution("a"), 0, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for its second replica")
    assert recorder.calls == []
    assert gate.join("b", 1, SYNC, replicas=2) == 0
    gate.contribute(contribution("b"), 0, [T0], grads([3.0]))
    assert a.result().next_step == 1
    np.testing.assert_array_equal(recorder.calls[0][2][0], np.float32([2.0]))


def test_ssp_a_peer_declared_dead_after_the_restart_is_not_awaited_again(spawn):
    """In ssp the steps run while members from before the restart are awaited: one back
    later, whose last answer named a client declared dead meanwhile, does not bring it
    back among the awaited."""
    gate = make_gate()
    assert gate.join("a", 1, ssp(1), resume_step=5, peers=ids("a", "b", "c")) == 5
    gate.leave("c", 1)  # retired by the coordinator
    assert gate.members() == ids("a", "b")
    assert gate.finish_step("a", 1, 5).next_step == 6
    assert gate.join("b", 1, ssp(1), resume_step=5, peers=ids("a", "b", "c")) == 5
    assert gate.finish_step("b", 1, 5).next_step == 6
    assert gate.finish_step("a", 1, 6).next_step == 7  # within K of b: c is not awaited
    assert gate.members() == ids("a", "b")


def test_a_retired_older_incarnation_does_not_stop_the_wait_for_the_newer_one(spawn):
    recorder = Recorder()
    gate = make_gate(recorder)
    gate.leave("b", 1)  # the coordinator's log, read again: b's incarnation 1 retired
    gate.join("a", 1, SYNC, resume_step=4, peers=[("a", 1), ("b", 2)])
    assert gate.members() == [("a", 1), ("b", 2)]
    gate.leave("b", 1)  # again, after the resume
    a = spawn(gate.contribute, contribution("a"), 4, [T0], grads([1.0]))
    blocked(gate, 1, "a waits for b's incarnation 2")
    gate.join("b", 2, SYNC, resume_step=4, peers=[("a", 1), ("b", 2)])
    gate.contribute(contribution("b", incarnation=2), 4, [T0], grads([3.0]))
    assert a.result().next_step == 5 and len(recorder.calls) == 1


def test_leaves_of_ids_no_member_could_have_keep_nothing():
    gate = make_gate(max_members=4)
    for i in range(32):
        gate.leave(f"{i:04d}" + "x" * (1 << 20), 1)  # longer than a member's id may be
    for i in range(32):
        gate.leave(f"c{i}", 1)
    assert list(gate._gone) == ["c28", "c29", "c30", "c31"]  # as many as members, newest


def test_a_join_with_an_id_longer_than_members_may_have_is_refused():
    gate = make_gate()
    with pytest.raises(InvalidArgument):
        gate.join("x" * (MAX_STEP_CLIENT_ID + 1), 1, SYNC)
    with pytest.raises(InvalidArgument):
        gate.join("a", 1, SYNC, resume_step=0, peers=[("y" * (MAX_STEP_CLIENT_ID + 1), 1)])
    assert gate.members() == []


def test_ssp_awaited_members_are_taken_at_the_lowest_step_back_beside_a_fresh_joiner(spawn):
    """c joined the restarted server afresh and made 10 steps alone; a, back, joins at c's
    step and names b, which is taken to be at the lowest step back (10), not at 0: c's step
    10 (11 done, within K = 1) goes through."""
    gate = make_gate()
    gate.join("c", 1, ssp(1))
    for step in range(10):
        gate.finish_step("c", 1, step)
    assert gate.join("a", 1, ssp(1), resume_step=7, peers=ids("a", "b", "c")) == 10
    assert gate.members() == ids("a", "b", "c")  # b awaited
    step_10 = spawn(gate.finish_step, "c", 1, 10)
    wait_until(lambda: step_10.done.is_set() or gate._changed.waiting == 1,
               "c's step 10 answered, or held in the gate")
    if not step_10.done.is_set():
        gate.leave("b")  # (lets it go: the test fails below)
    assert step_10.result().next_step == 11 and ("b", 1) in gate.members(), \
        "c, one step past the lowest step back, was held for b"
    ahead = spawn(gate.finish_step, "c", 1, 11)  # 12 done: two past b's assumed 10
    blocked(gate, 1, "c waits for b")
    gate.join("b", 1, ssp(1), resume_step=10, peers=ids("a", "b", "c"))
    gate.finish_step("a", 1, 10)
    gate.finish_step("b", 1, 10)
    assert ahead.result().next_step == 12


def test_sync_an_awaited_member_keeps_its_place_under_the_member_bound():
    """--max-streams 2: a is back and b awaited; c, joining afresh, is refused (as it would
    have been before the restart), and b finds its place."""
    gate = make_gate(max_members=2)
    gate.join("a", 1, SYNC, resume_step=4, peers=ids("a", "b"))
    with pytest.raises(FailedPrecondition, match="--max-streams"):
        gate.join("c", 1, SYNC)
    assert gate.join("b", 1, SYNC, resume_step=4, peers=ids("a", "b")) == 4


SPEC = VariableSpec("w", (4,), initializer=Component.of("zeros"),
                    optimizer=Component.of({"name": "sgd", "lr": 1.0}))
ONES = memoryview(np.ones(4, np.float32).tobytes())


def receiver() -> PushReceiver:
    store = ShardStore()
    store.assign(1, {"w": SPEC}, [Shard("w", 0, 0, 4, "s")])
    return PushReceiver(store, PushLedger(), PushStaging(store.nbytes))


def header(client: str, sequence: int, step: int) -> PushHeader:
    return PushHeader(client_id=client, incarnation=1, sequence=sequence, acked_through=0,
                      epoch=1, refs=[("w", 0)], metas=[TensorMeta("float32", (4,))], step=step)


def test_sync_the_answer_to_a_retried_push_names_the_members(spawn):
    pushes = receiver()
    for client in "ab":
        pushes.steps.join(client, 1, SYNC)
    first = spawn(pushes.receive_whole, header("a", 1, 0), ONES)
    wait_until(lambda: pushes.steps._pending.contributions, "a's push of step 0 pending")
    pushes.receive_whole(header("b", 1, 0), ONES)
    assert first.result().members == tuple(ids("a", "b"))
    again = pushes.receive_whole(header("a", 1, 0), ONES)  # its answer was lost
    assert again.duplicate and again.members == tuple(ids("a", "b"))


def test_a_stepped_answer_to_a_client_that_takes_no_part_names_no_members():
    """A restarted server, its ledger restored, where c joined afresh: a's push of an ssp
    step recorded before the restart is retried there. a takes no part in these steps:
    its answer names no members (naming c would make a's client forget b)."""
    pushes = receiver()
    with pushes._ledger.exactly_once("a", 1, 5, 0) as duplicate:  # recorded before
        assert not duplicate
    pushes.steps.join("c", 1, ssp(1))
    outcome = pushes.receive_whole(header("a", 5, 3), ONES)
    assert outcome.duplicate and outcome.members == ()


def test_a_member_given_up_long_ago_holds_no_place_and_is_named_nowhere():
    """a is back naming b, then leaves before any push: nobody pushes when the bound of the
    wait for b passes. Long after, b holds no place under --max-streams, no answer names
    it, and a new run's clients join as on any server."""
    now, _, gate = clocked_gate(max_members=2)
    assert gate.join("a", 1, SYNC, resume_step=5, peers=ids("a", "b")) == 5
    now[0] += 1.0
    gate.leave("a", 1)
    now[0] = 1000.0
    assert gate.members() == []
    gate.join("c", 1, SYNC, replicas=2)
    gate.join("d", 1, SYNC, replicas=2)
    assert gate.members() == ids("c", "d")


def test_sync_a_member_given_up_long_ago_joins_at_the_current_step(spawn):
    now, recorder, gate = clocked_gate()
    assert gate.join("a", 1, SYNC, resume_step=5, peers=ids("a")) == 5
    assert gate.contribute(contribution("a"), 5, [T0], grads([1.0])).next_step == 6
    now[0] += 1.0
    assert gate.join("d", 1, SYNC, resume_step=6, peers=ids("a", "b", "d")) == 6  # b awaited
    gate.leave("a", 1)
    gate.leave("d", 1)
    now[0] = 1000.0
    # No resume long after the window, though b was awaited once: a new run, replicas=2.
    assert gate.join("b", 1, SYNC, replicas=2, resume_step=40, peers=ids("a", "b", "d")) == 6
    b = spawn(gate.contribute, contribution("b"), 6, [T0], grads([1.0]))
    blocked(gate, 1, "b's first step waits for its second replica")
    assert len(recorder.calls) == 1
    gate.join("e", 1, SYNC, replicas=2)
    gate.contribute(contribution("e"), 6, [T0], grads([3.0]))
    assert b.result().next_step == 7 and len(recorder.calls) == 2


def test_ssp_a_second_wait_after_a_restart_takes_its_floor_afresh(spawn):
    """a and b are back (the first wait, at step 5, is over) and run to step 20; d is back
    within the window naming e: e is taken at the lowest step back now (20), not at 5."""
    now, _, gate = clocked_gate()
    assert gate.join("a", 1, ssp(1), resume_step=5, peers=ids("a", "b")) == 5
    assert gate.join("b", 1, ssp(1), resume_step=5, peers=ids("a", "b")) == 5
    for step in range(5, 20):
        gate.finish_step("a", 1, step)
        gate.finish_step("b", 1, step)
    now[0] += 1.0
    assert gate.join("d", 1, ssp(1), resume_step=20, peers=ids("a", "b", "d", "e")) == 20
    assert ("e", 1) in gate.members()
    step_20 = spawn(gate.finish_step, "a", 1, 20)  # 21 done: within K of 20
    wait_until(lambda: step_20.done.is_set() or gate._changed.waiting == 1,
               "a's step 20 answered, or held in the gate")
    if not step_20.done.is_set():
        gate.leave("e")  # (lets it go: the test fails below)
    assert step_20.result().next_step == 21 and ("e", 1) in gate.members(), \
        "a, one step past everyone back, was held for e taken at the first wait's floor"
