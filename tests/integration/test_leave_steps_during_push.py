"""PSClient.leave_steps in one thread while a synchronous push of the same client is in flight
in another ("one PSClient may be used from many threads at once"). The LeaveSteps is made
to land on the server right after the push's membership check, with events. The push then
lands once, and its answer says what happened: the step refuses it (the client has left),
and the client sends it again as a push that waits for nobody, which is applied whole; a
'duplicate' answer to that second send is its own first send's, not another client's."""

from __future__ import annotations

import threading

import numpy as np

from ps_server.consistency import StepGate
from ps_worker import PSClient, RemoteError

WAIT_S = 10.0

SHARED_MEMORY = False


def test_a_sync_push_raced_by_leave_steps_is_averaged_or_refused_whole(make_cluster,
                                                                        monkeypatch, spawn):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer={"name": "sgd", "lr": 1.0})
        a.join_steps("sync", replicas=2)
        b.join_steps("sync", replicas=2)

        checked, left = threading.Event(), threading.Event()
        real_check = StepGate.check_member

        def check_then_let_leave(self, client_id, incarnation):
            kind = real_check(self, client_id, incarnation)
            if client_id == a.client_id and not checked.is_set():
                checked.set()
                assert left.wait(WAIT_S)
            return kind

        monkeypatch.setattr(StepGate, "check_member", check_then_let_leave)

        def leave():
            assert checked.wait(WAIT_S)
            try:
                a.leave_steps()
            finally:
                left.set()

        leaver = spawn(leave)
        error = None
        try:
            a.push({"w": np.full(4, 2.0, np.float32)})
        except RemoteError as raised:
            error = raised
        leaver.result()
        values = a.pull("w")

    assert error is None, f"the push failed: {error}"
    # Applied once, whole (b never pushed: no sync step of a's could have been applied).
    np.testing.assert_array_equal(values, np.full(4, -2.0, np.float32))
