"""gRPC adapter of the parameter server: decode, call the store, encode. Nothing else."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from ps_common.errors import InvalidArgument
from ps_common.status import translate_errors
from ps_common.tensors import (
    Chunk, TensorMeta, array_reader, decode_chunk, dtype_from_proto,
    encode_chunk, iter_chunks,
)
from ps_common.wire import shard_to_proto, shardmap_from_proto
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.buffers import BufferPool
from ps_server.control import CoordinatorFence
from ps_server.ledger import PushLedger
from ps_server.pushes import PushHeader, PushReceiver
from ps_server.store import ShardStore


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thread-safe: every handler may run concurrently with every other."""

    def __init__(self, store: ShardStore, ledger: PushLedger, *, chunk_bytes: int,
                 fence: CoordinatorFence, server_id: str = "",
                 buffers: BufferPool | None = None):
        self._store = store
        # Set by the app once the port is bound (a server's id defaults to its address).
        self.server_id = server_id
        self._fence = fence
        self._chunk_bytes = chunk_bytes
        self._pushes = PushReceiver(store, ledger, buffers or BufferPool())

    def Pull(self, request: pb.PullRequest, context):
        with translate_errors(context, "Pull"):
            wire = (dtype_from_proto(request.wire_dtype, what="pull wire_dtype")
                    if request.wire_dtype else None)
            plan = self._store.plan_pull(
                request.epoch, [(r.variable, r.index) for r in request.shards], wire)
            header = pb.PullHeader(tensors=[meta.to_proto() for _, meta in plan])
            sizes = [meta.nbytes for _, meta in plan]
            readers = [array_reader(held.values, meta.dtype, held.lock) for held, meta in plan]
            for i, piece in enumerate(iter_chunks(sizes, readers, self._chunk_bytes)):
                yield encode_chunk(header.SerializeToString() if i == 0 else None, piece)

    def Push(self, request_iterator, context):
        """`request_iterator` yields decoded `Chunk`s (see `add_to_server`)."""
        with translate_errors(context, "Push"):
            chunks = map(_checked, request_iterator)
            first: Chunk | None = next(chunks, None)
            if first is None or first.header is None:
                raise InvalidArgument("a push stream must start with a chunk carrying its header")
            try:
                h = pb.PushHeader.FromString(first.header)
            except DecodeError:
                raise InvalidArgument("malformed push header") from None
            header = PushHeader(
                client_id=h.client_id, incarnation=h.incarnation, sequence=h.sequence,
                acked_through=h.acked_through, epoch=h.epoch,
                refs=[(r.variable, r.index) for r in h.shards],
                metas=[TensorMeta.from_proto(t, what=f"push tensor {i}")
                       for i, t in enumerate(h.tensors)])
            duplicate = self._pushes.receive(header, first.data, map(_data_only, chunks))
            return pb.PushReply(duplicate=duplicate)

    def AssignShards(self, request: pb.AssignShardsRequest, context):
        with translate_errors(context, "AssignShards"):
            self._fence.check(request.generation, request.control_token)
            shard_map = shardmap_from_proto(request.map)
            outcome = self._store.assign(
                shard_map.epoch, shard_map.variables, shard_map.shards_on(self.server_id))
            self._fence.remember_map(shard_map)
            return pb.AssignShardsReply(
                shards_created=outcome.created,
                failed=[pb.ShardFailure(shard=shard_to_proto(shard), message=message)
                        for shard, message in outcome.failed])


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
        "AssignShards": grpc.unary_unary_rpc_method_handler(
            servicer.AssignShards, request_deserializer=pb.AssignShardsRequest.FromString,
            response_serializer=pb.AssignShardsReply.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ps.v1.ParameterServer", handlers),))
