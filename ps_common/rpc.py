"""Channel and server options, deadlines and the retry policy shared by every caller.

Retries are data: which codes are retried, how often and how long to back off is decided
here, once. Only UNAVAILABLE is retried by default (and DEADLINE_EXCEEDED for idempotent
reads), plus any status carrying a google.rpc.RetryInfo delay (an overloaded server);
pushes are retried only because servers deduplicate them.
"""

from __future__ import annotations

import random
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc

from ps_common.auth import with_token
from ps_common.tls import TLS

from ps_common.clock import Clock, SystemClock
from ps_common.status import RemoteError, bounded

# Tensor bytes are streamed in chunks of this size, well under gRPC's 4 MiB default message
# limit (leaving room for headers), so no peer ever needs its limits raised.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_CHUNK_BYTES = 3 * 1024 * 1024  # leaves room for headers under MAX_MESSAGE_BYTES


def check_chunk_bytes(chunk_bytes: int, *, what: str = "chunk_bytes") -> None:
    """Chunks are a positive multiple of 8 (element-aligned for every dtype) and stay under
    gRPC's default 4 MiB message limit, so no peer needs its limits raised."""
    if chunk_bytes < 8 or chunk_bytes % 8 or chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"{what} {chunk_bytes} must be a multiple of 8 between 8 and "
                         f"{MAX_CHUNK_BYTES} (3 MiB)")

# Keepalive: every peer pings a connection silent for KEEPALIVE_TIME_MS and drops it when
# the answer takes longer than KEEPALIVE_TIMEOUT_MS. Servers accept client pings as often as
# every MIN_CLIENT_PING_INTERVAL_MS, which must not exceed the clients' KEEPALIVE_TIME_MS.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_CLIENT_PING_INTERVAL_MS = 10_000

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Many pulls/pushes share one connection: fail fast on a dead peer instead of hanging.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # A restarted server on the same port is found within a second, not after 20 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 100),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # A peer that vanished (host gone, no FIN or RST) ends its calls, and frees their handler
    # threads, once a ping goes unanswered: within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS
    # of silence, not when TCP gives up hours later. (A server's keepalive pings are not
    # limited by grpc.http2.max_pings_without_data: gRPC core applies that to clients only.)
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Clients ping every KEEPALIVE_TIME_MS, with or without calls in flight: accept pings
    # that often (more often than MIN_CLIENT_PING_INTERVAL_MS is a strike; enough strikes
    # and the server would close the connection with GOAWAY "too_many_pings").
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
]


def make_channel(address: str, token: str | None = None, tls: TLS | None = None) -> grpc.Channel:
    """A channel to `address`; every call on it carries `token` (ps_common.auth) if given,
    over TLS (ps_common.tls) if `tls` is given."""
    channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if tls is None else
               grpc.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS))
    return with_token(channel, token)


# A parameter server's HTTP/2 receive window per call (ps-server --receive-window): how much
# of a push a client may send before the server has taken it in. gRPC otherwise sizes the
# window from the bandwidth-delay product it measures (at least 4 MiB, more on a fast link),
# and on loopback that left up to 4 MiB per stream buffered in the transport beside what the
# server holds: with 1 MiB, W2's server peaked at 1.23-1.26x its 64 MiB of values above idle
# against 1.36-2.01x, for about 5% fewer round trips, within the runs' spread
# (benchmarks/RESULTS.md). A fixed window caps a call's throughput at window / round-trip
# time: links with a larger bandwidth-delay product want a larger window, or 0 (gRPC's own
# sizing).
DEFAULT_RECEIVE_WINDOW_BYTES = 1 << 20
MIN_RECEIVE_WINDOW_BYTES = 64 << 10  # about HTTP/2's default initial window (65,535)
MAX_RECEIVE_WINDOW_BYTES = (1 << 31) - 1  # HTTP/2's largest


def receive_window_options(nbytes: int) -> list[tuple[str, int]]:
    """Channel arguments for a fixed receive window of `nbytes` (0: gRPC sizes it)."""
    if nbytes == 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", nbytes)]


def make_server(max_workers: int = 16, interceptors=(),
                receive_window_bytes: int = 0) -> tuple[grpc.Server, futures.Executor]:
    """A gRPC server and its handler thread pool of `max_workers` threads (shut it down
    after the server stops). Each call in progress holds one thread, a stream for as long as
    it is open: a server that bounds its streams sizes the pool above that bound.
    `receive_window_bytes`: see DEFAULT_RECEIVE_WINDOW_BYTES (0: gRPC sizes it)."""
    executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc")
    server = grpc.server(executor,
                         options=SERVER_OPTIONS + receive_window_options(receive_window_bytes),
                         interceptors=list(interceptors))
    return server, executor


