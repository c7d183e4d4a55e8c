"""gRPC adapter of the parameter server: decode, call the store, encode. Nothing else."""

from __future__ import annotations

import numpy as np

from ps_common.errors import InvalidArgument
from ps_common.status import translate_errors
from ps_common.tensors import (
    StreamAssembler, TensorMeta, array_reader, dtype_from_proto, iter_chunks, view_bytes,
)
from ps_common.wire import shard_from_proto, spec_from_proto
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from ps_server.buffers import BufferPool
from ps_server.ledger import PushLedger
from ps_server.store import ShardStore


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """Thread-safe: every handler may run concurrently with every other."""

    def __init__(self, store: ShardStore, ledger: PushLedger, *, chunk_bytes: int,
                 buffers: BufferPool | None = None):
        self._store = store
        self._ledger = ledger
        self._chunk_bytes = chunk_bytes
        self._buffers = buffers or BufferPool()

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
                yield pb.PullChunk(header=header, data=piece) if i == 0 else pb.PullChunk(data=piece)

    def Push(self, request_iterator, context):
        with translate_errors(context, "Push"):
            chunks = iter(request_iterator)
            first = next(chunks, None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("a push stream must start with a chunk carrying its header")
            h = first.header
            if not h.client_id or h.sequence < 1:
                raise InvalidArgument(
                    "push header needs a client_id and a sequence >= 1 (exactly-once identity)")
            refs = [(r.variable, r.index) for r in h.shards]
            metas = [TensorMeta.from_proto(t, what=f"push tensor {i}")
                     for i, t in enumerate(h.tensors)]
            targets = self._store.plan_push(h.epoch, refs, metas)
            buffers = [self._buffers.acquire(meta.nbytes) for meta in metas]
            try:
                assembler = StreamAssembler(buffers, what="push")
                assembler.write(first.data)
                for chunk in chunks:
                    if chunk.HasField("header"):
                        raise InvalidArgument("push stream carries a second header")
                    assembler.write(chunk.data)
                assembler.finish()
                grads = [self._decode(buf, meta, held.spec.dtype)
                         for buf, meta, held in zip(buffers, metas, targets)]
                self._store.check_gradients(targets, grads)
                with self._ledger.exactly_once(
                    h.client_id, h.incarnation, h.sequence, h.acked_through
                ) as duplicate:
                    if not duplicate:
                        self._store.apply(targets, grads)
            finally:
                for buffer in buffers:
                    self._buffers.release(buffer)
            return pb.PushReply(duplicate=duplicate)

    @staticmethod
    def _decode(buffer: np.ndarray, meta: TensorMeta, stored_dtype: str) -> np.ndarray:
        grad = view_bytes(buffer, meta)
        # Views of our own receive buffer are writable: the optimizer uses the gradient as
        # scratch, and the buffer is reused once the push is done.
        return grad if grad.dtype == stored_dtype else grad.astype(stored_dtype)

    def AssignShards(self, request: pb.AssignShardsRequest, context):
        with translate_errors(context, "AssignShards"):
            specs = {v.name: spec_from_proto(v) for v in request.variables}
            shards = [shard_from_proto(s) for s in request.shards]
            created = self._store.assign(request.epoch, specs, shards)
            return pb.AssignShardsReply(shards_created=created)
