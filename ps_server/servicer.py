"""gRPC adapter of the parameter server: decode, call the store, encode. Nothing else."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from ps_common.errors import (
    CheckpointFailed, InvalidArgument, PSError, ResourceExhausted,
)
from ps_common.consistency import parse_mode
from ps_common.rpc import MAX_CHUNK_BYTES
from ps_common.status import translate_errors
from ps_common.tensors import (
    ByteReader, Chunk, TensorMeta, array_reader, chunk_prefix, chunk_spans, decode_chunk,
    dtype_from_proto, encode_chunk, wire_bytes,
)
from ps_common.wire import shard_to_proto, shardmap_from_proto
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.buffers import BufferPool, ByteBudget
from ps_server.control import CoordinatorFence
from ps_server.ledger import PushLedger
from ps_server import snapshots
from ps_server.consistency import PushOutcome
from ps_server.live_reads import LiveRead, PullCopies
from ps_server.push_staging import PushStaging
from ps_server.pushes import PushHeader, PushReceiver
from ps_server.restore import ShardRestore
from ps_server.shared_memory import SharedMemory
from ps_server.store import CheckedRead, HeldShard, ShardStore
from ps_server.streams import StreamLimiter
from ps_server.unary_pulls import RememberedPull, UnaryPulls


log = logging.getLogger(__name__)

# Bytes of copies that pushes make of shards while pulls stream them (ps_server.live_reads).
PULL_COPY_BYTES = 1 << 30
# The most peers a JoinSteps may name (members of a server's steps before it restarted:
# at most its --max-streams): bounds what a request can make a server remember.
MAX_STEP_PEERS = 1 << 16


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thread-safe: every handler may run concurrently with every other.

    Pull and Push are admitted by `streams` (at most its max_streams at once; beyond,
    RESOURCE_EXHAUSTED) and cut by its watchdog (CANCELLED) when their peer stays silent for
    its idle timeout: while a push waits for its next chunk, or a pull for its client to take
    the last one. A pull sends each shard as one consistent snapshot.
    """

    def __init__(self, store: ShardStore, ledger: PushLedger, *, chunk_bytes: int,
                 fence: CoordinatorFence, streams: StreamLimiter, server_id: str = "",
                 buffers: BufferPool | None = None, pull_copy_bytes: int = PULL_COPY_BYTES,
                 checkpoint_memory_bytes: int = snapshots.DEFAULT_MEMORY_BYTES,
                 checkpoint_stall_timeout_s: float = snapshots.DEFAULT_STALL_TIMEOUT_S,
                 shared: SharedMemory | None = None, push_socket_filter=None,
                 push_memory_bytes: int | None = None, spill_dir: str | None = None):
        self._store = store
        self._shared = shared
        self._ledger = ledger
        self._checkpoint_memory = checkpoint_memory_bytes
        self.checkpoint_stall_timeout_s = checkpoint_stall_timeout_s  # 0: never given up
        # Set by the app once the port is bound (a server's id defaults to its address).
        self.server_id = server_id
        self._fence = fence
        self._chunk_bytes = chunk_bytes
        self._streams = streams
        self._buffers = buffers or BufferPool()
        # Copies of multi-chunk shards for the pulls that pushes overtake: at most this many
        # bytes at once.
        self._pull_copies = PullCopies(self._buffers, ByteBudget(pull_copy_bytes))
        self.push_staging = PushStaging(store.nbytes, push_memory_bytes, spill_dir)
        # A push waiting for its step holds a handler thread: at most --max-streams clients
        # take part in the steps, so that the pool's control-plane threads stay free.
        self._pushes = PushReceiver(store, ledger, self.push_staging,
                                    max_step_clients=streams.max_streams)
        self._unary_pulls = UnaryPulls(store)
        if shared is not None:
            shared.serve_pushes(self._push_shared if push_socket_filter is None
                                else push_socket_filter(self._push_shared))

    def Pull(self, request: pb.PullRequest, context):
        with translate_errors(context, "Pull"), self._streams.admit(context, "Pull") as stream:
            wire = (dtype_from_proto(request.wire_dtype, what="pull wire_dtype")
                    if request.wire_dtype else None)
            plan = self._store.plan_pull(
                request.epoch, [(r.variable, r.index) for r in request.shards], wire,
                row_ids_of(request.shards))
            header = pb.PullHeader(tensors=[meta.to_proto() for _, meta, _ in plan])
            source = _PullSource(plan, self._chunk_bytes, self._pull_copies)
            try:
                for message in source.messages(header.SerializeToString()):
                    source.release_finished()  # the message holds its own copy of the bytes
                    stream.arm()  # until gRPC has handed the message on to the client
                    yield message
                    stream.disarm()
            finally:
                source.close()

    def Push(self, request_iterator, context):
        """`request_iterator` yields decoded `Chunk`s (see `add_to_server`)."""
        with translate_errors(context, "Push"), self._streams.admit(context, "Push") as stream:
            chunks = map(_checked, stream.requests(request_iterator))
            first: Chunk | None = next(chunks, None)
            if first is None or first.header is None:
                raise InvalidArgument("a push stream must start with a chunk carrying its header")
            header = _push_header(_parse_header(first.header))
            return _push_reply(self._pushes.receive(header, first.data,
                                                    map(_data_only, chunks)))

    # Unary calls hold a handler thread only while the server works on them (never while
    # waiting on the peer), so they need no stream slot and no idle watchdog.

    def PullUnary(self, request: bytes, context):
        """`request`: a serialized PullRequest (see `add_to_server`)."""
        # A remembered pull is answered first, with nothing to parse or check (see
        # ps_server.unary_pulls), and outside translate_errors, which costs more than the
        # rest of such an answer; what it raises (no memory to convert a narrowed pull) is
        # translated all the same.
        pull = self._unary_pulls.find(request)
        if pull is not None:
            try:
                return pull.answer()
            except Exception:
                with translate_errors(context, "PullUnary"):
                    raise
        with translate_errors(context, "PullUnary"):
            return self._one_message(self._checked_unary_pull(request, "PullUnary"))

    def PushUnary(self, chunk: Chunk | InvalidArgument, context):
        with translate_errors(context, "PushUnary"):
            chunk = _checked(chunk)
            if chunk.header is None:
                raise InvalidArgument("a push must carry its header")
            header = _push_header(_parse_header(chunk.header))
            return _push_reply(self._pushes.receive_whole(header, chunk.data))

    def PushThenPull(self, chunk: Chunk | InvalidArgument, context):
        with translate_errors(context, "PushThenPull"):
            chunk = _checked(chunk)
            if chunk.header is None or chunk.attached is None:
                raise InvalidArgument("PushThenPull must carry a push header and a pull")
            header = _push_header(_parse_header(chunk.header))
            # The pull is checked first: a request that would fail changes nothing.
            version = self._store.placement_version
            checked = self._checked_unary_pull(chunk.attached, "PushThenPull")
            pushed = _push_reply(self._pushes.receive_whole(header, chunk.data))
            try:
                if self._store.placement_version != version:
                    # The shards moved while the push ran (it may wait for its step): the
                    # pull is checked again against what this server holds now.
                    checked = self._checked_unary_pull(chunk.attached, "PushThenPull")
                return self._one_message(checked, pushed.SerializeToString())
            except PSError:
                # The push was applied; its pull is refused now (values past its wire
                # dtype, found as they are read; shards moved or dropped meanwhile): the
                # push's answer goes alone (no pull header), and the client pulls on its
                # own, which is answered or refused as any pull.
                return encode_chunk(None, b"", pushed.SerializeToString())

    def _checked_unary_pull(self, raw: bytes | memoryview, method: str
                            ) -> RememberedPull | list[CheckedRead]:
        """A one-message pull, parsed and checked (remembered, for whole shards), or found
        remembered: raises as the store does."""
        pull = self._unary_pulls.find(raw)
        if pull is not None:
            return pull
        try:
            request = pb.PullRequest.FromString(raw)
        except DecodeError:
            raise InvalidArgument(f"malformed pull request in {method}") from None
        version = self._store.placement_version  # before the check: see remember()
        checked = self._check_unary_pull(request, method)
        return self._unary_pulls.remember(raw, version, checked) or checked

    def _check_unary_pull(self, request: pb.PullRequest, method: str) -> list[CheckedRead]:
        wire = (dtype_from_proto(request.wire_dtype, what="pull wire_dtype")
                if request.wire_dtype else None)
        checked = self._store.check_pull(
            request.epoch, [(r.variable, r.index) for r in request.shards], wire,
            row_ids_of(request.shards))
        total = sum(read.meta.nbytes for read in checked)
        # Bounded by what one message may carry, not by this server's --chunk-bytes:
        # clients choose the unary call by their own chunk size.
        if total > MAX_CHUNK_BYTES:
            raise InvalidArgument(f"{method} pulling {total} bytes: more than one message "
                                  f"may carry ({MAX_CHUNK_BYTES} bytes); use Pull")
        return checked

    def _one_message(self, checked: RememberedPull | list[CheckedRead],
                     attached: bytes | None = None) -> bytes:
        """A checked pull's answer in one message (with `attached` as its field 3)."""
        if isinstance(checked, RememberedPull):
            return checked.answer(attached)
        plan = self._store.read_pull(checked)
        header = pb.PullHeader(
            tensors=[meta.to_proto() for _, meta, _ in plan]).SerializeToString()
        # The message is built in one copy from the shards' values, under their locks
        # (taken in key order, as pushes take them): one consistent cut of all of them.
        # (Rows of tables were read already, each shard's at one instant.)
        locks = [held.lock for held, _, rows in sorted(plan, key=lambda part: part[0].key)
                 if rows is None]
        for lock in locks:
            lock.acquire()
        try:
            return encode_chunk(header, [
                wire_bytes(held.values if rows is None else rows.whole(), meta.dtype,
                           held.describe())
                for held, meta, rows in plan], attached)
        finally:
            for lock in locks:
                lock.release()

    # ---- shared memory (ps_server.shared_memory) ---------------------------------------

    def OpenSharedMemory(self, request: pb.OpenSharedMemoryRequest, context):
        with translate_errors(context, "OpenSharedMemory"):
            if self._shared is None:
                return pb.OpenSharedMemoryReply(offered=False)
            try:
                connection = self._shared.open_connection(request.client_id)
            except OSError as error:  # no room in /dev/shm for its probe, say
                log.warning("no shared-memory connection for %s (%s): its pulls and pushes "
                            "go over gRPC", request.client_id, error.strerror or error)
                return pb.OpenSharedMemoryReply(offered=False)
            return pb.OpenSharedMemoryReply(
                offered=True, probe=connection.probe_name, control=self._shared.control.name,
                connection=connection.id, push_socket=self._shared.push_socket_name)

    def AttachShards(self, request: pb.AttachShardsRequest, context):
        with translate_errors(context, "AttachShards"):
            if self._shared_connection(request) is None:
                return pb.AttachShardsReply(connection_lost=True)
            self._store.check_epoch(request.epoch)
            shards = []
            for held in self._store.lookup([(r.variable, r.index) for r in request.shards]):
                segment = self._shared.segment_of(held.values)
                shards.append(pb.SharedShard(
                    shard=pb.ShardRef(variable=held.key[0], index=held.key[1]),
                    segment=segment.name if segment is not None else "",
                    meta=TensorMeta(held.spec.dtype, held.shape).to_proto()))
            return pb.AttachShardsReply(shards=shards)

    def PushShared(self, request: pb.PushSharedRequest, context):
        with translate_errors(context, "PushShared"):
            return self._push_shared(request)

    def _push_shared(self, request: pb.PushSharedRequest) -> pb.PushSharedReply:
        """PushShared, over gRPC or the push socket (ps_server.push_socket): raises PSError."""
        connection = self._shared_connection(request)
        if connection is None:
            return pb.PushSharedReply(connection_lost=True)
        if request.slot == 0:
            try:
                made = self._shared.new_slot(connection, request.slot_bytes,
                                             max(self._store.nbytes(), 1))
            except OSError as error:
                log.warning("no shared-memory push slot of %d bytes for %s (%s): its "
                            "pushes go over gRPC", request.slot_bytes, connection.client_id,
                            error.strerror or error)
                # RESOURCE_EXHAUSTED: the client asks for no more slots on this connection
                # (an empty answer would have it ask again with every push).
                raise ResourceExhausted(f"no room for a shared-memory push slot of "
                                 f"{request.slot_bytes} bytes ({error.strerror or error}): "
                                 f"pushes go over gRPC") from None
            if made is None:  # the connection ended meanwhile
                return pb.PushSharedReply(connection_lost=True)
            return pb.PushSharedReply(slot=made[0], segment=made[1].name)
        segment = self._shared.slot(connection, request.slot)
        if segment is None:
            return pb.PushSharedReply(connection_lost=True)
        outcome = self._pushes.receive_shared(
            _push_header(request.header), segment.data, self._shared.reader(segment),
            checked_in_slot=request.header.finite_checked)
        return pb.PushSharedReply(reply=_push_reply(outcome))

    # ---- consistency modes (ps_server.consistency) ---------------------------------------

    def JoinSteps(self, request: pb.JoinStepsRequest, context):
        with translate_errors(context, "JoinSteps"):
            if not request.client_id:
                raise InvalidArgument("JoinSteps needs a client_id")
            try:
                mode = parse_mode(request.mode, what="JoinSteps mode")
            except ValueError as error:
                raise InvalidArgument(str(error)) from None
            if len(request.peers) > MAX_STEP_PEERS:
                raise InvalidArgument(f"JoinSteps names {len(request.peers)} peers, more than "
                                      f"the {MAX_STEP_PEERS} a server takes in its steps")
            step = self._pushes.steps.join(
                request.client_id, request.incarnation, mode, max(request.replicas, 1),
                resume_step=request.resume_step if request.HasField("resume_step") else None,
                peers=[(p.client_id, p.incarnation) for p in request.peers])
            return pb.JoinStepsReply(step=step,
                                     members=_step_members(self._pushes.steps.members()))

    def LeaveSteps(self, request: pb.LeaveStepsRequest, context):
        with translate_errors(context, "LeaveSteps"):
            self._pushes.steps.leave(request.client_id, request.incarnation)
            return pb.LeaveStepsReply()

    @property
    def steps(self):
        """The server's consistency steps (for the app: clients the coordinator retires)."""
        return self._pushes.steps

    def CloseSharedMemory(self, request: pb.CloseSharedMemoryRequest, context):
        with translate_errors(context, "CloseSharedMemory"):
            connection = self._shared_connection(request)
            if connection is not None:
                self._shared.close_connection(connection)
            return pb.CloseSharedMemoryReply()

    def _shared_connection(self, request):
        if self._shared is None:
            return None
        return self._shared.connection(request.connection, request.secret)

    def AssignShards(self, request: pb.AssignShardsRequest, context):
        with translate_errors(context, "AssignShards"):
            self._fence.check(request.generation, request.control_token, request.map.epoch)
            shard_map = shardmap_from_proto(request.map)
            mine = shard_map.shards_on(self.server_id)
            restore = self._restore_plan(request, shard_map.variables, mine)
            outcome = self._store.assign(
                shard_map.epoch, shard_map.variables, mine, restore,
                frozenset((r.variable, r.index) for r in request.superseded))
            self._unary_pulls.forget()
            self._fence.remember_map(shard_map)
            if not outcome.failed:
                self._fence.note_assigned_in_full()
            if restore is not None:
                for held in restore.created.values():
                    log.info("restored %s from checkpoint %s (step %d, %d update(s))",
                             held.describe(), restore.checkpoint, restore.step, held.updates)
                if restore.error:
                    log.error("%s", restore.error)
            unreadable = restore is not None and restore.unreadable
            return pb.AssignShardsReply(
                shards_created=outcome.created,
                failed=[pb.ShardFailure(shard=shard_to_proto(shard), message=message,
                                        checkpoint_unreadable=unreadable
                                        and shard.key in restore.shards)
                        for shard, message in outcome.failed])

    def _restore_plan(self, request: pb.AssignShardsRequest, specs, mine) -> ShardRestore | None:
        """Read what the assignment restores, all of it before anything is created, and the
        ledger (if asked) before the shards exist: no push reaches them without it."""
        if not request.HasField("restore"):
            return None
        restore = ShardRestore(Path(request.restore.checkpoint),
                               {(r.variable, r.index) for r in request.restore.shards})
        restore.prepare(specs, mine, {(h.shard, h.spec) for h in self._store.held()},
                        self._store.memory, self._store.new_dynamic)
        if request.restore.ledger and restore.created:
            state = restore.ledger(self.server_id)
            if state is not None:
                self._ledger.restore(state)
                log.info("restored the exactly-once ledger (%d client(s)) from checkpoint %s",
                         len(state.get("clients", {})), restore.checkpoint)
        return restore

    def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context):
        with translate_errors(context, "SaveCheckpoint"):
            self._fence.check(request.generation, request.control_token)
            directory = Path(request.directory)
            try:
                outcome = snapshots.save(self._store, self._ledger, directory, self.server_id,
                                         request.epoch, self._checkpoint_memory,
                                         self.checkpoint_stall_timeout_s)
            except OSError as error:
                raise CheckpointFailed(
                    f"server {self.server_id} cannot write its checkpoint files in "
                    f"{directory}: {error.strerror or error} (every server needs write access "
                    "to the coordinator's --checkpoint-dir)") from error
            return pb.SaveCheckpointReply(
                files=[pb.SavedFile(name=f.name, bytes=f.bytes, sha256=f.sha256)
                       for f in outcome.files],
                shards=[pb.SavedShard(shard=pb.ShardRef(variable=s.variable, index=s.index),
                                      updates=s.updates, optimizer_steps=s.optimizer_steps,
                                      file=s.file) for s in outcome.shards],
                pushes_recorded=outcome.pushes_recorded)


