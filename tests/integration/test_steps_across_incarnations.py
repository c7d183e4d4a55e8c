"""sync steps across a client's incarnations (StepGate, ps_server/consistency.py): a new
incarnation's pushes are its own (its first is no retry of its predecessor's), and a step
waits for the live incarnation, not for a retired one's gradient. Each test failed before.

No test rests on timing. Interleavings are forced with hooks and events; where a test must
tell "this push would wait" from "this push returns", the server's step wait
(StepGate._wait_s, 30 s in the product) is set to 0 on the gate concerned: a push whose step
is applied (or whose ssp bound lets it through) returns at once, one that would wait raises
DEADLINE_EXCEEDED at once.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from ps_server.consistency import StepGate
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError

WAIT_S = 30.0  # bound of every event wait; never reached when the code is right


def gate(server) -> StepGate:
    return server._servicer.steps


def sgd() -> dict:
    return {"name": "sgd", "lr": 1.0}


def full(value: float) -> np.ndarray:
    return np.full(4, value, np.float32)


def member_incarnation(server, client_id: str):
    member = gate(server)._members.get(client_id)
    return None if member is None else member.incarnation


class Contributed:
    """Counts, per (incarnation, step), the pushes StepGate.contribute has taken into a
    server's pending sync step: it calls `copied` under the gate's lock once a push's
    gradients are summed (or found there already, for a retry), before the step can be
    applied or waited for."""

    def __init__(self, monkeypatch):
        self._counts: dict[tuple[int, int], int] = {}
        self._changed = threading.Condition()
        real = StepGate.contribute

        def contribute(gate_self, contribution, step, targets, grads, copied=None):
            def noted():
                if copied is not None:
                    copied()
                with self._changed:
                    key = (contribution.incarnation, step)
                    self._counts[key] = self._counts.get(key, 0) + 1
                    self._changed.notify_all()
            return real(gate_self, contribution, step, targets, grads, copied=noted)

        monkeypatch.setattr(StepGate, "contribute", contribute)

    def seen(self, incarnation: int, step: int, count: int = 1) -> bool:
        with self._changed:
            return self._counts.get((incarnation, step), 0) >= count

    def wait(self, incarnation: int, step: int, what: str, count: int = 1) -> None:
        with self._changed:
            assert self._changed.wait_for(
                lambda: self._counts.get((incarnation, step), 0) >= count, WAIT_S), what


def push_result(client: PSClient, grads: dict):
    """client.push(grads): None, or the RemoteError it raised."""
    try:
        client.push(grads)
        return None
    except RemoteError as error:
        return error


# ---- sync: a new incarnation of a client whose old one contributed to the pending step ---
#
# A client whose incarnation the coordinator retires while its push waits in a sync step
# (declared dead, or replaced: the same client id registered again) and whose new
# incarnation joins the steps. The pending step's contributions are keyed by client id and
# sequence only (ps_server/consistency.py _Step), and "every member contributed" compares
# client ids only (_maybe_apply): the retired incarnation's contribution passes for the new
# incarnation's.

@contextlib.contextmanager
def sync_pair(cluster):
    """Two clients in the sync steps (replicas=2) of "w" (4 float32, SGD lr 1)."""
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        yield a, b


@contextlib.contextmanager
def new_incarnation_of(cluster, server, old: PSClient):
    """A PSClient under `old`'s client id, in the sync steps: its incarnation, asked of the
    coordinator, retires `old`'s, which the server drops from its steps first."""
    with PSClient(cluster.coordinator_address, client_id=old.client_id) as again:
        assert again.incarnation > old.incarnation
        wait_until(lambda: member_incarnation(server, old.client_id) is None,
                   "the server drops the retired incarnation from the steps")
        again.join_steps("sync", replicas=2)
        yield again


