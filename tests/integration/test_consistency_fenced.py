"""Consistency steps and a client whose incarnation the coordinator retired (declared dead,
or replaced by a newer incarnation of the same client id) while it was still running.

The servers fence its incarnation and the steps stop waiting for it (docs/architecture.md
5.3). A fenced incarnation still running gets FAILED_PRECONDITION for its push and cannot
join the steps again (JoinSteps refuses it as its push is refused); a push of it that was
waiting in a sync step fails while the live clients' step is applied (its gradient counts
in that step, as one of a client that left while its push waited does)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError

WAIT_S = 30.0


def gate(server):
    return server._servicer.steps


def sgd() -> dict:
    return {"name": "sgd", "lr": 1.0}


def member_incarnation(server, client_id: str):
    member = gate(server)._members.get(client_id)
    return None if member is None else member.incarnation


@pytest.mark.parametrize("mode", ["sync", "ssp:0"])
def test_a_retired_incarnation_that_pushes_again_is_refused_and_holds_no_live_client(
        make_cluster, spawn, mode):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    # The product's 30 s bound on a step's wait, shortened: a correct server never waits
    # here (the live client is alone in the steps once the other is fenced).
    gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps(mode)
        first = spawn(b.push, {"w": np.full(4, 3.0, np.float32)})
        a.push({"w": np.full(4, 1.0, np.float32)})
        first.result()
        expected = -4.0 if mode != "sync" else -2.0
        np.testing.assert_array_equal(a.pull("w"), np.full(4, expected, np.float32))
        old = b.incarnation
        # The same client id registers again (b's process restarted while the old one, say
        # stalled or cut off, still runs): the coordinator retires b's old incarnation.
        with PSClient(cluster.coordinator_address, client_id=b.client_id) as again:
            assert again.incarnation > old
            wait_until(lambda: member_incarnation(server, b.client_id) is None,
                       "the servers drop b's retired incarnation from the steps")
            # The old incarnation, still running, pushes: it is fenced.
            late = spawn(b.push, {"w": np.full(4, 100.0, np.float32)})
            wait_until(lambda: late.done.is_set()
                       or member_incarnation(server, b.client_id) == old,
                       "b's fenced push refused, or b back in the steps")
            # a is the only live client taking part: its step is applied alone.
            a.push({"w": np.full(4, 1.0, np.float32)})
            np.testing.assert_array_equal(a.pull("w"), np.full(4, expected - 1.0, np.float32))
            with pytest.raises(RemoteError) as caught:
                late.result()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_sync_a_contributor_retired_while_its_push_waits_does_not_fail_the_live_clients_step(
        make_cluster, spawn):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        # b's gradient of step 0 waits at the server for a's.
        waiting = spawn(b.push, {"w": np.full(4, 3.0, np.float32)})
        wait_until(lambda: gate(server)._pending.contributions, "b's push of step 0 pending")
        # b's incarnation is retired (declared gone) while its push waits.
        with PSClient(cluster.coordinator_address, client_id=b.client_id) as again:
            assert again.incarnation > b.incarnation
            wait_until(lambda: member_incarnation(server, b.client_id) is None,
                       "the servers drop b's retired incarnation from the steps")
            # a, the live client, pushes its step: it is applied, never refused because of
            # another client; the retired client's gradient, in the step's sum, counts.
            a.push({"w": np.full(4, 1.0, np.float32)})
            np.testing.assert_array_equal(a.pull("w"), np.full(4, -2.0, np.float32))
            assert a.step_stats.dropped_stale == 0
            with pytest.raises(RemoteError):
                waiting.result()
