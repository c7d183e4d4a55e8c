"""Placement: which server holds which rows of each new variable. One pure function.

Variables are placed in declaration order. A variable at or under the split threshold goes
whole to the server with the smallest footprint (values plus optimizer slots). A larger one
is cut by rows into min(servers, rows, ceil(bytes / threshold)) near-equal shards, placed on
distinct servers, least loaded first. An embedding table, whatever its size, is cut by id
into one shard per server (ps_common.shardmap.Shard), so that every server serves its share
of the rows each step touches. A server's memory budget (0 = none) is never exceeded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ps_common.errors import InvalidArgument, NotReady, ResourceExhausted
from ps_common.shardmap import Shard, ShardMap, VariableSpec, shard_capacity, split_rows
from ps_server.footprint import footprint


@dataclass(frozen=True)
class Candidate:
    server_id: str
    address: str
    budget_bytes: int  # 0 = unlimited


def shard_rows(spec: VariableSpec, shard: Shard) -> int:
    """The rows a shard holds, or for a dynamic table the most it may hold (its share of
    the capacity; 0 when unlimited: it grows with the ids seen)."""
    if spec.dynamic:
        return shard_capacity(spec, shard)
    return shard.num_rows


# What each server last reported of its dynamic tables' shards: server id -> (variable,
# index) -> (rows, evictions, bytes).
Reported = dict[str, dict[tuple[str, int], tuple[int, int, int]]]


def _reported_bytes(reported: dict[tuple[str, int], tuple[int, int, int]],
                    shard: Shard) -> int:
    return reported.get(shard.key, (0, 0, 0))[2]


def shard_charge(spec: VariableSpec, shard: Shard,
                 reported: dict[tuple[str, int], tuple[int, int, int]]) -> int:
    """What placement charges `shard`: its values and slots; a dynamic table's shard its
    share of the capacity, or what its server reported holding (`reported`, that server's
    report) where that is more (an uncapped table's share is 0: it grows with the ids)."""
    cost = footprint(spec, shard_rows(spec, shard))
    return max(cost, _reported_bytes(reported, shard)) if spec.dynamic else cost


def server_loads(current: ShardMap, reported: Reported | None = None) -> dict[str, int]:
    """What placement charges each server (shard_charge of each of its shards)."""
    reported = reported or {}
    loads: dict[str, int] = {}
    for name, shards in current.shards.items():
        spec = current.variables[name]
        for s in shards:
            loads[s.server_id] = (loads.get(s.server_id, 0)
                                  + shard_charge(spec, s, reported.get(s.server_id, {})))
    return loads


def held_bytes(current: ShardMap, server_id: str,
               reported: dict[tuple[str, int], tuple[int, int, int]]) -> int:
    """What a server holds: its shards' values and slots, and for a dynamic table's shard
    what the server last reported of it (`reported`: (variable, index) -> (rows,
    evictions, bytes)); such a shard grows with the ids seen, and placement charges it only
    its share of the capacity, nothing when the table has none."""
    total = 0
    for shard in current.shards_on(server_id):
        spec = current.variables[shard.variable]
        total += (_reported_bytes(reported, shard) if spec.dynamic
                  else footprint(spec, shard.num_rows))
    return total


def place(current: ShardMap, new_specs: list[VariableSpec], candidates: list[Candidate],
          *, split_threshold_bytes: int, reported: Reported | None = None) -> ShardMap:
    """The map after adding `new_specs` (not yet in `current`), at epoch current.epoch + 1;
    `reported` as for server_loads."""
    if not candidates:
        raise NotReady("no parameter server is registered and alive yet; retry when one is")
    loads = server_loads(current, reported)
    for c in candidates:
        loads.setdefault(c.server_id, 0)
    budgets = {c.server_id: c.budget_bytes for c in candidates}
    variables = dict(current.variables)
    shards = dict(current.shards)
    for spec in new_specs:
        if spec.is_table:
            parts = len(candidates) if spec.dynamic else min(len(candidates), spec.rows)
            if spec.dynamic and spec.capacity and spec.capacity < parts:
                raise InvalidArgument(
                    f"embedding table {spec.name!r}: capacity {spec.capacity} is below the "
                    f"{parts} servers it is spread over (each holds a share of it)")
            cuts = [Shard(spec.name, i, i, spec.rows, "", parts) for i in range(parts)]
        else:
            parts = 1
            if spec.nbytes > split_threshold_bytes:
                parts = min(len(candidates), spec.rows,
                            math.ceil(spec.nbytes / split_threshold_bytes))
            cuts = [Shard(spec.name, i, start, stop, "")
                    for i, (start, stop) in enumerate(split_rows(spec.rows, parts))]
        placed = []
        used: set[str] = set()
        for cut in cuts:
            cost = footprint(spec, shard_rows(spec, cut))
            order = sorted(candidates, key=lambda c: (loads[c.server_id], c.server_id))
            fits = [c for c in order if c.server_id not in used
                    and (not budgets[c.server_id] or loads[c.server_id] + cost <= budgets[c.server_id])]
            if not fits:
                raise ResourceExhausted(
                    f"variable {spec.name!r}: no server has room for {cost} more bytes "
                    f"({cut.describe()} with optimizer slots); add servers or raise "
                    "--memory-budget"
                )
            chosen = fits[0]
            used.add(chosen.server_id)
            loads[chosen.server_id] += cost
            placed.append(dataclasses.replace(cut, server_id=chosen.server_id))
        variables[spec.name] = spec
        shards[spec.name] = tuple(placed)
    servers = {**current.servers, **{c.server_id: c.address for c in candidates}}
    return ShardMap(current.epoch + 1, servers, variables, shards)