class _PullSource:
    """The pieces of one pull's chunks, each shard a consistent snapshot. Not thread-safe.

    A shard whose bytes fall within one chunk is read in one piece under its lock. A larger
    one is read piece by piece through a LiveRead (ps_server.live_reads): from the live
    values while no push touches the shard, from a copy of them once one does. Pieces may be
    views of such copies: `release_finished()` ends the reads of shards sent in full once
    the pieces built from them are encoded; `close()` ends the rest.
    """

    def __init__(self, plan: list[tuple[HeldShard, TensorMeta]], chunk_bytes: int,
                 copies: PullCopies):
        self._copies = copies
        self._reads: list[LiveRead] = []
        self._finished: list[LiveRead] = []
        self._readers: list[ByteReader] = []
        self._live: set[int] = set()  # positions of the shards read through a LiveRead
        start = 0
        for held, meta, rows in plan:
            last = start + meta.nbytes - 1
            if rows is not None:  # a table's rows: a copy already
                self._readers.append(rows.reader(meta.dtype, held.describe()))
            elif meta.nbytes == 0 or start // chunk_bytes == last // chunk_bytes:
                self._readers.append(array_reader(held.values, meta.dtype, held.lock,
                                                 held.describe()))
            else:
                self._live.add(len(self._readers))
                self._readers.append(self._live_reader(held, meta))
            start += meta.nbytes
        self._sizes = [meta.nbytes for _, meta, _ in plan]
        self._chunk_bytes = chunk_bytes

    def messages(self, header: bytes) -> Iterator[bytes]:
        """The pull's chunk messages, the first with `header`. A chunk that is one piece of
        a large shard is built under the shard's lock in one copy of its bytes; the others
        from the pieces their readers copied."""
        for i, spans in enumerate(chunk_spans(self._sizes, self._chunk_bytes)):
            prefix = chunk_prefix(header if i == 0 else None, sum(n for _, _, n in spans))
            if len(spans) == 1 and spans[0][0] in self._live:
                tensor, offset, length = spans[0]
                yield self._readers[tensor](offset, length, prefix)
            else:
                yield b"".join([prefix, *(self._readers[tensor](offset, length)
                                          for tensor, offset, length in spans)])

    def _live_reader(self, held: HeldShard, meta: TensorMeta):
        current: list[LiveRead] = []  # opened when the stream reaches the shard

        def read(offset: int, length: int, prefix: bytes | None = None):
            if not current:
                current.append(LiveRead(held, meta.dtype, self._copies))
                self._reads.append(current[0])
            piece = current[0](offset, length, prefix)
            if offset + length == meta.nbytes:
                self._finished.append(current[0])
            return piece

        return read

    def release_finished(self) -> None:
        for read in self._finished:
            read.close()
        self._finished.clear()

    def close(self) -> None:
        for read in self._reads:
            read.close()
        self._reads.clear()
        self._finished.clear()


