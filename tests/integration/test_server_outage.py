"""A parameter server that goes away: a client whose retry policy has no attempt limit (a
worker's) waits for it, logging the outage once, until it is back or `interrupt()`."""

from __future__ import annotations

import contextlib
import logging
import threading

import grpc
import numpy as np
import pytest

from ps_server.app import ParameterServer, ServerConfig
from ps_server.initializers import initialize_rows
from ps_worker import PSClient, RemoteError, RetryPolicy

# These tests inject faults into calls on the wire: servers without shared memory.
SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0
# Waits as a worker does: no attempt limit (short backoffs, so the test retries many times).
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
CLIENT_LOG = "ps_worker.client"


class OutageLog(logging.Handler):
    """The client's warnings (the outage lines), with an event set by the first one."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.first.set()


@pytest.fixture
def outage_log():
    handler = OutageLog()
    logger = logging.getLogger(CLIENT_LOG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@contextlib.contextmanager
def patient_client(address: str):
    """A PSClient that waits for an absent server without limit, interrupted if the test
    fails: closing it then never waits for a server that is not coming back."""
    with PSClient(address, retry=PATIENT) as ps:
        try:
            yield ps
        except BaseException:
            ps.interrupt()
            raise


def test_a_pull_waits_for_its_server_to_come_back_and_logs_the_outage_once(
        make_cluster, outage_log, caplog):
    caplog.set_level(logging.INFO, logger=CLIENT_LOG)
    cluster = make_cluster(servers=1, reinitialize_lost_shards=True)
    with patient_client(cluster.coordinator_address) as ps:
        spec = ps.declare("w", shape=(6, 2), init="uniform", optimizer=SGD1, seed=1)
        address = ps.shard_map.servers["ps-0"]
        ps.push({"w": np.ones((6, 2), np.float32)})
        cluster.servers[0].stop(grace_s=0.5)

        waiting = ps.pull_async("w")
        assert outage_log.first.wait(WAIT_S)
        assert not waiting.done()
        cluster.restart_server(0)  # same id, same port, empty: its shard is re-created
        np.testing.assert_array_equal(waiting.result(timeout=WAIT_S),
                                      initialize_rows(spec, 0, 6))

    (unreachable,) = outage_log.records
    assert unreachable.args[:2] == ("ps-0", address)
    back = [r for r in caplog.records if r.levelno == logging.INFO and r.name == CLIENT_LOG
            and r.args[:2] == ("ps-0", address)]
    assert len(back) == 1


def test_interrupt_ends_the_wait_for_an_absent_server_with_cancelled(make_cluster, outage_log):
    cluster = make_cluster(servers=1)
    with patient_client(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        cluster.servers[0].stop(grace_s=0.5)
        waiting = ps.pull_async("w")
        assert outage_log.first.wait(WAIT_S)
        ps.interrupt()
        with pytest.raises(RemoteError) as caught:
            waiting.result(timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        # and from now on every call ends at once the same way
        with pytest.raises(RemoteError) as later:
            ps.push({"w": np.ones(4, np.float32)})
        assert later.value.code() == grpc.StatusCode.CANCELLED
    assert len(outage_log.records) == 1


def test_a_client_without_an_attempt_limit_finds_its_server_at_a_new_address(make_cluster,
                                                                              outage_log):
    """While it waits, the client asks the coordinator where the server is: a server back
    at another address (with its shards re-created) is found without giving up first."""
    cluster = make_cluster(servers=1, reinitialize_lost_shards=True)
    with patient_client(cluster.coordinator_address) as ps:
        spec = ps.declare("w", shape=(4,), init="uniform", optimizer=SGD1, seed=2)
        old = cluster.servers[0]
        old.stop(grace_s=0.5)
        waiting = ps.pull_async("w")
        assert outage_log.first.wait(WAIT_S)
        moved = ParameterServer(ServerConfig(
            server_id=old.server_id, port=0, coordinator=cluster.coordinator_address,
            heartbeat_interval_s=0.2, grace_s=0.2)).start()
        try:
            assert moved.address != old.address
            np.testing.assert_array_equal(waiting.result(timeout=WAIT_S),
                                          initialize_rows(spec, 0, 4))
            assert ps.shard_map.servers["ps-0"] == moved.address
        finally:
            moved.stop(grace_s=0.2)


@pytest.mark.parametrize("method", ["Pull", "Push"])
def test_interrupt_cancels_a_call_a_hung_server_holds(make_cluster, method):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer={"name": "sgd", "lr": 1.0})
        hung = threading.Event()
        cluster.faults.hold_next(method, hung)  # the server takes the call and sits on it
        outcome = []

        def call():
            try:
                ps.pull("w") if method == "Pull" else ps.push({"w": np.ones(4, np.float32)})
            except RemoteError as error:
                outcome.append(error.code())

        caller = threading.Thread(target=call, name=f"hung-{method}")
        caller.start()
        try:
            deadline = threading.Event()
            while cluster.faults.calls.get(method, 0) < 1 and not deadline.wait(0.01):
                pass
            ps.interrupt()
            caller.join(30)
            assert not caller.is_alive() and not hung.is_set()  # ended while still held
        finally:
            hung.set()
            caller.join(30)
        assert outcome == [grpc.StatusCode.CANCELLED]
