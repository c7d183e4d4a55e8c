"""What an operator sees (ps-ctl status, the coordinator's Prometheus metrics) after the events
that should move it: a ps-worker's own PSClient among the client members, a coordinator
restarted on a finished job's state, a server holding a dynamic table that grew."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.testing import metric, scrape_metrics, wait_until
from ps_worker import PSClient
from ps_worker.client import StepStats
from ps_worker.coordinator_client import CoordinatorClient

SGD = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


@pytest.fixture
def daemons():
    """`.coordinator(config)`, `.server(coordinator_address)`: started daemons on OS-chosen
    ports, every one stopped after the test (servers first; stopping twice is a no-op)."""
    coordinators: list[Coordinator] = []
    servers: list[ParameterServer] = []

    class Daemons:
        @staticmethod
        def coordinator(config: CoordinatorConfig) -> Coordinator:
            coordinators.append(Coordinator(config).start())
            return coordinators[-1]

        @staticmethod
        def server(address: str, server_id: str = "ps-0") -> ParameterServer:
            server = ParameterServer(ServerConfig(
                server_id=server_id, coordinator=address, heartbeat_interval_s=0.2,
                grace_s=0.5, shared_memory=False)).start()
            servers.append(server)
            assert server.registered.wait(WAIT_S), "the server did not register"
            return server

    yield Daemons
    for server in servers:
        server.stop(grace_s=0.5)
    for coordinator in coordinators:
        coordinator.stop(grace_s=0.5)


def job_config(**fields) -> CoordinatorConfig:
    return CoordinatorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, grace_s=0.5,
                             recovery_grace_s=0.0, **fields)


# ---- paramserve_members{role="client"}: "PSClient instances, the workers' own included" ---

def test_a_workers_own_client_counts_among_the_coordinators_client_members(daemons):
    coordinator = daemons.coordinator(job_config(
        job=JobSpec(epochs=1, tasks_per_epoch=2), metrics_port=0))
    daemons.server(coordinator.address)
    with CoordinatorClient(coordinator.address, give_up_after_s=5) as control:
        # What ps-worker does: register, then push with a PSClient under the worker's id and
        # the incarnation the coordinator gave it (ps_worker.runtime.Worker).
        worker = control.register_worker("worker-0")
        with PSClient(coordinator.address, client_id="worker-0",
                      incarnation=worker.incarnation) as ps:
            ps.declare("w", shape=(4,), optimizer=SGD)
            ps.push({"w": np.ones(4, np.float32)})
            samples = scrape_metrics(coordinator.metrics.url)
            assert metric(samples, "paramserve_members", role="worker", state="alive") == 1
            # The README: members by role, `client` being "PSClient instances, the workers'
            # own included". One PSClient instance holds an incarnation and pushes.
            assert metric(samples, "paramserve_members", role="client", state="alive") == 1


# ---- a restarted coordinator reports the job as its predecessor did ----------------------

@pytest.mark.parametrize("mode, stats", [
    ("ssp:2", StepStats(wait_s=0.75, staleness_max=2, dropped_stale=0)),
    ("sync", StepStats(wait_s=0.75, staleness_max=0, dropped_stale=3)),
], ids=["ssp", "sync"])
def test_a_restarted_coordinator_keeps_the_jobs_step_figures_and_data_paths(
        daemons, tmp_path, mode, stats):
    """README: `job.staleness.max` is the largest gap let through "over the whole job", and
    `job.dropped_stale_gradients` the gradients dropped; with a --state-dir a restarted
    coordinator "reloads the job's progress", and one started on a finished job's state
    "reports that job as done". What the job's workers said must not be forgotten with it."""
    config = job_config(job=JobSpec(epochs=1, tasks_per_epoch=1, evaluate_every=0, mode=mode),
                        state_dir=tmp_path, keep_serving=True)
    first = daemons.coordinator(config)
    with CoordinatorClient(first.address, give_up_after_s=5) as control:
        worker = control.register_worker("worker-0")
        outcome, task = control.lease("worker-0", worker.incarnation)
        assert outcome == "task"
        control.complete("worker-0", worker.incarnation, task.task_id, loss_sum=1.0,
                         examples=32, correct=16, steps=7, seconds=0.5, data_path="grpc",
                         step_stats=stats)
        assert control.heartbeat("worker-0", worker.incarnation, "grpc", stats) == "stop"
        before = control.status()
    # Its state file holds the worker done too (saved within half a second of a change).
    # (Read as it lies: the file is replaced by a rename, never written in place.)
    wait_until(lambda: [w["state"] for w in json.loads(config.state_path.read_text())
                        ["state"]["job"]["workers"]] == ["done"],
               "the worker's end in the state file", timeout_s=WAIT_S)
    expected = {"staleness_max": stats.staleness_max, "dropped": stats.dropped_stale,
                "workers": [("worker-0", "done", "grpc", stats.wait_s)]}
    assert before["job"]["state"] == "done" and seen(before) == expected
    summary = first.runner.summary()
    first.stop(grace_s=0.5)

    second = daemons.coordinator(replace(config, port=0))
    with CoordinatorClient(second.address, give_up_after_s=5) as control:
        after = control.status()
    assert (after["job"]["state"], after["job"]["steps"]) == ("done", 7)  # resumed
    assert seen(after) == expected
    # ps-coordinator's last line (`ps-coordinator finished: {...}`) is this summary.
    keys = ("data_paths", "staleness_max", "dropped_stale_gradients")
    assert {k: second.runner.summary()[k] for k in keys} == {k: summary[k] for k in keys}


def seen(status: dict) -> dict:
    """What ps-ctl status --json says of the job's steps and of each worker."""
    return {"staleness_max": status["job"]["staleness"]["max"],
            "dropped": status["job"]["dropped_stale_gradients"],
            "workers": [(w["id"], w["state"], w["data_path"], w["wait_s"])
                        for w in status["workers"]]}


# ---- a server's bytes in ps-ctl status -------------------------------------------------

def test_a_servers_bytes_in_status_count_the_rows_of_a_dynamic_table_it_holds(make_cluster):
    """README: ps-ctl status shows servers with their "shards, bytes"; an uncapped dynamic
    table "grows until the rest of its server's budget is full". A server holding 5,000
    rows of 64 float32 holds at least 1.2 MiB: its status must not say 0 B."""
    cluster = make_cluster(servers=1, metrics=True)
    server = cluster.servers[0]
    ids = np.arange(5000, dtype=np.int64)
    with PSClient(cluster.coordinator_address) as ps, \
            CoordinatorClient(cluster.coordinator_address, give_up_after_s=5) as control:
        ps.declare_embedding("users", dim=64, num_rows=None,
                             optimizer={"name": "adagrad", "lr": 0.1})
        ps.push_rows("users", ids, np.ones((len(ids), 64), np.float32))
        held = metric(scrape_metrics(server.metrics.url), "paramserve_shard_bytes")
        assert held >= len(ids) * 64 * 4  # what the server itself says it holds
        # The table's row count reaches the coordinator with the server's next heartbeat.
        wait_until(lambda: control.status()["tables"][0]["rows_held"] == len(ids),
                   "the table's rows in status", timeout_s=WAIT_S)
        status = control.status()
    (row,) = status["servers"]
    assert row["shards"] == 1
    assert row["bytes"] >= len(ids) * 64 * 4, (
        f"ps-ctl status says server {row['id']} holds {row['bytes']} bytes; it holds "
        f"{held:.0f} (paramserve_shard_bytes), the table {status['tables'][0]['bytes']}")
