"""Creating shards from a checkpoint instead of their initializers.

The coordinator names the checkpoint and the shards; the rows of each come from whichever
checkpointed shards held them, so a checkpoint restores onto any number of servers. Every
file read is checked against its checksum first.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ps_common.checkpoints import CheckpointError, RowSource
from ps_common.shardmap import Shard, VariableSpec
from ps_server.optimizers import make_state, resolve_knobs
from ps_server.store import HeldShard

log = logging.getLogger(__name__)


class ShardRestore:
    def __init__(self, checkpoint: Path, shards: set[tuple[str, int]]):
        self.checkpoint = checkpoint
        self.shards = shards
        self._failures: dict[tuple[str, int], str] = {}
        self._source: RowSource | None = None
        self.restored: list[HeldShard] = []

    def source(self) -> RowSource:
        if self._source is None:
            self._source = RowSource(self.checkpoint)
        return self._source

    def create(self, spec: VariableSpec, shard: Shard) -> HeldShard | None:
        try:
            state = make_state(spec, shard.shape(spec))
            values, updates, steps = self.source().load(spec, shard.row_start, shard.row_stop,
                                                        state.slots)
        except CheckpointError as error:
            self._failures[shard.key] = (f"cannot restore shard {shard.index} of {spec.name!r} "
                                         f"from {self.checkpoint}: {error}")
            return None
        state.steps = steps
        # At least one update: a restored shard holds trained values and is never dropped
        # or re-created from its initializer.
        held = HeldShard(spec, shard, values, state, resolve_knobs(spec), updates=max(updates, 1))
        self.restored.append(held)
        return held

    def failure(self, shard: Shard) -> str:
        return self._failures.get(shard.key, f"shard {shard.index} of {shard.variable!r} was "
                                             "not restored")

    def ledger(self, server_id: str) -> dict | None:
        return self.source().ledger(server_id)
