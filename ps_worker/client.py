"""PSClient: the library API a training loop calls: declare, pull, push.

The client routes every name to the servers that own its shards (one RPC per server per
call, in parallel), reassembles split variables, refreshes its shard map when a server says
it is stale, and retries UNAVAILABLE with jittered backoff. Pushes are exactly-once: each
carries (client id, incarnation, sequence) and servers apply each at most once, so a retry
after a lost response never double-applies.

A push is validated whole here first (names, shapes, dtypes; finiteness too when it spans
several servers) and then again by each server, which applies its part all-or-nothing; the
servers do not commit together (see `PSClient.push` for what the caller knows after an
error), so only a push to one server leaves its finiteness check to that server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Iterable, Mapping

import grpc
import numpy as np

from ps_common.consistency import SYNC, Mode, parse_mode
from ps_common.errors import NON_FINITE_GRADIENT, STEP_TIMEOUT, InvalidArgument, OutOfRange
from ps_common.rows import check_ids, dedup, sum_duplicates
from ps_common.rpc import (
    DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES, READ_RETRY_CODES, RetryPolicy, call_with_retry,
    check_chunk_bytes, make_channel,
)
from ps_common.shardmap import (
    EMBEDDING, Component, Shard, ShardMap, VariableSpec, rows_by_server, shard_capacity,
)
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_common.tensors import (
    WIRE_DTYPES, StreamAssembler, TensorMeta, all_finite, array_reader, decode_chunk,
    dtype_to_proto, encode_chunk, finite_in_both, from_wire, iter_chunks, narrowed, to_wire,
    wire_itemsize, wire_raw_dtype,
)
from ps_common.wire import shardmap_from_proto, spec_to_proto
from ps_worker.one_call_pulls import MAX_KEPT as MAX_KEPT_PULLS, OneCallPull
from ps_worker.shared_memory import (
    OWNER_CHECK_S, ConnectionLost, HandshakeFailed, SharedConnection,
)
from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from ps_proto.v1 import parameter_server_pb2 as ps_pb

# Forks of this process so far: a PSClient refuses to work in a child forked after it was
# made (PSClient._refuse_in_forked_child).
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)

log = logging.getLogger(__name__)

# How many times one pull or push follows a "your shard map is stale" answer before giving up.
MAX_MAP_REFRESHES = 5
# How far a client's push sequences to one server may run ahead of its acknowledged ones
# (servers remember up to 4096 by default: ps_server.ledger).
MAX_UNACKED_SEQUENCES = 1024
# Codes that mean a server did not answer (or we stopped listening): no news of its health.
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.CANCELLED})
# Deadline of the one GetShardMap with which a waiting call checks whether its server moved.
MOVED_CHECK_TIMEOUT_S = 5.0
# Row ids of an embedding table travel in a call's first message, beside up to 3 MiB of
# tensor bytes under gRPC's 4 MiB: 512 KiB of them per call at most.
MAX_ROW_IDS_PER_CALL = 65_536
# A chunk message's field tags and lengths, beyond what its fields hold (a few varints).
FIELD_FRAMING_BYTES = 64
# After a shared-memory handshake call failed, calls to that server go over gRPC this long
# before the handshake is tried again.
HANDSHAKE_RETRY_S = 5.0


def _local_error(code: grpc.StatusCode, message: str, reason: str = "") -> RemoteError:
    return RemoteError(code, message, target="client", reason=reason)


class _DataPath:
    """The data-path calls of one server, with the chunk codec of ps_common.tensors instead
    of protobuf messages around each chunk (same wire format, a fraction of the CPU)."""

    def __init__(self, channel: grpc.Channel):
        method = "/ps.v1.ParameterServer/"
        self.Pull = channel.unary_stream(
            method + "Pull", request_serializer=ps_pb.PullRequest.SerializeToString,
            response_deserializer=decode_chunk)
        self.Push = channel.stream_unary(
            method + "Push", request_serializer=_identity,
            response_deserializer=ps_pb.PushReply.FromString)
        self.PullUnary = channel.unary_unary(
            method + "PullUnary", request_serializer=ps_pb.PullRequest.SerializeToString,
            response_deserializer=decode_chunk)
        # Bytes in, bytes out: ps_worker.one_call_pulls.
        self.PullUnaryBytes = channel.unary_unary(method + "PullUnary")
        self.PushUnary = channel.unary_unary(
            method + "PushUnary", request_serializer=_identity,
            response_deserializer=ps_pb.PushReply.FromString)
        self.PushThenPull = channel.unary_unary(
            method + "PushThenPull", request_serializer=_identity,
            response_deserializer=decode_chunk)
        self.push_then_pull = True  # False once the server said it has no PushThenPull
        for name, request, reply in (
                ("OpenSharedMemory", ps_pb.OpenSharedMemoryRequest, ps_pb.OpenSharedMemoryReply),
                ("AttachShards", ps_pb.AttachShardsRequest, ps_pb.AttachShardsReply),
                ("PushShared", ps_pb.PushSharedRequest, ps_pb.PushSharedReply),
                ("CloseSharedMemory", ps_pb.CloseSharedMemoryRequest,
                 ps_pb.CloseSharedMemoryReply),
                ("JoinSteps", ps_pb.JoinStepsRequest, ps_pb.JoinStepsReply),
                ("LeaveSteps", ps_pb.LeaveStepsRequest, ps_pb.LeaveStepsReply)):
            setattr(self, name, channel.unary_unary(
                method + name, request_serializer=request.SerializeToString,
                response_deserializer=reply.FromString))


def _identity(raw: bytes) -> bytes:
    return raw


@dataclass
class StepStats:
    """What the servers said about this client's steps (join_steps): seconds its pushes
    waited for other clients, the largest gap in steps between it and the slowest client
    that a server let through, and its gradients dropped for coming too late (sync)."""
    wait_s: float = 0.0
    staleness_max: int = 0
    dropped_stale: int = 0


@dataclass(frozen=True)
class _Piece:
    """One shard's part of a push: the gradient rows headed for that shard."""

    shard: Shard
    grad: np.ndarray  # C-contiguous, in the wire dtype's raw element type
    wire_dtype: str
    row_ids: np.ndarray | None = None  # an embedding table's rows the gradient is for
    # Not checked for non-finite values here: the push goes to one server, which checks it
    # whole (PushHeader.refuse_non_finite) and applies all of it or nothing.
    unchecked: VariableSpec | None = None

    def ref(self) -> ps_pb.ShardRef:
        return ps_pb.ShardRef(variable=self.shard.variable, index=self.shard.index,
                              row_ids=b"" if self.row_ids is None else self.row_ids.tobytes())


class _PullAlong:
    """A pull that may go along with a push to the same server (PushThenPull): its size in
    bytes, and once it went, the arrays its tensors landed in. Its request and arrays are
    made only if it goes (a push over shared memory takes none along)."""

    def __init__(self, make_request, make_destinations, nbytes: int):
        self._make_request = make_request
        self._make_destinations = make_destinations
        self.nbytes = nbytes
        self.destinations: list[np.ndarray] = []
        self.done = False

    def request(self) -> bytes:
        return self._make_request().SerializeToString()

    def receive(self, answer, server_id: str) -> None:
        self.destinations = self._make_destinations()
        assembler = StreamAssembler(self.destinations, what=f"pull from {server_id}")
        assembler.write(answer.data)
        assembler.finish()
        self.done = True


def _pull_request(epoch: int, shards: list[Shard], wire_dtype: str | None) -> ps_pb.PullRequest:
    return ps_pb.PullRequest(
        epoch=epoch, shards=[ps_pb.ShardRef(variable=s.variable, index=s.index) for s in shards],
        wire_dtype=dtype_to_proto(wire_dtype) if wire_dtype else 0)


class _DensePull:
    """One server's part of a pull of whole variables: its request, the arrays its tensors
    land in (the outputs themselves where the bytes are already the values), and `finish`,
    which converts the rest into the outputs once they arrived."""

    def __init__(self, shard_map: ShardMap, shards: list[Shard],
                 outputs: dict[str, np.ndarray], wire_dtype: str | None):
        self._epoch, self._shards, self._wire_dtype = shard_map.epoch, shards, wire_dtype
        self.destinations: list[np.ndarray] = []
        self._conversions = []
        for shard in shards:
            spec = shard_map.variables[shard.variable]
            # A table's shard is every stride-th row: it lands in a buffer first.
            rows = outputs[shard.variable][shard.row_start:shard.row_stop:shard.stride]
            wire = wire_dtype or spec.dtype
            if wire != spec.dtype or shard.stride > 1:
                raw = np.empty(rows.shape, wire_raw_dtype(wire))
                self.destinations.append(raw)
                self._conversions.append((rows, raw, wire))
            else:
                self.destinations.append(rows)
        self.nbytes = sum(d.nbytes for d in self.destinations)

    def request(self) -> ps_pb.PullRequest:
        return _pull_request(self._epoch, self._shards, self._wire_dtype)

    def finish(self) -> None:
        for rows, raw, wire in self._conversions:
            rows[...] = from_wire(raw, wire)


