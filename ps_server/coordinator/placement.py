"""Placement: which server holds which rows of each new variable. One pure function.

Variables are placed in declaration order. A variable at or under the split threshold goes
whole to the server with the smallest footprint (values plus optimizer slots). A larger one
is cut by rows into min(servers, rows, ceil(bytes / threshold)) near-equal shards, placed on
distinct servers, least loaded first. A server's memory budget (0 = none) is never exceeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ps_common.errors import NotReady, ResourceExhausted
from ps_common.shardmap import Shard, ShardMap, VariableSpec, split_rows
from ps_server.optimizers import SLOTS, compute_dtype


@dataclass(frozen=True)
class Candidate:
    server_id: str
    address: str
    budget_bytes: int  # 0 = unlimited


def footprint(spec: VariableSpec, rows: int) -> int:
    """Bytes a shard of `rows` rows costs its server: values plus optimizer slots."""
    slots = len(SLOTS.get(spec.optimizer.name, ()))
    element_bytes = np.dtype(spec.dtype).itemsize + slots * compute_dtype(spec.dtype).itemsize
    return rows * spec.row_elements * element_bytes


def server_loads(current: ShardMap) -> dict[str, int]:
    loads: dict[str, int] = {}
    for name, shards in current.shards.items():
        spec = current.variables[name]
        for s in shards:
            loads[s.server_id] = loads.get(s.server_id, 0) + footprint(spec, s.row_stop - s.row_start)
    return loads


def place(current: ShardMap, new_specs: list[VariableSpec], candidates: list[Candidate],
          *, split_threshold_bytes: int) -> ShardMap:
    """The map after adding `new_specs` (not yet in `current`), at epoch current.epoch + 1."""
    if not candidates:
        raise NotReady("no parameter server is registered and alive yet; retry when one is")
    loads = server_loads(current)
    for c in candidates:
        loads.setdefault(c.server_id, 0)
    budgets = {c.server_id: c.budget_bytes for c in candidates}
    variables = dict(current.variables)
    shards = dict(current.shards)
    for spec in new_specs:
        parts = 1
        if spec.nbytes > split_threshold_bytes:
            parts = min(len(candidates), spec.rows, math.ceil(spec.nbytes / split_threshold_bytes))
        placed = []
        used: set[str] = set()
        for index, (start, stop) in enumerate(split_rows(spec.rows, parts)):
            cost = footprint(spec, stop - start)
            order = sorted(candidates, key=lambda c: (loads[c.server_id], c.server_id))
            fits = [c for c in order if c.server_id not in used
                    and (not budgets[c.server_id] or loads[c.server_id] + cost <= budgets[c.server_id])]
            if not fits:
                raise ResourceExhausted(
                    f"variable {spec.name!r}: no server has room for {cost} more bytes "
                    f"(rows {start}:{stop} with optimizer slots); add servers or raise "
                    "--memory-budget"
                )
            chosen = fits[0]
            used.add(chosen.server_id)
            loads[chosen.server_id] += cost
            placed.append(Shard(spec.name, index, start, stop, chosen.server_id))
        variables[spec.name] = spec
        shards[spec.name] = tuple(placed)
    servers = {**current.servers, **{c.server_id: c.address for c in candidates}}
    return ShardMap(current.epoch + 1, servers, variables, shards)
