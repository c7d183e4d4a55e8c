"""The cluster's shared token (ps_common.auth): without it every RPC of every service of
every daemon but health is UNAUTHENTICATED, a wrong one likewise; with it a client declares,
pulls and pushes over both data paths; the token never shows in an error, a repr or a log;
bad token files are refused naming the flag or variable."""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.auth import TOKEN_FILE_ENV
from ps_proto.v1 import coordinator_pb2, parameter_server_pb2
from ps_server.app import ServerConfig
from ps_server.coordinator.app import CoordinatorConfig
from ps_server.testing import InProcessCluster
from ps_worker import PSClient, RemoteError
from ps_worker.coordinator_client import CoordinatorClient

TOKEN = "t0ken-for-the-tests-7f3a"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def cluster():
    with InProcessCluster(servers=2, split_threshold_bytes=100, token=TOKEN) as c:
        yield c


def every_method():
    """(service, method, client streaming, server streaming) of every service of every
    daemon but health; reflection included (each daemon is asked for all of them: one
    that does not exist there is refused before anything else too)."""
    from grpc_reflection.v1alpha import reflection_pb2

    services = [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
                parameter_server_pb2.DESCRIPTOR.services_by_name["ParameterServer"],
                reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
    return [(service.full_name, method.name, method.client_streaming,
             method.server_streaming) for service in services for method in service.methods]


def call_raw(channel: grpc.Channel, service: str, method: str, client_streaming: bool,
             server_streaming: bool, metadata=()):
    """One call with an empty request (the token is checked before any request is read)."""
    path = f"/{service}/{method}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (client_streaming, server_streaming)]
    call = kind(path)
    request = iter([b""]) if client_streaming else b""
    result = call(request, timeout=WAIT_S, metadata=metadata)
    if server_streaming:
        list(result)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token"),),
                                      (("authorization", TOKEN),)],
                         ids=["no token", "wrong token", "no Bearer"])