def _parse_header(raw) -> pb.PushHeader:
    try:
        return pb.PushHeader.FromString(raw)
    except DecodeError:
        raise InvalidArgument("malformed push header") from None


def _push_header(h: pb.PushHeader) -> PushHeader:
    return PushHeader(
        client_id=h.client_id, incarnation=h.incarnation, sequence=h.sequence,
        acked_through=h.acked_through, epoch=h.epoch,
        refs=[(r.variable, r.index) for r in h.shards],
        metas=[TensorMeta.from_proto(t, what=f"push tensor {i}")
               for i, t in enumerate(h.tensors)],
        row_ids=row_ids_of(h.shards),
        step=h.step if h.HasField("step") else None,
        refuse_non_finite=h.refuse_non_finite)


def row_ids_of(refs) -> list[np.ndarray | None] | None:
    """The row ids each ShardRef names (None: the whole shard); None if none names any."""
    if not any(r.row_ids for r in refs):
        return None
    ids = []
    for r in refs:
        if not r.row_ids:
            ids.append(None)
        elif len(r.row_ids) % 8:
            raise InvalidArgument(f"row ids of {r.variable!r} shard {r.index}: "
                                  f"{len(r.row_ids)} bytes is not a whole number of int64s")
        else:
            ids.append(np.frombuffer(r.row_ids, "<i8"))
    return ids


