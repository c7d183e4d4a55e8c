"""No ordinary event silently loses, resets or double-applies a model's state: coordinator
restarts, reused client ids, foreign control-plane calls, oversized declarations and a
slow server, against in-process clusters on OS-chosen ports."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from ps_common.wire import shardmap_to_proto
from ps_proto.v1 import coordinator_pb2
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_common.shardmap import EMPTY_MAP
from ps_worker import PSClient, RemoteError, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0

SPECS = {  # name -> (shape, init): declared in one order, then again in another
    "a": ((6, 3), "uniform"),
    "b": ((5,), "normal"),
    "c": ((40, 2), "glorot_uniform"),
    "d": ((3,), "zeros"),
}


def declare(ps: PSClient, names) -> None:
    for name in names:
        shape, init = SPECS[name]
        ps.declare(name, shape=shape, init=init, optimizer=SGD1, seed=len(name))


def train(ps: PSClient, steps: int = 3) -> None:
    rng = np.random.default_rng(0)
    for _ in range(steps):
        ps.push({n: rng.standard_normal(SPECS[n][0]).astype(np.float32) for n in SPECS})


# ---- coordinator restart (defect 1) --------------------------------------------------------

def test_coordinator_restart_keeps_every_trained_value_when_declared_in_another_order(
        make_cluster):
    cluster = make_cluster(servers=3, split_threshold_bytes=200)
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a", "b", "c", "d"])
        train(ps)
        trained = ps.pull(list(SPECS))
        old_epoch = ps.shard_map.epoch
        assert len(ps.shard_map.shards["c"]) > 1  # a split variable too

        cluster.restart_coordinator()

        with PSClient(cluster.coordinator_address) as again:
            declare(again, ["d", "c", "b", "a"])  # another order: placement would differ
            assert again.shard_map.epoch > old_epoch  # never an epoch seen before
            for name, value in again.pull(list(SPECS)).items():
                np.testing.assert_array_equal(value, trained[name], err_msg=name)
            again.push({"b": np.ones(5, np.float32)})
        # The client from before the restart carries on with the new map.
        np.testing.assert_array_equal(ps.pull("b"), trained["b"] - 1)
        train(ps, steps=1)


def test_variables_declared_after_a_coordinator_restart_are_placed_fresh(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a"])
        train_a = ps.pull("a")
        cluster.restart_coordinator()
        declare(ps, ["b", "a"])
        np.testing.assert_array_equal(ps.pull("a"), train_a)
        np.testing.assert_array_equal(ps.pull("b"), ps.pull("b"))
        with pytest.raises(RemoteError) as caught:  # a conflicting spec is still refused
            ps.declare("a", shape=(6, 4))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---- fenced control plane (defect 7) -------------------------------------------------------

def _assign(address: str, **fields) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        stub = ps_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.AssignShards(ps_pb.AssignShardsRequest(**fields), timeout=10)
    return caught.value


def test_a_foreign_assignment_cannot_erase_a_server(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a"])
        ps.push({"a": np.ones((6, 3), np.float32)})
        before = ps.pull("a")
        server = cluster.servers[0]
        empty = shardmap_to_proto(EMPTY_MAP)
        empty.epoch = 10**9
        for fields in ({"map": empty},
                       {"map": empty, "generation": cluster.coordinator.generation},
                       {"map": empty, "generation": cluster.coordinator.generation,
                        "control_token": b"guessed-token-0"}):
            assert _assign(server.address, **fields).code() == grpc.StatusCode.PERMISSION_DENIED
        np.testing.assert_array_equal(ps.pull("a"), before)
        ps.push({"a": np.ones((6, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("a"), before - 1)


# ---- client identity (defect 3) ------------------------------------------------------------

def test_a_second_client_with_the_same_id_has_every_push_applied(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address, client_id="trainer") as first:
        declare(first, ["d"])
        start = first.pull("d")
        for _ in range(3):
            first.push({"d": np.ones(3, np.float32)})
    with PSClient(cluster.coordinator_address, client_id="trainer") as second:  # restarted
        for _ in range(2):
            second.push({"d": np.ones(3, np.float32)})
        assert second.incarnation != first.incarnation
        np.testing.assert_array_equal(second.pull("d"), start - 5)


def test_a_duplicate_answer_to_a_first_attempt_is_an_error(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address, client_id="twin") as one:
        declare(one, ["d"])
        start = one.pull("d")
        one.push({"d": np.ones(3, np.float32)})
        # A client that reuses another's identity outright (same id and incarnation).
        with PSClient(cluster.coordinator_address, client_id="twin",
                      incarnation=one.incarnation) as twin:
            with pytest.raises(RemoteError) as caught:
                twin.push({"d": np.ones(3, np.float32)})
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        np.testing.assert_array_equal(one.pull("d"), start - 1)


def test_a_replaced_client_is_fenced(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address, client_id="job") as old:
        declare(old, ["d"])
        old.push({"d": np.ones(3, np.float32)})
        with PSClient(cluster.coordinator_address, client_id="job") as new:
            new.push({"d": np.ones(3, np.float32)})
            with pytest.raises(RemoteError) as caught:
                old.push({"d": np.ones(3, np.float32)})
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_closed_clients_are_retired_on_the_servers(make_cluster):
    cluster = make_cluster(servers=1)
    ledger = cluster.servers[0].ledger
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["b"])
        ps.push({"b": np.ones(5, np.float32)})
        assert ledger.live_clients() == 1
    done = threading.Event()

    def poll():  # heartbeats carry the retirement to the server
        while not done.wait(0.02):
            if ledger.live_clients() == 0:
                done.set()

    watcher = threading.Thread(target=poll, name="retire-watch")
    watcher.start()
    finished = done.wait(WAIT_S)
    done.set()
    watcher.join()
    assert finished and ledger.live_clients() == 0


# ---- oversized declarations (defect 5) -----------------------------------------------------

def test_a_declare_no_server_can_hold_is_refused_before_the_map_changes(make_cluster):
    cluster = make_cluster(servers=2)  # the default budget: a share of the machine's memory
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a"])
        epoch = ps.shard_map.epoch
        with pytest.raises(RemoteError) as caught:
            ps.declare("huge", shape=(2**47,))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ps.refresh().epoch == epoch
        declare(ps, ["b"])
        ps.push({"a": np.ones((6, 3), np.float32), "b": np.ones(5, np.float32)})


def test_a_shard_a_server_cannot_allocate_never_blocks_the_others(make_cluster):
    cluster = make_cluster(servers=2, memory_budget_bytes=0)  # no budget: allocation fails
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a"])
        with pytest.raises(RemoteError) as caught:
            ps.declare("huge", shape=(2**47,))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "huge" not in ps.refresh().variables
        declare(ps, ["b", "c"])
        ps.push({n: np.ones(SPECS[n][0], np.float32) for n in ("a", "b", "c")})
        np.testing.assert_array_equal(ps.pull("b"), ps.pull("b"))


# ---- a slow server (defect 8) --------------------------------------------------------------

def test_a_slow_server_does_not_hold_up_declarations_of_known_variables(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        declare(ps, ["a", "b"])
        stalled = threading.Event()
        assigned = cluster.faults.calls.get("AssignShards", 0)
        cluster.faults.hold_next("AssignShards", stalled)
        new_declared = threading.Event()

        def declare_new():
            with PSClient(cluster.coordinator_address) as other:
                declare(other, ["c"])
            new_declared.set()

        slow = threading.Thread(target=declare_new, name="declare-new")
        slow.start()
        try:
            # The new declaration is parked on the held assignment (the coordinator would
            # hold its declare lock now, if it still had one).
            deadline = time.monotonic() + WAIT_S
            while cluster.faults.calls.get("AssignShards", 0) == assigned:
                assert time.monotonic() < deadline, "the new declaration never reached a server"
                time.sleep(0.01)
            with PSClient(cluster.coordinator_address) as starting:
                declare(starting, ["a", "b"])  # a worker starting up: known variables
                assert not new_declared.is_set()  # the other declaration still waits
        finally:
            stalled.set()
            slow.join(WAIT_S)
        assert new_declared.is_set()


def test_register_client_needs_an_id(make_cluster):
    cluster = make_cluster(servers=1)
    with grpc.insecure_channel(cluster.coordinator_address) as channel:
        from ps_proto.v1 import coordinator_pb2_grpc
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterClient(coordinator_pb2.RegisterClientRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
