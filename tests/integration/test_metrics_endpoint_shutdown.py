"""A daemon's metrics endpoint serves each scrape on a thread of its own: a client that
connects and sends nothing (a TCP probe, a half-open connection, a stalled scraper) holds
neither the other scrapes nor the daemon's stop() past its --grace (README: "every process
exits within its --grace on SIGTERM whatever it is waiting for"); scrapes in progress are
bounded (MAX_SCRAPES), and a client's timeout is logged at debug, not printed as a traceback.

Deterministic: what each thread is doing is read from its frames, never from timings."""

from __future__ import annotations

import logging
import socket
import sys
import threading

import pytest

from ps_common import telemetry
from ps_common.telemetry import MetricsEndpoint
from ps_server.app import ParameterServer, ServerConfig
from ps_server.testing import scrape_metrics, wait_until


def _functions(thread) -> list[tuple[str, str]]:
    """(file, function) of every frame `thread` is in now, innermost first."""
    frame = sys._current_frames().get(thread.ident)
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return out


def _serving_a_request(thread) -> bool:
    return any(name == "handle" and "wsgiref" in path for path, name in _functions(thread))


def _serving() -> int:
    """How many threads are serving a request now."""
    return sum(_serving_a_request(t) for t in threading.enumerate())


def _any_serving_a_request() -> bool:
    return _serving() > 0


def _waiting_for_the_endpoint_to_shut_down(thread) -> bool:
    """`thread` is in MetricsEndpoint.stop, inside socketserver's shutdown(), which waits
    for the serving loop to come back (from a request, were it to handle one itself)."""
    functions = _functions(thread)
    return (any(name == "stop" and path == telemetry.__file__ for path, name in functions)
            and any(name == "shutdown" and path.endswith("socketserver.py")
                    for path, name in functions))


def test_a_silent_metrics_client_does_not_hold_the_servers_stop(spawn):
    server = ParameterServer(ServerConfig(host="127.0.0.1", port=0, metrics_port=0,
                                          grace_s=0.2, shared_memory=False)).start()
    silent = socket.create_connection(("127.0.0.1", server.metrics.port))
    try:
        endpoint_thread = server.metrics._thread
        # The endpoint took the connection and waits for its request (which never comes).
        wait_until(_any_serving_a_request,
                   "the metrics endpoint serving the silent connection", 10.0)
        stopping = spawn(server.stop)
        # Either stop() is over, or it is seen waiting for the endpoint's loop while that
        # loop reads the silent client's request itself: stop() would then return only when
        # the client goes away or SCRAPE_TIMEOUT_S passes, past the server's --grace.
        wait_until(lambda: stopping.done.is_set() or (
            _waiting_for_the_endpoint_to_shut_down(stopping.thread)
            and _serving_a_request(endpoint_thread)),
            "stop() over, or stop() waiting for the metrics endpoint", 30.0)
        assert stopping.done.is_set(), (
            f"ParameterServer.stop() (grace 0.2 s) waits for a metrics client that sends "
            f"nothing, up to SCRAPE_TIMEOUT_S={telemetry.SCRAPE_TIMEOUT_S:g} s")
    finally:
        silent.close()
        server.stop()


def _no_request_served():
    """Earlier tests' connections, closed, end their threads by themselves: wait for that,
    so that counting the threads serving counts this test's connections only."""
    wait_until(lambda: _serving() == 0, "no request served", 10.0)


@pytest.fixture
def endpoint():
    _no_request_served()
    served = MetricsEndpoint("127.0.0.1", 0, name="test")
    served.start()
    yield served
    served.stop()


def test_a_silent_client_does_not_hold_the_other_scrapes(endpoint):
    with socket.create_connection(("127.0.0.1", endpoint.port)):
        wait_until(lambda: _serving() == 1, "the endpoint serving the silent connection", 10.0)
        [held] = [t for t in threading.enumerate() if _serving_a_request(t)]
        assert scrape_metrics(endpoint.url)
        # Answered while the silent connection was still being served, not after it timed out.
        assert _serving_a_request(held)


def test_scrapes_beyond_max_scrapes_are_closed_at_once_and_their_slots_come_back(monkeypatch):
    monkeypatch.setattr(telemetry, "MAX_SCRAPES", 2)
    _no_request_served()
    endpoint = MetricsEndpoint("127.0.0.1", 0, name="test")
    endpoint.start()
    silent = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(2)]
    try:
        wait_until(lambda: _serving() == 2, "both silent connections served", 10.0)
        with socket.create_connection(("127.0.0.1", endpoint.port)) as extra:
            extra.settimeout(30.0)  # a guard against a hang, not a timing
            assert extra.recv(1) == b"", "a connection beyond MAX_SCRAPES is closed unread"
        assert _serving() == 2
        for connection in silent:
            connection.close()
        wait_until(lambda: _serving() == 0, "the silent connections' threads ended", 10.0)
        assert scrape_metrics(endpoint.url)
    finally:
        for connection in silent:
            connection.close()
        endpoint.stop()


def test_a_client_that_times_out_is_logged_at_debug_without_a_traceback(
        monkeypatch, caplog, capfd):
    monkeypatch.setattr(telemetry._QuietHandler, "timeout", 0.05)
    caplog.set_level(logging.DEBUG, logger=telemetry.__name__)
    endpoint = MetricsEndpoint("127.0.0.1", 0, name="test")
    endpoint.start()
    try:
        with socket.create_connection(("127.0.0.1", endpoint.port)):
            wait_until(lambda: any("TimeoutError" in r.getMessage() for r in caplog.records),
                       "the silent client's timeout logged", 10.0)
    finally:
        endpoint.stop()
    [record] = [r for r in caplog.records if "TimeoutError" in r.getMessage()]
    assert record.levelno == logging.DEBUG
    assert "Traceback" not in capfd.readouterr().err
