"""Channel and server options, deadlines and the retry policy shared by every caller.

Retries are data: which codes are retried, how often and how long to back off is decided
here, once. Only UNAVAILABLE is retried by default (and DEADLINE_EXCEEDED for idempotent
reads); pushes are retried only because servers deduplicate them.
"""

from __future__ import annotations

import random
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, TypeVar

import grpc

from ps_common.clock import Clock, SystemClock
from ps_common.status import RemoteError

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

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Many pulls/pushes share one connection: fail fast on a dead peer instead of hanging.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # A restarted server on the same port is found within a second, not after 20 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 100),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def make_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def make_server(max_workers: int = 16, interceptors=()) -> tuple[grpc.Server, futures.Executor]:
    """A gRPC server and its handler thread pool (shut it down after the server stops)."""
    executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc")
    server = grpc.server(executor, options=SERVER_OPTIONS, interceptors=list(interceptors))
    return server, executor


def bind(server: grpc.Server, host: str, port: int) -> tuple[str, int]:
    """Bind `server` to host:port (0 = any free port); returns (address, bound port)."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:  # grpcio >= 1.60 raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind {target}: address in use or not available")
    address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    return address, bound


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded, jittered exponential backoff. `max_attempts` includes the first try."""

    max_attempts: int = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5  # each sleep is backoff * uniform(1 - jitter, 1)
    retry_codes: frozenset = frozenset({grpc.StatusCode.UNAVAILABLE})

    def backoff(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt)
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
) -> T:
    """Run `call` (one RPC); retry the policy's codes with backoff; raise RemoteError.

    `call` must be safe to repeat: an idempotent read, or a push that carries its
    (client, incarnation, sequence).
    """
    clock = clock or SystemClock()
    rng = rng or _JITTER
    attempt = 0
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            remote = RemoteError.from_rpc_error(error, target=target)
        except RemoteError as error:
            remote = error
        attempt += 1
        if remote.code() not in policy.retry_codes or attempt >= policy.max_attempts:
            raise remote
        clock.sleep(policy.backoff(attempt - 1, rng))