class PSClient:
    """Talks to a paramserve cluster through its coordinator. Thread-safe.

    Args:
        coordinator: the coordinator's HOST:PORT.
        client_id / incarnation: the exactly-once identity of this client's pushes. By
            default the coordinator hands this instance a fresh incarnation (on its first
            push), so a restarted trainer that reuses a client_id never has its pushes taken
            for its predecessor's; the predecessor's incarnation is fenced from then on. The
            worker runtime passes the incarnation the coordinator gave its worker; any
            incarnation passed in must come from the coordinator in the same way.
        chunk_bytes: size of the chunks tensors are streamed in.
        timeout_s: deadline of each RPC, plus `timeout_per_gib_s` per GiB it carries.
        retry: backoff policy for UNAVAILABLE (and DEADLINE_EXCEEDED on pulls). With
            `max_attempts=None` a call waits for an absent server until it answers, the
            coordinator's map moves it to another address, or `interrupt()`. Either way an
            outage is logged once per server (and its end once), not once per retry.
        max_in_flight_pushes: window of `push_async`; a further call blocks until one ends.
        allow_non_finite: push NaN/Inf gradients (servers started with --allow-non-finite
            accept them). Otherwise they are refused: by the client before anything is sent
            for a push that spans servers, by the server for a push to one server whose
            replies said it honours the ask (the push's header asks even a server started
            with --allow-non-finite to refuse them).
        shared_memory: with a server on this host that offers it, pull and push through
            shared memory (ps_worker.shared_memory); False: always gRPC (--no-shm).
        token: the cluster's shared token, sent on every call (ps_common.auth: daemons
            started with --token-file refuse calls without it, UNAUTHENTICATED).
        tls_ca, tls_cert, tls_key: PEM files (ps_common.tls): with `tls_ca` every call goes
            over TLS and the daemons' certificates are checked against it; `tls_cert` and
            `tls_key` are this client's certificate for daemons that require one (mutual
            TLS). `tls`: the same settings already read (ps_common.tls.TLS), instead.
    """

    def __init__(
        self,
        coordinator: str,
        *,
        client_id: str | None = None,
        incarnation: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 60.0,
        timeout_per_gib_s: float = 60.0,
        retry: RetryPolicy | None = None,
        max_in_flight_pushes: int = 4,
        allow_non_finite: bool = False,
        shared_memory: bool = True,
        token: str | None = None,
        tls_ca: str | os.PathLike | None = None,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
        tls: TLS | None = None,
    ):
        check_chunk_bytes(chunk_bytes)
        if tls is not None and (tls_ca or tls_cert or tls_key):
            raise ValueError("give tls or tls_ca/tls_cert/tls_key, not both")
        if tls is None:
            tls = TLS.from_files(ca=tls_ca, cert=tls_cert, key=tls_key)
        if max_in_flight_pushes < 1:
            raise ValueError("max_in_flight_pushes must be >= 1")
        self.coordinator = coordinator
        self._made_before_forks = _forks  # see _refuse_in_forked_child
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._incarnation = incarnation
        self._registered_incarnation = False  # this instance asked the coordinator for it
        self._identity_lock = threading.Lock()
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._timeout_per_gib_s = timeout_per_gib_s
        self._retry = retry or RetryPolicy()
        self._read_retry = RetryPolicy(**{**self._retry.__dict__, "retry_codes": READ_RETRY_CODES})
        self._allow_non_finite = allow_non_finite

        self._lock = threading.Lock()
        self._sequences_changed = threading.Condition(self._lock)
        self._token = token  # the cluster's (ps_common.auth): on every call, never logged
        self._tls = tls
        self._coordinator_channel = make_channel(coordinator, token, tls)
        self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._coordinator_channel)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, _DataPath] = {}
        self._map: ShardMap | None = None
        # Exactly-once bookkeeping, per server: last sequence issued, and those finished.
        self._next_seq: dict[str, int] = {}
        self._finished: dict[str, set[int]] = {}
        self._acked_through: dict[str, int] = {}
        # Addresses of servers whose push replies said they refuse non-finite gradients when
        # a header asks (an older server would ignore the ask): see _split.
        self._servers_checking: set[str] = set()

        self._rpc_pool = futures.ThreadPoolExecutor(max_workers=16,
                                                    thread_name_prefix="ps-client-rpc")
        self._prefetch_pool = futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="ps-client-pull")
        self._async_pool = futures.ThreadPoolExecutor(
            max_workers=max_in_flight_pushes, thread_name_prefix="ps-client-push")
        self._window = threading.BoundedSemaphore(max_in_flight_pushes)
        self._pending: set[futures.Future] = set()
        self._failed: list[futures.Future] = []  # finished push_async calls not yet flushed
        self._closed = False
        # Set by close() once its calls in flight are over: every later call is refused
        # (no channel is opened again, nothing is sent under the released incarnation).
        self._shut = threading.Event()
        self._interrupted = threading.Event()  # see interrupt()
        self._wire_calls: set = set()  # data-path calls in progress (interrupt cancels them)
        self._unreachable: set[str] = set()  # servers whose outage has been logged
        self._use_shared_memory = shared_memory
        # Consistency steps (join_steps): the mode, and per server the step this client
        # computes next there; what the servers' answers said, for ps-ctl and the worker.
        self._mode: Mode | None = None
        self._replicas = 1
        self._steps: dict[str, int] = {}
        # Per server, the members of its steps (client_id, incarnation) its last stepped
        # answer named, and the step this client was at there if it must join again: told to
        # it if it restarted (JoinStepsRequest.resume_step, peers), so that its first step
        # waits for them.
        self._step_members: dict[str, tuple[tuple[str, int], ...]] = {}
        self._resume_at: dict[str, int] = {}
        self.step_stats = StepStats()
        # Address -> shared-memory connection, or None: that server's calls go over gRPC.
        self._shared: dict[str, SharedConnection | None] = {}
        # Address -> the path its calls took last ("shm" or "grpc"); kept after close().
        self._paths: dict[str, str] = {}
        # address -> when a failed shared-memory handshake may be tried again
        self._handshake_retry_at: dict[str, float] = {}
        # (names, wire dtype) -> the pull one call answers (ps_worker.one_call_pulls)
        self._one_call_pulls: dict[tuple, OneCallPull] = {}
        # When a shared-memory pull from a dead server last asked the coordinator whether
        # its shards were placed anew (_refuse_if_placed_anew).
        self._placement_checked_at = 0.0

    # ---- identity ----------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        """This instance's incarnation (asked of the coordinator the first time it is needed)."""
        # One registration per instance: a second one would retire the first incarnation.
        with self._identity_lock:
            if self._incarnation is None:
                reply = call_with_retry(
                    lambda: self._coordinator_call(
                        "RegisterClient",
                        coordinator_pb2.RegisterClientRequest(client_id=self.client_id),
                        self._timeout_s),
                    target=self.coordinator, policy=self._retry, stop=self._interrupted)
                with self._lock:
                    self._incarnation = reply.incarnation
                    self._registered_incarnation = True
            return self._incarnation

    def _release_incarnation(self) -> None:
        """Tell the coordinator this instance is done, so servers may retire its dedup
        state. Best effort: a coordinator that cannot be reached only means servers keep
        that state (bounded), never that a push is lost or applied twice."""
        with self._lock:
            incarnation = self._incarnation if self._registered_incarnation else None
        if incarnation is None:
            return
        try:
            self._coordinator.ReleaseClient(coordinator_pb2.ReleaseClientRequest(
                client_id=self.client_id, incarnation=incarnation), timeout=5.0)
        except grpc.RpcError as error:
            log.info("could not release client %s at the coordinator: %s", self.client_id,
                     error.code().name)

    # ---- lifecycle ---------------------------------------------------------------------

    def interrupt(self) -> None:
        """End every wait of this client, now and from now on: a call that is retrying (e.g.
        for a server that is away), a pull or push on the wire (cancelled), and every later
        call raise RemoteError CANCELLED at once. Pushes cut short this way may or may not
        have been applied. For a worker told to stop (SIGTERM, or the job is over); `close()`
        is still to be called. Irreversible; thread-safe. In a forked child it does nothing:
        the sockets it would shut down are the parent's too."""
        if self._forked_away:
            return
        self._interrupted.set()
        with self._lock:
            calls = list(self._wire_calls)
            # Unary data-path calls block without a future (a future costs a thread handoff
            # per call); closing their channels is what ends them.
            channels = list(self._channels.values())
            connections = [x for x in self._shared.values() if x is not None]
        for call in calls:
            call.cancel()
        for connection in connections:
            connection.interrupt()
        for channel in channels:
            channel.close()

    @property
    def _forked_away(self) -> bool:
        """This process is a child forked after this client was made."""
        return _forks != self._made_before_forks

    def _refuse_in_forked_child(self) -> None:
        """Raise FAILED_PRECONDITION in a child forked after this client was made. The child
        would share the parent's client id, push sequences, push slots and sockets: its
        pushes would be taken for the parent's retries (answered, never applied) or mixed
        into the parent's in the same slot, and its gRPC channels may hang."""
        if self._forked_away:
            raise _local_error(grpc.StatusCode.FAILED_PRECONDITION,
                               "this PSClient was made before this process was forked: it "
                               "belongs to the parent process; make a new PSClient here")

    def _refuse_if_closed(self, *, closing: bool = False) -> None:
        """Raise FAILED_PRECONDITION once close() is done with the calls in flight, or, with
        `closing`, once it has begun (for a new call in the background, which close() would
        not wait for); and in a forked child (see _refuse_in_forked_child)."""
        self._refuse_in_forked_child()
        if self._shut.is_set() or (closing and self._closed):
            raise _local_error(grpc.StatusCode.FAILED_PRECONDITION,
                               "this PSClient is closed: make a new one")

    def _submit(self, pool: futures.ThreadPoolExecutor, fn, *args, **kwargs) -> futures.Future:
        """`pool.submit`, refused as any call is once the client is closed (a pool shut
        down by close() would raise RuntimeError)."""
        self._refuse_if_closed()
        try:
            return pool.submit(fn, *args, **kwargs)
        except RuntimeError:
            self._refuse_if_closed(closing=True)  # only close() shuts the pools down
            raise

    def _coordinator_call(self, method: str, request, timeout: float):
        """A call to the coordinator that interrupt() cancels (a declare may wait long for
        its shards, a refresh for a coordinator that restarts)."""
        self._refuse_if_closed()
        call = getattr(self._coordinator, method).future(request, timeout=timeout)
        with self._on_the_wire(call):
            try:
                return call.result()
            except grpc.FutureCancelledError:
                raise _local_error(grpc.StatusCode.CANCELLED,
                                   f"{method} to the coordinator interrupted") from None

    def _unary(self, method, request, timeout: float, server_id: str):
        """A blocking unary data-path call, ended by interrupt() (which closes its channel)."""
        return self._invoke(lambda: method(request, timeout=timeout), server_id)

    def _invoke(self, start, server_id: str):
        """`start()`: a data-path call made (unary) or begun (a stream) on a channel that
        close() or interrupt() in another thread may have closed meanwhile (a retry after
        its backoff, say): refused as a call after close(), or CANCELLED."""
        try:
            return start()
        except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
            self._refuse_if_closed()  # close() in another thread closed it
            if not self._interrupted.is_set():
                raise
            raise _local_error(grpc.StatusCode.CANCELLED,
                               f"call to {server_id} interrupted") from None

    @contextlib.contextmanager
    def _on_the_wire(self, call):
        """Track a data-path call so that `interrupt()` can cancel it."""
        with self._lock:
            self._wire_calls.add(call)
        try:
            if self._interrupted.is_set():  # interrupted between the check and the call
                call.cancel()
            yield call
        finally:
            with self._lock:
                self._wire_calls.discard(call)

    def close(self) -> None:
        """Wait for calls in flight, release threads and channels, then raise the first
        error of a `push_async` that failed and was never flushed (its gradients did not
        land, or not everywhere: see `push`). Idempotent: only the first call raises.
        Under a retry policy without an attempt limit the wait lasts as long as a server is
        away: call `interrupt()` first to give up on what is in flight. In a forked child
        it does nothing: what it would close is the parent's."""
        if self._forked_away:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._async_pool.shutdown(wait=True)
        self._prefetch_pool.shutdown(wait=True)
        self._rpc_pool.shutdown(wait=True)
        self._shut.set()
        self._release_incarnation()
        self._one_call_pulls.clear()
        with self._lock:
            connections = [x for x in self._shared.values() if x is not None]
            self._shared.clear()
        for connection in connections:
            connection.close()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
        self._coordinator_channel.close()
        with self._lock:
            failed, self._failed = self._failed, []
        for future in failed:
            future.result()  # raises the first error

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # The block's own exception is the one its caller must see: an unflushed push's
        # error is logged instead of replacing it (not when interrupt() cut it short: that
        # was asked for).
        try:
            self.close()
        except RemoteError as error:
            if not (self._interrupted.is_set() and error.code() == grpc.StatusCode.CANCELLED):
                log.warning("a push_async that was never flushed failed: %s", error)

    # ---- shard map ---------------------------------------------------------------------

    @property
    def shard_map(self) -> ShardMap:
        self._refuse_in_forked_child()  # every data-path call starts here
        with self._lock:
            current = self._map
        return current if current is not None else self.refresh()

    def refresh(self) -> ShardMap:
        """Fetch the current shard map from the coordinator."""
        reply = call_with_retry(
            lambda: self._coordinator_call(
                "GetShardMap", coordinator_pb2.GetShardMapRequest(), self._timeout_s),
            target=self.coordinator, policy=self._read_retry, stop=self._interrupted)
        return self._adopt(shardmap_from_proto(reply))

    def _adopt(self, new: ShardMap) -> ShardMap:
        with self._lock:
            moved_on = self._map is not None and new.epoch > self._map.epoch
            if self._map is None or new.epoch >= self._map.epoch:
                if new is not self._map:  # kept pulls are for the map they were made with
                    self._one_call_pulls.clear()
                self._map = new
            adopted = self._map
            connections = [x for x in self._shared.values() if x is not None] if moved_on \
                else []
        for connection in connections:
            connection.forget_moved(adopted)
        return adopted

    def _map_with(self, names: Iterable[str]) -> ShardMap:
        """The shard map, refreshed once if it does not know every name yet."""
        current = self.shard_map
        if any(n not in current.variables for n in names):
            current = self.refresh()
        for name in names:
            if name not in current.variables:
                raise _local_error(grpc.StatusCode.NOT_FOUND,
                                   f"variable {name!r} has not been declared")
        return current

    # ---- declare -----------------------------------------------------------------------

    def declare(self, name: str, shape, dtype: str = "float32", init="zeros",
                optimizer="sgd", seed: int = 0) -> VariableSpec:
        """Declare a variable (a no-op if declared before with the same spec).

        `init`: "zeros" | "constant" | "uniform" | "normal" | "glorot_uniform", or a dict
        with "name" and knobs (value; minval, maxval; mean, stddev). `optimizer`: "sgd" |
        "momentum" | "adagrad" | "adam", or a dict with "name" and knobs (lr, momentum,
        nesterov, beta1, beta2, eps, initial_accumulator, weight_decay).
        Raises RemoteError: FAILED_PRECONDITION if `name` exists with another spec,
        INVALID_ARGUMENT for a bad spec, RESOURCE_EXHAUSTED if no server has room.
        """
        spec = self._spec(name, shape, dtype, init, optimizer, seed)
        self.declare_many([spec])
        return spec

    def declare_many(self, specs: list[VariableSpec]) -> ShardMap:
        """Declare several variables in one request (placed together, one epoch change)."""
        request = coordinator_pb2.DeclareRequest(variables=[spec_to_proto(s) for s in specs])
        reply = call_with_retry(
            lambda: self._coordinator_call("Declare", request, self._timeout_s * 5),
            target=self.coordinator, policy=self._retry, stop=self._interrupted)
        return self._adopt(shardmap_from_proto(reply))

    def declare_embedding(self, name: str, dim: int, num_rows: int | None = None, *,
                          dtype: str = "float32", init="uniform", optimizer="sgd",
                          seed: int = 0, capacity: int | None = None,
                          ttl_seconds: float | None = None) -> VariableSpec:
        """Declare an embedding table: `num_rows` x `dim`, or with `num_rows=None` a dynamic
        table whose ids may be any int64 (a row is made from the seeded initializer the first
        time its id is pulled or pushed: the same id gets the same initial row on any server,
        in any run). A dynamic table holds at most `capacity` rows (the least recently used
        are evicted first) and evicts rows untouched for `ttl_seconds`; a pull or push of an
        evicted id makes its row afresh from the initializer. Rows are spread over every
        server by id. `init` and `optimizer` as for `declare` ("uniform" is +-0.05); the
        optimizers update touched rows only (adam counts steps per row).
        Raises RemoteError as `declare` does."""
        try:
            spec = VariableSpec(
                name=name, shape=(0 if num_rows is None else _whole(num_rows, "num_rows"),
                                  _whole(dim, "dim")),
                dtype=str(dtype), initializer=Component.of(init),
                optimizer=Component.of(optimizer), seed=_whole(seed, "seed"), kind=EMBEDDING,
                capacity=0 if capacity is None else _whole(capacity, "capacity"),
                ttl_seconds=0.0 if ttl_seconds is None else float(ttl_seconds))
            if num_rows is not None and int(num_rows) < 1:
                raise InvalidArgument(f"embedding table {name!r}: num_rows must be >= 1, or "
                                      "None for a dynamic table")
        except InvalidArgument as error:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
        except (TypeError, ValueError) as error:  # int("abc"), say: a field of the wrong type
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"declare_embedding {name!r}: a field of the wrong type or "
                               f"value ({error})") from None
        self.declare_many([spec])
        return spec

    @staticmethod
    def _spec(name, shape, dtype, init, optimizer, seed) -> VariableSpec:
        try:
            return VariableSpec(
                name=name, shape=tuple(_whole(d, "shape") for d in np.atleast_1d(shape)),
                dtype=str(dtype), initializer=Component.of(init),
                optimizer=Component.of(optimizer), seed=_whole(seed, "seed"))
        except InvalidArgument as error:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None
        except (TypeError, ValueError) as error:  # int("abc"), say: a field of the wrong type
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"declare {name!r}: shape {shape!r} or seed {seed!r} is not made "
                               f"of integers ({error})") from None

    # ---- pull --------------------------------------------------------------------------

    def pull(self, names: str | list[str], *, wire_dtype: str | None = None,
             out: Mapping[str, np.ndarray] | None = None):
        """Current values: one array for a name, a dict for a list of names.

        `wire_dtype` ("float16", "bfloat16", ...) narrows the transfer; values come back in
        the variable's own dtype. `out` maps names to C-contiguous arrays of the variable's
        shape and dtype (e.g. reusable or pinned host buffers) that the bytes land in
        directly (on an error, they may hold part of the new values). Raises RemoteError,
        and ValueError for an `out` that is not such a mapping.
        """
        _check_out_mapping(out)
        single = isinstance(names, str)
        wanted = [names] if single else list(dict.fromkeys(names))
        key = (tuple(wanted), wire_dtype)
        kept = self._one_call_pulls.get(key)
        if kept is not None and kept.shard_map is self._map:
            try:
                outputs = self._pull_one_call(kept, out)
                return outputs[0] if single else dict(zip(wanted, outputs))
            except RemoteError as error:
                if not self._map_moved(kept.shard_map, error, wanted):
                    raise
                # The map moved: the general path below, with the refreshed map.
        for _ in range(MAX_MAP_REFRESHES):
            shard_map = self._map_with(wanted)
            outputs = self._pull_outputs(shard_map, wanted, out, wire_dtype)
            try:
                self._run_per_server(shard_map, wanted, lambda sid, shards: self._pull_from(
                    shard_map, sid, shards, outputs, wire_dtype))
            except RemoteError as error:
                if not self._map_moved(shard_map, error, wanted):
                    raise
                continue
            self._keep_one_call_pull(key, shard_map, wanted, wire_dtype)
            return outputs[names] if single else outputs
        raise _local_error(grpc.StatusCode.ABORTED,
                           f"shard map kept changing during {MAX_MAP_REFRESHES} pull attempts")

    def _pull_one_call(self, pull: OneCallPull, out: Mapping[str, np.ndarray] | None
                       ) -> list[np.ndarray]:
        shard_map, server_id = pull.shard_map, pull.server_id
        outputs = [self._output(shard_map.variables[name], out) for name in pull.names]
        method = self._stub(shard_map.servers[server_id]).PullUnaryBytes
        answer = self._call_server(
            lambda: self._unary(method, pull.request, pull.deadline, server_id),
            shard_map, server_id, self._read_retry)
        pull.unpack(answer, outputs)
        return outputs

    def _keep_one_call_pull(self, key, shard_map: ShardMap, names: list[str],
                            wire_dtype: str | None) -> None:
        """Keep the pull of `names` that just succeeded, if one unary call to one server over
        gRPC answers it and its bytes are the values (ps_worker.one_call_pulls)."""
        groups = shard_map.group_by_server(names)
        if len(groups) != 1:
            return
        (server_id, shards), = groups.items()
        if any(shard.stride != 1 or wire_dtype not in (None, shard_map.spec(
                shard.variable).dtype) for shard in shards):
            return
        if self._use_shared_memory and self._shared.get(
                shard_map.servers[server_id], False) is not None:
            return  # a shared-memory connection, or none known yet: the general path
        nbytes = OneCallPull.bytes_of(shard_map, shards)
        if nbytes > self._chunk_bytes:
            return
        if len(self._one_call_pulls) >= MAX_KEPT_PULLS:
            self._one_call_pulls.clear()
        self._one_call_pulls[key] = OneCallPull(
            shard_map, server_id, names, shards,
            _pull_request(shard_map.epoch, shards, wire_dtype).SerializeToString(),
            self._deadline(nbytes))

    def pull_async(self, names: str | list[str], *, wire_dtype: str | None = None,
                   out: Mapping[str, np.ndarray] | None = None) -> futures.Future:
        """`pull` in the background (e.g. the next step's parameters while this step
        computes); returns a Future of what `pull` returns."""
        self._refuse_if_closed(closing=True)
        _check_out_mapping(out)  # here, not in the background: the caller's mistake
        return self._submit(self._prefetch_pool, self.pull, names, wire_dtype=wire_dtype,
                            out=out)

    def _pull_outputs(self, shard_map: ShardMap, names: list[str],
                      out: Mapping[str, np.ndarray] | None,
                      wire_dtype: str | None) -> dict[str, np.ndarray]:
        """The arrays a pull of `names` lands in (`out`'s where given), once the pull is
        checked: raises before anything is sent."""
        for name in names:
            self._check_wire_dtype(shard_map.spec(name), wire_dtype)
            if shard_map.spec(name).dynamic:
                raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{name!r} is a dynamic embedding table: its rows are "
                                   "any int64 ids, it cannot be pulled whole; use pull_rows")
        return {n: self._output(shard_map.spec(n), out) for n in names}

    @staticmethod
    def _check_wire_dtype(spec: VariableSpec, wire_dtype: str | None) -> None:
        if wire_dtype is None:
            return
        if not isinstance(wire_dtype, str) or wire_dtype not in WIRE_DTYPES:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"wire_dtype {wire_dtype!r} is not one of {WIRE_DTYPES}")
        if wire_itemsize(wire_dtype) > np.dtype(spec.dtype).itemsize:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {spec.name!r}: wire dtype {wire_dtype} is wider than "
                               f"its stored dtype {spec.dtype}")

    def _map_moved(self, used: ShardMap, error: RemoteError, names=()) -> bool:
        """After a failed call: should it be redone with a fresh map? True when a server
        said the map was stale, or when a server stayed unreachable and the coordinator
        now knows a newer map (e.g. the server came back at another address) that places
        the call's variables, `names` (a coordinator restarted a moment ago knows none of
        them until their servers register again: the server's error stands)."""
        if error.stale_epoch is not None:
            self.refresh()
            return True
        if not _unreachable(error):
            return False
        try:
            current = self.refresh()
        except RemoteError as refresh_error:
            if refresh_error.code() == grpc.StatusCode.DATA_LOSS:
                raise  # the server is unreachable because its values are gone: say so
            return False
        return current.epoch > used.epoch and all(n in current.variables for n in names)

    @staticmethod
    def _output(spec: VariableSpec, out: Mapping[str, np.ndarray] | None) -> np.ndarray:
        if out is None or spec.name not in out:
            return np.empty(spec.shape, spec.dtype)
        given = out[spec.name]
        if not isinstance(given, np.ndarray):
            raise ValueError(f"out[{spec.name!r}] must be a writable C-contiguous {spec.dtype} "
                             f"array of shape {spec.shape}, got {type(given).__name__}")
        if (tuple(given.shape) != spec.shape or given.dtype != np.dtype(spec.dtype)
                or not given.flags.c_contiguous or not given.flags.writeable):
            raise ValueError(
                f"out[{spec.name!r}] must be a writable C-contiguous {spec.dtype} array of shape "
                f"{spec.shape}, got {given.dtype} {given.shape}")
        return given

    def _pull_from(self, shard_map: ShardMap, server_id: str, shards: list[Shard],
                   outputs: dict[str, np.ndarray], wire_dtype: str | None) -> None:
        if all(s.stride == 1 for s in shards) and self._pull_shared(
                shard_map, server_id, shards, outputs, wire_dtype):
            return
        plan = _DensePull(shard_map, shards, outputs, wire_dtype)
        self._receive(shard_map, server_id, plan.request(), plan.destinations)
        plan.finish()

    def _receive(self, shard_map: ShardMap, server_id: str, request: ps_pb.PullRequest,
                 destinations: list[np.ndarray]) -> None:
        """A pull over gRPC, its tensors' bytes landing in `destinations` in order: one
        unary call when they fit one message, else a stream."""
        nbytes = sum(d.nbytes for d in destinations)
        stub = self._stub(shard_map.servers[server_id])

        def attempt():
            assembler = StreamAssembler(destinations, what=f"pull from {server_id}")
            if nbytes <= self._chunk_bytes:  # one message each way: no stream to set up
                assembler.write(self._unary(stub.PullUnary, request, self._deadline(nbytes),
                                            server_id).data)
            else:
                with self._on_the_wire(self._invoke(lambda: stub.Pull(
                        request, timeout=self._deadline(nbytes)), server_id)) as call:
                    for chunk in call:
                        assembler.write(chunk.data)
            assembler.finish()

        self._call_server(attempt, shard_map, server_id, self._read_retry)

    def _pull_shared(self, shard_map: ShardMap, server_id: str, shards: list[Shard],
                     outputs: dict[str, np.ndarray], wire_dtype: str | None) -> bool:
        """The pull through shared memory, if this server shares it with us; False: over
        gRPC. Values pass through the wire dtype as they would on the wire."""
        connection = self._shared_connection(shard_map, server_id)
        if connection is None:
            return False
        self._refuse_if_placed_anew(connection, shard_map, server_id)
        rows = [outputs[s.variable][s.row_start:s.row_stop] for s in shards]
        try:
            done = connection.read(shard_map.epoch, shards, rows, self._timeout_s)
        except ConnectionLost:
            self._forget_shared(shard_map.servers[server_id], connection)
            return False
        if done and wire_dtype is not None:
            for shard, values in zip(shards, rows):
                if wire_dtype != shard_map.variables[shard.variable].dtype:
                    values[...] = _through_wire(values, wire_dtype, shard)
        return done

    def _refuse_if_placed_anew(self, connection: SharedConnection, shard_map: ShardMap,
                               server_id: str) -> None:
        """A pull through shared memory reads on from a server that died (SIGKILL) the values
        it held, until its shards are placed anew: then it raises UNAVAILABLE, for the
        caller to follow the coordinator's new map, as a pull over gRPC would. (Such a pull
        makes no call that would tell it: the coordinator is asked at most once a second.)"""
        if not connection.owner_gone():
            return
        now = time.monotonic()
        if now - self._placement_checked_at < OWNER_CHECK_S:
            return
        self._placement_checked_at = now
        try:
            current = self.refresh()
        except RemoteError:
            return  # the coordinator away too: the snapshot is what there is
        if current.epoch > shard_map.epoch:
            raise _local_error(grpc.StatusCode.UNAVAILABLE,
                               f"server {server_id} is gone and the coordinator's map has "
                               "moved on: following it")

    def _shared_connection(self, shard_map: ShardMap, server_id: str) -> SharedConnection | None:
        """This server's shared-memory connection, opened (the handshake) on first use."""
        address = shard_map.servers[server_id]
        if self._interrupted.is_set():  # as _stub() refuses a call over gRPC
            raise _local_error(grpc.StatusCode.CANCELLED, "the client was interrupted")
        self._refuse_if_closed()
        if not self._use_shared_memory:
            self._paths[address] = "grpc"
            return None
        with self._lock:
            if address in self._shared:
                return self._shared[address]
            if time.monotonic() < self._handshake_retry_at.get(address, 0.0):
                return None
        try:
            connection = SharedConnection.open(self._stub(address), self.client_id, server_id)
        except HandshakeFailed:
            with self._lock:
                self._handshake_retry_at[address] = time.monotonic() + HANDSHAKE_RETRY_S
                self._paths.setdefault(address, "grpc")
            return None
        with self._lock:
            if address in self._shared:  # another thread's handshake won
                extra, connection = connection, self._shared[address]
            else:
                extra, self._shared[address] = None, connection
                self._paths[address] = "grpc" if connection is None else "shm"
        if extra is not None:
            extra.close()
        return connection

    def _forget_shared(self, address: str, connection: SharedConnection) -> None:
        """The server ended the connection (it restarted or stopped): the next call opens a
        new one, or goes over gRPC."""
        with self._lock:
            if self._shared.get(address) is connection:
                del self._shared[address]

    @property
    def data_paths(self) -> dict[str, str]:
        """Per server address this client has used: "shm" (it has a shared-memory connection
        with that server) or "grpc". A server whose connection ended keeps "shm" until the
        client's next call to it finds out which path that call takes."""
        with self._lock:
            return dict(sorted(self._paths.items()))

    # ---- embedding tables --------------------------------------------------------------

    def pull_rows(self, name: str, ids, *, out: np.ndarray | None = None,
                  wire_dtype: str | None = None) -> np.ndarray:
        """The rows of table `name` for `ids` (int64, any order, repeats allowed), as an array
        `(len(ids), dim)` in the order of `ids`: `out` if given (C-contiguous, that shape and
        the table's dtype). Each distinct id is fetched once, each server asked for its rows
        only, all servers at once. A dynamic table makes the rows of ids it has not seen.
        Raises RemoteError: INVALID_ARGUMENT (not a table, ids not int64, bad `out` or
        wire dtype), OUT_OF_RANGE (an id outside a fixed table's rows), NOT_FOUND."""
        ids = self._row_ids(name, ids)
        for _ in range(MAX_MAP_REFRESHES):
            shard_map = self._map_with([name])
            spec = self._table(shard_map, name, ids)
            self._check_wire_dtype(spec, wire_dtype)
            result = self._rows_output(spec, len(ids), out)
            if _distinct_sorted(ids):  # e.g. the trainer's, deduplicated already
                unique, inverse = ids, None
            else:
                unique, inverse = dedup(ids)
            rows = np.empty((len(unique), spec.shape[1]), spec.dtype)
            groups = self._rows_by_server(spec, shard_map, unique)
            try:
                self._fetch_rows(shard_map, spec, groups, unique, rows, wire_dtype)
            except RemoteError as error:
                if not self._map_moved(shard_map, error, [name]):
                    raise
                continue
            return _in_order(rows, inverse, result)
        raise _local_error(grpc.StatusCode.ABORTED,
                           f"shard map kept changing during {MAX_MAP_REFRESHES} pull attempts")

    def _fetch_rows(self, shard_map: ShardMap, spec: VariableSpec, groups: dict,
                    unique: np.ndarray, rows: np.ndarray, wire_dtype: str | None) -> None:
        """`rows` = the rows of `unique`, grouped by server as `groups` has them."""
        # Reads from shared memory are memory copies: done here, in this thread; the calls
        # over gRPC go out in parallel.
        remote = {server_id: parts for server_id, parts in groups.items()
                  if spec.dynamic or not self._pull_rows_shared(
                      shard_map, server_id, parts, unique, rows, wire_dtype)}
        self._run_groups(remote, lambda server_id, parts: self._pull_rows_from(
            shard_map, server_id, parts, unique, rows, wire_dtype))

    def pull_rows_async(self, name: str, ids, *, out: np.ndarray | None = None,
                        wire_dtype: str | None = None) -> futures.Future:
        """`pull_rows` in the background; returns a Future of its array. `ids` are copied
        at the call: the caller may refill its array right away (not `out`, until done)."""
        self._refuse_if_closed(closing=True)
        if isinstance(ids, np.ndarray):
            ids = ids.copy()
        elif isinstance(ids, list):
            ids = list(ids)
        return self._submit(self._prefetch_pool, self.pull_rows, name, ids, out=out,
                            wire_dtype=wire_dtype)

    def push_rows(self, name: str, ids, grads, *, wire_dtype: str | None = None) -> None:
        """Gradients of the rows of table `name` for `ids` (int64, any order; the gradients
        of repeated ids are summed): `grads` is `(len(ids), dim)`. Each server gets the
        summed gradients of its rows, all servers at once, and applies its part once and
        all-or-nothing, as `push` does (see there for errors and partial failure).
        Raises RemoteError as `pull_rows` and `push` do."""
        self._push_rows(name, ids, grads, wire_dtype)

    def _push_rows(self, name: str, ids, grads, wire_dtype: str | None,
                   pulls_for=None) -> None:
        """push_rows; `pulls_for(shard_map)`, if given, is called once the push is checked
        and before anything is sent, and returns the pulls to make along with it
        ({server_id: _PullAlong}), which go with the push to their server where its push
        is one message (none when the push takes several rounds of calls)."""
        self._refuse_in_forked_child()  # before any lock a parent's thread may hold
        ids = self._row_ids(name, ids)
        with self._lock:
            if self._mode is not None and self._mode.kind == SYNC:
                raise _local_error(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"push_rows({name!r}) in the sync mode: sync averages whole "
                                   "variables only; train embedding tables in async or ssp:K")
        shard_map = self._map_with([name])
        spec = self._table(shard_map, name, ids)
        grads = np.asarray(grads)
        self._check_gradient(spec, grads, (len(ids), spec.shape[1]), wire_dtype)
        if _distinct_sorted(ids):  # e.g. the trainer's, summed per id already
            unique, summed = ids, grads
        else:
            unique, inverse = dedup(ids)
            # float16 gradients are summed in float32, as the server sums them, and sent so
            # where the table holds float32 or wider: a sum past float16's range, or one
            # float16 would round, reaches it whole (a float16 table takes float16).
            if grads.dtype == np.float16 and wire_dtype is None \
                    and np.dtype(spec.dtype).itemsize >= 4:
                sum_dtype, wire_dtype = np.dtype(np.float32), "float32"
            else:
                sum_dtype = None
            with np.errstate(over="ignore"):  # an overflow is refused below, saying so
                summed = sum_duplicates(grads, inverse, len(unique), sum_dtype)
            if (not self._allow_non_finite and summed.size and not all_finite(summed)
                    and all_finite(grads)):
                # The caller's gradients are finite: name what made them not, as the
                # server does.
                raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"variable {name!r}: the gradients of a repeated id sum to "
                                   "a non-finite value (NaN or Inf); nothing was applied",
                                   NON_FINITE_GRADIENT)
        # Summed before narrowing to the wire dtype; a NaN or Inf anywhere shows in the sums.
        summed, wire = self._encode(spec, summed, (len(unique), spec.shape[1]), wire_dtype)
        groups = self._rows_by_server(spec, shard_map, unique)
        # The ids travel in the push's header: a server's part of more than
        # MAX_ROW_IDS_PER_CALL rows goes in several pushes, each exactly-once and
        # all-or-nothing.
        batches = [_id_batches(parts) for parts in groups.values()]
        rounds = max((len(b) for b in batches), default=0)  # no ids: nothing to send
        pulls = pulls_for(shard_map) if pulls_for is not None else {}
        for round_ in range(rounds):
            self._send(shard_map, [
                _Piece(shard, np.ascontiguousarray(summed[positions]), wire, unique[positions])
                for server_batches in batches if round_ < len(server_batches)
                for shard, positions in server_batches[round_]],
                pulls=pulls if rounds == 1 else None)

    def push_rows_async(self, name: str, ids, grads, *,
                        wire_dtype: str | None = None) -> futures.Future:
        """`push_rows` in the background, in the same window as `push_async` (`flush`
        waits for both). The caller must not modify `ids` or `grads` until it is done."""
        return self._push_in_background(self.push_rows, name, ids, grads, wire_dtype=wire_dtype)

    def push_pull_rows(self, name: str, ids, grads, next_ids, *, out: np.ndarray | None = None,
                       wire_dtype: str | None = None) -> np.ndarray:
        """`push_rows(name, ids, grads)`, then `pull_rows(name, next_ids, out=out)`: a
        trainer's gradients of step t out and its rows for step t+1 back. Over gRPC, a
        server that gets both gets them in one call (one round trip instead of two) when
        each fits one message. The rows are read after this push was applied on their
        server, exactly as with the two calls in turn, and the same errors are raised: a
        bad `next_ids` or `out` is refused before anything is sent. `wire_dtype` is both
        parts'."""
        next_ids = self._row_ids(name, next_ids)
        along: dict = {}

        def pulls_for(shard_map: ShardMap) -> dict[str, _PullAlong]:
            spec = self._table(shard_map, name, next_ids)
            self._check_wire_dtype(spec, wire_dtype)
            result = self._rows_output(spec, len(next_ids), out)
            unique, inverse = ((next_ids, None) if _distinct_sorted(next_ids)
                               else dedup(next_ids))
            groups = self._rows_by_server(spec, shard_map, unique)
            along.update(shard_map=shard_map, spec=spec, result=result, unique=unique,
                         inverse=inverse, groups=groups, pulls={})
            raw = wire_raw_dtype(wire_dtype or spec.dtype)
            for server_id, parts in groups.items():
                if len(_id_batches(parts)) == 1:
                    along["pulls"][server_id] = _PullAlong(
                        lambda parts=parts: self._rows_request(shard_map, parts, unique,
                                                               wire_dtype),
                        lambda parts=parts: [np.empty((len(p), spec.shape[1]), raw)
                                             for _, p in parts],
                        sum(len(p) for _, p in parts) * spec.shape[1] * raw.itemsize)
            return along["pulls"]

        self._push_rows(name, ids, grads, wire_dtype, pulls_for)
        shard_map, spec, unique = along["shard_map"], along["spec"], along["unique"]
        rows = np.empty((len(unique), spec.shape[1]), spec.dtype)
        rest = {}
        for server_id, parts in along["groups"].items():
            pull = along["pulls"].get(server_id)
            if pull is None or not pull.done:
                rest[server_id] = parts
                continue
            for (_, positions), raw in zip(parts, pull.destinations):
                rows[positions] = from_wire(raw, wire_dtype or spec.dtype)
        try:
            self._fetch_rows(shard_map, spec, rest, unique, rows, wire_dtype)
        except RemoteError as error:
            if not self._map_moved(shard_map, error, [name]):
                raise
            return self.pull_rows(name, next_ids, out=out, wire_dtype=wire_dtype)
        return _in_order(rows, along["inverse"], along["result"])

    @staticmethod
    def _rows_by_server(spec: VariableSpec, shard_map: ShardMap, unique: np.ndarray):
        """rows_by_server, refusing (before anything is sent) a request that would take more
        of a dynamic table's shard than its share of the capacity: servers refuse their part
        of it, but the others would have made (and evicted) rows for theirs."""
        groups = rows_by_server(spec, shard_map.shards_of(spec.name), unique)
        if spec.dynamic and spec.capacity:
            for parts in groups.values():
                for shard, positions in parts:
                    if len(positions) > shard_capacity(spec, shard):
                        raise _local_error(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"table {spec.name!r}: {len(positions)} of the request's distinct "
                            f"ids fall on shard {shard.index}, more than its share of the "
                            f"table's capacity ({shard_capacity(spec, shard)} of "
                            f"{spec.capacity} rows): send fewer ids at once or declare a larger "
                            "capacity; nothing was sent")
        return groups

    @staticmethod
    def _row_ids(name: str, ids) -> np.ndarray:
        try:
            return check_ids(ids, what=f"ids of table {name!r}")
        except InvalidArgument as error:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT, error.message) from None

    @staticmethod
    def _table(shard_map: ShardMap, name: str, ids: np.ndarray) -> VariableSpec:
        spec = shard_map.spec(name)
        if not spec.is_table:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {name!r} is dense, not an embedding table: use pull "
                               "and push (pull_rows and push_rows are for tables)")
        if not spec.dynamic and ids.size and (ids.min() < 0 or ids.max() >= spec.rows):
            bad = ids[(ids < 0) | (ids >= spec.rows)][0]
            raise _local_error(grpc.StatusCode.OUT_OF_RANGE,
                               f"table {name!r}: id {bad} is outside its rows 0:{spec.rows}")
        return spec

    @staticmethod
    def _rows_output(spec: VariableSpec, count: int, out: np.ndarray | None) -> np.ndarray:
        shape = (count, spec.shape[1])
        if out is None:
            return np.empty(shape, spec.dtype)
        if not isinstance(out, np.ndarray):  # pull's mapping of names, say
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"out must be a writable C-contiguous {spec.dtype} array of shape "
                               f"{shape} for table {spec.name!r}, got {type(out).__name__}")
        if (tuple(out.shape) != shape or out.dtype != np.dtype(spec.dtype)
                or not out.flags.c_contiguous or not out.flags.writeable):
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"out must be a writable C-contiguous {spec.dtype} array of shape "
                               f"{shape} for table {spec.name!r}, got {out.dtype} {out.shape}")
        return out

    def _pull_rows_from(self, shard_map: ShardMap, server_id: str,
                        parts: list[tuple[Shard, np.ndarray]], unique: np.ndarray,
                        rows: np.ndarray, wire_dtype: str | None) -> None:
        """`rows[positions]` = the rows of ids `unique[positions]`, for each (shard,
        positions) part, from one server."""
        spec = shard_map.variables[parts[0][0].variable]
        wire = wire_dtype or spec.dtype
        # The ids travel in the request message: at most MAX_ROW_IDS_PER_CALL per call.
        for batch in _id_batches(parts):
            received = [np.empty((len(p), spec.shape[1]), wire_raw_dtype(wire))
                        for _, p in batch]
            self._receive(shard_map, server_id,
                          self._rows_request(shard_map, batch, unique, wire_dtype), received)
            for (_, positions), raw in zip(batch, received):
                rows[positions] = from_wire(raw, wire)

    @staticmethod
    def _rows_request(shard_map: ShardMap, parts: list[tuple[Shard, np.ndarray]],
                      unique: np.ndarray, wire_dtype: str | None) -> ps_pb.PullRequest:
        return ps_pb.PullRequest(
            epoch=shard_map.epoch,
            shards=[ps_pb.ShardRef(variable=s.variable, index=s.index,
                                   row_ids=unique[p].tobytes()) for s, p in parts],
            wire_dtype=dtype_to_proto(wire_dtype) if wire_dtype else 0)

    def _pull_rows_shared(self, shard_map: ShardMap, server_id: str,
                          parts: list[tuple[Shard, np.ndarray]], unique: np.ndarray,
                          rows: np.ndarray, wire_dtype: str | None) -> bool:
        """A fixed table's rows read straight from the server's shared memory, if it shares
        it with us; False: over gRPC. Values pass through the wire dtype as on the wire."""
        connection = self._shared_connection(shard_map, server_id)
        if connection is None:
            return False
        self._refuse_if_placed_anew(connection, shard_map, server_id)
        shards = [shard for shard, _ in parts]
        ids = [unique[positions] for _, positions in parts]
        found = [np.empty((len(i), rows.shape[1]), rows.dtype) for i in ids]
        try:
            done = connection.read_rows(shard_map.epoch, shards,
                                     [i // shard.stride for i, shard in zip(ids, shards)],
                                     found, self._timeout_s)
        except ConnectionLost:
            self._forget_shared(shard_map.servers[server_id], connection)
            return False
        if done:
            for (shard, positions), values in zip(parts, found):
                if wire_dtype is not None and wire_dtype != rows.dtype.name:
                    values = _through_wire(values, wire_dtype, shard)
                rows[positions] = values
        return done

    # ---- push --------------------------------------------------------------------------

    def push(self, grads: Mapping[str, np.ndarray], *, wire_dtype: str | None = None) -> None:
        """Send gradients; returns once every server has applied its part (exactly once).

        Each server applies its part all-or-nothing, but a push that spans several servers
        is not atomic across them: when this raises, the parts that other servers answered
        before the error may have been applied, and the part of the server named in the
        error (`RemoteError.target`) may or may not have been (e.g. retries exhausted after
        a lost response). Calling push again sends a new push, applied again wherever the
        first one landed. Errors raised before anything is sent (unknown variable, wrong
        shape or dtype, non-finite values) mean nothing was applied anywhere; so does
        INVALID_ARGUMENT for non-finite values from the one server a push goes to.

        Raises RemoteError: NOT_FOUND (unknown variable), INVALID_ARGUMENT (dtype, shape,
        non-finite values), ALREADY_EXISTS (another client pushes under this client's id and
        incarnation; not applied), FAILED_PRECONDITION (this incarnation was replaced), or
        the server's status after retries are exhausted.
        """
        shard_map = self._map_with(list(grads))
        self._send(shard_map, self._split(shard_map, grads, wire_dtype), stepped=True)

    def _send(self, shard_map: ShardMap, pieces: list[_Piece], stepped: bool = False,
              pulls: dict[str, "_PullAlong"] | None = None) -> None:
        """Push `pieces`, one call per server in parallel (see `push`); `pulls` go along
        with their server's push where it can take them (see `_push_once`)."""
        # One sequence per (server, exact set of shards), kept across map refreshes: a part
        # whose response was lost and that is then refused as stale goes out again under the
        # same identity, so a server that did apply it answers 'duplicate' instead of applying
        # it twice. Sequences are released (acknowledged) only when the whole push is over.
        sequences: dict[tuple, tuple[str, int]] = {}
        sequences_lock = threading.Lock()
        # A stepped push is this client's step on every server, not only on those its
        # gradients go to: each other server gets an empty push (no shards), which counts
        # as the step there (ssp: finished; sync: a contribution of no gradients), so that
        # nobody waits there for a step this client has no gradients of.
        with self._lock:
            in_steps = stepped and self._mode is not None
        empty = set(shard_map.servers) - {p.shard.server_id for p in pieces} \
            if in_steps else set()

        # The step each server's part of this push carried there: pieces relocated to a
        # server after its part went (their old server dropped them) go as that step, so
        # they count in it (ssp), or are dropped as late (sync: it was applied without them),
        # and never count as another step of this client's.
        sent_steps: dict[str, int] = {}

        def sequence_for(server_id: str, group: list[_Piece]) -> tuple[int, bool]:
            """The group's sequence, and whether this is its first send."""
            key = (server_id, tuple(p.shard.key for p in group))
            with sequences_lock:
                first = key not in sequences
                if first:
                    sequences[key] = (server_id, self._issue_sequence(server_id))
                return sequences[key][1], first

        # The pieces sent together before (at first, all of them, grouped by server below).
        sent_together = [pieces]
        try:
            for _ in range(MAX_MAP_REFRESHES):
                # A group sent before never takes in pieces of another: its server, which may
                # have applied it before its answer was lost, would see new shards under a
                # new sequence and apply it again. Pieces moved to a server go as their own
                # group (a call of their own, under a sequence of their own).
                by_group: dict[tuple[str, int], list[_Piece]] = {
                    (server_id, -1): [] for server_id in empty}
                for n, together in enumerate(sent_together):
                    for piece in together:
                        by_group.setdefault((piece.shard.server_id, n), []).append(piece)
                failed: list[list[_Piece]] = []
                failed_servers: set[str] = set()
                errors: list[RemoteError] = []

                def push_one(key: tuple[str, int], group: list[_Piece], shard_map=shard_map,
                             pulls=pulls or {}):
                    server_id = key[0]
                    try:
                        step = self._push_to(shard_map, server_id, group,
                                             *sequence_for(server_id, group), stepped=stepped,
                                             pull=pulls.get(server_id),
                                             at_step=sent_steps.get(server_id))
                        if step is not None:
                            sent_steps.setdefault(server_id, step)
                    except RemoteError as error:
                        if error.stale_epoch is None and not _unreachable(error):
                            raise
                        failed.append(group)
                        failed_servers.add(server_id)
                        errors.append(error)

                self._run_groups(by_group, push_one)
                if not failed_servers:
                    return
                # Parts refused as stale, or whose server stayed unreachable, are sent again
                # if the coordinator's map has moved on (e.g. the server is at a new address).
                names = {p.shard.variable for group in failed for p in group}
                if not any(self._map_moved(shard_map, e, names) for e in errors):
                    raise errors[0]
                shard_map = self.shard_map
                sent_together = [[self._relocate(shard_map, p) for p in group]
                                 for group in failed]
                pieces = [p for group in sent_together for p in group]
                # In the steps, a server whose part failed (refused whole: its step there did
                # not count) gets an empty push again if it is still in the map and no
                # relocated pieces carry the step there: else the others' step there waits
                # for this client for good (its pieces moved to another server, say).
                empty = {server_id for server_id in failed_servers
                         if server_id in shard_map.servers} \
                    - {p.shard.server_id for p in pieces} if in_steps else set()
                # Left to one server's check, they may now go to several: checked here
                # first. None of them was applied (a server refuses non-finite ones).
                for piece in pieces:
                    if piece.unchecked is not None:
                        self._refuse_non_finite(piece.unchecked, piece.grad, piece.wire_dtype)
                pulls = None  # they were for the old map: the caller pulls what is missing
            raise _local_error(grpc.StatusCode.ABORTED,
                               f"shard map kept changing during {MAX_MAP_REFRESHES} push attempts")
        finally:
            for server_id, sequence in sequences.values():
                self._finish_sequence(server_id, sequence)

    def push_pull(self, grads: Mapping[str, np.ndarray], names: str | list[str], *,
                  out: Mapping[str, np.ndarray] | None = None,
                  wire_dtype: str | None = None):
        """`push(grads)`, then `pull(names, out=out)`: a trainer's gradients of one step out
        and the values of a later step back. Over gRPC, a server that gets both gets them
        in one call (one round trip, and one call for the server to handle, instead of two)
        when each fits one message. Each server's values are read after this push was
        applied there, exactly as with the two calls in turn, and the same errors are
        raised: a bad `names` or `out` is refused before anything is sent. `wire_dtype` is
        both parts'. Returns what `pull` returns."""
        _check_out_mapping(out)
        single = isinstance(names, str)
        wanted = [names] if single else list(dict.fromkeys(names))
        shard_map = self._map_with([*grads, *wanted])
        outputs = self._pull_outputs(shard_map, wanted, out, wire_dtype)
        pieces = self._split(shard_map, grads, wire_dtype)
        groups = shard_map.group_by_server(wanted)
        plans = {sid: _DensePull(shard_map, shards, outputs, wire_dtype)
                 for sid, shards in groups.items()}
        pulls = {sid: _PullAlong(plan.request, lambda plan=plan: plan.destinations, plan.nbytes)
                 for sid, plan in plans.items()}
        self._send(shard_map, pieces, stepped=True, pulls=pulls)
        rest = {}
        for server_id, shards in groups.items():
            if pulls[server_id].done:
                plans[server_id].finish()
            else:
                rest[server_id] = shards
        try:
            self._run_groups(rest, lambda sid, shards: self._pull_from(
                shard_map, sid, shards, outputs, wire_dtype))
        except RemoteError as error:
            if not self._map_moved(shard_map, error, wanted):
                raise
            return self.pull(names, wire_dtype=wire_dtype, out=out)
        return outputs[names] if single else outputs

    def push_pull_async(self, grads: Mapping[str, np.ndarray], names: str | list[str], *,
                        out: Mapping[str, np.ndarray] | None = None,
                        wire_dtype: str | None = None) -> futures.Future:
        """`push_pull` in the background, in the window of `push_async` (`flush` waits for
        it too); returns a Future of the pulled values. The caller must not modify `grads`
        or read `out` until it is done."""
        _check_out_mapping(out)
        return self._push_in_background(self.push_pull, grads, names, out=out,
                                        wire_dtype=wire_dtype)

    def push_async(self, grads: Mapping[str, np.ndarray], *,
                   wire_dtype: str | None = None) -> futures.Future:
        """`push` in the background; returns a Future. Blocks while `max_in_flight_pushes`
        pushes are already in flight. The caller must not modify `grads` until it is done."""
        return self._push_in_background(self.push, grads, wire_dtype=wire_dtype)

    def _push_in_background(self, push, *args, **kwargs) -> futures.Future:
        self._refuse_if_closed(closing=True)
        self._window.acquire()
        try:
            future = self._submit(self._async_pool, push, *args, **kwargs)
        except BaseException:
            self._window.release()
            raise
        with self._lock:
            self._pending.add(future)

        def done(f):
            self._window.release()
            with self._lock:
                if f in self._pending:  # else flush() took it, error and all
                    self._pending.discard(f)
                    if not f.cancelled() and f.exception() is not None:
                        self._failed.append(f)

        future.add_done_callback(done)
        return future

    # ---- consistency modes (ps_common.consistency) --------------------------------------

    def join_steps(self, mode: str, *, replicas: int = 1) -> None:
        """Take part in the servers' steps in `mode` ("ssp:K" or "sync"; "async" leaves
        them) from now on. Every `push` is then one step: it carries this client's step to
        each server and returns only when the mode allows the next one: in ssp:K once no
        live client is more than K steps behind, in sync once the step's gradients from
        every client that joined have been averaged and applied (a pull after it sees
        them). In sync, the first step also waits until `replicas` clients have joined;
        a step never waits for a client that left or that the coordinator declared dead.
        Join before the first pull whose values a step uses. In sync, push a step's
        gradients in one `push`: a second push of the same step counts only if it arrives
        before the step is applied (else it is dropped and counted as stale). `push_rows`
        in sync is refused (sync averages whole variables); in ssp:K it carries no step: push
        a step's rows first and wait for them, then `push` (empty if need be) to finish the
        step, so that the others' pulls after it see them (as ps-worker does).
        A server that restarts forgets its members: this client joins it again on its
        next push, saying where it was and with whom, and the server's first step there
        waits for those clients (see the README, "Across a server restart").
        Raises ValueError for a bad mode, RemoteError FAILED_PRECONDITION when other
        clients take part in another mode."""
        self._refuse_in_forked_child()  # before any lock a parent's thread may hold
        parsed = parse_mode(mode, what="join_steps mode")
        if not parsed.stepped:
            self.leave_steps()
            return
        if replicas < 1:
            raise ValueError(f"join_steps replicas {replicas}: must be >= 1")
        self.leave_steps()
        with self._lock:
            self._mode, self._replicas = parsed, replicas
        shard_map = self.shard_map
        try:
            self._run_groups({server_id: None for server_id in shard_map.servers},
                             lambda server_id, _: self._step_at(shard_map, server_id))
        except BaseException:
            # Refused (another mode, say) or unreachable: this client takes part in no
            # steps, on no server, as before the call.
            with self._lock:
                self._mode, self._steps, self._step_members, self._resume_at = None, {}, {}, {}
            self._leave(shard_map.servers)
            raise

    def leave_steps(self) -> None:
        """Take part in no steps any more (pushes no longer wait for other clients, and no
        server waits for this one). Waits for push_async pushes in flight first; a push
        made meanwhile in another thread lands in its step, or after the leave as a push
        that waits for nobody, and only once either way."""
        self._refuse_in_forked_child()  # before any lock a parent's thread may hold
        with self._lock:
            mode = self._mode
            self._mode, self._steps, self._step_members, self._resume_at = None, {}, {}, {}
        if mode is None:
            return
        try:
            self.flush()  # its pushes carry steps: they land before this client leaves
        finally:
            self._leave(self.shard_map.servers)

    def _leave(self, servers) -> None:
        """LeaveSteps on `servers` (ids; those the map no longer names are skipped). It is
        sent to every server of the map, not only those whose step this client knows: a
        server whose join answer was lost, or whose step it forgot after a failed sync
        step, still counts it as a member and would wait for it."""
        shard_map = self.shard_map
        request = ps_pb.LeaveStepsRequest(client_id=self.client_id,
                                          incarnation=self.incarnation)
        for server_id in servers:
            address = shard_map.servers.get(server_id)
            if address is None:
                continue
            try:
                self._call_server(lambda: self._unary(self._stub(address).LeaveSteps, request,
                                                      self._timeout_s, server_id),
                                  shard_map, server_id, self._retry)
            except RemoteError as error:  # it forgets us when it restarts or we retire
                log.info("leaving the steps of server %s: %s", server_id, error)

    @property
    def mode(self) -> str:
        """The consistency mode this client takes part in ("async" when none)."""
        with self._lock:
            return "async" if self._mode is None else str(self._mode)

    def _forget_step(self, server_id: str) -> None:
        """Ask `server_id` where its steps are before the next push there, telling it where
        this client was (a restarted server goes on from there: JoinStepsRequest.resume_step).
        Expects the lock held."""
        was = self._steps.pop(server_id, None)
        # Only after a step answered there: a server that answered none has nothing to
        # resume (and one whose first step is still pending keeps its `replicas`).
        if was is not None and server_id in self._step_members:
            self._resume_at[server_id] = was

    def _step_at(self, shard_map: ShardMap, server_id: str) -> int | None:
        """The step this client computes next at `server_id`, joining it first if need be
        (None: this client takes part in no steps)."""
        with self._lock:
            mode, replicas = self._mode, self._replicas
            if mode is None:
                return None
            if server_id in self._steps:
                return self._steps[server_id]
            resume_step = self._resume_at.get(server_id)
            peers = self._step_members.get(server_id, ()) if resume_step is not None else ()
        address = shard_map.servers[server_id]
        request = ps_pb.JoinStepsRequest(
            client_id=self.client_id, incarnation=self.incarnation, mode=str(mode),
            replicas=replicas, peers=[ps_pb.StepMember(client_id=client_id, incarnation=inc)
                                      for client_id, inc in peers])
        if resume_step is not None:
            request.resume_step = resume_step
        reply = self._call_server(
            lambda: self._unary(self._stub(address).JoinSteps, request, self._timeout_s,
                                server_id), shard_map, server_id, self._retry)
        with self._lock:
            left = self._mode is not mode  # left (or joined anew) meanwhile
            if not left:
                self._resume_at.pop(server_id, None)
                return self._steps.setdefault(server_id, reply.step)
        if self.mode == "async":  # left: this join may have landed after the leave did
            self._leave([server_id])
        return None

    def _stepped(self, server_id: str, reply: ps_pb.PushReply) -> None:
        with self._lock:
            if self._mode is not None:
                self._steps[server_id] = max(self._steps.get(server_id, 0), reply.next_step)
                members = tuple((m.client_id, m.incarnation) for m in reply.step_members)
                # Only a list that names this client is of the steps it takes part in.
                if any(client_id == self.client_id for client_id, _ in members):
                    self._step_members[server_id] = members
            stats = self.step_stats
            stats.wait_s += reply.waited_s
            stats.staleness_max = max(stats.staleness_max, reply.staleness)
            stats.dropped_stale += int(reply.stale_dropped)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every push_async issued so far; raise the first error among them."""
        self._refuse_in_forked_child()  # before any lock a parent's thread may hold
        with self._lock:
            pending = list(self._pending)
        done, not_done = futures.wait(pending, timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} push(es) still in flight after {timeout} s")
        with self._lock:
            # A future wakes its waiters before it runs its done callbacks: a push may be
            # over here and not yet in `_failed`. Taken from `_pending` here, its callback
            # leaves it alone.
            failed, self._failed = self._failed, []
            failed += [f for f in pending if f in self._pending and not f.cancelled()
                       and f.exception() is not None]
            self._pending.difference_update(pending)
        for future in failed:
            future.result()  # raises the first error

    def _split(self, shard_map: ShardMap, grads: Mapping[str, np.ndarray],
               wire_dtype: str | None) -> list[_Piece]:
        specs = {name: shard_map.spec(name) for name in grads}
        for name, spec in specs.items():
            if spec.is_table:
                raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{name!r} is an embedding table: push gradients of the rows "
                                   "a step used with push_rows")
        # A push to one server is all-or-nothing there, so its check for non-finite values
        # is left to that server instead of reading every gradient once more here, once the
        # server has said it honours the header's ask. A push over several servers is
        # checked whole first: they do not commit together. So is one in the steps of a map
        # of several servers: its step goes to each of them (an empty push to the others),
        # and a refused push must count as a step on none.
        servers = {shard.server_id for name in grads for shard in shard_map.shards_of(name)}
        with self._lock:
            in_steps = self._mode is not None
        one_server = len(servers) == 1 and \
            shard_map.servers.get(next(iter(servers))) in self._servers_checking and \
            not (in_steps and len(shard_map.servers) > 1)
        pieces = []
        for name, grad in grads.items():
            spec = specs[name]
            encoded, wire = self._encode(spec, np.asarray(grad), spec.shape, wire_dtype,
                                         check_finite=not one_server)
            for shard in shard_map.shards_of(name):
                pieces.append(_Piece(shard, encoded[shard.row_start:shard.row_stop], wire,
                                     unchecked=spec if one_server else None))
        return pieces

    def _encode(self, spec: VariableSpec, grad: np.ndarray, shape: tuple[int, ...],
                wire_dtype: str | None, *, check_finite: bool = True) -> tuple[np.ndarray, str]:
        """A gradient checked (dtype, `shape`, and finiteness if `check_finite`) and encoded
        in its wire dtype."""
        wire = self._check_gradient(spec, grad, shape, wire_dtype)
        with np.errstate(over="ignore"):
            encoded = to_wire(grad, wire)
        if check_finite:
            self._refuse_non_finite(spec, encoded, wire)
        return encoded, wire

    def _refuse_non_finite(self, spec: VariableSpec, encoded: np.ndarray, wire: str) -> None:
        """Raise INVALID_ARGUMENT (nothing sent) for a gradient, `encoded` in `wire`, with a
        NaN or Inf, unless this client accepts them. Checked after narrowing (a value that
        overflows the wire dtype becomes Inf), in the wire's raw form, which all_finite
        takes: nothing decoded; or as the server will store it, where a finite value of the
        wire dtype may overflow that."""
        if self._allow_non_finite or not encoded.size:
            return
        checked = encoded
        if not finite_in_both(wire, spec.dtype):
            with np.errstate(over="ignore"):
                checked = from_wire(encoded, wire).astype(spec.dtype)
        if not all_finite(checked):
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {spec.name!r}: gradient has non-finite values (NaN or "
                               f"Inf) in wire dtype {wire}; nothing was applied",
                               NON_FINITE_GRADIENT)

    @staticmethod
    def _check_gradient(spec: VariableSpec, grad: np.ndarray, shape: tuple[int, ...],
                        wire_dtype: str | None) -> str:
        """Its dtype and shape checked; returns the wire dtype it travels in."""
        name = spec.name
        if grad.dtype.kind != "f":
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {name!r}: gradient dtype {grad.dtype} is not a float "
                               f"dtype; expected {spec.dtype}")
        wire = wire_dtype or grad.dtype.name
        if not isinstance(wire, str) or wire not in WIRE_DTYPES:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {name!r}: wire dtype {wire} is not one of "
                               f"{WIRE_DTYPES}")
        if tuple(grad.shape) != tuple(shape):
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {name!r}: gradient shape {list(grad.shape)} does not "
                               f"match "
                               f"{'its ids and the rows' if spec.is_table else 'the variable'}"
                               f"'s shape {list(shape)}")
        if wire_itemsize(wire) > np.dtype(spec.dtype).itemsize:
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {name!r}: gradient dtype {wire} is wider than the "
                               f"variable's dtype {spec.dtype}")
        return wire

    @staticmethod
    def _relocate(shard_map: ShardMap, piece: _Piece) -> _Piece:
        if piece.shard.variable not in shard_map.variables:  # (a coordinator recovering)
            raise _local_error(grpc.StatusCode.UNAVAILABLE,
                               f"variable {piece.shard.variable!r} is in no shard map the "
                               "coordinator has now: its servers have not registered again")
        for shard in shard_map.shards_of(piece.shard.variable):
            if (shard.index, shard.row_start, shard.row_stop, shard.stride) == (
                    piece.shard.index, piece.shard.row_start, piece.shard.row_stop,
                    piece.shard.stride):
                return _Piece(shard, piece.grad, piece.wire_dtype, piece.row_ids,
                              piece.unchecked)
        raise _local_error(grpc.StatusCode.ABORTED,
                           f"variable {piece.shard.variable!r} was re-sharded during a push")

    def _push_to(self, shard_map: ShardMap, server_id: str, pieces: list[_Piece],
                 sequence: int, first_send: bool, stepped: bool = False,
                 pull: "_PullAlong | None" = None, at_step: int | None = None) -> int | None:
        """Push `pieces` to one server under `sequence`. `first_send`: this sequence has
        never gone out before (not even in an attempt whose answer was lost), so a
        'duplicate' answer means another client shares this identity: an error.
        `stepped`: a push of a client that joined steps carries its step there (`at_step`
        if given), and waits as the mode says (a server that no longer knows it is joined
        again, once). Returns the step it carried (None: none)."""
        step = self._step_at(shard_map, server_id) if stepped else None
        if step is not None and at_step is not None:
            step = at_step
        if step is None and not pieces:  # an empty push carries a step, and this client left
            return None
        try:
            self._push_once(shard_map, server_id, pieces, sequence, first_send, step, pull)
        except RemoteError as error:
            if step is None:
                raise
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                # A sync step may have failed whole (an average the server would not apply,
                # say) and the server moved on to the next: the next push asks it where the
                # steps are, instead of carrying a step already over (dropped as late).
                with self._lock:
                    if self._mode is not None and self._mode.kind == SYNC:
                        self._forget_step(server_id)
                raise
            with self._lock:
                self._forget_step(server_id)
            step = self._step_at(shard_map, server_id)  # the server restarted, say
            if step is None and not pieces:
                return None
            # This sequence has gone out: a 'duplicate' answer now is its own.
            self._push_once(shard_map, server_id, pieces, sequence, False, step, pull)
        return step

    def _push_once(self, shard_map: ShardMap, server_id: str, pieces: list[_Piece],
                   sequence: int, first_send: bool, step: int | None,
                   pull: "_PullAlong | None" = None) -> None:
        """One push to one server over shared memory or gRPC. `pull` goes with it in one
        PushThenPull call if the push goes over gRPC and both fit one message each way;
        `pull.done` tells whether it went."""
        address = shard_map.servers[server_id]
        stub = self._stub(address)
        sizes = [p.grad.nbytes for p in pieces]
        nbytes = sum(sizes)
        readers = [array_reader(p.grad, p.wire_dtype) for p in pieces]
        incarnation = self.incarnation
        attempts = 0

        def header() -> ps_pb.PushHeader:
            return ps_pb.PushHeader(
                client_id=self.client_id, incarnation=incarnation, sequence=sequence,
                acked_through=self._acked(server_id), epoch=shard_map.epoch,
                shards=[p.ref() for p in pieces],
                tensors=[TensorMeta(p.wire_dtype, p.grad.shape).to_proto() for p in pieces],
                step=step, refuse_non_finite=not self._allow_non_finite,
            )

        def attempt():
            nonlocal attempts
            attempts += 1
            first_header = header().SerializeToString()
            if nbytes <= self._chunk_bytes:  # one message: no stream to set up
                data = [r(0, n) for r, n in zip(readers, sizes)]
                if (pull is not None and stub.push_then_pull
                        and pull.nbytes <= self._chunk_bytes):
                    request = pull.request()
                    # The push's header and the pull's request both carry row ids (up to
                    # 512 KiB each): together they must fit gRPC's message limit.
                    if nbytes + len(first_header) + len(request) + FIELD_FRAMING_BYTES \
                            <= MAX_MESSAGE_BYTES:
                        return self._push_then_pull(stub, first_header, data, pull, request,
                                                    server_id)
                return self._unary(stub.PushUnary, encode_chunk(first_header, data),
                                   self._deadline(nbytes), server_id)
            call = self._invoke(lambda: stub.Push.future(
                (encode_chunk(first_header if i == 0 else None, piece) for i, piece in
                 enumerate(iter_chunks(sizes, readers, self._chunk_bytes))),
                timeout=self._deadline(nbytes)), server_id)
            with self._on_the_wire(call):
                return _result(call, server_id)

        sent_shared = [0]  # attempts over shared memory
        # An empty push (a step alone, see _send) has no slot to fill: one small message.
        reply = self._push_shared(shard_map, server_id, pieces, header, sent_shared) \
            if pieces else None
        attempts = sent_shared[0]
        if reply is None:
            # Safe to retry: the server deduplicates (client_id, incarnation, sequence).
            reply = self._call_server(attempt, shard_map, server_id, self._retry)
        if reply.honours_refuse_non_finite:
            self._servers_checking.add(shard_map.servers[server_id])
        if reply.duplicate and first_send and attempts == 1:
            # Nothing of ours can have been applied before our first send: someone else
            # pushes under this identity, and this push was NOT applied.
            raise _local_error(
                grpc.StatusCode.ALREADY_EXISTS,
                f"server {server_id} says push {sequence} of client {self.client_id!r} "
                f"incarnation {incarnation} was applied already, before this client sent it: "
                "another client uses the same client_id and incarnation; this push was not "
                "applied (let the coordinator hand out incarnations)")
        if step is not None:
            self._stepped(server_id, reply)

    def _push_then_pull(self, stub: "_DataPath", header: bytes, data: list,
                        pull: "_PullAlong", request: bytes, server_id: str) -> ps_pb.PushReply:
        nbytes = sum(memoryview(part).nbytes for part in data)
        try:
            answer = self._unary(stub.PushThenPull, encode_chunk(header, data, request),
                                 self._deadline(nbytes + pull.nbytes), server_id)
        except RemoteError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            stub.push_then_pull = False  # a server from before the call: the push alone
            return self._unary(stub.PushUnary, encode_chunk(header, data),
                               self._deadline(nbytes), server_id)
        if answer.header is not None:  # (else the push's answer alone: the pull goes apart)
            pull.receive(answer, server_id)
        return ps_pb.PushReply.FromString(answer.attached or b"")

    def _push_shared(self, shard_map: ShardMap, server_id: str, pieces: list[_Piece],
                     header, attempts: list[int]) -> ps_pb.PushReply | None:
        """The push through a shared-memory slot, if this server shares memory with us;
        None: send it over gRPC (under the same identity: a server that applied it already
        answers 'duplicate'). Counts the calls it makes in `attempts[0]`."""
        connection = self._shared_connection(shard_map, server_id)
        if connection is None:
            return None
        address = shard_map.servers[server_id]
        try:
            slot = connection.push_slot(sum(p.grad.nbytes for p in pieces), self._timeout_s)
        except ConnectionLost:
            self._forget_shared(address, connection)
            return None
        if slot is None:
            return None
        stub = self._stub(address)
        # Checked in the slot as it is written (the cheapest place: the bytes are still in
        # cache, and they are exactly what the server will apply), so the server need not
        # read the slot once more for it (PushHeader.finite_checked). A push that spans
        # several servers was checked whole before anything went (_split): not again.
        checked = not self._allow_non_finite
        unchecked = checked and any(p.unchecked is not None for p in pieces)
        try:
            bad = slot.write([p.grad for p in pieces], check_finite=unchecked)
        except BaseException:
            connection.release(slot)  # nothing was sent: nobody reads it
            raise
        if bad is not None:
            connection.release(slot)  # nothing was sent
            piece = pieces[bad]
            raise _local_error(grpc.StatusCode.INVALID_ARGUMENT,
                               f"variable {piece.shard.variable!r}: gradient has non-finite "
                               f"values (NaN or Inf) in wire dtype {piece.wire_dtype}; nothing "
                               "was applied", NON_FINITE_GRADIENT)

        unanswered = [False]

        def attempt():
            attempts[0] += 1
            shared_header = header()
            shared_header.finite_checked = checked
            request = connection.push_request(slot, shared_header)
            try:
                reply = connection.push(request, self._timeout_s)
                if reply is None:
                    reply = self._unary(stub.PushShared, request, self._timeout_s, server_id)
                return reply
            except (grpc.RpcError, RemoteError) as error:
                remote = error if isinstance(error, RemoteError) else \
                    RemoteError.from_rpc_error(error, target=server_id)
                # (A step waited out was answered: in ssp the push was applied, in sync its
                # step holds a copy; the slot is free.)
                unanswered[0] |= remote.code() in _NO_ANSWER and remote.reason != STEP_TIMEOUT
                raise

        # After an attempt without an answer the server may still be reading the slot,
        # whatever a later attempt was told: it is never written again (the connection keeps
        # it until it ends). When every attempt was answered, nobody reads it any more.
        try:
            reply = self._call_server(attempt, shard_map, server_id, self._retry)
        except RemoteError as error:
            if error.code() not in _NO_ANSWER and not unanswered[0]:
                connection.release(slot)
            raise
        if not unanswered[0]:
            connection.release(slot)
        if reply.connection_lost:
            self._forget_shared(address, connection)
            return None
        return reply.reply

    def _issue_sequence(self, server_id: str) -> int:
        """The next sequence for `server_id`, waiting (bounded) while it would be more than
        MAX_UNACKED_SEQUENCES above the acknowledged ones: servers remember only so many,
        and refuse pushes further ahead rather than guess."""
        deadline = time.monotonic() + self._timeout_s
        with self._sequences_changed:
            while (self._next_seq.get(server_id, 0) + 1 - self._acked_through.get(server_id, 0)
                   > MAX_UNACKED_SEQUENCES):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break  # the server will say RESOURCE_EXHAUSTED: an error, not a lost push
                self._sequences_changed.wait(remaining)
            self._next_seq[server_id] = self._next_seq.get(server_id, 0) + 1
            return self._next_seq[server_id]

    def _finish_sequence(self, server_id: str, sequence: int) -> None:
        with self._sequences_changed:
            finished = self._finished.setdefault(server_id, set())
            finished.add(sequence)
            acked = self._acked_through.get(server_id, 0)
            while acked + 1 in finished:
                acked += 1
                finished.discard(acked)
            self._acked_through[server_id] = acked
            self._sequences_changed.notify_all()

    def _acked(self, server_id: str) -> int:
        with self._lock:
            return self._acked_through.get(server_id, 0)

    # ---- plumbing ----------------------------------------------------------------------

    def _stub(self, address: str) -> "_DataPath":
        """One channel and one data-path stub per server address, made once."""
        self._refuse_in_forked_child()  # before the lock, which a parent's thread may hold
        with self._lock:
            if self._interrupted.is_set():  # its channels are closed: no new ones
                raise _local_error(grpc.StatusCode.CANCELLED, "the client was interrupted")
            self._refuse_if_closed()
            stub = self._stubs.get(address)
            if stub is None:
                channel = self._channels[address] = make_channel(address, self._token, self._tls)
                stub = self._stubs[address] = _DataPath(channel)
            return stub

    def _deadline(self, nbytes: int) -> float:
        return self._timeout_s + self._timeout_per_gib_s * nbytes / 2**30

    def _call_server(self, attempt, shard_map: ShardMap, server_id: str, policy: RetryPolicy):
        """`attempt()` (one RPC to `server_id`) with retries, ended early by `interrupt()`.

        While the server does not answer, one line is logged per outage (and one when it
        answers again), however many calls wait for it. Under a policy without an attempt
        limit, each retry also asks the coordinator where the server is: if its map puts the
        server at another address (or drops it), the call's error is raised, for the caller
        to redo the call with that map; else the call waits on."""
        address = shard_map.servers[server_id]
        patient = policy.max_attempts is None

        def on_retry(attempts: int, error: RemoteError) -> None:
            if error.retry_after_s is not None:
                return  # busy, not away: the server asked us to come back shortly
            if error.reason == STEP_TIMEOUT:  # (a policy that retries DEADLINE_EXCEEDED)
                log.info("%s; waiting on", error)  # answering, not away
                return
            self._note_unreachable(server_id, address, error, patient)
            if patient and self._server_moved(shard_map, server_id):
                raise error

        try:
            result = call_with_retry(attempt, target=server_id, policy=policy,
                                     stop=self._interrupted, on_retry=on_retry)
        except RemoteError as error:
            if error.code() not in _NO_ANSWER:
                self._note_reachable(server_id, address)
            raise
        self._note_reachable(server_id, address)
        return result

    def _note_unreachable(self, server_id: str, address: str, error: RemoteError,
                          patient: bool) -> None:
        with self._lock:
            if server_id in self._unreachable:
                return
            self._unreachable.add(server_id)
        log.warning("parameter server %s at %s is unreachable (%s); %s", server_id, address,
                    error.code().name, "waiting for it to come back (the coordinator decides "
                    "when to give up)" if patient else "retrying")

    def _note_reachable(self, server_id: str, address: str) -> None:
        if server_id not in self._unreachable:  # the common case, without the lock
            return
        with self._lock:
            if server_id not in self._unreachable:
                return
            self._unreachable.discard(server_id)
        log.info("parameter server %s at %s is reachable again", server_id, address)

    def _server_moved(self, used: ShardMap, server_id: str) -> bool:
        """Whether the coordinator's map puts `server_id` elsewhere than `used` does, or no
        longer has it. One attempt, no retries: a coordinator that does not answer says no."""
        if self._interrupted.is_set() or self._shut.is_set():
            return False
        try:
            reply = self._coordinator.GetShardMap(coordinator_pb2.GetShardMapRequest(),
                                                  timeout=MOVED_CHECK_TIMEOUT_S)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DATA_LOSS:
                # The server is away because its values are gone: waiting cannot help.
                raise RemoteError.from_rpc_error(error, target=self.coordinator) from None
            return False
        current = self._adopt(shardmap_from_proto(reply))
        if server_id in current.servers:
            return current.servers[server_id] != used.servers[server_id]
        # Gone from the map: its shards moved, if the map places them (a coordinator restarted
        # a moment ago knows none of them yet: not moved, the call waits on).
        held = {s.variable for shards in used.shards.values() for s in shards
                if s.server_id == server_id}
        return all(name in current.variables for name in held)

    def _run_per_server(self, shard_map: ShardMap, names: list[str], fn) -> None:
        self._run_groups(shard_map.group_by_server(names), fn)

    def _run_groups(self, groups: dict, fn) -> None:
        """fn(server_id, group) for every group, in parallel; re-raise the first error."""
        if not groups:
            return
        (first_id, first_group), *others = groups.items()
        # The first group runs in this thread: one handoff fewer per call.
        pending = [self._submit(self._rpc_pool, fn, sid, group) for sid, group in others]
        try:
            fn(first_id, first_group)
        finally:
            futures.wait(pending)  # none may still be running when this returns or raises
        for future in pending:
            future.result()


def _unreachable(error: RemoteError) -> bool:
    """Whether a call's server did not answer it: away (UNAVAILABLE), or hung, stopped or
    cut off after connecting (DEADLINE_EXCEEDED, but for a step it waited out, which the
    server answered)."""
    return error.code() == grpc.StatusCode.UNAVAILABLE or (
        error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and error.reason != STEP_TIMEOUT)


def _through_wire(values: np.ndarray, wire_dtype: str, shard: Shard) -> np.ndarray:
    """`values` of `shard`, read from shared memory, as a pull in `wire_dtype` gets them
    over gRPC: narrowed and widened again, and refused as a server refuses them."""
    try:
        return from_wire(narrowed(values, wire_dtype, shard.describe()), wire_dtype)
    except OutOfRange as error:
        raise _local_error(grpc.StatusCode.OUT_OF_RANGE, str(error)) from None


def _whole(value, what: str) -> int:
    """`value` as an int: 3, np.int64(3), 3.0 and 1e6 are whole numbers; 2.5 is refused
    (ValueError naming `what`) rather than cut down to 2."""
    number = int(value)  # TypeError or ValueError for what is no number at all
    if number != value:
        raise ValueError(f"{what} {value!r} is not a whole number")
    return number


def _check_out_mapping(out) -> None:
    """A pull's `out` maps names to arrays: an array given alone (as pull_rows takes one)
    would be looked up by name, found to hold none, and silently left as it was."""
    if out is not None and not isinstance(out, Mapping):
        raise ValueError(f"out must map variable names to arrays (out={{name: array}}), got "
                         f"{type(out).__name__}")


def _in_order(rows: np.ndarray, inverse: np.ndarray | None, result: np.ndarray) -> np.ndarray:
    """`result` = the distinct ids' `rows` in the caller's order (`inverse`; None: as is)."""
    if inverse is None:
        result[...] = rows
        return result
    return np.take(rows, inverse, axis=0, out=result)


def _distinct_sorted(ids: np.ndarray) -> bool:
    return len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))


def _id_batches(parts: list[tuple[Shard, np.ndarray]]) -> list[list[tuple[Shard, np.ndarray]]]:
    """One server's (shard, positions) parts cut into calls of at most MAX_ROW_IDS_PER_CALL
    ids (they travel in the call's first message, bounded by the gRPC message size)."""
    batches: list[list[tuple[Shard, np.ndarray]]] = [[]]
    room = MAX_ROW_IDS_PER_CALL
    for shard, positions in parts:
        while len(positions):
            if not room:
                batches.append([])
                room = MAX_ROW_IDS_PER_CALL
            batches[-1].append((shard, positions[:room]))
            room -= len(batches[-1][-1][1])
            positions = positions[len(batches[-1][-1][1]):]
    return batches


def _result(call, server_id: str):
    """The answer of a unary call started with `.future()` (so that interrupt() can
    cancel it): a cancelled future says so with its own exception, made CANCELLED here."""
    try:
        return call.result()
    except grpc.FutureCancelledError:
        raise _local_error(grpc.StatusCode.CANCELLED,
                           f"call to {server_id} interrupted") from None
