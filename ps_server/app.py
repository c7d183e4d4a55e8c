"""The parameter-server daemon: store + servicer + daemon + coordinator membership."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

import grpc

from ps_common.rpc import DEFAULT_CHUNK_BYTES, check_chunk_bytes, make_channel
from ps_common.wire import shard_to_proto, shardmap_to_proto, spec_to_proto
from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from ps_server.control import CoordinatorFence
from ps_server.daemon import Daemon
from ps_server.ledger import PushLedger
from ps_server.memory import default_memory_budget
from ps_server.servicer import ParameterServerServicer, add_to_server
from ps_server.store import ShardStore

log = logging.getLogger(__name__)

SERVICE_NAME = "ps.v1.ParameterServer"


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
    max_workers: int = 16

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not in 0..65535")
        check_chunk_bytes(self.chunk_bytes, what="--chunk-bytes")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 0:
            raise ValueError(f"--memory-budget {self.memory_budget_bytes} must be >= 0")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("--heartbeat-interval must be > 0")


def advertised_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", "[::]", ""):
        return f"{socket.gethostname()}:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ParameterServer:
    """A running ps-server. Start with `start()` (or `with`); `stop()` is graceful.

    Registers with the coordinator (if configured) from a background thread that retries
    until the coordinator answers, then heartbeats; it re-registers when the coordinator
    no longer knows it (e.g. after the coordinator restarted).
    """

    def __init__(self, config: ServerConfig, *, interceptors=()):
        self.config = config
        self.store = ShardStore(allow_non_finite=config.allow_non_finite)
        self.ledger = PushLedger()
        self.fence = CoordinatorFence()
        self.memory_budget_bytes = (default_memory_budget() if config.memory_budget_bytes is None
                                    else config.memory_budget_bytes)
        servicer = ParameterServerServicer(self.store, self.ledger, fence=self.fence,
                                           chunk_bytes=config.chunk_bytes)
        self._daemon = Daemon(
            host=config.host, port=config.port, service_names=[SERVICE_NAME],
            add_servicers=lambda s: add_to_server(servicer, s),
            interceptors=interceptors, max_workers=config.max_workers,
        )
        self.bound_address, self.port = self._daemon.address, self._daemon.port
        self.address = config.advertise_address or advertised_address(config.host, self.port)
        self.server_id = servicer.server_id = config.server_id or self.address
        self._stop = threading.Event()
        self._membership: threading.Thread | None = None
        self.registered = threading.Event()

    def start(self) -> "ParameterServer":
        self._daemon.start()
        if self.config.coordinator:
            self._membership = threading.Thread(
                target=self._membership_loop, name=f"ps-server-{self.server_id}-membership",
                daemon=True)
            self._membership.start()
        return self

    def stop(self, grace_s: float | None = None) -> None:
        self._stop.set()
        self._daemon.stop(self.config.grace_s if grace_s is None else grace_s)
        if self._membership is not None and self._membership is not threading.current_thread():
            self._membership.join(timeout=5.0)

    def wait(self, timeout: float | None = None) -> bool:
        return self._daemon.wait(timeout)

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
            last_map=shardmap_to_proto(self.fence.last_map), generation=self.fence.generation)

    def _membership_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        with make_channel(self.config.coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            registered = False
            while not self._stop.is_set():
                try:
                    if not registered:
                        reply = stub.RegisterServer(self._registration(), timeout=5.0)
                        self.fence.adopt(reply.generation, reply.control_token)
                        registered = True
                        self.registered.set()
                        log.info("registered with coordinator %s (generation %d) as %s, "
                                 "holding %d shard(s)", self.config.coordinator,
                                 reply.generation, self.server_id, len(self.store.held()))
                    generation = self.fence.generation
                    reply = stub.ServerHeartbeat(coordinator_pb2.ServerHeartbeatRequest(
                        server_id=self.server_id, epoch=self.store.epoch, generation=generation,
                        retired_through=self.fence.retired_through), timeout=5.0)
                    registered = reply.known
                    for client in reply.retired:
                        self.ledger.retire(client.client_id, client.incarnation)
                    self.fence.advance_retired(generation, reply.retired_through)
                    if reply.shutdown:
                        log.info("the coordinator says the job is over: shutting down")
                        threading.Thread(target=self.stop, name="ps-server-shutdown",
                                         daemon=True).start()
                        return
                except grpc.RpcError as error:
                    log.warning("coordinator %s: %s", self.config.coordinator, error.code().name)
                    registered = False
                self._stop.wait(interval if registered else min(interval, 0.5))
