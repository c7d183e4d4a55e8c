"""Shared fixtures: in-process clusters that are always stopped, and a thread-leak check."""

from __future__ import annotations

import gc
import threading
import time

import pytest


# The fixture users get (README): `ps_cluster`, a started 2-server InProcessCluster.
pytest_plugins = ["ps_server.testing"]

THREAD_LEAK_WAIT_S = 5.0


@pytest.fixture(autouse=True)
def no_thread_leak():
    """Fail a test that leaves a non-daemon thread running (waits a bounded time for
    threads that are already on their way out)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_LEAK_WAIT_S
    while True:
        leaked = [t for t in threading.enumerate()
                  if t not in before and not t.daemon and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        gc.collect()  # an unreferenced executor lets its workers exit
        leaked[0].join(timeout=0.05)
    assert not leaked, f"test leaked non-daemon threads: {[t.name for t in leaked]}"


@pytest.fixture
def make_cluster(no_thread_leak, request):
    """Factory: `make_cluster(servers=3, split_threshold_bytes=1000, ...)` returns a started
    InProcessCluster (on OS-chosen ports); every cluster made is stopped after the test.

    Its servers offer shared memory unless the test module sets `SHARED_MEMORY = False`
    (tests of what happens on the wire), or the test uses the `data_path` fixture
    (parametrized over "grpc" and "shm" where a module defines it)."""
    from ps_server.testing import InProcessCluster  # after pytest loaded it as a plugin

    shared = getattr(request.module, "SHARED_MEMORY", True)
    if "data_path" in request.fixturenames:
        shared = request.getfixturevalue("data_path") == "shm"
    started: list[InProcessCluster] = []

    def make(**kwargs):
        kwargs.setdefault("shared_memory", shared)
        cluster = InProcessCluster(**kwargs).start()
        started.append(cluster)
        return cluster

    yield make
    for cluster in reversed(started):
        cluster.stop()


@pytest.fixture
def cluster(make_cluster):
    """A started 2-server cluster with default settings."""
    return make_cluster(servers=2)
