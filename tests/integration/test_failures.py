"""Failure handling against an in-process cluster: stale shard maps, lost responses and
injected errors (exactly-once pushes, bounded retries), a restarted server, a dead address."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server.app import ParameterServer, ServerConfig
from ps_server.initializers import initialize_rows
from ps_worker import PSClient, RemoteError, RetryPolicy
from ps_worker.coordinator_client import CoordinatorClient

# These tests inject faults into calls on the wire: servers without shared memory.
SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)


def initial(ps: PSClient, name: str) -> np.ndarray:
    spec = ps.shard_map.spec(name)
    return initialize_rows(spec, 0, spec.rows)


def calls(cluster, method: str) -> int:
    return cluster.faults.calls.get(method, 0)


# ---- stale shard map --------------------------------------------------------------------------

def test_stale_epoch_is_aborted_with_current_epoch_and_clients_refresh(cluster):
    with PSClient(cluster.coordinator_address) as a, PSClient(cluster.coordinator_address) as b:
        a.declare("a", shape=(8, 3), init="uniform", optimizer=SGD1, seed=1)
        value = a.pull("a")
        old = a.shard_map
        epoch = old.epoch
        b.declare("b", shape=(4,), optimizer=SGD1)
        assert b.shard_map.epoch == epoch + 1
        cluster.wait_until_synced()

        (shard,) = old.shards["a"]
        with grpc.insecure_channel(old.servers[shard.server_id]) as channel:
            stub = ps_grpc.ParameterServerStub(channel)
            request = ps_pb.PullRequest(epoch=epoch,
                                        shards=[ps_pb.ShardRef(variable="a", index=0)])
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Pull(request, timeout=10))
        assert caught.value.code() == grpc.StatusCode.ABORTED
        remote = RemoteError.from_rpc_error(caught.value)
        assert remote.code() == grpc.StatusCode.ABORTED
        assert remote.stale_epoch is not None
        assert remote.stale_epoch.request_epoch == epoch
        assert remote.stale_epoch.current_epoch == epoch + 1

        # Client A still holds epoch E: its next pull and push refresh transparently.
        assert a.shard_map.epoch == epoch
        pulls = calls(cluster, "Pull")
        np.testing.assert_array_equal(a.pull("a"), value)
        assert calls(cluster, "Pull") - pulls == 2  # refused once as stale, then served
        assert a.shard_map.epoch == epoch + 1
        a.push({"a": np.ones((8, 3), np.float32)})
        np.testing.assert_array_equal(a.pull("a"), value - 1)


def test_stale_push_is_applied_once_after_refresh(cluster):
    with PSClient(cluster.coordinator_address) as a, PSClient(cluster.coordinator_address) as b:
        a.declare("a", shape=(6,), optimizer=SGD1)
        a.pull("a")
        b.declare("b", shape=(6,), optimizer=SGD1)
        pushes = calls(cluster, "Push")
        a.push({"a": np.ones(6, np.float32)})
        assert calls(cluster, "Push") - pushes == 2
        np.testing.assert_array_equal(b.pull("a"), -np.ones(6, np.float32))


def test_stale_push_of_a_nan_is_refused_before_it_goes_out_again(cluster):
    """A push to one server leaves its NaN check to that server; refused as stale first, it
    is checked by the client before it goes to the shards' servers of the new map."""
    with PSClient(cluster.coordinator_address) as a, PSClient(cluster.coordinator_address) as b:
        a.declare("a", shape=(6,), optimizer=SGD1)
        a.push({"a": np.zeros(6, np.float32)})  # its server says it honours the client's ask
        b.declare("b", shape=(6,), optimizer=SGD1)
        pushes = calls(cluster, "Push")
        grad = np.ones(6, np.float32)
        grad[2] = np.nan
        with pytest.raises(RemoteError) as refused:
            a.push({"a": grad})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "non-finite" in refused.value.details()
        assert calls(cluster, "Push") - pushes == 1  # the stale one only
        np.testing.assert_array_equal(b.pull("a"), np.zeros(6, np.float32))
        a.push({"a": np.ones(6, np.float32)})
        np.testing.assert_array_equal(b.pull("a"), -np.ones(6, np.float32))


# ---- exactly-once and retries -----------------------------------------------------------------

