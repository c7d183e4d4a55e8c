"""The parameter-server daemon: store + servicer + daemon + coordinator membership."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from dataclasses import dataclass, field

import grpc

from ps_common import shm
from ps_common.rpc import (
    DEFAULT_CHUNK_BYTES, DEFAULT_RECEIVE_WINDOW_BYTES, MAX_RECEIVE_WINDOW_BYTES,
    MIN_RECEIVE_WINDOW_BYTES, check_chunk_bytes, make_channel,
)
from ps_common.status import connection_hint
from ps_common.telemetry import MetricsEndpoint, PushSocketMetrics
from ps_common.tls import TLS
from ps_common.wire import shard_to_proto, shardmap_to_proto, spec_to_proto
from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from ps_server.control import CoordinatorFence
from ps_server.daemon import Daemon
from ps_server.ledger import PushLedger
from ps_server.memory import default_checkpoint_memory, default_memory_budget
from ps_server.servicer import ParameterServerServicer, add_to_server
from ps_server.shared_memory import SharedMemory, clear_dead
from ps_server.snapshots import DEFAULT_STALL_TIMEOUT_S
from ps_server.store import ShardStore
from ps_server.streams import StreamLimiter, handler_threads
from ps_server.telemetry import ServerCollector

log = logging.getLogger(__name__)

SERVICE_NAME = "ps.v1.ParameterServer"
# How often dynamic tables are swept for rows past their ttl (each table's own sweeps are
# at most every quarter of its ttl).
EXPIRY_INTERVAL_S = 1.0
# --memory-budget goes to the coordinator as an int64 (RegisterServerRequest).
MAX_INT64 = 2**63 - 1


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    server_id: str | None = None  # default: the advertised address
    # The address workers and the coordinator use to reach this server. Default: the bound
    # address, or HOSTNAME:PORT when bound to all interfaces (containers, pods).
    advertise_address: str | None = None
    coordinator: str | None = None
    # None: a share of the machine's memory (ps_server.memory); 0: no limit.
    memory_budget_bytes: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    allow_non_finite: bool = False
    grace_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    # Pull + Push streams served at once; more are refused with RESOURCE_EXHAUSTED. The
    # handler pool has ps_server.streams.CONTROL_PLANE_THREADS threads more.
    max_streams: int = 128
    # A stream whose peer sends (push) or takes (pull) nothing for this long is cancelled.
    stream_idle_timeout_s: float = 30.0
    # Copies a checkpoint may hold at once to keep pushes going while it writes
    # (ps_server.snapshots); past it, pushes to shards not yet written wait for the writer.
    # None: 15% of the machine's or container's memory (ps_server.memory).
    checkpoint_memory_bytes: int | None = None
    # A checkpoint's write that makes no progress this long is given up, and the pushes it
    # held go on (ps_server.snapshots); 0: never.
    checkpoint_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # Memory that streamed pushes may wait in until all of each has arrived; a push past it
    # waits in a file in spill_dir (ps_server.push_staging). None: a quarter of the bytes
    # the server holds, at least 16 MiB. spill_dir None: the system's temporary directory.
    push_memory_bytes: int | None = None
    # HTTP/2 receive window per call (ps_common.rpc.DEFAULT_RECEIVE_WINDOW_BYTES); 0: gRPC's
    receive_window_bytes: int = DEFAULT_RECEIVE_WINDOW_BYTES
    spill_dir: str | None = None
    # Offer clients on this host the shared-memory data path (ps_server.shared_memory),
    # where the machine allows it (ps_common.shm.supported).
    shared_memory: bool = True
    # Every call to this server must carry it, and its calls to the coordinator carry it
    # (ps_common.auth); None: no token. Kept out of the repr: it is a secret.
    token: str | None = field(default=None, repr=False)
    # Serve TLS only, and call the coordinator over TLS (ps_common.tls); None: plaintext.
    tls: TLS | None = None
    # Serve Prometheus metrics on host:metrics_port (0: any free port); None: no metrics.
    metrics_port: int | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not in 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} is not in 0..65535")
        check_chunk_bytes(self.chunk_bytes, what="--chunk-bytes")
        if self.memory_budget_bytes is not None and not (
                0 <= self.memory_budget_bytes <= MAX_INT64):
            raise ValueError(f"--memory-budget {self.memory_budget_bytes} must be from 0 to "
                             f"{MAX_INT64} bytes (an int64 on the wire to the coordinator)")
        if not (math.isfinite(self.heartbeat_interval_s) and self.heartbeat_interval_s > 0):
            raise ValueError(f"--heartbeat-interval {self.heartbeat_interval_s} must be a "
                             "number of seconds > 0")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ValueError(f"--grace {self.grace_s} must be a number of seconds >= 0")
        if self.checkpoint_memory_bytes is not None and self.checkpoint_memory_bytes < 0:
            raise ValueError(f"--checkpoint-memory {self.checkpoint_memory_bytes} must be >= 0")
        if not (math.isfinite(self.checkpoint_stall_timeout_s)
                and self.checkpoint_stall_timeout_s >= 0):
            raise ValueError(f"--checkpoint-stall-timeout {self.checkpoint_stall_timeout_s} must "
                             "be a number of seconds >= 0 (0: never)")
        if self.push_memory_bytes is not None and self.push_memory_bytes < 0:
            raise ValueError(f"--push-memory {self.push_memory_bytes} must be >= 0")
        if self.receive_window_bytes != 0 and not (
                MIN_RECEIVE_WINDOW_BYTES <= self.receive_window_bytes <= MAX_RECEIVE_WINDOW_BYTES):
            raise ValueError(f"--receive-window {self.receive_window_bytes} must be 0 (gRPC "
                             f"sizes it) or between {MIN_RECEIVE_WINDOW_BYTES} (64KiB) and "
                             f"{MAX_RECEIVE_WINDOW_BYTES} bytes")
        if self.spill_dir is not None and not (
                os.path.isdir(self.spill_dir) and os.access(self.spill_dir, os.W_OK | os.X_OK)):
            raise ValueError(f"--spill-dir {self.spill_dir}: not a directory this user can "
                             "write to")
        if self.max_streams < 1:
            raise ValueError(f"--max-streams {self.max_streams} must be >= 1")
        if not (math.isfinite(self.stream_idle_timeout_s) and self.stream_idle_timeout_s > 0):
            raise ValueError(f"--stream-idle-timeout {self.stream_idle_timeout_s} must be a "
                             "number of seconds > 0")


def advertised_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", "[::]", ""):
        return f"{socket.gethostname()}:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# While the coordinator does not answer: the longest wait between two tries, and how many
# failed calls in a row between two log lines (the first is logged at once).
MAX_REGISTER_BACKOFF_S = 2.0
UNREACHABLE_LOG_EVERY = 30


class ParameterServer:
    """A running ps-server. Start with `start()` (or `with`); `stop()` is graceful.

    Registers with the coordinator (if configured) from a background thread that retries
    until the coordinator answers, then heartbeats; it re-registers when the coordinator
    no longer knows it (e.g. after the coordinator restarted).
    """

    def __init__(self, config: ServerConfig, *, interceptors=(), push_socket_filter=None):
        """`interceptors`: gRPC server interceptors. Calls through the push socket
        (ps_server.push_socket) do not pass them: a client reaches that socket only with the
        secret of a shared-memory connection it opened over gRPC. `push_socket_filter(handle)`
        returns the handler the push socket calls instead of `handle` (tests inject faults
        there, as `interceptors` do over gRPC).

        With `config.metrics_port`, `metrics` serves this server's figures at `metrics.url`
        (ps_server.telemetry, ps_common.telemetry); else it is None and nothing is counted.
        Raises OSError when the port cannot be bound, MetricsBindError (an OSError) when
        the metrics port cannot."""
        self.config = config
        self.metrics = (None if config.metrics_port is None else MetricsEndpoint(
            config.host, config.metrics_port,
            name=f"ps-server-{config.server_id}" if config.server_id else "ps-server"))
        if self.metrics is not None:
            socket_metrics = PushSocketMetrics(self.metrics.registry).filter
            push_socket_filter = (socket_metrics if push_socket_filter is None else
                                  lambda handle, inner=push_socket_filter:
                                  socket_metrics(inner(handle)))
        self.shared = self._shared_memory(config)
        self.memory_budget_bytes = (default_memory_budget() if config.memory_budget_bytes is None
                                    else config.memory_budget_bytes)
        self.store = ShardStore(allow_non_finite=config.allow_non_finite, memory=self.shared,
                                memory_budget=self.memory_budget_bytes)
        self.ledger = PushLedger()
        self.fence = CoordinatorFence()
        self.streams = StreamLimiter(
            max_streams=config.max_streams, idle_timeout_s=config.stream_idle_timeout_s,
            name=f"ps-server-{config.server_id}" if config.server_id else "ps-server")
        self._servicer = servicer = ParameterServerServicer(self.store, self.ledger, fence=self.fence,
                                           chunk_bytes=config.chunk_bytes, streams=self.streams,
                                           checkpoint_memory_bytes=(
                                               default_checkpoint_memory()
                                               if config.checkpoint_memory_bytes is None
                                               else config.checkpoint_memory_bytes),
                                           checkpoint_stall_timeout_s=(
                                               config.checkpoint_stall_timeout_s),
                                           shared=self.shared,
                                           push_socket_filter=push_socket_filter,
                                           push_memory_bytes=config.push_memory_bytes,
                                           spill_dir=config.spill_dir)
        self.push_staging = servicer.push_staging
        try:
            self._daemon = Daemon(
                host=config.host, port=config.port, service_names=[SERVICE_NAME],
                add_servicers=lambda s: add_to_server(servicer, s), interceptors=interceptors,
                max_workers=handler_threads(config.max_streams), companions=[self.streams],
                drain=self.streams.drain,
                token=config.token, tls=config.tls, metrics=self.metrics,
                receive_window_bytes=config.receive_window_bytes,
            )
        except BaseException:  # e.g. the port is taken: leave no segment (and no port) behind
            if self.shared is not None:
                self.shared.close()
            if self.metrics is not None:
                self.metrics.stop()
            raise
        self.bound_address, self.port = self._daemon.address, self._daemon.port
        # How often it heartbeats: its --heartbeat-interval, or the coordinator's if shorter
        # (set when it registers).
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.address = config.advertise_address or advertised_address(config.host, self.port)
        self.server_id = servicer.server_id = config.server_id or self.address
        self.store.server_id, self.store.address = self.server_id, self.address
        self.store.last_map = lambda: self.fence.last_map
        if self.metrics is not None:
            self.metrics.register(ServerCollector(self))
        self._stop = threading.Event()
        self._membership: threading.Thread | None = None
        self._expiry = threading.Thread(target=self._expiry_loop, daemon=True,
                                        name=f"ps-server-{self.server_id}-expiry")
        self._membership_rpc: grpc.Future | None = None  # the call stop() cancels
        self._membership_lock = threading.Lock()
        self.registered = threading.Event()
        self._stopped = threading.Event()  # stop() has finished: segments removed too

    @staticmethod
    def _shared_memory(config: ServerConfig) -> SharedMemory | None:
        unsupported = shm.supported()
        if unsupported is None:
            clear_dead()  # a dead predecessor's segments, whichever path this server uses
        if not config.shared_memory:
            log.info("shared memory off (--no-shm): clients on this host use gRPC")
            return None
        if unsupported is not None:
            log.info("%s", unsupported)
            return None
        try:
            return SharedMemory()
        except OSError as error:
            log.warning("no shared memory (%s): clients on this host use gRPC",
                        error.strerror or error)
            return None

    @property
    def steps(self):
        """The server's consistency steps (ps_server.consistency.StepGate)."""
        return self._servicer.steps

    @property
    def data_path(self) -> str:
        """What this server offers clients on its host: "shm" or "grpc"."""
        return "grpc" if self.shared is None else "shm"

    def start(self) -> "ParameterServer":
        self._daemon.start()
        if self.config.coordinator:
            self._membership = threading.Thread(
                target=self._membership_loop, name=f"ps-server-{self.server_id}-membership",
                daemon=True)
            self._membership.start()
        self._expiry.start()
        return self

    def _expiry_loop(self) -> None:
        """Evict dynamic tables' rows past their ttl even where no request reaches them."""
        while not self._stop.wait(EXPIRY_INTERVAL_S):
            try:
                self.store.expire_rows()
            except Exception:  # noqa: BLE001 - never let the sweep thread die silently
                log.exception("evicting expired rows of dynamic tables failed")

    def stop(self, grace_s: float | None = None) -> None:
        self._stop.set()
        # A hung coordinator must not hold the server past its grace: the membership call
        # in flight is cancelled (and _coordinator_call starts none once _stop is set).
        with self._membership_lock:
            rpc = self._membership_rpc
        if rpc is not None:
            rpc.cancel()
        # A push waiting for other clients' steps is no call being applied: it is woken
        # (UNAVAILABLE: its client retries against the server that comes back) before the
        # gRPC server's grace and the push socket's close, which would otherwise wait for it.
        self._servicer.steps.close()
        self._daemon.stop(self.config.grace_s if grace_s is None else grace_s)
        self.push_staging.close()
        if self.shared is not None:
            self.shared.close()
        self._stopped.set()
        if self._membership is not None and self._membership is not threading.current_thread():
            self._membership.join(timeout=5.0)
        with self._membership_lock:
            # A cancelled call kept until the interpreter's teardown can hang it there (its
            # completion thread frozen holding the call's lock): let it go now.
            self._membership_rpc = None
        if self._expiry.is_alive() and self._expiry is not threading.current_thread():
            self._expiry.join(timeout=5.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (by stop(), from any thread) or `timeout`
        passes; True if it has. Returns only once stop() is complete, so a process that
        exits then leaves no shared-memory segment behind."""
        if not self._daemon.wait(timeout):
            return False
        # The gRPC server ends inside stop(), before stop() removes the segments: bounded
        # by the shutdown's own duration (the grace period and the segments' removal).
        return self._stopped.wait(self.config.grace_s + 30.0)

    def __enter__(self) -> "ParameterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- coordinator membership -------------------------------------------------------

    def _registration(self) -> coordinator_pb2.RegisterServerRequest:
        """What this server holds, so that a restarted coordinator rebuilds its view from it."""
        held = [coordinator_pb2.HeldShard(spec=spec_to_proto(h.spec), shard=shard_to_proto(h.shard),
                                          updates=h.updates) for h in self.store.held()]
        return coordinator_pb2.RegisterServerRequest(
            server_id=self.server_id, address=self.address,
            memory_budget_bytes=self.memory_budget_bytes, epoch=self.store.epoch, held=held,
            last_map=shardmap_to_proto(self.fence.last_map),
            generation=self.fence.reported_generation)

    def _membership_loop(self) -> None:
        with make_channel(self.config.coordinator, self.config.token,
                          self.config.tls) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            registered = False
            failures = 0  # calls failed in a row: the outage's length, for backoff and logs
            while not self._stop.is_set():
                try:
                    if not registered:
                        reply = self._coordinator_call(stub.RegisterServer,
                                                       self._registration())
                        self.fence.adopt(reply.generation, reply.control_token,
                                         reply.min_epoch)
                        # The coordinator times members out at a multiple of its own
                        # interval: a server set to heartbeat more slowly would be declared
                        # dead while alive. It keeps a faster interval of its own.
                        if reply.heartbeat_interval_ms > 0:
                            self.heartbeat_interval_s = min(
                                self.config.heartbeat_interval_s,
                                reply.heartbeat_interval_ms / 1000.0)
                        registered = True
                        self.registered.set()
                        log.info("registered with coordinator %s (generation %d) as %s, "
                                 "holding %d shard(s)", self.config.coordinator,
                                 reply.generation, self.server_id, len(self.store.held()))
                    generation = self.fence.generation
                    reply = self._coordinator_call(
                        stub.ServerHeartbeat, coordinator_pb2.ServerHeartbeatRequest(
                            server_id=self.server_id, epoch=self.store.epoch,
                            generation=generation, retired_through=self.fence.retired_through,
                            tables=[coordinator_pb2.TableShardStats(
                                variable=t.variable, index=t.index, rows=t.rows,
                                evictions=t.evictions, bytes=t.nbytes)
                                for t in self.store.table_stats()]))
                    registered = reply.known
                    if failures:
                        log.info("coordinator %s answers again", self.config.coordinator)
                        failures = 0
                    for client in reply.retired:
                        self.ledger.retire(client.client_id, client.incarnation)
                        self._servicer.steps.leave(client.client_id, client.incarnation)
                        if self.shared is not None:
                            self.shared.close_client(client.client_id)
                    self.fence.advance_retired(generation, reply.retired_through)
                    if reply.shutdown:
                        log.info("the coordinator says the job is over: shutting down")
                        threading.Thread(target=self.stop, name="ps-server-shutdown",
                                         daemon=True).start()
                        return
                except grpc.FutureCancelledError:
                    return  # by stop()
                except grpc.RpcError as error:
                    failures += 1
                    if failures == 1 or failures % UNREACHABLE_LOG_EVERY == 0:
                        # (an RpcError from a call has code() and details(); be sure anyway:
                        # this thread must not die of its own log line)
                        code = getattr(error, "code", lambda: None)()
                        details = getattr(error, "details", lambda: "")() or ""
                        hint = (connection_hint(details)
                                if code == grpc.StatusCode.UNAVAILABLE else None)
                        log.warning(
                            "coordinator %s does not answer (%s: %s), %d call(s) in a row; "
                            "retrying. %s", self.config.coordinator,
                            getattr(code, "name", "no answer"), details, failures,
                            f"Check this server's TLS flags: {hint}" if hint else
                            "Check that ps-coordinator runs there, that --coordinator names its "
                            "address and port, and that both have the same token")
                    registered = False
                # Unregistered: retried soon, backing off to MAX_REGISTER_BACKOFF_S while
                # the coordinator stays away (a restarted one is found within that).
                interval = self.heartbeat_interval_s
                self._stop.wait(interval if registered and not failures else min(
                    MAX_REGISTER_BACKOFF_S, min(interval, 0.5) * 2 ** min(failures, 8)))

    def _coordinator_call(self, rpc, request):
        """`rpc(request)` with a 5 s deadline, cancellable by stop(). Raises grpc.RpcError,
        or grpc.FutureCancelledError once stop() was called."""
        call = rpc.future(request, timeout=5.0)
        with self._membership_lock:
            self._membership_rpc = call
        # stop() sets _stop before it reads _membership_rpc: if it read the previous call,
        # this sees _stop set.
        if self._stop.is_set():
            call.cancel()
        return call.result()