def test_sync_a_new_incarnations_first_push_is_not_taken_for_its_retired_predecessors(
        make_cluster, spawn, monkeypatch):
    """The retired incarnation's waiting push was its first to this server (sequence 1);
    so is the new incarnation's (every PSClient numbers its pushes from 1). In step 0 the
    new push is taken for a retry of the old one ("a retry, under the same sequence, counts
    once"): its gradient is not added, and once a's push completes the step it is answered
    with the OLD incarnation's fence error (_left_out is keyed by client id and sequence).
    The client reads that FAILED_PRECONDITION as "not a member", joins again and sends the
    gradient of step 0 into step 1, where it waits for a's next step and is averaged with
    a's gradient of step 1."""
    contributed = Contributed(monkeypatch)
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    with sync_pair(cluster) as (a, b):
        old = spawn(push_result, b, {"w": full(100.0)})  # b's sequence 1, waits for a
        contributed.wait(b.incarnation, 0, "b's push is in the pending step 0")

        with new_incarnation_of(cluster, server, b) as again:
            new = spawn(push_result, again, {"w": full(1.0)})  # its sequence 1 too
            contributed.wait(again.incarnation, 0, "the new incarnation's push at step 0")
            a_error = push_result(a, {"w": full(3.0)})  # completes step 0
            after_step_0 = a.pull("w")
            wait_until(lambda: new.done.is_set() or contributed.seen(again.incarnation, 1),
                       "the new incarnation's push returns, or goes on into step 1")
            carried = not new.done.is_set()
            a.leave_steps()  # releases a push of the new incarnation left waiting in step 1
            new_error = new.result()
            old_error = old.result()

    assert a_error is None, a_error
    assert isinstance(old_error, RemoteError), "the retired incarnation's push returned"
    assert not carried, (
        "the live incarnation's push of step 0 was refused with its predecessor's fence "
        "and sent again into step 1")
    assert new_error is None, new_error
    # Step 0 holds the new incarnation's gradient: -(1 + 3) / 2 without the retired one's,
    # or -(100 + 1 + 3) / 3 with it (a retired contributor's gradient stays in the sum);
    # not -(100 + 3) / 2.
    assert after_step_0[0] in (np.float32(-2.0), np.float32(-104.0 / 3)), after_step_0


def test_sync_a_step_waits_for_the_new_incarnation_not_its_retired_predecessors_gradient(
        make_cluster, spawn, monkeypatch):
    """Step 1: b's push (its sequence 2) waits; b's incarnation is retired and its new
    incarnation joins at step 1. a's push then completes step 1 without the new
    incarnation (its id "contributed"), whose push of step 1 is dropped as late: the step
    averaged a gone incarnation's gradient and not the live member's ("each step, the
    servers average one gradient from every live worker")."""
    contributed = Contributed(monkeypatch)
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    with sync_pair(cluster) as (a, b):
        first = spawn(push_result, b, {"w": full(1.0)})
        assert push_result(a, {"w": full(1.0)}) is None  # step 0: w = -1
        assert first.result() is None

        old = spawn(push_result, b, {"w": full(100.0)})  # step 1, b's sequence 2
        contributed.wait(b.incarnation, 1, "b's push of step 1 is in the pending step")
        with new_incarnation_of(cluster, server, b) as again:
            assert member_incarnation(server, b.client_id) == again.incarnation
            a_push = spawn(push_result, a, {"w": full(3.0)})
            contributed.wait(a.incarnation, 1, "a's push of step 1 at the server")
            new_error = push_result(again, {"w": full(5.0)})
            a_error = a_push.result()
            old.result()
            values = a.pull("w")
            dropped = again.step_stats.dropped_stale

    assert (a_error, new_error) == (None, None), (a_error, new_error)
    assert dropped == 0, "the live incarnation's gradient of step 1 was dropped as late"
    # -1 - (3 + 5) / 2, or -1 - (100 + 3 + 5) / 3 with the retired one's gradient kept.
    assert values[0] in (np.float32(-5.0), np.float32(-1.0 - 108.0 / 3)), values
