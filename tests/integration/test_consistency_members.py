"""Who takes part in a server's ssp/sync steps, and what a step does when a client is
retired, pushes to only some servers, joins after an earlier run, or when the server stops
or has no room for more clients. Several tests shorten the product's 30 s bound on a step's
wait (StepGate._wait_s): a correct server never reaches it there."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_server.consistency import MAX_STEP_CLIENT_ID
from ps_server.servicer import MAX_STEP_PEERS
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError


def gate(server):
    return server._servicer.steps


def sgd() -> dict:
    return {"name": "sgd", "lr": 1.0}


def one_server_with_short_steps(make_cluster):
    """(cluster, server): one server whose step wait is 5 s instead of the product's 30 s
    bound (a correct server never reaches it in these tests)."""
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    gate(server)._wait_s = 5.0
    return cluster, server


# ---- Clients the coordinator retired -----------------------------------------------------
#
# Consistency steps and a client whose incarnation the coordinator retired (declared dead,
# or replaced by a newer incarnation of the same client id) while it was still running.
#
# The servers fence its incarnation and the steps stop waiting for it (docs/architecture.md
# 5.3). A fenced incarnation still running gets FAILED_PRECONDITION for its push and cannot
# join the steps again (JoinSteps refuses it as its push is refused); a push of it that was
# waiting in a sync step fails while the live clients' step is applied (its gradient counts
# in that step, as one of a client that left while its push waited does).

def member_incarnation(server, client_id: str):
    member = gate(server)._members.get(client_id)
    return None if member is None else member.incarnation


@pytest.mark.parametrize("mode", ["sync", "ssp:0"])
def test_a_retired_incarnation_that_pushes_again_is_refused_and_holds_no_live_client(
        make_cluster, spawn, mode):
    cluster, server = one_server_with_short_steps(make_cluster)
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
    cluster, server = one_server_with_short_steps(make_cluster)
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


# ---- Pushes that touch only some servers -------------------------------------------------
#
# Consistency steps and a stepped push that touches only some of the servers.
#
# A push of a client that joined the steps is its step on every server (PSClient.join_steps):
# a server its gradients do not go to gets an empty push, which counts as the client's step
# there (ssp: finished; sync: a contribution of no gradients, each shard averaging the
# gradients it got). The other clients are not held there waiting for it.

@pytest.mark.parametrize("mode", ["sync", "ssp:0"])
def test_a_push_of_one_servers_variables_finishes_the_clients_step_on_every_server(
        make_cluster, spawn, mode):
    cluster = make_cluster(servers=2)
    for server in cluster.servers:
        # The product's 30 s bound on a step's wait, shortened (never reached when right:
        # both clients push their step at once).
        gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        for name in ("w", "v"):
            a.declare(name, (4,), optimizer=sgd())
        shard_map = a.refresh()
        holders = {name: {s.server_id for s in shard_map.shards_of(name)} for name in "wv"}
        assert holders["w"] != holders["v"], holders  # one variable per server
        cluster.wait_until_synced()
        for ps in (a, b):
            ps.join_steps(mode)
        # Step 0: b has gradients of both variables, a of "w" only (none for "v" this step).
        both = spawn(b.push, {"w": np.full(4, 1.0, np.float32),
                              "v": np.full(4, 1.0, np.float32)})
        a.push({"w": np.full(4, 3.0, np.float32)})
        both.result()
        values = a.pull(["w", "v"])
        w_expected = -2.0 if mode == "sync" else -4.0
        np.testing.assert_array_equal(values["w"], np.full(4, w_expected, np.float32))
        np.testing.assert_array_equal(values["v"], np.full(4, -1.0, np.float32))


# ---- replicas on servers whose steps ran before ------------------------------------------
#
# `join_steps("sync", replicas=N)` on servers whose steps ran before.
#
# In sync, the first step waits until `replicas` clients have joined (README). A client that
# joins steps nobody takes part in starts a new run there: after an earlier run (sync or
# ssp:K) whose clients all left, the first step of the new pair waits for the second replica
# and is the average of both gradients, as on fresh servers.

@pytest.mark.parametrize("before", ["sync", "ssp:1"])
def test_sync_replicas_hold_the_first_step_of_a_new_run_on_servers_that_ran_steps(
        make_cluster, spawn, before):
    cluster = make_cluster(servers=1)
    server = cluster.servers[0]
    # The product's 30 s bound on a step's wait, shortened (never reached when it is right).
    gate(server)._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", (4,), optimizer=sgd())
    # A first run: two clients take part in steps, push once, and leave.
    with PSClient(cluster.coordinator_address) as r0, \
            PSClient(cluster.coordinator_address) as r1:
        for ps in (r0, r1):
            ps.join_steps(before, replicas=2) if before == "sync" else ps.join_steps(before)
        first = spawn(r0.push, {"w": np.full(4, 1.0, np.float32)})
        r1.push({"w": np.full(4, 1.0, np.float32)})
        first.result()
        for ps in (r0, r1):
            ps.leave_steps()
        start = r0.pull("w")
    assert gate(server).stats().members == 0
    # The same script again: rank 0 starts first.
    with PSClient(cluster.coordinator_address) as r0, \
            PSClient(cluster.coordinator_address) as r1:
        r0.join_steps("sync", replicas=2)
        pushed = spawn(r0.push, {"w": np.full(4, 2.0, np.float32)})
        wait_until(lambda: pushed.done.is_set() or gate(server)._pending.contributions,
                   "rank 0's push of its first step at the server")
        assert not pushed.done.is_set(), \
            "rank 0's first step was applied alone: replicas=2 was not honoured"
        r1.join_steps("sync", replicas=2)
        r1.push({"w": np.full(4, 6.0, np.float32)})
        pushed.result()
        # One step: the average (2 + 6) / 2 = 4, applied once.
        np.testing.assert_array_equal(r0.pull("w"), start - 4.0)
        assert r0.step_stats.dropped_stale == r1.step_stats.dropped_stale == 0


# ---- A server restarted while a step waits -----------------------------------------------
#
# A parameter server stopped and restarted while a sync step waits.
#
# ParameterServer.stop wakes the pushes waiting in its steps (StepGate.close: UNAVAILABLE),
# over gRPC and over shared memory (the push socket) alike: the waiting push is retried
# against the restarted server, joins its steps again, and the step completes with both
# clients' gradients.

def first_sync_step_checkpointed(cluster, spawn, a: PSClient, b: PSClient,
                                 replicas: int = 1) -> None:
    """a declares "w" (SGD, lr 1), a and b join sync and make its first step (3 and 1
    averaged: w = -2), and a checkpoint holds it."""
    a.declare("w", (4,), optimizer=sgd())
    for ps in (a, b):
        ps.join_steps("sync", replicas=replicas)
    other = spawn(b.push, {"w": np.full(4, 1.0, np.float32)})
    a.push({"w": np.full(4, 3.0, np.float32)})
    other.result()
    np.testing.assert_array_equal(a.pull("w"), np.full(4, -2.0, np.float32))
    cluster.checkpoint()


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_sync_a_server_restarted_while_a_step_waits_completes_the_step(
        make_cluster, spawn, tmp_path, shared_memory):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck",
                           shared_memory=shared_memory)
    # The product's 30 s bound on a step's wait, shortened (never reached when right).
    gate(cluster.servers[0])._wait_s = 5.0
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        first_sync_step_checkpointed(cluster, spawn, a, b, replicas=2)  # w = -2
        waiting = spawn(a.push, {"w": np.full(4, 5.0, np.float32)})
        wait_until(lambda: gate(cluster.servers[0])._pending.contributions,
                   "a's push of step 1 waiting at the server")
        restarted = cluster.restart_server(0)  # its shard comes back from the checkpoint
        gate(restarted)._wait_s = 5.0
        b.push({"w": np.full(4, 7.0, np.float32)})
        waiting.result()
        # -2 - (5 + 7) / 2
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -8.0, np.float32))


# Without `replicas`, as ps-worker joins: the restarted server learns from the first client
# back that b took part too (each stepped answer names the members; a client joining again
# after a restart says where it was and with whom), and waits for b instead of applying a's
# gradient alone and then pairing b's step 1 with a's step 2.

@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_sync_after_a_server_restart_the_first_step_waits_for_every_member_from_before(
        make_cluster, spawn, tmp_path, shared_memory):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck",
                           shared_memory=shared_memory)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        first_sync_step_checkpointed(cluster, spawn, a, b)  # w = -2
        cluster.restart_server(0)  # nothing waits there: its steps start empty
        waiting = spawn(a.push, {"w": np.full(4, 5.0, np.float32)})
        wait_until(lambda: _awaits(cluster.servers[0], b),
                   "a back at the restarted server, which waits for b")
        b.push({"w": np.full(4, 7.0, np.float32)})
        waiting.result()
        a.push_async({"w": np.full(4, 1.0, np.float32)})
        b.push({"w": np.full(4, 3.0, np.float32)})
        a.flush()
        # -2 - (5 + 7) / 2 - (1 + 3) / 2: each step one gradient of each client
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -10.0, np.float32))
        assert gate(cluster.servers[0]).stats().applied == 2


def test_sync_a_new_run_with_replicas_after_a_server_restart_waits_for_its_replicas(
        make_cluster, spawn, tmp_path):
    """A first run of r0 and r1 ends (each leaves); the server restarts; a second run with
    replicas=2 waits for both replicas in its first step, as on a server that never
    restarted."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck", shared_memory=False)
    with PSClient(cluster.coordinator_address) as r0, \
            PSClient(cluster.coordinator_address) as r1:
        first_sync_step_checkpointed(cluster, spawn, r0, r1, replicas=2)  # w = -2
        r1.leave_steps()
        r0.push({"w": np.full(4, 2.0, np.float32)})  # alone: w = -4
        r0.leave_steps()
        cluster.checkpoint()
        server = cluster.restart_server(0)
        r0.join_steps("sync", replicas=2)
        pushed = spawn(r0.push, {"w": np.full(4, 2.0, np.float32)})
        wait_until(lambda: pushed.done.is_set() or gate(server)._pending.contributions,
                   "r0's first push of the new run at the server")
        assert not pushed.done.is_set()
        r1.join_steps("sync", replicas=2)
        r1.push({"w": np.full(4, 6.0, np.float32)})
        pushed.result()
        np.testing.assert_array_equal(r0.pull("w"), np.full(4, -8.0, np.float32))


