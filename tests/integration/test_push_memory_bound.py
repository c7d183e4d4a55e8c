"""The memory a server keeps for streamed pushes stays within --push-memory, idle buffers
kept for the next pushes included: row pushes change size every step, and buffers of sizes
no later push asks for must not pile up past the bound (README: "`--push-memory SIZE`
(memory streamed pushes wait in ...)")."""

from __future__ import annotations

import numpy as np

from ps_worker import PSClient

SHARED_MEMORY = False
PUSH_MEMORY = 64 << 10  # --push-memory 64KiB
DIM = 16


def test_streamed_row_pushes_of_changing_sizes_keep_no_more_than_push_memory(make_cluster,
                                                                             tmp_path):
    cluster = make_cluster(servers=1, chunk_bytes=1024, push_memory_bytes=PUSH_MEMORY,
                           spill_dir=tmp_path)
    server = cluster.servers[0]
    with PSClient(cluster.coordinator_address, chunk_bytes=1024) as ps:
        ps.declare_embedding("items", dim=DIM, num_rows=100_000,
                             init={"name": "constant", "value": 0.0},
                             optimizer={"name": "sgd", "lr": 1.0})
        rng = np.random.default_rng(0)
        for step in range(40):
            # A step's batch touches between 400 and 900 distinct ids: 25-56 KiB of rows,
            # each push within --push-memory, each streamed (over 1 KiB).
            ids = np.unique(rng.integers(0, 100_000, size=400 + 13 * step))
            ps.push_rows("items", ids, np.ones((len(ids), DIM), np.float32))
    assert server.push_staging.staged_pushes == 0  # every one of them waited in memory
    kept = server.push_staging.idle_buffer_bytes()
    assert kept > 0  # some are kept for the next pushes
    assert kept <= PUSH_MEMORY, (
        f"after 40 streamed row pushes the server keeps {kept} bytes of idle push buffers, "
        f"{kept / PUSH_MEMORY:.0f}x its --push-memory of {PUSH_MEMORY}")
