"""One replica of the two-process sync run of test_sync_processes.py (the README's example,
with its data seeded by rank): `python sync_replica.py COORDINATOR RANK STEPS OUT.npy`."""

from __future__ import annotations

import sys

import numpy as np

from ps_worker import PSClient


def batch(rank: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(rank).standard_normal((256, 8)).astype(np.float32)
    return x, x @ np.arange(8, dtype=np.float32)


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (2 * x.T @ (x @ w - y) / len(x)).astype(np.float32)


def main() -> None:
    coordinator, rank, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    x, y = batch(rank)
    with PSClient(coordinator) as ps:
        ps.declare("w", shape=(8,), optimizer={"name": "sgd", "lr": 0.1})
        ps.join_steps("sync", replicas=2)
        for _ in range(steps):
            ps.push({"w": gradient(ps.pull("w"), x, y)})
        ps.leave_steps()
        np.save(out, ps.pull("w"))
        print(f"staleness_max {ps.step_stats.staleness_max} "
              f"dropped {ps.step_stats.dropped_stale}", flush=True)


if __name__ == "__main__":
    main()
