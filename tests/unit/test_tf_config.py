"""TF_CONFIG: the parser (every malformed case is refused naming TF_CONFIG and the field),
what each command takes from it, the precedence of flags, and the coordinator placing
nothing before the servers TF_CONFIG lists have registered (fake clock)."""

from __future__ import annotations

import json

import pytest

from ps_common.clock import FakeClock
from ps_common.errors import NotReady
from ps_common.shardmap import Component, VariableSpec
from ps_common.tf_config import (
    COORDINATOR, SERVER, TF_CONFIG_ENV, WORKER, TFConfigError, bind_host, parse, task_for,
)
from ps_server.cli import build_parser as server_parser
from ps_server.cli import config_from_args as server_config
from ps_server.coordinator.app import CoordinatorConfig
from ps_server.coordinator.cli import build_parser as coordinator_parser
from ps_server.coordinator.cli import config_and_task as coordinator_config
from ps_server.coordinator.state import CoordinatorState
from ps_worker.cli import build_parser as worker_parser
from ps_worker.cli import config_from_args as worker_config

# What Kubeflow's training operator sets for a TFJob named "job" in namespace "ns".
CLUSTER = {
    "chief": ["job-chief-0.ns.svc:2222"],
    "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2223"],
    "worker": ["job-worker-0.ns.svc:2222", "job-worker-1.ns.svc:2222"],
}


def tf_config(task_type: str, index: int = 0, cluster: dict | None = None, **extra) -> str:
    return json.dumps({"cluster": CLUSTER if cluster is None else cluster,
                       "task": {"type": task_type, "index": index},
                       "environment": "cloud", **extra})


def env(text: str) -> dict[str, str]:
    return {TF_CONFIG_ENV: text}


# ---- the parser ------------------------------------------------------------------------

def test_each_command_takes_its_own_entry_and_the_chief_as_coordinator():
    chief = task_for(COORDINATOR, tf_config("chief"))
    assert (chief.address, chief.port, chief.bind_host) == (
        "job-chief-0.ns.svc:2222", 2222, "0.0.0.0")
    assert (chief.servers, chief.workers) == (2, 2)
    server = task_for(SERVER, tf_config("ps", 1))
    assert (server.address, server.port, server.coordinator, server.name) == (
        "job-ps-1.ns.svc:2223", 2223, "job-chief-0.ns.svc:2222", "ps-1")
    worker = task_for(WORKER, tf_config("worker", 1))
    assert (worker.coordinator, worker.name) == ("job-chief-0.ns.svc:2222", "worker-1")


def test_master_is_the_chief_and_an_evaluator_list_is_ignored():
    cluster = {"master": ["m:2222"], "ps": ["p:2222"], "evaluator": ["e:2222"]}
    assert task_for(COORDINATOR, tf_config("master", cluster=cluster)).address == "m:2222"
    assert task_for(SERVER, tf_config("ps", cluster=cluster)).coordinator == "m:2222"
    assert parse(tf_config("ps", cluster=cluster)).worker == ()


def test_the_task_index_defaults_to_0_as_in_tensorflow():
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "ps"}})
    assert task_for(SERVER, text).address == "job-ps-0.ns.svc:2222"


@pytest.mark.parametrize("address,host", [
    ("job-ps-0.ns.svc:2222", "0.0.0.0"),  # a Service's name: not an address of the pod's own
    ("10.4.0.7:2222", "0.0.0.0"),
    ("127.0.0.1:2222", "127.0.0.1"),  # a cluster on one machine stays on loopback
    ("localhost:2222", "localhost"),
    ("[::1]:2222", "::1"),
])
def test_a_process_binds_loopback_entries_as_they_are_and_others_on_all_interfaces(
        address, host):
    assert bind_host(address) == host


