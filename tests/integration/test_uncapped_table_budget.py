"""An uncapped dynamic table grows only within its server's --memory-budget, counted as the
server reports it (with each row's bookkeeping)."""

from __future__ import annotations

import grpc
import numpy as np

from ps_worker import PSClient, RemoteError

SGD = {"name": "sgd", "lr": 0.1}


def test_an_uncapped_dynamic_table_stays_within_the_memory_budget(make_cluster):
    """An uncapped table grows until the rest of the budget is full, then requests needing new
    rows get RESOURCE_EXHAUSTED. The budget counted a pool's values and slots only, while a
    growth asks room for each row's bookkeeping too (last use, the id's index entry): a
    narrow table was admitted until it held several times the budget."""
    budget = 200_000
    cluster = make_cluster(servers=1, memory_budget_bytes=budget)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("open", dim=1, init="zeros", optimizer=SGD)  # uncapped
        refused = None
        for start in range(0, 200_000, 512):
            ids = np.arange(start, start + 512, dtype=np.int64)
            try:
                ps.push_rows("open", ids, np.ones((512, 1), np.float32))
            except RemoteError as error:
                refused = error
                break
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--memory-budget" in refused.details()
        held = sum(t.nbytes for t in cluster.servers[0].store.table_stats())
        assert held <= budget, (
            f"the table's {held} bytes exceed the server's --memory-budget of {budget}")
