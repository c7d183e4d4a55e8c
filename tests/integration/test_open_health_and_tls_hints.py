"""README "Security: a token, TLS and mutual TLS": a caller without the token can open the
health service's Watch streams without taking the daemon's threads, and a wrong TLS setting
between the daemons is reported where it is (to a client, and by a server)."""

from __future__ import annotations

import contextlib
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.certs import make_certs
from ps_common.rpc import RetryPolicy
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_proto.v1 import (coordinator_pb2, coordinator_pb2_grpc, parameter_server_pb2,
                         parameter_server_pb2_grpc)
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import HANDLER_THREADS, Coordinator, CoordinatorConfig
from ps_server.streams import handler_threads
from ps_server.testing import InProcessCluster, wait_until
from ps_worker import PSClient

TOKEN = "a-token-for-these-tests-9b2e"
# A bound on each wait of these tests (the calls that should answer do so at once).
WAIT_S = 10.0
# A refused connection is not worth long retries here.
FAIL_FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)


@contextlib.contextmanager
def open_health_watches(address: str, count: int):
    """`count` Health.Watch streams on `address`, opened without any token (the health
    service is open so that probes work), each read up to its first answer so that the
    daemon has taken it up; cancelled on exit."""
    channel = grpc.insecure_channel(address)
    calls = []
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(count):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120.0)
            calls.append(call)
            assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        yield
    finally:
        for call in calls:
            call.cancel()
        channel.close()


def health_check(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S).status


@pytest.mark.parametrize("metrics", [False, True], ids=["no metrics", "metrics"])
def test_health_watches_without_the_token_leave_the_coordinator_serving_its_cluster(metrics):
    """README: "Every RPC ... that does not carry the token is refused with UNAUTHENTICATED
    ...; the gRPC health service stays open so that probes work". A caller without the token
    opens as many Health.Watch streams as the coordinator has handler threads (16): each
    costs it no thread (grpc's HealthServicer answers Watch without blocking one, and the
    daemon's interceptors leave it so), so the cluster's own calls, and health checks, are
    still answered."""
    with InProcessCluster(servers=1, token=TOKEN, metrics=metrics) as cluster:
        address = cluster.coordinator_address
        with open_health_watches(address, HANDLER_THREADS):
            with grpc.insecure_channel(address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                status = stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=WAIT_S,
                                        metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert [s.server_id for s in status.servers] == ["ps-0"]
            assert health_check(address) == health_pb2.HealthCheckResponse.SERVING


def test_health_watches_without_the_token_leave_a_parameter_server_serving():
    """The same for a parameter server (2 * --max-streams + 16 handler threads; README:
    "health checks and the control plane always find a thread"), made directly (not by
    InProcessCluster, whose servers carry the test FaultInjector)."""
    with InProcessCluster(servers=1, token=TOKEN) as cluster:
        config = ServerConfig(coordinator=cluster.coordinator_address, server_id="ps-extra",
                              token=TOKEN, max_streams=1, grace_s=0.5)
        with ParameterServer(config) as server:
            address = server.bound_address
            with open_health_watches(address, handler_threads(1)):
                assert health_check(address) == health_pb2.HealthCheckResponse.SERVING
                with grpc.insecure_channel(address) as channel:
                    reply = parameter_server_pb2_grpc.ParameterServerStub(channel).LeaveSteps(
                        parameter_server_pb2.LeaveStepsRequest(client_id="nobody"),
                        timeout=WAIT_S, metadata=(("authorization", f"Bearer {TOKEN}"),))
                assert reply == parameter_server_pb2.LeaveStepsReply()


# ---- what a wrong TLS setting looks like ------------------------------------------------------

@pytest.fixture(scope="module")
def two_cas(tmp_path_factory):
    """Two `ps-ctl make-certs` outputs: two CAs, each with its server and client certificate."""
    out = tmp_path_factory.mktemp("two-cas")
    make_certs(out / "a")
    make_certs(out / "b")
    return out / "a", out / "b"


def daemon_tls(ca, cert_from) -> TLS:
    return TLS.from_files(ca=ca / "ca.pem", cert=cert_from / "server.pem",
                          key=cert_from / "server-key.pem")


def test_a_coordinator_that_cannot_reach_a_server_is_not_reported_as_the_client_s_handshake(
        two_cas):
    """A server's certificate is signed by a CA the coordinator does not trust, so the
    coordinator cannot deliver the shard map, and Declare ends UNAVAILABLE with the
    coordinator's own message ("could not deliver shard map ... to server(s) s (UNAVAILABLE:
    the TLS handshake failed ...)"). The client's own connection to the coordinator is fine
    (it got that answer): the error carries no hint to check the client's TLS flags
    (ps-worker and CoordinatorClient would turn one into "cannot reach the coordinator")."""
    ca_a, ca_b = two_cas
    with Coordinator(CoordinatorConfig(tls=daemon_tls(ca_a, ca_a), recovery_grace_s=0.0,
                                       grace_s=0.5)) as coordinator:
        config = ServerConfig(coordinator=coordinator.address, server_id="s",
                              tls=daemon_tls(ca_a, ca_b), grace_s=0.5)
        with ParameterServer(config) as server:
            assert server.registered.wait(WAIT_S)  # the server reaches the coordinator
            with PSClient(coordinator.address, tls_ca=ca_a / "ca.pem", retry=FAIL_FAST,
                          shared_memory=False) as ps:
                with pytest.raises(RemoteError) as refused:
                    ps.declare("w", shape=(4,), init="zeros")
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("could not deliver shard map epoch "), error.details()
    assert error.connection_hint is None, str(error)


def test_a_server_whose_tls_ca_did_not_sign_the_coordinator_s_certificate_is_told_to_check_it(
        two_cas, caplog):
    """README, "What a wrong setting looks like": "A client whose --tls-ca did not sign the
    daemon's certificate fails with UNAVAILABLE: the TLS handshake failed: check that
    --tls-ca holds the CA ...". A server registering with its coordinator is such a client:
    its warning says to check its TLS flags, not the coordinator's address and token."""
    caplog.set_level(logging.WARNING, logger="ps_server.app")
    ca_a, ca_b = two_cas
    with Coordinator(CoordinatorConfig(tls=daemon_tls(ca_a, ca_a))) as coordinator:
        config = ServerConfig(coordinator=coordinator.address, server_id="s",
                              tls=daemon_tls(ca_b, ca_a), heartbeat_interval_s=0.05,
                              grace_s=0.5)
        with ParameterServer(config):
            wait_until(lambda: any("does not answer" in r.getMessage()
                                   for r in caplog.records),
                       "the server's warning about its coordinator", timeout_s=WAIT_S)
    warning = next(r.getMessage() for r in caplog.records if "does not answer" in r.getMessage())
    assert coordinator.address in warning and "UNAVAILABLE" in warning
    assert "--tls-ca" in warning, warning