def test_every_rpc_of_every_daemon_but_health_is_unauthenticated_without_the_token(
        cluster, metadata):
    addresses = [cluster.coordinator_address, *(s.address for s in cluster.servers)]
    methods = every_method()
    assert len(methods) > 20
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            for service, method, client_streaming, server_streaming in methods:
                with pytest.raises(grpc.RpcError) as refused:
                    call_raw(channel, service, method, client_streaming, server_streaming,
                             metadata)
                error = refused.value
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (address, method)
                assert "--token-file" in error.details() and TOKEN not in error.details()
            # Health stays open, so that probes work.
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_with_the_token_a_client_trains_over_both_data_paths(cluster, shared_memory):
    name = f"w_{'shm' if shared_memory else 'grpc'}"
    with PSClient(cluster.coordinator_address, token=TOKEN,
                  shared_memory=shared_memory) as ps:
        ps.declare(name, shape=(30, 4), init="zeros", optimizer={"name": "sgd", "lr": 1.0})
        cluster.wait_until_synced()
        for _ in range(3):
            ps.push({name: np.ones((30, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull(name), np.full((30, 4), -3.0, np.float32))
        used = set(ps.data_paths.values())
        assert used == ({"shm"} if shared_memory else {"grpc"}), used
    with CoordinatorClient(cluster.coordinator_address, token=TOKEN) as client:
        assert {s["id"] for s in client.status()["servers"]} == {"ps-0", "ps-1"}


def test_a_client_with_a_wrong_token_is_refused_and_the_error_shows_no_token(cluster, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(RemoteError) as refused:
        with PSClient(cluster.coordinator_address, token="not-the-token") as ps:
            ps.declare("never", shape=(2,), optimizer={"name": "sgd", "lr": 1.0})
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not-the-token" not in str(refused.value) and TOKEN not in str(refused.value)
    assert TOKEN not in caplog.text and "not-the-token" not in caplog.text


def test_configs_keep_the_token_out_of_their_repr():
    assert TOKEN not in repr(ServerConfig(token=TOKEN))
    assert TOKEN not in repr(CoordinatorConfig(token=TOKEN))


@pytest.mark.parametrize("module", ["ps_server.cli", "ps_server.coordinator.cli",
                                    "ps_worker.cli", "ps_worker.ctl"])
def test_a_bad_token_file_is_refused_naming_the_flag_or_the_variable(module, tmp_path):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    extra = {"ps_worker.cli": ["--coordinator", "127.0.0.1:1"],
             "ps_worker.ctl": ["--coordinator", "127.0.0.1:1"]}.get(module, [])
    tail = ["status"] if module == "ps_worker.ctl" else []
    by_flag = subprocess.run([sys.executable, "-m", module, *extra, "--token-file",
                              str(missing), *tail], capture_output=True, text=True,
                             timeout=WAIT_S)
    assert by_flag.returncode != 0 and "--token-file" in by_flag.stderr, by_flag.stderr
    assert str(missing) in by_flag.stderr
    env = {"PATH": "/usr/bin:/bin", TOKEN_FILE_ENV: str(empty)}
    by_env = subprocess.run([sys.executable, "-m", module, *extra, *tail],
                            capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert by_env.returncode != 0 and TOKEN_FILE_ENV in by_env.stderr, by_env.stderr
    assert "empty" in by_env.stderr


@pytest.mark.parametrize("module", ["ps_server.cli", "ps_server.coordinator.cli",
                                    "ps_worker.cli", "ps_worker.ctl"])
def test_an_empty_token_file_value_is_refused_not_taken_for_no_token(module):
    # `--token-file "$FILE"` with $FILE unset must not bring a daemon up open.
    extra = {"ps_worker.cli": ["--coordinator", "127.0.0.1:1"],
             "ps_worker.ctl": ["--coordinator", "127.0.0.1:1"]}.get(module, [])
    tail = ["status"] if module == "ps_worker.ctl" else []
    env = {"PATH": "/usr/bin:/bin"}
    by_flag = subprocess.run([sys.executable, "-m", module, *extra, "--token-file", "", *tail],
                             capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert by_flag.returncode != 0, by_flag.stderr
    assert "--token-file: is empty" in by_flag.stderr, by_flag.stderr
    by_env = subprocess.run([sys.executable, "-m", module, *extra, *tail], capture_output=True,
                            text=True, timeout=WAIT_S, env={**env, TOKEN_FILE_ENV: ""})
    assert by_env.returncode != 0, by_env.stderr
    assert f"{TOKEN_FILE_ENV} is set but empty" in by_env.stderr, by_env.stderr


class _RecordReplies(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, replies: list[bytes]):
        self._replies = replies

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        if outcome.exception() is None:
            self._replies.append(outcome.result().SerializeToString())
        return outcome


def test_the_coordinator_hands_no_secret_to_a_client(cluster, monkeypatch):
    """Whatever a client asks the coordinator (register, the shard map, status), no reply
    carries the cluster's token or the control token that lets the coordinator command the
    servers."""
    from ps_common import rpc
    from ps_worker import client as client_module, coordinator_client

    replies: list[bytes] = []

    def recording_channel(address, token=None, tls=None):
        return grpc.intercept_channel(rpc.make_channel(address, token, tls),
                                      _RecordReplies(replies))

    monkeypatch.setattr(client_module, "make_channel", recording_channel)
    monkeypatch.setattr(coordinator_client, "make_channel", recording_channel)
    with PSClient(cluster.coordinator_address, token=TOKEN) as ps:
        ps.declare("secretless", shape=(4,), init="zeros")
        ps.pull("secretless")
    with CoordinatorClient(cluster.coordinator_address, token=TOKEN) as client:
        client.status()
    assert len(replies) >= 3
    control_token = cluster.servers[0].fence._token
    assert control_token
    for reply in replies:
        assert TOKEN.encode() not in reply and control_token not in reply