def test_sync_a_client_that_left_before_the_restart_is_not_awaited(
        make_cluster, spawn, tmp_path):
    """a, b and c make a step; c leaves for good and b between two tasks; a makes a step
    alone, the only member when the server restarts. a, back, names only itself: with b,
    which joins afresh for its next task, the first step there waits for nobody else."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck", shared_memory=False)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b, \
            PSClient(cluster.coordinator_address) as c:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b, c):
            ps.join_steps("sync")
        others = [spawn(ps.push, {"w": np.full(4, 3.0, np.float32)}) for ps in (b, c)]
        a.push({"w": np.full(4, 3.0, np.float32)})
        for other in others:
            other.result()
        c.leave_steps()
        b.leave_steps()
        a.push({"w": np.full(4, 1.0, np.float32)})  # alone: w = -4
        cluster.checkpoint()
        server = cluster.restart_server(0)
        b.join_steps("sync")
        waiting = spawn(a.push, {"w": np.full(4, 7.0, np.float32)})
        wait_until(lambda: len(gate(server)._pending.contributions) == 1,
                   "a back, its step waiting for b")
        assert gate(server).members() == sorted(
            [(a.client_id, a.incarnation), (b.client_id, b.incarnation)])
        b.push({"w": np.full(4, 5.0, np.float32)})
        waiting.result()
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -10.0, np.float32))


def test_ssp_a_push_answered_as_a_duplicate_after_the_restart_keeps_its_clients_peers(
        make_cluster, spawn, tmp_path):
    """a's push of an ssp step, applied and waiting for b, is in the checkpoint; the server
    restarts, c joins it afresh, and a's push, retried there, is answered as a duplicate.
    That answer does not replace a's peers: back on its next push, a brings b."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck", shared_memory=False)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b, \
            PSClient(cluster.coordinator_address) as c:
        a.declare("w", (4,), optimizer=sgd())
        for ps in (a, b):
            ps.join_steps("ssp:1")
        a.push({"w": np.ones(4, np.float32)})  # step 0: within K of b
        server = cluster.servers[0]
        waiting = spawn(a.push, {"w": np.ones(4, np.float32)})  # step 1: waits for b
        wait_until(lambda: gate(server)._members[a.client_id].done == 2,
                   "a's push of step 1 applied, waiting for b")
        cluster.checkpoint()  # a's push of step 1 is in it, with its ledger entry
        release = threading.Event()
        pushes = cluster.faults.calls.get("Push", 0)
        cluster.faults.hold_next("Push", release)  # a's retry at the restarted server
        try:
            server = cluster.restart_server(0)
            wait_until(lambda: cluster.faults.calls.get("Push", 0) > pushes,
                       "a's push retried at the restarted server")
            c.join_steps("ssp:1")
            cluster.wait_until_synced()  # its shard and ledger restored
        finally:
            release.set()
        waiting.result()  # answered as a duplicate
        a.push({"w": np.ones(4, np.float32)})  # refused as not joined: a joins again
        assert (b.client_id, b.incarnation) in gate(server).members()


