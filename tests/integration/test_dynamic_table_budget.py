"""Placement charges a server's --memory-budget for a capped dynamic table's whole capacity
(rows, slots and bookkeeping), so the table can always hold that many rows: an uncapped
table on the same server grows only into the rest of the budget."""

from __future__ import annotations

import grpc
import numpy as np

from ps_worker import PSClient, RemoteError

ADAM = {"name": "adam", "lr": 0.01}


def test_an_uncapped_table_does_not_take_the_room_charged_for_a_capped_ones_capacity(
        make_cluster):
    # A capped table of 1,000 rows of 64 floats under adam is charged 1000 x 901 bytes at
    # placement (values, m, v, per-row steps and bookkeeping): 901,000 of the 1,000,000.
    cluster = make_cluster(servers=1, memory_budget_bytes=1_000_000)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("capped", dim=64, init="zeros", optimizer=ADAM, capacity=1000)
        ps.declare_embedding("open", dim=64, init="zeros", optimizer=ADAM)  # uncapped
        # The uncapped table grows until the server's budget refuses it.
        refused = None
        for start in range(0, 20_000, 256):
            ids = np.arange(start, start + 256, dtype=np.int64)
            try:
                ps.push_rows("open", ids, np.ones((256, 64), np.float32))
            except RemoteError as error:
                refused = error
                break
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # 300 rows of the capped table: well within the capacity it was charged for.
        ids = np.arange(300, dtype=np.int64)
        ps.push_rows("capped", ids, np.ones((300, 64), np.float32))
        assert sum(t.rows for t in cluster.servers[0].store.table_stats()
                   if t.variable == "capped") == 300
