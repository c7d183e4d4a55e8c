"""push_pull over gRPC (one PushThenPull call per server) answers as push(grads) then
pull(names) would: the push applied whatever becomes of the pull, and values read from what
the server holds after the push."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_server.pushes import PushReceiver
from ps_worker import PSClient, RemoteError

SHARED_MEMORY = False  # PushThenPull is the gRPC path
SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(servers=1)


def test_push_pull_whose_narrowed_pull_is_out_of_range_still_applies_its_push(cluster):
    """A pull whose values are past its wire dtype is refused (OUT_OF_RANGE) after the push
    was applied. The first time a server saw such a pull it remembered it
    (ps_server.unary_pulls), converting the values to the wire dtype before the push was
    applied: the OutOfRange ended the whole call and the push was lost, while the same call
    made again (the pull now remembered) applied it."""
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        ps.declare("w", (4,), init={"name": "constant", "value": 1e5}, optimizer=SGD1)
        for step in (1, 2):
            with pytest.raises(RemoteError) as caught:
                ps.push_pull({"w": np.ones(4, np.float32)}, "w", wire_dtype="float16")
            assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE, caught.value
            # As push() then pull(): the push went, the pull was refused.
            np.testing.assert_array_equal(ps.pull("w"), np.float32(1e5) - step,
                                          err_msg=f"push_pull number {step}")


def test_push_pull_never_answers_values_of_a_shard_replaced_while_its_push_ran(
        cluster, monkeypatch):
    """The values a push_pull brings back are read from what the server holds after its push
    was applied (or refused as such a pull would be). PushThenPull checks its pull before the
    push; a shard dropped and placed anew while the push ran (a wait for an ssp/sync step,
    an assignment) was answered from the dropped shard: values the server no longer held."""
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        ps.declare("w", (4,), init="zeros", optimizer=SGD1)
        ps.declare("v", (4,), init={"name": "constant", "value": 5.0}, optimizer=SGD1)
        ps.push({"v": np.ones(4, np.float32)})  # v holds trained values: 4.0
        shard_map = ps.refresh()
        mine = shard_map.shards_on(server.server_id)
        real = PushReceiver.receive_whole

        def receive_whole_then_replace_v(self, header, data):
            outcome = real(self, header, data)
            # While the call is between its push and its pull's answer: v is superseded
            # and dropped, then placed here again afresh (its initializer: 5.0).
            epoch = server.store.epoch
            server.store.assign(epoch + 1, shard_map.variables,
                                [s for s in mine if s.variable != "v"],
                                superseded=frozenset({("v", 0)}))
            server.store.assign(epoch + 2, shard_map.variables, mine)
            return outcome

        monkeypatch.setattr(PushReceiver, "receive_whole", receive_whole_then_replace_v)
        try:
            pulled = ps.push_pull({"w": np.ones(4, np.float32)}, "v")
        except RemoteError as error:  # refused as a stale pull would be: fine
            assert error.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
            return
        finally:
            monkeypatch.undo()
        held_now = server.store.lookup([("v", 0)])[0].values
        np.testing.assert_array_equal(held_now, 5.0)
        np.testing.assert_array_equal(pulled, held_now)  # not the dropped shard's 4.0