def _push_reply(outcome: PushOutcome) -> pb.PushReply:
    reply = pb.PushReply()
    if outcome.members:
        # Every client's answer in a step names the same members: built once, copied.
        reply.CopyFrom(_naming(outcome.members))
    reply.duplicate, reply.next_step = outcome.duplicate, outcome.next_step
    reply.waited_s, reply.staleness = outcome.waited_s, outcome.staleness
    reply.stale_dropped, reply.honours_refuse_non_finite = outcome.stale_dropped, True
    return reply


@functools.lru_cache(maxsize=8)
def _naming(members: tuple[tuple[str, int], ...]) -> pb.PushReply:
    """A PushReply naming `members` and nothing else (never changed: copied from)."""
    return pb.PushReply(step_members=_step_members(members))


def _step_members(members) -> list[pb.StepMember]:
    return [pb.StepMember(client_id=client_id, incarnation=incarnation)
            for client_id, incarnation in members]


def _data_only(chunk: Chunk):
    if chunk.header is not None:
        raise InvalidArgument("push stream carries a second header")
    return chunk.data


def _checked(chunk: Chunk | InvalidArgument) -> Chunk:
    if isinstance(chunk, InvalidArgument):
        raise chunk
    return chunk


def _identity(raw: bytes) -> bytes:
    return raw


