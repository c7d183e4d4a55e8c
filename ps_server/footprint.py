"""What a shard costs the server that holds it, in bytes: values, optimizer slots and a
table's bookkeeping. Placement charges servers by it (ps_server.coordinator.placement), and
a server's store checks its own budget by it (ps_server.store)."""

from __future__ import annotations

import numpy as np

from ps_common.shardmap import VariableSpec
from ps_server.dynamic_rows import ROW_OVERHEAD_BYTES
from ps_server.optimizers import SLOTS, compute_dtype


def footprint(spec: VariableSpec, rows: int) -> int:
    """Bytes a shard of `rows` rows costs its server: values plus optimizer slots (and a
    table's per-row step count under adam)."""
    slots = len(SLOTS.get(spec.optimizer.name, ()))
    element_bytes = np.dtype(spec.dtype).itemsize + slots * compute_dtype(spec.dtype).itemsize
    row_steps = 8 if spec.is_table and spec.optimizer.name == "adam" else 0
    bookkeeping = ROW_OVERHEAD_BYTES if spec.dynamic else 0
    return rows * (spec.row_elements * element_bytes + row_steps + bookkeeping)
