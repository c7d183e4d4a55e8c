"""Prometheus metrics of one daemon or worker: a registry of its own, the HTTP endpoint that
serves it, and the figures of the gRPC calls it answers.

Off unless asked for (`--metrics-port`): without it nothing here is created, no interceptor
is installed and no call pays for any of it. With it, each daemon gets a CollectorRegistry
of its own, never prometheus-client's process-wide one, so that several daemons in one
process (ps_server.testing) each serve their own figures on their own port.

Most figures are read when Prometheus scrapes, by collectors over state the daemon keeps
anyway (the exactly-once ledger's counts, the coordinator's member tables). Only what
exists per call is recorded as calls happen, by RpcMetrics: per method, calls by status
code, latency, bytes in and out, calls in progress. Every name starts with `paramserve_`;
the README lists them all.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import sys
import threading
import time
from typing import Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client import make_wsgi_app

from ps_common.rpc import answers_without_a_thread

NAMESPACE = "paramserve"
# Seconds: from a call through shared memory (tens of µs) to a push waiting for a sync step
# (up to 30 s).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A scrape whose client sends nothing for this long is dropped: its thread must not live on.
SCRAPE_TIMEOUT_S = 10.0
# Scrapes served at once, each on a thread of its own; a connection beyond them is closed at
# once, so that clients that connect and send nothing cannot pile up threads.
MAX_SCRAPES = 8
# How often the endpoint's thread looks whether it was told to stop.
_POLL_S = 0.1
# Methods outside the daemon's own services (possible only for calls refused for want of
# the token) share this label, so that callers cannot make up label values.
OTHER_METHOD = "other"

log = logging.getLogger(__name__)


class MetricsBindError(OSError):
    """The metrics endpoint's address cannot be bound (the port is taken, say)."""


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format, *args):  # noqa: A002 - the signature is http.server's
        pass  # one line per scrape on stderr is noise