def _decode_push_chunk(raw: bytes) -> Chunk | InvalidArgument:
    # A deserializer's exception would end the call as INTERNAL; a malformed message must
    # end it with INVALID_ARGUMENT, so the error travels to Push as a value.
    try:
        return decode_chunk(raw)
    except InvalidArgument as error:
        return error


def add_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Register the servicer with the chunk codec of ps_common.tensors on the data path
    (the generated add_..._to_server would build and parse protobuf messages around every
    chunk, which costs more than moving its bytes). The wire format is unchanged."""
    handlers = {
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=pb.PullRequest.FromString,
            response_serializer=_identity),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=_decode_push_chunk,
            response_serializer=pb.PushReply.SerializeToString),
        "PullUnary": grpc.unary_unary_rpc_method_handler(
            servicer.PullUnary, request_deserializer=None,  # its bytes are its cache key
            response_serializer=_identity),
        "PushUnary": grpc.unary_unary_rpc_method_handler(
            servicer.PushUnary, request_deserializer=_decode_push_chunk,
            response_serializer=pb.PushReply.SerializeToString),
        "PushThenPull": grpc.unary_unary_rpc_method_handler(
            servicer.PushThenPull, request_deserializer=_decode_push_chunk,
            response_serializer=_identity),
        **{name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=request.FromString,
            response_serializer=reply.SerializeToString) for name, request, reply in (
                ("OpenSharedMemory", pb.OpenSharedMemoryRequest, pb.OpenSharedMemoryReply),
                ("AttachShards", pb.AttachShardsRequest, pb.AttachShardsReply),
                ("PushShared", pb.PushSharedRequest, pb.PushSharedReply),
                ("CloseSharedMemory", pb.CloseSharedMemoryRequest, pb.CloseSharedMemoryReply),
                ("JoinSteps", pb.JoinStepsRequest, pb.JoinStepsReply),
                ("LeaveSteps", pb.LeaveStepsRequest, pb.LeaveStepsReply))},
        "AssignShards": grpc.unary_unary_rpc_method_handler(
            servicer.AssignShards, request_deserializer=pb.AssignShardsRequest.FromString,
            response_serializer=pb.AssignShardsReply.SerializeToString),
        "SaveCheckpoint": grpc.unary_unary_rpc_method_handler(
            servicer.SaveCheckpoint, request_deserializer=pb.SaveCheckpointRequest.FromString,
            response_serializer=pb.SaveCheckpointReply.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ps.v1.ParameterServer", handlers),))
