"""Shared fixtures: in-process clusters that are always stopped, and a thread-leak check."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

# One BLAS thread in every process of the suite (this one, and the servers, workers and
# benchmarks it starts, which inherit it), set before anything imports numpy. The tests time
# nothing, and a BLAS library otherwise starts a thread per core in each process: on a
# many-core host, thousands over the suite, against the host's process limit.
# (The names are ps_worker.cluster.BLAS_THREAD_VARIABLES; importing it here would import numpy.)
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


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
def make_cluster(no_thread_leak, request, tmp_path_factory):
    """Factory: `make_cluster(servers=3, split_threshold_bytes=1000, ...)` returns a started
    InProcessCluster (on OS-chosen ports); every cluster made is stopped after the test.

    Its servers offer shared memory unless the test module sets `SHARED_MEMORY = False`
    (tests of what happens on the wire), or the test uses the `data_path` fixture
    (parametrized where a module defines it: "shm"; "grpc"; "grpc-staged", gRPC with every
    streamed push waiting in a file, ps_server.push_staging)."""
    from ps_server.testing import InProcessCluster  # after pytest loaded it as a plugin

    shared = getattr(request.module, "SHARED_MEMORY", True)
    staged = False
    if "data_path" in request.fixturenames:
        shared = request.getfixturevalue("data_path") == "shm"
        staged = request.getfixturevalue("data_path") == "grpc-staged"
    started: list[InProcessCluster] = []

    def make(**kwargs):
        kwargs.setdefault("shared_memory", shared)
        if staged:
            kwargs.setdefault("push_memory_bytes", 0)
            kwargs.setdefault("spill_dir", tmp_path_factory.mktemp("spill"))
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


# ---- calls in threads ---------------------------------------------------------------------

CALL_WAIT_S = 30.0  # bound of every join; never reached when the code is right


class BackgroundCall:
    """fn(*args) in a thread; `done` is set when it returns or raises; `result()` joins it
    (bounded) and returns or raises what it did."""

    def __init__(self, fn, *args, name: str = "test-call"):
        self.done = threading.Event()
        self._value = self._error = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), name=name)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self._value = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to result()
            self._error = error
        finally:
            self.done.set()

    def result(self):
        self.thread.join(CALL_WAIT_S)
        assert not self.thread.is_alive(), f"{self.thread.name} did not finish"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def spawn():
    """spawn(fn, *args) -> BackgroundCall; every thread is joined (bounded) after the test.
    (System tests have a `spawn` of their own: processes.)"""
    calls: list[BackgroundCall] = []

    def start(fn, *args) -> BackgroundCall:
        calls.append(BackgroundCall(fn, *args, name=f"test-call-{len(calls)}"))
        return calls[-1]

    yield start
    for call in calls:
        call.thread.join(CALL_WAIT_S)
    assert not [c for c in calls if c.thread.is_alive()], "a call in a thread never finished"


@pytest.fixture
def unstartable_threads(monkeypatch):
    """`unstartable_threads(module, name, once=False)`: in `module` (which does `import
    threading`), a thread named `name` cannot be started, as where a pids limit is reached
    for a moment (RuntimeError "can't start new thread"); with `once`, only the first.
    Returns an Event set at the first refused start."""

    def refuse(module, name: str, *, once: bool = False) -> threading.Event:
        refused = threading.Event()
        real_thread = threading.Thread

        def thread(*args, **kwargs):
            made = real_thread(*args, **kwargs)
            if kwargs.get("name") == name and not (once and refused.is_set()):
                def start():
                    refused.set()
                    raise RuntimeError("can't start new thread")
                made.start = start
            return made

        monkeypatch.setattr(module, "threading", _ThreadingWith(thread))
        return refused

    return refuse


class _ThreadingWith:
    """The threading module, but for its Thread."""

    def __init__(self, thread):
        self.Thread = thread

    def __getattr__(self, name):
        return getattr(threading, name)