class _ScrapeServer(socketserver.ThreadingMixIn, WSGIServer):
    """Serves each scrape on a daemon thread of its own, at most MAX_SCRAPES at once: a client
    that connects and sends nothing holds neither the other scrapes nor `shutdown()`, which
    then waits only for the accept loop."""

    daemon_threads = True
    # server_close() must not join the scrapes' threads either: a stalled client's ends
    # with SCRAPE_TIMEOUT_S or with the process.
    block_on_close = False

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d scrapes in progress; closing the connection of %s",
                      MAX_SCRAPES, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (none left to the process, say)
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, (TimeoutError, ConnectionError)):
            # A client that went silent or away: its business, not an error of the daemon's.
            log.debug("metrics: scrape from %s ended: %r", client_address, error)
        else:
            log.warning("metrics: scrape from %s failed", client_address, exc_info=True)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MetricsEndpoint:
    """A registry and the HTTP server that serves it at `url` (http://HOST:PORT/metrics).

    The port is bound in the constructor (`port` 0: any free one; `.port` is the one bound),
    which raises MetricsBindError naming the address when it cannot be. `start()` accepts
    from a thread of its own and serves each scrape on another (_ScrapeServer); `stop()`
    ends the accepting thread and frees the port (also for an endpoint never started). The
    registry holds the process's memory and CPU (`paramserve_process_*`); add the daemon's
    own collectors with `register`.
    """

    def __init__(self, host: str, port: int, *, name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(namespace=NAMESPACE, registry=self.registry)
        bare = host.strip("[]") or "0.0.0.0"
        try:
            family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]

            class Server(_ScrapeServer):
                address_family = family

            self._httpd = Server((bare, port), _QuietHandler)
        except OSError as error:
            raise MetricsBindError(
                f"cannot serve metrics on {_address(bare, port)}: "
                f"{error.strerror or error}") from None
        self._httpd.set_app(make_wsgi_app(self.registry))
        self.port = self._httpd.server_port
        self.url = f"http://{_address(bare, self.port)}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(_POLL_S,),
                                        name=f"{name}-metrics", daemon=True)
        self._lock = threading.Lock()
        self._closed = False

    def register(self, collector) -> None:
        self.registry.register(collector)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Thread-safe; returns once the endpoint accepts no more connections, without
        waiting for a scrape in progress (it ends by itself, within SCRAPE_TIMEOUT_S of its
        client's silence, or with the process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for the accept loop only (within _POLL_S)
            self._thread.join()
        self._httpd.server_close()


def service_methods(service_names: Iterable[str]) -> frozenset[str]:
    """The full method names ("/package.Service/Method") of the named services, as their
    descriptors (imported with their generated modules) list them."""
    pool = descriptor_pool.Default()
    methods = set()
    for name in service_names:
        try:
            service = pool.FindServiceByName(name)
        except KeyError:
            continue
        methods.update(f"/{service.full_name}/{m.name}" for m in service.methods)
    return frozenset(methods)


class _MethodMetrics:
    """The children of one method's series, bound once (labels() costs a lock each time)."""

    def __init__(self, rpc: "RpcMetrics", method: str):
        self._handled = rpc.handled
        self.method = method
        self.seconds = rpc.seconds.labels(method)
        self.received = rpc.received_bytes.labels(method)
        self.sent = rpc.sent_bytes.labels(method)
        self.in_flight = rpc.in_flight.labels(method)
        self._by_code: dict[str, object] = {}

    def finish(self, code: str, started: float) -> None:
        self.seconds.observe(time.perf_counter() - started)
        self.in_flight.dec()
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._handled.labels(self.method, code)
        child.inc()


def _code(context, raised: bool) -> str:
    """The status a call ends with: what the handler set (abort, set_code); else UNKNOWN for
    an exception (what gRPC answers then), OK otherwise."""
    code = context.code()
    if code is None:
        return "UNKNOWN" if raised else "OK"
    return code.name


class RpcMetrics(grpc.ServerInterceptor):
    """Per method: calls by status code, handling time, request and response bytes (as they
    cross the wire, counted in the (de)serializers, so streamed chunks count one by one),
    and calls in progress. Thread-safe.

    `methods`: the daemon's own full method names; any other method is labelled "other".
    Install it before the token check (ps_common.auth): calls refused for want of the token
    are then counted too, as UNAUTHENTICATED, which is how a process given the wrong token
    shows up. It reads the method's name and the messages' sizes, nothing of their content.
    Calls through the push socket pass no interceptor: PushSocketMetrics counts those.
    """

    def __init__(self, registry: CollectorRegistry, methods: Iterable[str]):
        self._methods = frozenset(methods)
        self.handled = Counter(
            "rpc_handled", "gRPC calls answered, by full method name and status code",
            ["method", "code"], namespace=NAMESPACE, registry=registry)
        self.seconds = Histogram(
            "rpc_handling_seconds", "Time from a call's start to its answer (for a streamed "
            "answer: to its last message)", ["method"], namespace=NAMESPACE,
            registry=registry, buckets=LATENCY_BUCKETS)
        self.received_bytes = Counter(
            "rpc_received_bytes", "Bytes of request messages received", ["method"],
            namespace=NAMESPACE, registry=registry)
        self.sent_bytes = Counter(
            "rpc_sent_bytes", "Bytes of response messages sent", ["method"],
            namespace=NAMESPACE, registry=registry)
        self.in_flight = Gauge(
            "rpc_in_flight", "Calls being handled now", ["method"], namespace=NAMESPACE,
            registry=registry)
        self._per_method: dict[str, _MethodMetrics] = {}
        # method -> (the handler seen last, its wrapped version), for the daemon's own methods:
        # their handlers are long-lived, so each is wrapped once (a refused call's handler is
        # made per call).
        self._wrapped: dict[str, tuple] = {}

    def _metrics_of(self, method: str) -> _MethodMetrics:
        label = method if method in self._methods else OTHER_METHOD
        found = self._per_method.get(label)
        if found is None:  # two threads may both build it: the same children either way
            found = self._per_method[label] = _MethodMetrics(self, label)
        return found

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or answers_without_a_thread(handler):
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, self._metrics_of(method))
        if method in self._methods:  # a caller names any method it likes: keep none of those
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, metrics: _MethodMetrics):
        kind = ("unary_unary" if handler.unary_unary else "unary_stream"
                if handler.unary_stream else "stream_unary" if handler.stream_unary
                else "stream_stream")
        behavior = getattr(handler, kind)
        if handler.response_streaming:
            call = _streaming_answer(behavior, metrics)
        else:
            call = _single_answer(behavior, metrics)
        return handler._replace(**{
            kind: call,
            "request_deserializer": _counting_reader(handler.request_deserializer,
                                                     metrics.received),
            "response_serializer": _counting_writer(handler.response_serializer,
                                                    metrics.sent)})


