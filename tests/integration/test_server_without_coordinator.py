"""A server whose coordinator does not answer says so once, naming the address and what to
check, and keeps trying (backing off) instead of logging every half second."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from ps_server.app import ParameterServer, ServerConfig

WAIT_S = 30.0


def test_a_server_names_its_silent_coordinator_and_what_to_check(caplog):
    caplog.set_level(logging.INFO, logger="ps_server.app")
    with socket.socket() as taken:  # bound, not listening: connections are refused
        taken.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with ParameterServer(ServerConfig(coordinator=address, heartbeat_interval_s=0.05,
                                          grace_s=0.5)):
            deadline = time.monotonic() + WAIT_S
            while not [r for r in caplog.records if "does not answer" in r.getMessage()]:
                if time.monotonic() > deadline:
                    pytest.fail(f"no warning about {address} within {WAIT_S:g} s")
                time.sleep(0.01)
    warnings = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert address in warnings[0] and "UNAVAILABLE" in warnings[0]
    assert "Check that ps-coordinator runs there" in warnings[0]
    assert "--coordinator" in warnings[0] and "token" in warnings[0]



def test_a_server_heartbeats_at_least_as_often_as_its_coordinator_asks(make_cluster):
    """The coordinator declares a member dead after a multiple of its own interval: a server
    set to a slower --heartbeat-interval takes the coordinator's; a faster one keeps its own."""
    cluster = make_cluster(servers=1, heartbeat_interval_s=0.2)
    for own, expected in ((30.0, 0.2), (0.1, 0.1)):
        with ParameterServer(ServerConfig(coordinator=cluster.coordinator_address,
                                          heartbeat_interval_s=own, grace_s=0.5)) as server:
            assert server.registered.wait(WAIT_S)
            assert server.heartbeat_interval_s == expected
