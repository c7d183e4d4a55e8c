"""What every paramserve daemon has: a gRPC server with health and reflection, a bound
address, and graceful shutdown: health says NOT_SERVING (so probes and load balancers send
nothing new) while the daemon drains the calls in flight, still answering; then it stops,
letting what remains finish within the rest of the grace period."""

from __future__ import annotations

import logging
import threading
import time

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_common.auth import server_interceptors, warn_if_open
from ps_common.rpc import MalformedRequests, bind, make_server
from ps_common.telemetry import MetricsEndpoint, RpcMetrics, service_methods
from ps_common.tls import TLS

# How long a stop waits for the health service to mark every service NOT_SERVING before it
# goes on (see GrpcDaemon.stop).
HEALTH_MARK_S = 1.0

log = logging.getLogger(__name__)


class Daemon:
    """A started gRPC server serving `services` plus health and reflection.

    `add_servicers(server)` registers the daemon's own servicers; `token`: every call but
    health's must carry it (ps_common.auth); `tls`: it serves TLS only (ps_common.tls), and
    mutual TLS with a client CA; `max_workers` sizes its
    handler thread pool. `companions` are objects with `start()` and `stop()` that run beside
    the server (e.g. a watchdog): started after it, stopped after it has stopped, so they
    serve its grace period too. `drain(timeout)`: blocks until the daemon's work in flight
    is done or `timeout` passes (e.g. a parameter server's Pull and Push streams); the daemon
    keeps serving meanwhile, its health NOT_SERVING. `metrics` (ps_common.telemetry; None:
    no metrics, and no interceptor) gets the figures of every call and is served like a
    companion, its last. Thread-safe `stop`.
    """

    def __init__(self, *, host: str, port: int, service_names: list[str], add_servicers,
                 interceptors=(), max_workers: int = 16, companions=(), drain=None,
                 token: str | None = None, tls: TLS | None = None,
                 metrics: MetricsEndpoint | None = None, receive_window_bytes: int = 0):
        if tls is not None:
            tls.check_daemon()
        all_services = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        # The token is checked before anything else looks at a call, but for the call
        # metrics: they read only the method's name and the messages' sizes, and count the
        # calls refused for want of the token too (ps_common.telemetry.RpcMetrics).
        counted = ([] if metrics is None
                   else [RpcMetrics(metrics.registry, service_methods(all_services))])
        self.server, self._executor = make_server(
            max_workers=max_workers,
            interceptors=[*counted, *server_interceptors(token), MalformedRequests(),
                          *interceptors],
            receive_window_bytes=receive_window_bytes)
        warn_if_open(host, token, tls, f"{service_names[0] if service_names else 'a daemon'}")
        self._companions = [*companions, *([metrics] if metrics is not None else [])]
        self._drain = drain
        add_servicers(self.server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(all_services, self.server)
        self._service_names = service_names
        self.address, self.port = bind(self.server, host, port, tls)
        self._stopped = threading.Event()

    def start(self) -> None:
        self.server.start()
        for companion in self._companions:
            companion.start()
        for name in ["", *self._service_names]:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float) -> None:
        """Stop taking new RPCs, let those in flight finish within `grace_s`, then return."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        # NOT_SERVING goes to every Health.Watch stream, and grpc's send to a stream being
        # torn down (or whose caller stopped reading) can block for good: the health service
        # is open to anyone, so no watcher may hold up a stop. The server's stop below ends
        # those streams, and with them a send still blocked.
        marking = threading.Thread(target=self._health.enter_graceful_shutdown,
                                   name="health-not-serving", daemon=True)
        marking.start()
        marking.join(HEALTH_MARK_S)
        remaining = grace_s
        if self._drain is not None:
            began = time.monotonic()
            self._drain(grace_s)
            remaining = max(0.0, grace_s - (time.monotonic() - began))
        self.server.stop(remaining).wait(remaining + 1.0)
        marking.join(HEALTH_MARK_S)
        for companion in self._companions:
            companion.stop()
        self._executor.shutdown(wait=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates or `timeout` passes; True if it terminated."""
        timed_out = self.server.wait_for_termination(timeout)
        return not timed_out
