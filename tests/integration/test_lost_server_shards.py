"""A lost server's shards: where the coordinator moves them (within the survivors' memory
budgets), and what a server of another id listening at the lost server's address answers
for them (UNAVAILABLE: clients wait and follow the map once the shards move)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.rpc import RetryPolicy
from ps_common.status import RemoteError
from ps_server.app import ParameterServer, ServerConfig
from ps_server.testing import wait_until
from ps_worker import PSClient

SHARED_MEMORY = False  # the newcomer answers over gRPC, where its answer is what is tested
WAIT_S = 30.0  # bound of every wait; never reached when the code is right
SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.1)


def start_newcomer(cluster, port: int) -> ParameterServer:
    """A server of id ps-other on `port` (a dead server's), registered and holding the map."""
    newcomer = ParameterServer(ServerConfig(
        server_id="ps-other", port=port, coordinator=cluster.coordinator_address,
        heartbeat_interval_s=0.2, grace_s=0.2, shared_memory=False)).start()
    try:
        assert newcomer.registered.wait(WAIT_S)
        wait_until(lambda: newcomer.store.epoch >= cluster.coordinator.state.shard_map.epoch,
                   "the newcomer has the map", WAIT_S)
    except BaseException:
        newcomer.stop(grace_s=0.2)
        raise
    return newcomer


def test_a_lost_server_s_shards_move_only_within_the_survivors_memory_budget(make_cluster,
                                                                              tmp_path):
    """Two servers with a 1 MiB budget each hold 600 KiB each. One is lost: its shard would
    take the other to 1.2 MiB against its 1 MiB budget (with the default budget, 70% of the
    machine's memory, such a move can take a server out of memory). The move is not made:
    the loss is reported, as when no checkpoint holds the shards, naming --memory-budget."""
    budget = 1 << 20
    cluster = make_cluster(servers=2, memory_budget_bytes=budget, checkpoint_dir=tmp_path,
                           server_timeout_s=0.5)
    with PSClient(cluster.coordinator_address) as ps:
        rows = 600 * 1024 // 4
        ps.declare("a", shape=(rows,), dtype="float32", init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(rows,), dtype="float32", init="zeros", optimizer=SGD1)
        placed = {name: {s.server_id for s in shards}
                  for name, shards in ps.shard_map.shards.items()}
        assert placed == {"a": {"ps-0"}, "b": {"ps-1"}}
    cluster.checkpoint()
    survivor, lost = cluster.servers
    lost.stop(grace_s=0.2)
    wait_until(lambda: any(state == "lost" for m, state, _ in
                           cluster.coordinator.state.server_states()
                           if m.server_id == "ps-1"),
               "ps-1 is lost", WAIT_S)
    wait_until(lambda: survivor.store.epoch >= cluster.coordinator.state.shard_map.epoch,
               "the survivor has the map that follows the loss", WAIT_S)
    assert survivor.store.nbytes() <= budget, (
        f"{survivor.server_id} holds {survivor.store.nbytes()} bytes, its --memory-budget "
        f"is {budget}")
    assert {s.server_id for s in cluster.coordinator.state.shard_map.shards["b"]} == {"ps-1"}
    loss = cluster.coordinator.state.data_loss
    assert "ps-1" in loss and "--memory-budget" in loss and "b[0:153600]" in loss
    # The checkpoint still holds them: a coordinator restarted with room resumes the job.
    assert cluster.coordinator.state.data_loss_resumable


def test_a_server_of_another_id_on_a_dead_server_s_port_makes_clients_wait_not_fail(
        make_cluster):
    """ps-0 stops; a server with another --server-id starts on its port (a rescheduled pod
    given another id, two servers restarted on each other's ports). A server that dies and
    does not come back is waited for until its shards move: the newcomer answers pulls and
    pushes meant for ps-0 with UNAVAILABLE (which clients retry), not NOT_FOUND."""
    cluster = make_cluster(servers=1)
    old = cluster.servers[0]
    with PSClient(cluster.coordinator_address,
                  retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01,
                                    max_backoff_s=0.05)) as ps:
        ps.declare("w", shape=(4,), dtype="float32", init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        old.stop(grace_s=0.2)
        newcomer = start_newcomer(cluster, old.port)
        try:
            with pytest.raises(RemoteError) as pulled:
                ps.pull("w")
            with pytest.raises(RemoteError) as pushed:
                ps.push({"w": np.ones(4, np.float32)})
            assert (pulled.value.code(), pushed.value.code()) == (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
            assert "ps-other" in pulled.value.details() and "ps-0" in pulled.value.details()
        finally:
            newcomer.stop(grace_s=0.2)


def test_a_client_waiting_at_a_newcomer_follows_the_shards_once_they_move(make_cluster,
                                                                          tmp_path, spawn):
    """The same newcomer, with a checkpoint: a patient client's pull waits through the
    newcomer's UNAVAILABLE answers until the coordinator has moved ps-0's shards (onto the
    newcomer, the only live server), then refreshes its map and gets the checkpoint's
    values."""
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path, server_timeout_s=3.0)
    old = cluster.servers[0]
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        ps.declare("w", shape=(4,), dtype="float32", init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        cluster.checkpoint()
        old.stop(grace_s=0.2)
        newcomer = start_newcomer(cluster, old.port)
        try:
            pull = spawn(ps.pull, "w")
            np.testing.assert_array_equal(pull.result(), -np.ones(4, np.float32))
            assert {s.server_id for s in ps.shard_map.shards["w"]} == {"ps-other"}
        finally:
            newcomer.stop(grace_s=0.2)