@pytest.fixture
def one(make_cluster):
    """(cluster, client) with 'w' (4x3, zeros, sgd lr=1) on one server."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address, retry=RetryPolicy(initial_backoff_s=0.01)) as ps:
        ps.declare("w", shape=(4, 3), optimizer=SGD1)
        yield cluster, ps


def test_lost_push_response_is_retried_and_applied_once(one):
    cluster, ps = one
    before = calls(cluster, "Push")
    cluster.faults.drop_response_next("Push", 1)
    ps.push({"w": np.ones((4, 3), np.float32)})
    assert calls(cluster, "Push") - before == 2  # the lost one and its retry
    np.testing.assert_array_equal(ps.pull("w"), -np.ones((4, 3), np.float32))


def test_lost_push_response_then_a_new_epoch_is_still_applied_once(one):
    """The push is applied, its response is lost, and the shard map moves on before the
    retry: the retry (refused as stale, resent after a refresh) must not apply it again."""
    cluster, ps = one
    with PSClient(cluster.coordinator_address) as other:
        cluster.faults.drop_response_next(
            "Push", 1, then=lambda: other.declare("x", shape=(2,), optimizer=SGD1))
        ps.push({"w": np.ones((4, 3), np.float32)})
        assert other.shard_map.epoch > 1
    np.testing.assert_array_equal(ps.pull("w"), -np.ones((4, 3), np.float32))


def test_push_failing_before_apply_is_retried_and_applied_once(one):
    cluster, ps = one
    before = calls(cluster, "Push")
    cluster.faults.fail_next("Push", 2)
    ps.push({"w": np.ones((4, 3), np.float32)})
    assert calls(cluster, "Push") - before == 3
    np.testing.assert_array_equal(ps.pull("w"), -np.ones((4, 3), np.float32))


def test_pull_failing_is_retried(one):
    cluster, ps = one
    ps.push({"w": np.ones((4, 3), np.float32)})
    before = calls(cluster, "Pull")
    cluster.faults.fail_next("Pull", 2)
    np.testing.assert_array_equal(ps.pull("w"), -np.ones((4, 3), np.float32))
    assert calls(cluster, "Pull") - before == 3


def test_pull_deadline_exceeded_is_retried(one):
    cluster, ps = one
    before = calls(cluster, "Pull")
    cluster.faults.fail_next("Pull", 1, code=grpc.StatusCode.DEADLINE_EXCEEDED)
    np.testing.assert_array_equal(ps.pull("w"), np.zeros((4, 3), np.float32))
    assert calls(cluster, "Pull") - before == 2


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.INTERNAL])
def test_push_non_retryable_error_is_not_retried(one, code):
    cluster, ps = one
    before = calls(cluster, "Push")
    cluster.faults.fail_next("Push", 1, code=code)
    with pytest.raises(RemoteError) as caught:
        ps.push({"w": np.ones((4, 3), np.float32)})
    assert caught.value.code() == code
    assert calls(cluster, "Push") - before == 1
    np.testing.assert_array_equal(ps.pull("w"), np.zeros((4, 3), np.float32))
    # The next push is unaffected.
    ps.push({"w": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(ps.pull("w"), -np.ones((4, 3), np.float32))


def test_lost_responses_on_a_split_push_apply_each_part_once(make_cluster):
    cluster = make_cluster(servers=3, split_threshold_bytes=200)
    with PSClient(cluster.coordinator_address, retry=RetryPolicy(initial_backoff_s=0.01)) as ps:
        ps.declare("w", shape=(30, 4), optimizer=SGD1)
        assert len(ps.shard_map.shards["w"]) == 3
        before = calls(cluster, "Push")
        cluster.faults.drop_response_next("Push", 2)
        ps.push({"w": np.ones((30, 4), np.float32)})
        ps.push({"w": np.ones((30, 4), np.float32)})
        assert calls(cluster, "Push") - before == 3 + 3 + 2
        np.testing.assert_array_equal(ps.pull("w"), np.full((30, 4), -2.0, np.float32))


def test_concurrent_pushes_with_lost_responses_apply_exactly_once(make_cluster):
    """Eight threads share one client; some responses are lost and some calls fail before
    running: every push is still applied exactly once (out-of-order sequences included)."""
    cluster = make_cluster(servers=2, split_threshold_bytes=200)
    threads, pushes = 8, 10
    with PSClient(cluster.coordinator_address,
                  retry=RetryPolicy(max_attempts=20, initial_backoff_s=0.005)) as ps:
        ps.declare("w", shape=(16, 4), optimizer=SGD1)
        assert len(ps.shard_map.shards["w"]) == 2
        before = calls(cluster, "Push")
        cluster.faults.drop_response_next("Push", 12)
        errors: list[BaseException] = []

        def run(t):
            try:
                for _ in range(pushes):
                    if t == 0:
                        cluster.faults.fail_next("Push", 1)
                    ps.push({"w": np.full((16, 4), t + 1, np.float32)})
            except BaseException as error:
                errors.append(error)

        workers = [threading.Thread(target=run, args=(t,), name=f"test-pusher-{t}")
                   for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert not any(w.is_alive() for w in workers) and not errors, errors
        assert calls(cluster, "Push") - before >= threads * pushes * 2 + 12
        total = pushes * sum(range(1, threads + 1))
        np.testing.assert_array_equal(ps.pull("w"), np.full((16, 4), -total, np.float32))


@pytest.mark.parametrize("method", ["Push", "Pull"])
def test_retries_are_bounded(one, method):
    cluster, _ = one
    with PSClient(cluster.coordinator_address, retry=FAST_RETRY) as ps:
        ps.refresh()
        before = calls(cluster, method)
        cluster.faults.fail_next(method, 100)
        with pytest.raises(RemoteError) as caught:
            if method == "Push":
                ps.push({"w": np.ones((4, 3), np.float32)})
            else:
                ps.pull("w")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert calls(cluster, method) - before == 3  # the policy's attempts, then it gives up
    cluster.faults.fail_next(method, 0)
    with PSClient(cluster.coordinator_address) as check:
        np.testing.assert_array_equal(check.pull("w"), np.zeros((4, 3), np.float32))


# ---- a restarted server --------------------------------------------------------------------------

def test_restarted_empty_server_fails_with_data_loss_naming_it(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address, retry=FAST_RETRY) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        (shard,) = ps.shard_map.shards["w"]
        index = [s.server_id for s in cluster.servers].index(shard.server_id)
        cluster.restart_server(index)
        with pytest.raises(RemoteError) as caught:
            ps.refresh()
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert shard.server_id in caught.value.details()
        with pytest.raises(RemoteError) as declared:
            ps.declare("other", shape=(2,))
        assert declared.value.code() == grpc.StatusCode.DATA_LOSS
        with pytest.raises(RemoteError) as pulled:  # not UNAVAILABLE: the cause
            ps.pull("w")
        assert pulled.value.code() == grpc.StatusCode.DATA_LOSS
    with CoordinatorClient(cluster.coordinator_address) as coordinator:
        status = coordinator.status()
    (server,) = [s for s in status["servers"] if s["id"] == shard.server_id]
    assert server["state_losses"] == 1
    assert server["lost_shards"] == ["w[0:4]"]
    assert server["loss_action"] == "failed the job"


def test_restarted_server_gets_its_shards_back_and_clients_keep_working(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=200, reinitialize_lost_shards=True)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(20, 5), init="uniform", optimizer=SGD1, seed=3)
        ps.declare("b", shape=(5,), init="normal", optimizer=SGD1, seed=4)
        shard_map = ps.shard_map
        assert len(shard_map.shards["w"]) == 2
        start = ps.pull(["w", "b"])
        np.testing.assert_array_equal(start["w"], initial(ps, "w"))
        np.testing.assert_array_equal(start["b"], initial(ps, "b"))
        ps.push({"w": np.ones((20, 5), np.float32), "b": np.ones(5, np.float32)})

        victim = cluster.servers[0]
        restarted = cluster.restart_server(0)
        assert restarted.server_id == victim.server_id and restarted.port == victim.port

        after = ps.pull(["w", "b"])
        # Rows held by the restarted server are back to their initial values (no
        # checkpoints yet); the other server kept the push.
        expected_w = start["w"] - 1
        for s in shard_map.shards["w"]:
            if s.server_id == victim.server_id:
                expected_w[s.row_start:s.row_stop] = start["w"][s.row_start:s.row_stop]
        (b_shard,) = shard_map.shards["b"]
        expected_b = start["b"] if b_shard.server_id == victim.server_id else start["b"] - 1
        np.testing.assert_array_equal(after["w"], expected_w)
        np.testing.assert_array_equal(after["b"], expected_b)

        # Pushes keep working, exactly once, on the restarted server too.
        ps.push({"w": np.ones((20, 5), np.float32), "b": np.ones(5, np.float32)})
        again = ps.pull(["w", "b"])
        np.testing.assert_array_equal(again["w"], expected_w - 1)
        np.testing.assert_array_equal(again["b"], expected_b - 1)


def test_server_restarted_at_a_new_address_is_found(make_cluster):
    cluster = make_cluster(servers=1, reinitialize_lost_shards=True)
    retry = RetryPolicy(max_attempts=8, initial_backoff_s=0.02, max_backoff_s=0.2)
    with PSClient(cluster.coordinator_address, retry=retry) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        old_map = ps.shard_map
        old = cluster.servers[0]
        old.stop(grace_s=0.2)
        moved = ParameterServer(ServerConfig(
            server_id=old.server_id, port=0, coordinator=cluster.coordinator_address,
            heartbeat_interval_s=0.2, grace_s=0.2)).start()
        try:
            assert moved.registered.wait(10)
            assert moved.address != old.address
            np.testing.assert_array_equal(ps.pull("w"), np.zeros(4, np.float32))
            assert ps.shard_map.epoch > old_map.epoch
        finally:
            moved.stop(grace_s=0.2)


# ---- nothing listening ------------------------------------------------------------------------

def test_client_against_closed_port_fails_unavailable_after_its_bounded_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PSClient(f"127.0.0.1:{port}", retry=FAST_RETRY, timeout_s=2.0) as ps:
        with pytest.raises(RemoteError) as caught:
            ps.declare("w", shape=(3,))
        with pytest.raises(RemoteError) as caught_pull:
            ps.pull("w")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught_pull.value.code() == grpc.StatusCode.UNAVAILABLE
