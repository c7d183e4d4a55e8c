"""W1 dense-mlp (../shared/BENCHMARKS.md): MLP 784-512-512-10 (669,706 params), batch 128,
softmax cross-entropy, SGD lr 0.01 on the servers; 2 servers, 2 workers, async. A step =
pull all params, forward + backward, push all grads. Figure: total steps/s over 20 s after a
3 s warm-up, beside the compute-only baseline: the same MLP steps in one process with no
server (NumPy applying SGD in place), measured in the same run.

    python benchmarks/w1_dense_mlp.py [--seconds 20] [--warmup 3] [--workers 2] [--servers 2]

Workers are real `ps-worker` processes running the real training runtime on a job given to
the coordinator (data: seeded random 784-feature examples in an .npz, 10 classes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import REPO_ROOT, bounded, cluster, context, report

from ps_worker.cluster import worker_environment

HIDDEN = (512, 512)
FEATURES, CLASSES, BATCH, LR = 784, 10, 128, 0.01
EXAMPLES = 128 * 100


def make_data(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((EXAMPLES, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES)
    np.savez(path, x=x, y=y)


def compute_only_in_subprocess(seconds: float, workers: int) -> float:
    """The compute-only rate of one process given a worker's share of the cores (the same
    BLAS thread count ps-cluster gives each worker): the ceiling for one worker."""
    out = subprocess.run(
        [sys.executable, __file__, "--compute-only", str(seconds)], cwd=REPO_ROOT,
        env=worker_environment(workers), capture_output=True, text=True, timeout=seconds + 120,
        check=True).stdout
    return float(out.split()[-1])


def compute_only_steps_per_s(seconds: float) -> float:
    """The same MLP steps in this process, no server."""
    from ps_worker.data import iter_batches, load_dataset
    from ps_worker.models import MLP, initial_values

    with tempfile.TemporaryDirectory() as tmp:
        make_data(Path(tmp) / "w1.npz")
        data = load_dataset(str(Path(tmp) / "w1.npz"))
    model = MLP(FEATURES, CLASSES, hidden=HIDDEN)
    params = initial_values(model.variables(), seed=0)
    batches = list(iter_batches(data, np.arange(data.num_train), BATCH))
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        x, y = batches[steps % len(batches)]
        _, grads = model.loss_and_grads(params, (x, y))
        for name, grad in grads.items():
            grad *= LR
            params[name] -= grad
        steps += 1
    return steps / (time.perf_counter() - started)


def status(address: str) -> dict:
    from ps_worker.coordinator_client import CoordinatorClient

    with CoordinatorClient(address, give_up_after_s=10.0) as client:
        return client.status()


def cluster_steps_per_s(args) -> tuple[float, dict]:
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "w1.npz"
        make_data(data)
        job = ["--model", "mlp", "--hidden", ",".join(map(str, HIDDEN)), "--data", str(data),
               "--batch-size", str(BATCH), "--optimizer", "sgd", "--lr", str(LR),
               "--epochs", "1000", "--tasks-per-epoch", "50"]  # 2 steps a task: fine counts
        with cluster(args.servers, coordinator_args=job) as c:
            workers = [subprocess.Popen(
                [py, "-m", "ps_worker.cli", "--coordinator", c.address, "--worker-id", f"w{i}",
                 "--device", "cpu", "--log-level", "warning"],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=worker_environment(args.workers))
                for i in range(args.workers)]
            try:
                return _measure(c, args)
            finally:
                for worker in workers:
                    worker.terminate()
                for worker in workers:
                    try:
                        worker.wait(10)
                    except subprocess.TimeoutExpired:
                        worker.kill()
                        worker.wait(5)


def _measure(c, args) -> tuple[float, dict]:
    deadline = time.monotonic() + 60
    while status(c.address)["job"]["steps"] == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("no step was completed within 60 s")
        time.sleep(0.2)
    time.sleep(args.warmup)
    s0, t0 = status(c.address)["job"]["steps"], time.monotonic()
    time.sleep(args.seconds)
    final = status(c.address)
    s1, t1 = final["job"]["steps"], time.monotonic()
    rss = {s.name: s.peak_rss_bytes() for s in c.servers}
    return (s1 - s0) / (t1 - t0), {"server_peak_rss_bytes": rss, "steps": s1 - s0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--compute-only", type=float, metavar="SECONDS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compute_only:
        print(compute_only_steps_per_s(args.compute_only))
        return 0
    with bounded(args.seconds * 2 + args.warmup + 240, "W1"):
        baseline = compute_only_in_subprocess(min(args.seconds, 10.0), args.workers)
        rate, extra = cluster_steps_per_s(args)
    per_worker = rate / args.workers
    lost = 1.0 - per_worker / baseline
    params = sum(a * b + b for a, b in zip((FEATURES, *HIDDEN), (*HIDDEN, CLASSES)))
    report("W1 dense-mlp", [
        ("model", f"MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES} ({params:,} params), "
                  f"batch {BATCH}, sgd lr {LR}"),
        ("cluster", f"{args.servers} servers, {args.workers} workers, async"),
        ("paramserve", f"{rate:.1f} steps/s total, {per_worker:.1f} per worker "
                       f"({extra['steps']} steps in {args.seconds:g} s)"),
        ("compute only", f"{baseline:.1f} steps/s (same steps, one process with a worker's "
                         f"share of the cores, no server)"),
        ("ratio", f"{per_worker / baseline:.2f}: {lost:.0%} of each worker step lost to the "
                  f"parameter server ({args.servers} servers and {args.workers} workers share "
                  f"{os.cpu_count()} cores)"),
    ], {"benchmark": "W1 dense-mlp", "steps_per_s": rate, "per_worker_steps_per_s": per_worker,
        "compute_only_steps_per_s": baseline, "per_worker_ratio": per_worker / baseline,
        "total_ratio": rate / baseline, **extra, **context()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
