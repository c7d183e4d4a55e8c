"""Run a paramserve cluster inside a test process, and inject faults into it.

    from ps_server.testing import InProcessCluster

    def test_my_training_loop():
        with InProcessCluster(servers=2) as cluster:
            with PSClient(cluster.coordinator_address) as ps:
                ...

or, with pytest, use the `ps_cluster` fixture (registered by `pytest_plugins =
["ps_server.testing"]` in a conftest.py). Every server and the coordinator bind OS-chosen
ports on 127.0.0.1, so clusters never collide, and two may live in one process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc

from ps_common.errors import PSError
from ps_common.rpc import answers_without_a_thread
from ps_common.tls import TLS
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import tensor_pb2
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.checkpointer import Interval


def first_shard_push_header(shard_map, name: str, client_id: str) -> ps_pb.PushHeader:
    """The header of a raw push (sequence 1) of a float32 gradient for shard 0 of `name`,
    for tests that drive the Push stream by hand (`shard_map`: a PSClient's)."""
    shard, spec = shard_map.shards[name][0], shard_map.spec(name)
    return ps_pb.PushHeader(
        client_id=client_id, incarnation=1, sequence=1, acked_through=0,
        epoch=shard_map.epoch, shards=[ps_pb.ShardRef(variable=name, index=shard.index)],
        tensors=[tensor_pb2.TensorMeta(
            dtype=tensor_pb2.FLOAT32, shape=[shard.row_stop - shard.row_start, *spec.shape[1:]])])


class _Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def cut_off_from_coordinator(server: ParameterServer) -> threading.Event:
    """Make `server`'s calls to its coordinator fail as a network partition would (UNAVAILABLE),
    while clients still reach it, until the returned event is set: past --server-timeout the
    coordinator takes it for lost and moves its shards."""
    reachable = threading.Event()
    real_call = server._coordinator_call

    def call(rpc, request):
        if not reachable.is_set():
            raise _Unreachable()
        return real_call(rpc, request)

    server._coordinator_call = call
    return reachable


def wait_until(predicate, what: str, timeout_s: float = 30.0, poll_s: float = 0.005) -> None:
    """Wait, polling, until `predicate()` is true; TimeoutError naming `what` after
    `timeout_s` (a bound that a sound build never reaches, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)

class FaultInjector(grpc.ServerInterceptor):
    """Server interceptor that fails chosen calls with a chosen status. Thread-safe.

    `fail_next(method, n, code)` fails the next n calls of `method` (e.g. "Push") before
    they run; `hold_next(method, until)` makes the next call wait for the event `until`
    before it runs (a slow or stalled server); `drop_response_next(method, n, then=fn)` runs the next n calls, calls `fn()`
    (e.g. to move the shard map while the response is "in flight"), and then replaces their
    response with UNAVAILABLE, as a lost response would look to the client.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._fail: dict[str, list] = {}
        self._drop: dict[str, int] = {}
        self._then: dict[str, object] = {}
        self._hold: dict[str, threading.Event] = {}
        self.calls: dict[str, int] = {}
        self.socket_calls = 0  # PushShared calls that came through a push socket

    def fail_next(self, method: str, n: int = 1,
                  code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        with self._lock:
            self._fail[method] = [n, code]

    def hold_next(self, method: str, until: threading.Event) -> None:
        with self._lock:
            self._hold[method] = until

    def drop_response_next(self, method: str, n: int = 1, then=None) -> None:
        with self._lock:
            self._drop[method] = n
            self._then[method] = then

    def _take(self, method: str):
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            hold = self._hold.pop(method, None)
            if hold is not None:
                return "hold", hold
            fail = self._fail.get(method)
            if fail and fail[0] > 0:
                fail[0] -= 1
                return "fail", fail[1]
            if self._drop.get(method, 0) > 0:
                self._drop[method] -= 1
                return "drop", self._then.get(method)
            return None, None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or answers_without_a_thread(handler):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        behavior = getattr(handler, kind)

        def wrapped(request, context):
            action, code = self._take(_family(method, request))
            if action == "hold":
                code.wait(timeout=60.0)  # bounded: a forgotten event never hangs a server
            if action == "fail":
                context.abort(code, f"injected failure of {method}")
            result = behavior(request, context)
            if action != "drop":
                return result  # a streamed response stays streamed (stalls, snapshots)
            if kind.endswith("stream"):
                list(result)  # the call runs to its end; its response is then lost
            if code is not None:  # the `then` hook
                code()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"injected loss of the {method} response")

        return handler._replace(**{kind: wrapped})

    def push_socket_filter(self, handle):
        """The same faults, and the same counts in `calls`, for PushShared calls through the
        push socket (ParameterServer's `push_socket_filter`)."""

        def wrapped(request):
            with self._lock:
                self.socket_calls += 1
            action, code = self._take(_family("PushShared", request))
            if action == "hold":
                code.wait(timeout=60.0)
            if action == "fail":
                raise _injected(code, "injected failure of PushShared")
            result = handle(request)
            if action != "drop":
                return result
            if code is not None:
                code()
            raise _injected(grpc.StatusCode.UNAVAILABLE, "injected loss of the PushShared response")

        return wrapped


def _injected(code: grpc.StatusCode, message: str) -> PSError:
    error = PSError(message)
    error.code = code.name
    return error


# Data-path calls are counted and faulted by what they do: "Pull" and "Push" name every
# way of pulling over the wire and of pushing (a push through shared memory included: its
# header still travels as a call; pulls through shared memory make none).
_FAMILIES = {"PullUnary": "Pull", "PushUnary": "Push", "PushShared": "Push",
             "PushThenPull": "Push"}  # a push, whose pull comes with its answer


def _family(method: str, request) -> str:
    if method == "PushShared" and not request.slot:
        return "PushSharedSlot"  # asks for a slot: no push in it
    return _FAMILIES.get(method, method)


class InProcessCluster:
    """A coordinator and N parameter servers in this process on OS-chosen ports.

    `.coordinator_address`, `.servers` (ParameterServer objects), `.coordinator`,
    `.faults` (a FaultInjector installed on every server). `restart_server(i)` stops server i
    and starts a fresh one with the same id on the same port, as after a crash without
    checkpoints: the coordinator finds its trained shards lost (DATA_LOSS), or re-creates
    them from their initializers with `reinitialize_lost_shards=True`.
    `restart_coordinator()` replaces the coordinator with a fresh one on the same port.
    `shared_memory=False` starts the servers with --no-shm (every client then uses gRPC).
    `token`: every daemon checks it (--token-file); clients then need PSClient(token=...).
    `tls` (ps_common.tls.TLS, with a certificate and key): every daemon serves TLS only, and
    mutual TLS when it has a client CA; clients then need PSClient(tls_ca=...).
    With `checkpoint_dir`, the coordinator takes checkpoints there (`checkpoint()` takes one
    now; periodic ones only with `checkpoint_every`) and a restarted server gets its shards
    back from the newest one. With `metrics=True` every daemon serves Prometheus metrics on a
    port of its own (`.metrics.url` of the coordinator and of each server).
    `push_memory_bytes` and `spill_dir` are the servers' --push-memory and --spill-dir
    (`push_memory_bytes=0`: every streamed push waits in a file). `receive_window_bytes` is
    their --receive-window and `checkpoint_stall_timeout_s` their --checkpoint-stall-timeout
    (None: the defaults).
    """

    def __init__(self, servers: int = 2, *, split_threshold_bytes: int = 64 * 1024 * 1024,
                 chunk_bytes: int | None = None, allow_non_finite: bool = False,
                 memory_budget_bytes: int | None = None, heartbeat_interval_s: float = 0.2,
                 ready_timeout_s: float = 10.0, reinitialize_lost_shards: bool = False,
                 server_timeout_s: float = 60.0, max_streams: int | None = None,
                 stream_idle_timeout_s: float | None = None,
                 checkpoint_dir: str | Path | None = None,
                 checkpoint_every: Interval | None = None, shared_memory: bool = True,
                 token: str | None = None, tls: TLS | None = None,
                 metrics: bool = False, push_memory_bytes: int | None = None,
                 spill_dir: str | Path | None = None, receive_window_bytes: int | None = None,
                 checkpoint_stall_timeout_s: float | None = None):
        self._n = servers
        self._coordinator_config = CoordinatorConfig(
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_interval_s * 10,
            split_threshold_bytes=split_threshold_bytes, grace_s=1.0,
            reinitialize_lost_shards=reinitialize_lost_shards, server_timeout_s=server_timeout_s,
            recovery_grace_s=0.0,  # a new cluster: nothing to wait for
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None,
            checkpoint_every=checkpoint_every, token=token, tls=tls,
            metrics_port=0 if metrics else None)
        self._server_kwargs = dict(
            heartbeat_interval_s=heartbeat_interval_s, allow_non_finite=allow_non_finite,
            memory_budget_bytes=memory_budget_bytes, grace_s=1.0, shared_memory=shared_memory,
            token=token, tls=tls, metrics_port=0 if metrics else None,
            push_memory_bytes=push_memory_bytes,
            spill_dir=str(spill_dir) if spill_dir is not None else None)
        if chunk_bytes is not None:
            self._server_kwargs["chunk_bytes"] = chunk_bytes
        # None: ServerConfig's defaults (--max-streams, --stream-idle-timeout).
        if max_streams is not None:
            self._server_kwargs["max_streams"] = max_streams
        if stream_idle_timeout_s is not None:
            self._server_kwargs["stream_idle_timeout_s"] = stream_idle_timeout_s
        if receive_window_bytes is not None:
            self._server_kwargs["receive_window_bytes"] = receive_window_bytes
        if checkpoint_stall_timeout_s is not None:
            self._server_kwargs["checkpoint_stall_timeout_s"] = checkpoint_stall_timeout_s
        self._ready_timeout_s = ready_timeout_s
        self.faults = FaultInjector()
        self.coordinator: Coordinator | None = None
        self.servers: list[ParameterServer] = []

    @property
    def coordinator_address(self) -> str:
        assert self.coordinator is not None, "cluster not started"
        return self.coordinator.address

    def start(self) -> "InProcessCluster":
        self.coordinator = Coordinator(self._coordinator_config).start()
        try:
            for i in range(self._n):
                self.servers.append(self._start_server(f"ps-{i}", port=0))
            self.wait_until_registered()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_server(self, server_id: str, port: int) -> ParameterServer:
        config = ServerConfig(server_id=server_id, port=port,
                              coordinator=self.coordinator_address, **self._server_kwargs)
        return ParameterServer(config, interceptors=[self.faults],
                               push_socket_filter=self.faults.push_socket_filter).start()

    def wait_until_registered(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        for server in self.servers:
            if not server.registered.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"server {server.server_id} did not register in time")

    def wait_until_synced(self, timeout_s: float | None = None) -> None:
        """Wait until every server holds the coordinator's current shard-map epoch (a
        declaration waits only for the servers holding what it declares; the others get
        the new map in the background)."""
        deadline = time.monotonic() + (timeout_s or self._ready_timeout_s)
        while True:
            epoch = self.coordinator.state.shard_map.epoch
            behind = [s.server_id for s in self.servers if s.store.epoch < epoch]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"server(s) {behind} did not reach epoch {epoch} in time")
            time.sleep(0.01)

    def checkpoint(self):
        """Take a checkpoint now (the cluster needs a checkpoint_dir); returns its Manifest."""
        return self.coordinator.checkpointer.take("requested")

    def restart_coordinator(self) -> Coordinator:
        """Stop the coordinator and start a fresh one (nothing carried over) on the same
        port, as after a crash: it rebuilds its view from what the servers report when they
        register again. Returns once every server has registered with it."""
        port = self.coordinator.port
        self.coordinator.stop(grace_s=0.2)
        # Servers heartbeat every heartbeat_interval_s: give them a few to report.
        grace = 5 * self._coordinator_config.heartbeat_interval_s
        self.coordinator = Coordinator(replace(self._coordinator_config, port=port,
                                               recovery_grace_s=grace)).start()
        deadline = time.monotonic() + self._ready_timeout_s
        while len(self.coordinator.state.live_servers()) < len(self.servers):
            if time.monotonic() > deadline:
                raise TimeoutError("servers did not register with the restarted coordinator")
            time.sleep(0.01)
        return self.coordinator

    def restart_server(self, index: int) -> ParameterServer:
        old = self.servers[index]
        old.stop(grace_s=0.5)
        self.servers[index] = self._start_server(old.server_id, port=old.port)
        self.wait_until_registered()
        return self.servers[index]

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace_s=0.5)
        self.servers = []
        if self.coordinator is not None:
            self.coordinator.stop(grace_s=0.5)

    def __enter__(self) -> "InProcessCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


try:
    import pytest

    @pytest.fixture
    def ps_cluster():
        """A started 2-server InProcessCluster, stopped after the test."""
        with InProcessCluster(servers=2) as cluster:
            yield cluster
except ImportError:  # pytest is only needed for the fixture
    pass


def scrape_metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """One scrape of a --metrics-port endpoint: (sample name, its labels) -> value. Read one
    with `metric(samples, name, **labels)`."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """The value of sample `name` with exactly `labels` in a scrape; 0 when absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)