def _awaits(server, client: PSClient) -> bool:
    """Whether the server's steps have a member back and wait for `client` (a member
    before the restart that has not joined again)."""
    steps = gate(server)
    return steps.stats().members == 1 and (client.client_id, client.incarnation) in \
        steps.members()


def test_sync_a_retired_older_incarnation_of_a_peer_does_not_stop_the_wait_for_it(
        make_cluster, spawn, tmp_path):
    """b registered again under its id (a restarted trainer): the coordinator retired its
    incarnation 1, and the restarted server reads that retirement again from the start of
    the coordinator's log. It stands for the old incarnation, not for b."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "ck", shared_memory=False)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as old_b:
        old = old_b.incarnation  # (registers it)
        with PSClient(cluster.coordinator_address, client_id=old_b.client_id) as b:
            assert b.incarnation > old
            first_sync_step_checkpointed(cluster, spawn, a, b)  # w = -2
            server = cluster.restart_server(0)
            wait_until(lambda: server.fence.retired_through >= 1,
                       "the restarted server read the retirements")
            waiting = spawn(a.push, {"w": np.full(4, 5.0, np.float32)})
            wait_until(lambda: _awaits(server, b), "a back, the server waiting for b")
            b.push({"w": np.full(4, 7.0, np.float32)})
            waiting.result()
            np.testing.assert_array_equal(a.pull("w"), np.full(4, -8.0, np.float32))
            assert gate(server).stats().applied == 1


def test_sync_a_push_again_after_a_timeout_still_waits_for_the_first_steps_replicas(
        make_cluster, spawn):
    """A live server: the first push's wait for its second replica runs out
    (DEADLINE_EXCEEDED), the client joins again on its next push, and that push still waits
    for the second replica."""
    cluster = make_cluster(servers=1, shared_memory=False)
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd())
        a.join_steps("sync", replicas=2)
        gate(server)._wait_s = 0.2  # the product's 30 s, shortened: this wait must end
        with pytest.raises(RemoteError) as timed_out:
            a.push({"w": np.full(4, 1.0, np.float32)})
        assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate(server)._wait_s = 30.0
        again = spawn(a.push, {"w": np.full(4, 1.0, np.float32)})
        wait_until(lambda: again.done.is_set() or gate(server).stats().waits == 0
                   and len(gate(server)._pending.contributions) >= 2,
                   "a's second push returned, or waits in step 0 beside its first")
        assert not again.done.is_set() and gate(server).stats().applied == 0
        b.join_steps("sync", replicas=2)
        b.push({"w": np.full(4, 3.0, np.float32)})
        again.result()
        assert gate(server).stats().applied == 1


def test_a_join_naming_more_peers_or_longer_ids_than_a_server_takes_is_refused(make_cluster):
    cluster, server = one_server_with_short_steps(make_cluster)
    peers = [ps_pb.StepMember(client_id=f"p{i}", incarnation=1)
             for i in range(MAX_STEP_PEERS + 1)]
    with grpc.insecure_channel(server.address) as channel:
        join = channel.unary_unary("/ps.v1.ParameterServer/JoinSteps",
                                   response_deserializer=ps_pb.JoinStepsReply.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            join(ps_pb.JoinStepsRequest(client_id="c", incarnation=1, mode="sync",
                                        resume_step=3, peers=peers).SerializeToString(),
                 timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{MAX_STEP_PEERS + 1} peers" in refused.value.details()
        assert gate(server).members() == []
        reply = join(ps_pb.JoinStepsRequest(client_id="c", incarnation=1, mode="sync",
                                            resume_step=3, peers=peers[:2]).SerializeToString(),
                     timeout=30)
        assert reply.step == 3
        assert [(m.client_id, m.incarnation) for m in reply.members] == [
            ("c", 1), ("p0", 1), ("p1", 1)]
        for client_id, named in (
                ("x" * (MAX_STEP_CLIENT_ID + 1), []),
                ("d", [ps_pb.StepMember(client_id="y" * (MAX_STEP_CLIENT_ID + 1))])):
            with pytest.raises(grpc.RpcError) as refused:
                join(ps_pb.JoinStepsRequest(client_id=client_id, incarnation=1, mode="sync",
                                            resume_step=3, peers=named).SerializeToString(),
                     timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{MAX_STEP_CLIENT_ID + 1} characters" in refused.value.details()
        assert gate(server).members() == [("c", 1), ("p0", 1), ("p1", 1)]


# ---- How many clients a server takes in its steps ----------------------------------------
#
# A server takes at most --max-streams clients in its ssp/sync steps: a push waiting for
# its step holds one of its handler threads, and past that many, waiting pushes would take
# the threads the pool keeps for health checks and the control plane (and the push that
# completes the step would wait for a thread until the step's bound).

@pytest.mark.parametrize("mode", ["sync", "ssp:1"])
def test_a_client_past_max_streams_is_refused_joining_naming_the_flag(make_cluster, mode):
    cluster = make_cluster(servers=1, max_streams=2)
    clients = [PSClient(cluster.coordinator_address) for _ in range(3)]
    try:
        clients[0].declare("w", shape=(4,), optimizer=sgd())
        for ps in clients[:2]:
            ps.join_steps(mode)
        with pytest.raises(RemoteError) as refused:
            clients[2].join_steps(mode)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--max-streams" in str(refused.value)
        # The two members' step goes on: averaged in sync, each push applied in ssp.
        first = clients[0].push_async({"w": np.ones(4, np.float32)})
        clients[1].push({"w": np.full(4, 3.0, np.float32)})
        first.result(timeout=30)
        expected = -2.0 if mode == "sync" else -4.0
        np.testing.assert_array_equal(clients[0].pull("w"), np.full(4, expected, np.float32))
    finally:
        for ps in clients:
            ps.close()


def test_sync_replicas_past_max_streams_are_refused(make_cluster):
    cluster = make_cluster(servers=1, max_streams=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=sgd())
        with pytest.raises(RemoteError) as refused:
            ps.join_steps("sync", replicas=3)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "replicas 3" in str(refused.value) and "--max-streams" in str(refused.value)