BAD = {
    "not-json": ("{'cluster': {}}", SERVER, "JSON"),
    "not-an-object": ("[1, 2]", SERVER, "object"),
    "no-cluster": (json.dumps({"task": {"type": "ps", "index": 0}}), SERVER, "cluster"),
    "sparse-cluster": (json.dumps({"sparseCluster": {"ps": ["p:1"]},
                                   "task": {"type": "ps", "index": 0}}), SERVER, "sparseCluster"),
    "no-chief": (tf_config("ps", cluster={"ps": ["p:2222"]}), SERVER, "cluster.chief"),
    "two-chiefs": (tf_config("ps", cluster={**CLUSTER, "chief": ["a:1", "b:1"]}), SERVER,
                   "cluster.chief"),
    "chief-and-master": (tf_config("ps", cluster={**CLUSTER, "master": ["m:1"]}), SERVER,
                         "master"),
    "no-ps": (tf_config("chief", cluster={"chief": ["c:2222"]}), COORDINATOR, "cluster.ps"),
    "empty-ps": (tf_config("chief", cluster={**CLUSTER, "ps": []}), COORDINATOR, "cluster.ps"),
    "ps-not-a-list": (tf_config("ps", cluster={**CLUSTER, "ps": "p:2222"}), SERVER,
                      "cluster.ps"),
    "entry-without-port": (tf_config("ps", cluster={**CLUSTER, "ps": ["p:2222", "p"]}),
                           SERVER, "cluster.ps[1]"),
    "entry-bad-port": (tf_config("chief", cluster={**CLUSTER, "chief": ["c:70000"]}),
                       COORDINATOR, "cluster.chief[0]"),
    # '::1:2222' would bind, and advertise an address gRPC cannot dial: the job would hang.
    "ipv6-without-brackets": (tf_config("ps", cluster={**CLUSTER, "ps": ["::1:2222", "p:1"]}),
                              SERVER, "in brackets"),
    "port-of-other-digits": (tf_config("ps", cluster={**CLUSTER, "ps": ["p:\u0663", "p:1"]}),
                             SERVER, "cluster.ps[0]"),
    "worker-entry-not-a-string": (tf_config("worker", cluster={**CLUSTER, "worker": [2222]}),
                                  WORKER, "cluster.worker[0]"),
    "no-task": (json.dumps({"cluster": CLUSTER}), SERVER, "task"),
    "no-task-type": (json.dumps({"cluster": CLUSTER, "task": {"index": 0}}), SERVER,
                     "task.type"),
    "unknown-task-type": (tf_config("trainer"), WORKER, "task.type"),
    "evaluator": (tf_config("evaluator"), WORKER, "evaluator"),
    "index-out-of-range": (tf_config("ps", 2), SERVER, "task.index"),
    "index-negative": (tf_config("worker", -1), WORKER, "task.index"),
    "index-a-string": (tf_config("worker", "0"), WORKER, "task.index"),
    "index-a-bool": (tf_config("worker", True), WORKER, "task.index"),
    "worker-without-workers": (tf_config("worker", cluster={"chief": ["c:1"], "ps": ["p:1"]}),
                               WORKER, "cluster.worker"),
    "server-given-the-chiefs": (tf_config("chief"), SERVER, "task.type"),
    "coordinator-given-a-workers": (tf_config("worker"), COORDINATOR, "task.type"),
    "worker-given-a-servers": (tf_config("ps"), WORKER, "task.type"),
}


@pytest.mark.parametrize("text,command,field", BAD.values(), ids=BAD.keys())
def test_a_malformed_tf_config_is_refused_naming_tf_config_and_the_field(text, command, field):
    with pytest.raises(TFConfigError) as refused:
        task_for(command, text)
    assert str(refused.value).startswith(f"{TF_CONFIG_ENV}: ")
    assert field in str(refused.value)


# ---- the commands: what they take, and flags first -------------------------------------

def test_a_server_given_only_tf_config_listens_on_its_entry_and_advertises_it():
    parser = server_parser()
    config = server_config(parser, parser.parse_args([]), env(tf_config("ps", 1)))
    assert (config.host, config.port) == ("0.0.0.0", 2223)
    assert config.advertise_address == "job-ps-1.ns.svc:2223"
    assert config.coordinator == "job-chief-0.ns.svc:2222"
    assert config.server_id == "ps-1"


def test_a_server_on_loopback_entries_stays_on_loopback():
    cluster = {"chief": ["127.0.0.1:5000"], "ps": ["127.0.0.1:5001"]}
    parser = server_parser()
    config = server_config(parser, parser.parse_args([]), env(tf_config("ps", cluster=cluster)))
    assert (config.host, config.port, config.advertise_address, config.coordinator) == (
        "127.0.0.1", 5001, "127.0.0.1:5001", "127.0.0.1:5000")


@pytest.mark.parametrize("flags", [
    ["--port", "5000"], ["--host", "0.0.0.0"], ["--coordinator", "c:1"],
    ["--advertise-address", "me:1"],
], ids=["port", "host", "coordinator", "advertise-address"])
def test_any_address_flag_makes_a_server_ignore_tf_config_even_a_malformed_one(flags):
    parser = server_parser()
    for text in (tf_config("ps", 1), "{not json"):
        config = server_config(parser, parser.parse_args(flags), env(text))
        assert config.server_id is None
        assert config.port == (5000 if "--port" in flags else 0)
        assert config.coordinator == ("c:1" if "--coordinator" in flags else None)