class MalformedRequests(grpc.ServerInterceptor):
    """Ends a call whose request is not a message of its method with INVALID_ARGUMENT:
    gRPC's own answer, when a request deserializer raises, is INTERNAL ("Exception
    deserializing request!"), which tells the client nothing about its mistake. Install it
    after the token check, before any interceptor that reads requests: it then wraps only
    handlers of methods the daemon serves, and the interceptors after it see only real
    requests. Calls that stream requests decode each message in their handler (Push), and
    are left alone.
    """

    def __init__(self):
        self._wrapped: dict[str, tuple] = {}  # method -> (its handler, the wrapped one)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None \
                or answers_without_a_thread(handler):
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _refusing_malformed(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def answers_without_a_thread(handler) -> bool:
    """Whether gRPC runs `handler` without holding a handler thread for it (the health
    service's Watch, which answers through a callback until its caller hangs up). Such a
    handler must reach gRPC as it is: a wrapper drops the mark, and each open Watch would
    then hold one of the daemon's threads, so that a caller without the token (the health
    service is open to probes) could take them all."""
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                or handler.stream_stream)
    return bool(getattr(behavior, "experimental_non_blocking", False))


class _Malformed:
    def __init__(self, message: str):
        self.message = message


def _refusing_malformed(handler, method: str):
    parse = handler.request_deserializer
    kind = "unary_unary" if handler.unary_unary else "unary_stream"
    behavior = getattr(handler, kind)

    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except Exception as error:  # protobuf's DecodeError and friends
            return _Malformed(bounded(f"{method}: the request is not a message of this method "
                                      f"({type(error).__name__}: {error}); nothing was done"))

    def run(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)

    return handler._replace(request_deserializer=deserialize, **{kind: run})


class BindError(OSError):
    """A daemon's address cannot be bound (taken, or not this host's)."""


def bind(server: grpc.Server, host: str, port: int,
         tls: TLS | None = None) -> tuple[str, int]:
    """Bind `server` to host:port (0 = any free port), serving TLS only if `tls` is given;
    returns (address, bound port)."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(target) if tls is None else
                 server.add_secure_port(target, tls.server_credentials()))
    except RuntimeError:  # grpcio >= 1.60 raises instead of returning 0
        bound = 0
    if bound == 0:
        raise BindError(f"could not bind {target}: address in use or not available")
    address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    return address, bound


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded, jittered exponential backoff. `max_attempts` includes the first try.

    `max_attempts=None` retries without limit: only for callers that pass `call_with_retry`
    a `stop` event, so that whoever owns the wait (e.g. a worker told by its coordinator
    that the job is over, or by SIGTERM) decides when it ends.
    """

    max_attempts: int | None = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5  # each sleep is backoff * uniform(1 - jitter, 1)
    retry_codes: frozenset = frozenset({grpc.StatusCode.UNAVAILABLE})

    def backoff(self, attempt: int, rng: random.Random) -> float:
        # The exponent is capped: an unlimited policy reaches attempts whose power would
        # overflow a float (2.0 ** 1100), long after the backoff reached its maximum.
        base = min(self.max_backoff_s,
                   self.initial_backoff_s * self.multiplier ** min(attempt, 64))
        return base * rng.uniform(1.0 - self.jitter, 1.0)


# Seeding a Random from os.urandom costs ~30 us: one shared generator serves every call
# (its methods are safe to call from several threads).
_JITTER = random.Random()

READ_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

T = TypeVar("T")


def call_with_retry(
    call: Callable[[], T],
    *,
    target: str,
    policy: RetryPolicy,
    clock: Clock | None = None,
    rng: random.Random | None = None,
    stop: threading.Event | None = None,
    on_retry: Callable[[int, RemoteError], None] | None = None,
) -> T:
    """Run `call` (one RPC); retry the policy's codes with backoff; raise RemoteError.

    `call` must be safe to repeat: an idempotent read, or a push that carries its
    (client, incarnation, sequence).

    `stop`: once it is set no further attempt starts and a backoff wait ends at once, with
    RemoteError CANCELLED (an attempt in flight runs on, bounded by its own deadline). The
    backoff is then waited on the event, in real time, whatever `clock` is.
    `on_retry(attempt, error)`: called before each backoff wait, `attempt` counting the
    failed attempts so far (1 after the first); it may raise to end the retries early.
    """
    if policy.max_attempts is None and stop is None:
        raise ValueError(f"{target}: a retry policy without max_attempts needs a stop event")
    clock = clock or SystemClock()
    rng = rng or _JITTER
    attempt = 0
    while True:
        if stop is not None and stop.is_set():
            raise _cancelled(target)
        try:
            return call()
        except grpc.RpcError as error:
            remote = RemoteError.from_rpc_error(error, target=target)
        except RemoteError as error:
            remote = error
        attempt += 1
        # A server that says when to come back (google.rpc.RetryInfo: e.g. RESOURCE_EXHAUSTED
        # while every stream slot is taken) is retried whatever its code.
        asked_back = remote.retry_after_s is not None
        if (remote.code() not in policy.retry_codes and not asked_back) or (
                policy.max_attempts is not None and attempt >= policy.max_attempts):
            raise remote
        if on_retry is not None:
            on_retry(attempt, remote)
        delay = max(policy.backoff(attempt - 1, rng), remote.retry_after_s or 0.0)
        if stop is None:
            clock.sleep(delay)
        elif stop.wait(delay):
            raise _cancelled(target)


def _cancelled(target: str) -> RemoteError:
    return RemoteError(grpc.StatusCode.CANCELLED, "the caller stopped waiting", target=target)
