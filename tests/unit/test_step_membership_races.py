"""A stepped push whose client leaves the steps (LeaveSteps) while the push is being received,
right after its membership was checked. The mode it takes part in is read with that check:
a sync push is then refused whole by its step (never applied whole outside the average, then
refused), and an ssp push that was applied is answered as applied (nobody to wait for). The
interleaving is forced with events."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_common.consistency import parse_mode
from ps_common.errors import FailedPrecondition
from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta
from ps_server.ledger import PushLedger
from ps_server.push_staging import PushStaging
from ps_server.pushes import PushHeader, PushReceiver
from ps_server.store import ShardStore

WAIT_S = 10.0
SPEC = VariableSpec("w", (4,), initializer=Component.of("zeros"),
                    optimizer=Component.of({"name": "sgd", "lr": 1.0}))


def _receiver() -> tuple[ShardStore, PushLedger, PushReceiver]:
    store = ShardStore()
    store.assign(1, {"w": SPEC}, [Shard("w", 0, 0, 4, "s")])
    ledger = PushLedger()
    return store, ledger, PushReceiver(store, ledger, PushStaging(store.nbytes))


@pytest.mark.parametrize("mode", ["sync", "ssp:1"])
def test_a_stepped_push_whose_client_leaves_meanwhile_is_refused_whole_not_applied(mode):
    store, ledger, receiver = _receiver()
    gate = receiver.steps
    gate.join("a", 1, parse_mode(mode), replicas=2 if mode == "sync" else 1)
    gate.join("b", 1, parse_mode(mode), replicas=2 if mode == "sync" else 1)

    # The push's membership check passes; then the client's LeaveSteps (another thread)
    # is handled before the push goes on.
    checked, left = threading.Event(), threading.Event()
    real_check = gate.check_member

    def check_then_let_leave(client_id, incarnation):
        kind = real_check(client_id, incarnation)
        checked.set()
        assert left.wait(WAIT_S)
        return kind

    gate.check_member = check_then_let_leave

    def leave():
        assert checked.wait(WAIT_S)
        gate.leave("a", 1)  # what the LeaveSteps handler calls
        left.set()

    leaver = threading.Thread(target=leave, name="leave-steps")
    leaver.start()
    grad = np.ones(4, np.float32)
    header = PushHeader(client_id="a", incarnation=1, sequence=1, acked_through=0, epoch=1,
                        refs=[("w", 0)], metas=[TensorMeta("float32", (4,))], step=0)
    outcome = None
    try:
        try:
            outcome = receiver.receive_whole(header, memoryview(grad.tobytes()))
        except FailedPrecondition:
            pass
    finally:
        leaver.join(WAIT_S)
    assert not leaver.is_alive()

    (held,) = store.lookup([("w", 0)])
    if outcome is None:
        # Refused: then nothing of it may have been applied or recorded.
        np.testing.assert_array_equal(held.values, np.zeros(4, np.float32),
                                      err_msg="a refused stepped push was applied")
        assert held.updates == 0
        assert not ledger.applied("a", 1, 1)
    else:
        assert mode != "sync", "a sync push was answered without its step being applied"
        np.testing.assert_array_equal(held.values, -grad)  # applied once, whole
        assert ledger.applied("a", 1, 1)