class PushSocketMetrics:
    """PushShared calls answered through a server's push socket (shared memory: no gRPC
    call, so RpcMetrics never sees them), by status code, and their handling time."""

    def __init__(self, registry: CollectorRegistry):
        self.handled = Counter(
            "push_socket_handled", "PushShared calls answered through the push socket "
            "(shared memory, no gRPC), by status code", ["code"], namespace=NAMESPACE,
            registry=registry)
        self.seconds = Histogram(
            "push_socket_handling_seconds", "Time to answer a PushShared call through the "
            "push socket", namespace=NAMESPACE, registry=registry, buckets=LATENCY_BUCKETS)

    def filter(self, handle):
        """The push socket's handler (ps_server.push_socket) with its calls counted and
        timed: `handle(request)` answers, or raises a PSError whose `code` names the status."""
        by_code: dict[str, object] = {}

        def counted(request):
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                reply = handle(request)
                code = "OK"
                return reply
            except Exception as error:
                # A PSError names its status; the socket answers anything else INTERNAL.
                code = error.code if isinstance(getattr(error, "code", None), str) \
                    else "INTERNAL"
                raise
            finally:
                self.seconds.observe(time.perf_counter() - started)
                child = by_code.get(code)
                if child is None:
                    child = by_code[code] = self.handled.labels(code)
                child.inc()

        return counted


def _single_answer(behavior, metrics: _MethodMetrics):
    """A unary-answer handler, timed from its start to its return."""

    def call(request_or_iterator, context):
        metrics.in_flight.inc()
        started = time.perf_counter()
        raised = True
        try:
            answer = behavior(request_or_iterator, context)
            raised = False
            return answer
        finally:
            metrics.finish(_code(context, raised), started)

    return call


def _streaming_answer(behavior, metrics: _MethodMetrics):
    """A streamed-answer handler, timed until the call ends: gRPC reports that end
    (context.add_callback) however it comes, the last message sent, an error, or the client
    gone (CANCELLED) with the stream not read to its end."""

    def call(request_or_iterator, context):
        metrics.in_flight.inc()
        started = time.perf_counter()
        outcome: list[str] = []  # the code, once the answer's iterator ended by itself

        def ended():
            metrics.finish(outcome[0] if outcome else "CANCELLED", started)

        try:
            answers = behavior(request_or_iterator, context)
        except BaseException:
            metrics.finish(_code(context, True), started)
            raise
        if not context.add_callback(ended):  # the call is over already
            outcome.append(_code(context, False))
            ended()
            return answers
        return _watched(answers, context, outcome)

    return call


def _watched(answers, context, outcome: list[str]):
    try:
        yield from answers
    except GeneratorExit:
        raise  # closed unread: the client is gone (the callback says CANCELLED)
    except BaseException:
        outcome.append(_code(context, True))
        raise
    outcome.append(_code(context, False))


def _counting_reader(deserialize, counter):
    if deserialize is None:
        def read(raw):
            counter.inc(len(raw))
            return raw
    else:
        def read(raw):
            counter.inc(len(raw))
            return deserialize(raw)
    return read


def _counting_writer(serialize, counter):
    def write(message):
        raw = message if serialize is None else serialize(message)
        counter.inc(len(raw))
        return raw
    return write
