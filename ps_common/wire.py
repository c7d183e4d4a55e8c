"""Conversions between the shard-map domain types and their protobuf messages."""

from __future__ import annotations

from ps_common.errors import InvalidArgument
from ps_common.shardmap import DENSE, Component, Shard, ShardMap, VariableSpec
from ps_common.tensors import dtype_from_proto, dtype_to_proto
from ps_proto.v1 import tensor_pb2


def component_to_proto(c: Component) -> tensor_pb2.Component:
    return tensor_pb2.Component(name=c.name, params=dict(c.params))


def component_from_proto(msg: tensor_pb2.Component) -> Component:
    return Component(msg.name, tuple(sorted((k, float(v)) for k, v in msg.params.items())))


def spec_to_proto(spec: VariableSpec) -> tensor_pb2.VariableSpec:
    return tensor_pb2.VariableSpec(
        name=spec.name,
        shape=spec.shape,
        dtype=dtype_to_proto(spec.dtype),
        initializer=component_to_proto(spec.written_initializer),
        optimizer=component_to_proto(spec.written_optimizer),
        seed=spec.seed,
        kind="" if spec.kind == DENSE else spec.kind,
        capacity=spec.capacity,
        ttl_seconds=spec.ttl_seconds,
    )


def spec_from_proto(msg: tensor_pb2.VariableSpec) -> VariableSpec:
    dtype = dtype_from_proto(msg.dtype, what=f"variable {msg.name!r}")
    if dtype == "bfloat16":
        raise InvalidArgument(
            f"variable {msg.name!r}: bfloat16 is a transport dtype only; store float32"
        )
    return VariableSpec(
        name=msg.name,
        shape=tuple(int(d) for d in msg.shape),
        dtype=dtype,
        initializer=component_from_proto(msg.initializer),
        optimizer=component_from_proto(msg.optimizer),
        seed=int(msg.seed),
        kind=msg.kind or DENSE,
        capacity=int(msg.capacity),
        ttl_seconds=float(msg.ttl_seconds),
    )


def shard_to_proto(s: Shard) -> tensor_pb2.Shard:
    return tensor_pb2.Shard(
        variable=s.variable, index=s.index, row_start=s.row_start, row_stop=s.row_stop,
        server_id=s.server_id, stride=s.stride,
    )


def shard_from_proto(msg: tensor_pb2.Shard) -> Shard:
    return Shard(msg.variable, int(msg.index), int(msg.row_start), int(msg.row_stop),
                 msg.server_id, int(msg.stride) or 1)


def shardmap_to_proto(m: ShardMap) -> tensor_pb2.ShardMap:
    return tensor_pb2.ShardMap(
        epoch=m.epoch,
        servers=[tensor_pb2.ServerInfo(server_id=i, address=a) for i, a in m.servers.items()],
        variables=[spec_to_proto(s) for s in m.variables.values()],
        shards=[shard_to_proto(s) for shards in m.shards.values() for s in shards],
    )


def shardmap_from_proto(msg: tensor_pb2.ShardMap) -> ShardMap:
    variables = {v.name: spec_from_proto(v) for v in msg.variables}
    shards: dict[str, list[Shard]] = {name: [] for name in variables}
    for s in msg.shards:
        shards.setdefault(s.variable, []).append(shard_from_proto(s))
    return ShardMap(
        epoch=int(msg.epoch),
        servers={s.server_id: s.address for s in msg.servers},
        variables=variables,
        shards={k: tuple(sorted(v, key=lambda s: s.index)) for k, v in shards.items()},
    )
