"""Prometheus metrics of in-process daemons (InProcessCluster(metrics=True)): each daemon
serves its own endpoint on a port of its own, and what PSClient does moves the figures:
pushes applied and deduplicated, a refused push under its status code, bytes, steps, the
coordinator's members and checkpoint. Everything is read over HTTP, as Prometheus reads it."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from ps_common.telemetry import MetricsBindError, MetricsEndpoint
from ps_worker import PSClient, RemoteError
from ps_server.testing import metric, scrape_metrics
from ps_worker.telemetry import WorkerMetrics

# Over gRPC: the call figures (PushUnary) are the gRPC interceptor's; pushes through the
# push socket are counted apart (paramserve_push_socket_*), tested below too.
SHARED_MEMORY = False
SGD = {"name": "sgd", "lr": 1.0}
PUSH = "/ps.v1.ParameterServer/PushUnary"


def test_pushes_move_the_servers_figures_over_the_wire(make_cluster):
    cluster = make_cluster(servers=1, metrics=True)
    server = cluster.servers[0]
    assert server.metrics.url != cluster.coordinator.metrics.url
    before = scrape_metrics(server.metrics.url)
    assert metric(before, "paramserve_pushes_applied_total") == 0
    grad = np.ones(4, np.float32)
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD)
        for _ in range(3):
            ps.push({"w": grad})
        # A lost answer: the client retries, the server finds the push applied already.
        cluster.faults.drop_response_next("Push")
        ps.push({"w": grad})
        with pytest.raises(RemoteError) as refused:  # checked by the server, not the client
            ps.push({"w": np.full(4, np.nan, np.float32)})
        assert refused.value.code().name == "INVALID_ARGUMENT"
        np.testing.assert_array_equal(ps.pull("w"), -4 * grad)
    after = scrape_metrics(server.metrics.url)
    assert metric(after, "paramserve_pushes_applied_total") == 4
    assert metric(after, "paramserve_pushes_deduplicated_total") == 1
    assert metric(after, "paramserve_rpc_handled_total", method=PUSH, code="OK") == 4
    assert metric(after, "paramserve_rpc_handled_total", method=PUSH, code="UNAVAILABLE") == 1
    assert metric(after, "paramserve_rpc_handled_total", method=PUSH,
               code="INVALID_ARGUMENT") == 1
    assert metric(after, "paramserve_rpc_handling_seconds_count", method=PUSH) == 6
    assert metric(after, "paramserve_rpc_received_bytes_total", method=PUSH) > 6 * grad.nbytes
    pulled = "/ps.v1.ParameterServer/PullUnary"
    assert metric(after, "paramserve_rpc_sent_bytes_total", method=pulled) > grad.nbytes
    assert metric(after, "paramserve_shards") == 1
    assert metric(after, "paramserve_shard_bytes") >= grad.nbytes
    assert metric(after, "paramserve_server_info", server_id="ps-0", data_path="grpc") == 1
    assert metric(after, "paramserve_process_resident_memory_bytes") > 0


def test_pushes_through_shared_memory_are_counted_too(make_cluster):
    cluster = make_cluster(servers=1, metrics=True, shared_memory=True)
    url = cluster.servers[0].metrics.url
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD)
        for _ in range(3):
            ps.push({"w": np.ones(4, np.float32)})
        paths = set(ps.data_paths.values())
    samples = scrape_metrics(url)
    assert metric(samples, "paramserve_pushes_applied_total") == 3
    if paths == {"shm"}:  # (a machine without shared memory stays on gRPC)
        assert metric(samples, "paramserve_push_socket_handled_total", code="OK") == 3


def test_steps_and_the_coordinators_view_move(make_cluster, tmp_path):
    cluster = make_cluster(servers=2, metrics=True, checkpoint_dir=tmp_path)
    coordinator = cluster.coordinator.metrics.url
    samples = scrape_metrics(coordinator)
    assert metric(samples, "paramserve_members", role="server", state="alive") == 2
    assert metric(samples, "paramserve_job_state", state="none") == 1
    assert ("paramserve_checkpoint_age_seconds", frozenset()) not in samples
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD)
        ps.join_steps("sync", replicas=1)
        for _ in range(3):
            ps.push({"w": np.ones(4, np.float32)})
        ps.leave_steps()
        assert metric(scrape_metrics(coordinator), "paramserve_members", role="client",
                   state="alive") == 1
        holder = next(s for s in cluster.servers if s.store.held())
        stepped = scrape_metrics(holder.metrics.url)
        assert metric(stepped, "paramserve_sync_steps_total") == 3
        assert metric(stepped, "paramserve_step_wait_seconds_count") == 3
        assert metric(stepped, "paramserve_pushes_applied_total") == 3
        manifest = cluster.checkpoint()
    samples = scrape_metrics(coordinator)
    assert metric(samples, "paramserve_checkpoint_step") == manifest.step
    assert metric(samples, "paramserve_checkpoint_age_seconds") >= 0
    assert metric(samples, "paramserve_checkpoint_timestamp_seconds") == manifest.created_unix_s
    assert metric(samples, "paramserve_rpc_handled_total", method="/ps.v1.Coordinator/Declare",
               code="OK") >= 1


def test_without_metrics_no_daemon_has_an_endpoint(make_cluster):
    cluster = make_cluster(servers=1)
    assert cluster.coordinator.metrics is None and cluster.servers[0].metrics is None


def test_an_endpoint_on_a_taken_port_says_so_and_a_stopped_one_frees_its_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(MetricsBindError) as caught:
            MetricsEndpoint("127.0.0.1", taken.getsockname()[1], name="test")
        assert str(taken.getsockname()[1]) in str(caught.value)
    endpoint = MetricsEndpoint("127.0.0.1", 0, name="test")
    endpoint.start()
    try:
        assert metric(scrape_metrics(endpoint.url), "paramserve_process_open_fds") > 0
    finally:
        endpoint.stop()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", endpoint.port))  # free again


def served_names(samples) -> set[str]:
    """The names the README lists: histograms and summaries by their base name."""
    names = set()
    for name, _ in samples:
        if name.endswith("_created"):  # prometheus-client's own, beside each counter
            continue
        for suffix in ("_bucket", "_count", "_sum"):
            name = name.removesuffix(suffix)
        names.add(name)
    return names


def test_the_readme_lists_every_metric_served(make_cluster, tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    cluster = make_cluster(servers=1, metrics=True, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("t", dim=2, num_rows=None, optimizer=SGD)
        ps.push_rows("t", np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
        cluster.checkpoint()
        names = served_names(scrape_metrics(cluster.servers[0].metrics.url))
        names |= served_names(scrape_metrics(cluster.coordinator.metrics.url))
    registry = CollectorRegistry()
    WorkerMetrics(registry).watch(SimpleNamespace(worker_id="w", data_path="shm"))
    names |= served_names((s.name, s.labels) for family in registry.collect()
                          for s in family.samples)
    assert {"paramserve_table_rows", "paramserve_checkpoint_age_seconds",
            "paramserve_worker_pull_wait_seconds"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in readme and f"`{n}{{" not in readme)
    assert not missing, f"served but not in the README's Metrics table: {missing}"


def test_sync_steps_total_counts_only_steps_whose_average_was_applied(make_cluster, spawn):
    """README (Metrics): `paramserve_sync_steps_total` counts "averaged steps applied
    (`sync`)". A step whose average the server refuses (nothing of it applied, both pushes
    INVALID_ARGUMENT) does not count: here a client that allows non-finite gradients and one
    that refuses them (its header asks) share a step on a server run with
    --allow-non-finite, so the NaN average is refused whole, naming the lenient client."""
    cluster = make_cluster(servers=1, metrics=True, allow_non_finite=True)
    url = cluster.servers[0].metrics.url
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as lenient, \
            PSClient(cluster.coordinator_address) as strict:
        lenient.declare("w", shape=(4,), optimizer=SGD)
        lenient.join_steps("sync", replicas=2)
        strict.join_steps("sync", replicas=2)
        nan_push = spawn(lenient.push, {"w": np.full(4, np.nan, np.float32)})
        with pytest.raises(RemoteError) as refused:
            strict.push({"w": np.ones(4, np.float32)})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "allows NaN and Inf" in refused.value.details()
        with pytest.raises(RemoteError):
            nan_push.result()
        np.testing.assert_array_equal(strict.pull("w"), np.zeros(4, np.float32))  # nothing applied
        samples = scrape_metrics(url)
        assert metric(samples, "paramserve_pushes_applied_total") == 0
        assert metric(samples, "paramserve_sync_steps_total") == 0