def test_a_server_id_flag_wins_over_tf_config():
    parser = server_parser()
    config = server_config(parser, parser.parse_args(["--server-id", "mine"]),
                           env(tf_config("ps", 1)))
    assert (config.server_id, config.port) == ("mine", 2223)


def test_without_tf_config_the_defaults_hold():
    parser = server_parser()
    config = server_config(parser, parser.parse_args([]), {TF_CONFIG_ENV: " "})
    assert (config.host, config.port, config.coordinator, config.server_id) == (
        "127.0.0.1", 0, None, None)


def test_the_coordinator_takes_its_port_and_the_number_of_servers():
    parser = coordinator_parser()
    config, task = coordinator_config(parser, parser.parse_args(["--epochs", "1"]),
                                      env(tf_config("chief")))
    assert (config.host, config.port, config.expected_servers) == ("0.0.0.0", 2222, 2)
    assert config.job.epochs == 1 and task.workers == 2
    config, _ = coordinator_config(parser, parser.parse_args(["--expect-servers", "1"]),
                                   env(tf_config("chief")))
    assert (config.port, config.expected_servers) == (2222, 1)
    config, task = coordinator_config(parser, parser.parse_args(["--host", "127.0.0.1"]),
                                      env(tf_config("chief")))
    assert task is None and (config.port, config.expected_servers) == (0, 1)


def test_expect_servers_must_be_at_least_one():
    with pytest.raises(ValueError, match="--expect-servers"):
        CoordinatorConfig(expected_servers=0)


def test_a_worker_takes_the_chief_as_coordinator_unless_given_one():
    parser = worker_parser()
    config = worker_config(parser, parser.parse_args([]), env(tf_config("worker", 1)))
    assert (config.coordinator, config.worker_id) == ("job-chief-0.ns.svc:2222", "worker-1")
    config = worker_config(parser, parser.parse_args(["--coordinator", "c:1"]),
                           env(tf_config("worker", 1)))
    assert (config.coordinator, config.worker_id) == ("c:1", None)


def test_a_worker_with_neither_coordinator_nor_tf_config_is_a_usage_error(capsys):
    parser = worker_parser()
    with pytest.raises(SystemExit) as exited:
        worker_config(parser, parser.parse_args([]), {})
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "--coordinator" in stderr and TF_CONFIG_ENV in stderr


@pytest.mark.parametrize("command", ["server", "coordinator", "worker"])
def test_a_tf_config_for_another_command_is_a_usage_error_naming_it(command, capsys):
    parser, build, text = {
        "server": (server_parser(), server_config, tf_config("chief")),
        "coordinator": (coordinator_parser(), coordinator_config, tf_config("ps")),
        "worker": (worker_parser(), worker_config, tf_config("ps", 5)),
    }[command]
    with pytest.raises(SystemExit) as exited:
        build(parser, parser.parse_args([]), env(text))
    assert exited.value.code == 2
    assert TF_CONFIG_ENV in capsys.readouterr().err


# ---- the coordinator waits for the servers it expects ------------------------------------

SGD = Component.of({"name": "sgd", "lr": 0.1})
TIMEOUT = 10.0


def test_nothing_is_placed_before_the_expected_servers_are_registered_then_any_number_will_do():
    clock = FakeClock()
    state = CoordinatorState(clock, heartbeat_timeout_s=TIMEOUT, split_threshold_bytes=1 << 20,
                             expected_servers=2)
    state.register_server("ps-0", "p0:2222", 0)
    with pytest.raises(NotReady):
        state.declare([VariableSpec("a", (10,), optimizer=SGD)])
    assert state.shard_map.epoch == 0
    state.register_server("ps-1", "p1:2222", 0)
    placed = state.declare([VariableSpec("a", (10,), optimizer=SGD),
                            VariableSpec("b", (10,), optimizer=SGD)])
    assert {s.server_id for name in ("a", "b") for s in placed.shards[name]} == {"ps-0", "ps-1"}
    clock.advance(TIMEOUT / 2)
    state.server_heartbeat("ps-1", placed.epoch)  # ps-0 stops heartbeating and expires
    clock.advance(TIMEOUT / 2 + 0.001)
    assert [m.server_id for m in state.live_servers()] == ["ps-1"]
    later = state.declare([VariableSpec("c", (10,), optimizer=SGD)])
    assert [s.server_id for s in later.shards["c"]] == ["ps-1"]
