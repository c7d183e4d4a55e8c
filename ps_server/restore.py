"""Creating shards from a checkpoint instead of their initializers.

The coordinator names the checkpoint and the shards; the rows of each come from whichever
checkpointed shards held them, so a checkpoint restores onto any number of servers. Every
file read is checked against its checksum first.

A server restores all the shards it is given from one checkpoint, or none: shards of one
server restored from two checkpoints would hold a push in one and not the other, while its
ledger says it was applied. So everything is read before anything is created, and the
ledger is adopted only once every shard has been read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ps_common.checkpoints import CheckpointError, RowSource
from ps_common.shardmap import Shard, VariableSpec
from ps_server.dynamic_rows import AGE_SLOT, AGO_SLOT, BOOKKEEPING_SLOTS
from ps_server.optimizers import make_state, resolve_knobs
from ps_server.store import HeldShard, make_shard_state

log = logging.getLogger(__name__)


class ShardRestore:
    def __init__(self, checkpoint: Path, shards: set[tuple[str, int]]):
        self.checkpoint = checkpoint
        self.shards = shards
        self.created: dict[tuple[str, int], HeldShard] = {}
        self.error = ""  # why nothing was restored
        self.unreadable = False  # ... because the checkpoint cannot be read
        self.step = 0
        self._source: RowSource | None = None
        self._memory = None
        self._new_dynamic = None

    def prepare(self, specs: dict[str, VariableSpec], shards: list[Shard],
                held: set[tuple[Shard, VariableSpec]], memory=None,
                new_dynamic=None) -> None:
        """Read every shard of `shards` named for restore that is not held already, into
        arrays from `memory` (a store's value memory; ordinary memory if None).
        `new_dynamic(spec, shard)` makes an empty dynamic table shard (ShardStore.new_dynamic)."""
        self._memory = memory
        self._new_dynamic = new_dynamic
        wanted = [s for s in shards
                  if s.key in self.shards and (s, specs[s.variable]) not in held]
        if not wanted:
            return
        try:
            self._source = RowSource(self.checkpoint)
            self.step = self._source.manifest.step
            for shard in wanted:
                self.created[shard.key] = self._read(specs[shard.variable], shard)
        except CheckpointError as error:
            self._give_up(f"cannot restore from {self.checkpoint}: {error}", unreadable=True)
        except MemoryError:
            self._give_up(f"out of memory restoring from {self.checkpoint}", unreadable=False)

    def _give_up(self, message: str, *, unreadable: bool) -> None:
        if self._memory is not None:
            for held in self.created.values():
                self._memory.retire(held.values)
        self.created.clear()
        self.error, self.unreadable = message, unreadable

    def _read(self, spec: VariableSpec, shard: Shard) -> HeldShard:
        if spec.is_table:
            return self._read_table(spec, shard)
        state = make_state(spec, shard.shape(spec))
        values = (None if self._memory is None
                  else self._memory.empty(shard.shape(spec), spec.dtype))
        try:
            values, updates, steps = self._source.load(spec, shard.row_start, shard.row_stop,
                                                       state.slots, values)
        except BaseException:
            if values is not None:
                self._memory.retire(values)
            raise
        state.steps = steps
        # At least one update: a restored shard holds trained values and is never dropped
        # or re-created from its initializer.
        return HeldShard(spec, shard, values, state, resolve_knobs(spec), updates=max(updates, 1))

    def _read_table(self, spec: VariableSpec, shard: Shard) -> HeldShard:
        """A table's rows come back by id, so the checkpoint may have cut it into another
        number of shards; a dynamic table's come back as the rows it held."""
        empty = make_shard_state(spec, (0, *spec.shape[1:]))
        slot_names = sorted(empty.slots) + (list(BOOKKEEPING_SLOTS) if spec.dynamic else [])
        # A checkpoint written before rows' last use was saved: every row used at its cut.
        last_use = {AGE_SLOT: np.float64(0), AGO_SLOT: np.int64(0)} if spec.dynamic else {}
        ids, values, slots, updates, steps = self._source.load_table(
            spec, shard.index, shard.stride, slot_names, last_use)
        if spec.dynamic:
            held = self._new_dynamic(spec, shard)
            ages, agos = slots.pop(AGE_SLOT), slots.pop(AGO_SLOT)
            held.dynamic.adopt(np.ascontiguousarray(values), {
                name: np.ascontiguousarray(array) for name, array in slots.items()},
                last_use=(ages, agos))
            held.sync_pool()
        else:
            if len(ids) != shard.num_rows:
                raise CheckpointError(f"checkpoint {self._source.manifest.id} holds {len(ids)} "
                                      f"of the {shard.num_rows} rows of {shard.describe()}")
            local = ids // shard.stride
            state = make_shard_state(spec, shard.shape(spec))
            for name, array in slots.items():
                state.slots[name][local] = array
            into = (np.empty(shard.shape(spec), spec.dtype) if self._memory is None
                    else self._memory.empty(shard.shape(spec), spec.dtype))
            into[local] = values
            held = HeldShard(spec, shard, into, state, resolve_knobs(spec))
        held.state.steps = steps
        held.updates = max(updates, 1)
        return held

    def failure(self, shard: Shard) -> str:
        return self.error or (f"shard {shard.index} of {shard.variable!r} was not restored "
                              f"from {self.checkpoint}")

    def ledger(self, server_id: str) -> dict | None:
        """This server's ledger from the checkpoint; only once every shard was read."""
        if self._source is None or self.error:
            return None
        try:
            return self._source.ledger(server_id)
        except (CheckpointError, ValueError) as error:
            self._give_up(f"cannot restore the exactly-once ledger of {server_id} from "
                          f"{self.checkpoint}: {error}", unreadable=True)
            return None
