"""W1 dense-mlp: MLP 784-512-512-10 (669,706 params), batch 128,
softmax cross-entropy, SGD lr 0.01 on the servers; 2 servers, 2 workers, async. A step =
pull all params, forward + backward, push all grads. Figure: total steps/s over 20 s after a
3 s warm-up, beside the compute-only baseline: the same MLP steps in one process with no
server (NumPy applying SGD in place), measured in the same run; and beside the cores'
ceiling: as many of those compute-only processes at once as there are workers.

    python benchmarks/w1_dense_mlp.py [--seconds 20] [--warmup 3] [--workers 2] [--servers 2]
    python benchmarks/w1_dense_mlp.py --quick      # a few seconds: does it still run?

Workers are real `ps-worker` processes running the real training runtime on a job given to
the coordinator (data: seeded random 784-feature examples in an .npz, 10 classes), each
with a worker's share of the cores for BLAS (`ps_worker.cluster.worker_environment`: the
cores split evenly, at least 1 thread each), as `ps-cluster` starts them. The job evaluates
no held-out split (`--evaluate-every 0`): a W1 step is a pull, a forward and backward pass
and a push, as in the compute-only baseline; `--evaluate-every N` measures the job with an
evaluation after every N-th epoch instead.

This module also holds the W1 machinery that w5_scale.py and profile_w1.py reuse:
`w1_cluster` (coordinator with the W1 job, servers, workers), `wait_all_stepping`,
`sample` / `measure_window` (steps from the coordinator's status and the CPU of every
process of the cluster, from /proc) and `compute_only` (the in-run baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from ps_worker.cluster import worker_environment
from ps_worker.data import TEST_FRACTION

HIDDEN = (512, 512)
FEATURES, CLASSES, BATCH, LR = 784, 10, 128, 0.01
EXAMPLES = 128 * 100
PARAMS = sum(a * b + b for a, b in zip((FEATURES, *HIDDEN), (*HIDDEN, CLASSES), strict=True))
# As in a real job, a worker leases a task, runs its steps with pulls and pushes overlapped,
# and drains its pushes at the end. The coordinator counts a task's steps when it completes,
# so a window's count is off by at most STEPS_PER_TASK per worker: 16 (the job trains on
# the 80% of the examples it does not hold out, 80 batches an epoch, in 5 tasks).
TASKS_PER_EPOCH = 5
STEPS_PER_TASK = (EXAMPLES - round(EXAMPLES * TEST_FRACTION)) // BATCH // TASKS_PER_EPOCH
STEPPING_TIMEOUT_S = 120.0  # every worker's first task, however many start at once
WINDOW_LIMIT_S = 120.0  # a measured window waits this long at most for a first step


def make_data(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((EXAMPLES, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES)
    np.savez(path, x=x, y=y)


def model_text() -> str:
    return (f"MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES} ({PARAMS:,} params), "
            f"batch {BATCH}, sgd lr {LR}")


# ---- the compute-only baseline -----------------------------------------------------------

def blas_threads(workers: int) -> int:
    """BLAS threads of each of `workers` workers (and of the compute-only baseline for them)."""
    return int(worker_environment(workers)["OPENBLAS_NUM_THREADS"])


def compute_only(seconds: float, workers: int) -> dict:
    """The compute-only rate of one process given a worker's share of the cores (the same
    BLAS thread count ps-cluster gives each of `workers` workers): the ceiling for one
    worker. {"steps_per_s", "cpu_ms_per_step", "steps", "blas_threads"}."""
    out = subprocess.run(
        [sys.executable, __file__, "--compute-only", str(seconds)], cwd=harness.REPO_ROOT,
        env=worker_environment(workers), capture_output=True, text=True, timeout=seconds + 120,
        check=True).stdout
    return {**json.loads(out.splitlines()[-1]), "blas_threads": blas_threads(workers)}


def compute_only_together(seconds: float, workers: int) -> dict:
    """`workers` compute-only processes at once (each with a worker's share of the cores),
    no server: what the cores give when the workers do nothing but compute, the ceiling of
    the cluster's total steps/s on this machine. {"steps_per_s" (their sum), "processes"}."""
    procs = [subprocess.Popen([sys.executable, __file__, "--compute-only", str(seconds)],
                              cwd=harness.REPO_ROOT, env=worker_environment(workers),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(workers)]
    try:
        outs = [p.communicate(timeout=seconds + 120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    rates = [json.loads(out.splitlines()[-1])["steps_per_s"] for out in outs]
    return {"steps_per_s": sum(rates), "processes": workers}


def compute_only_steps(seconds: float) -> dict:
    """The same MLP steps in this process, no server: steps/s and CPU ms per step (all of
    this process's threads)."""
    from ps_worker.data import iter_batches, load_dataset
    from ps_worker.models import MLP, initial_values

    with tempfile.TemporaryDirectory() as tmp:
        make_data(Path(tmp) / "w1.npz")
        data = load_dataset(str(Path(tmp) / "w1.npz"))
    model = MLP(FEATURES, CLASSES, hidden=HIDDEN)
    params = initial_values(model.variables(), seed=0)
    batches = list(iter_batches(data, np.arange(data.num_train), BATCH))
    steps, started, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        x, y = batches[steps % len(batches)]
        _, grads = model.loss_and_grads(params, (x, y))
        for name, grad in grads.items():
            grad *= LR
            params[name] -= grad
        steps += 1
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    return {"steps_per_s": steps / elapsed, "cpu_ms_per_step": 1e3 * cpu / steps,
            "steps": steps}


# ---- the cluster -------------------------------------------------------------------------

@dataclass
class W1Cluster:
    """A coordinator running the W1 job, its servers and its ps-worker processes."""

    cluster: harness.Cluster
    workers: list[harness.Process]

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def processes(self) -> list[harness.Process]:
        """Every process of the cluster: coordinator, servers, workers (in that order)."""
        return [self.cluster.coordinator, *self.cluster.servers, *self.workers]

    @property
    def roles(self) -> dict[str, list[str]]:
        """Process names by role: {"coordinator": [...], "servers": [...], "workers": [...]}."""
        return {"coordinator": [self.cluster.coordinator.name],
                "servers": [s.name for s in self.cluster.servers],
                "workers": [w.name for w in self.workers]}

    def check_alive(self) -> None:
        for process in self.processes:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with status "
                                   f"{process.popen.returncode} ({harness.thread_census()}):"
                                   f"\n{process.log_tail()}")


@contextlib.contextmanager
def w1_cluster(servers: int, workers: int, shared_memory: bool = True, *,
               evaluate_every: int = 0) -> Iterator[W1Cluster]:
    """The W1 job on a coordinator, `servers` servers and `workers` workers (ids w0, w1, ...)
    each with `blas_threads(workers)` BLAS threads. Stops them all on exit (workers first).
    `shared_memory=False`: servers and workers run with --no-shm (the gRPC path).
    `evaluate_every`: the job's (0: no evaluation, as W1 defines its steps)."""
    no_shm = [] if shared_memory else ["--no-shm"]
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="paramserve-w1-") as tmp:
        data = Path(tmp) / "w1.npz"
        make_data(data)
        job = ["--model", "mlp", "--hidden", ",".join(map(str, HIDDEN)), "--data", str(data),
               "--batch-size", str(BATCH), "--optimizer", "sgd", "--lr", str(LR),
               "--epochs", "1000", "--tasks-per-epoch", str(TASKS_PER_EPOCH),
               "--evaluate-every", str(evaluate_every)]
        with harness.cluster(servers, coordinator_args=job, server_args=no_shm) as c, \
                harness.ProcessGroup(together=True) as group:
            env = worker_environment(workers)
            started = [group.start(f"w{i}", [
                py, "-m", "ps_worker.cli", "--coordinator", c.address, "--worker-id", f"w{i}",
                "--device", "cpu", "--log-level", "warning", *no_shm], env=env)
                for i in range(workers)]
            yield W1Cluster(c, started)


def status(address: str) -> dict:
    from ps_worker.coordinator_client import CoordinatorClient

    with CoordinatorClient(address, give_up_after_s=10.0) as client:
        return client.status()


def wait_all_stepping(w1c: W1Cluster, timeout_s: float = STEPPING_TIMEOUT_S) -> None:
    """Block (bounded) until every worker has completed a train task."""
    wanted = {w.name for w in w1c.workers}
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(w1c.address)
        if s["job"]["state"] not in ("running", "done"):
            raise RuntimeError(f"the job is {s['job']['state']}: {s['job']['failure']}")
        stepping = {w["id"] for w in s["workers"] if w["steps"] > 0}
        if wanted <= stepping:
            return
        w1c.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(wanted - stepping)} completed no step within "
                               f"{timeout_s:g} s")
        time.sleep(0.2)


def sample(w1c: W1Cluster, *, threads: bool = False) -> dict:
    """Steps so far (the job's and each worker's, from the coordinator's status) and the CPU
    of every process of the cluster (`harness.cpu_snapshot`s if `threads`, else seconds)."""
    s = status(w1c.address)
    t = time.monotonic()
    cpu = {p.name: (harness.cpu_snapshot(p.pid) if threads else harness.cpu_seconds(p.pid))
           for p in w1c.processes}
    return {"t": t, "job_state": s["job"]["state"], "steps": s["job"]["steps"],
            "worker_steps": {w["id"]: w["steps"] for w in s["workers"]}, "cpu": cpu}


def measure_window(w1c: W1Cluster, warmup: float, seconds: float, *,
                   threads: bool = False) -> tuple[dict, dict]:
    """`sample`s at the start and the end of `seconds`, after `warmup` seconds. A window in
    which no step was reported yet (workers report steps every few, and a loaded machine
    may be slow) is extended until one is, for at most WINDOW_LIMIT_S. Raises if the job
    stopped running or still no step completed."""
    time.sleep(warmup)
    first = sample(w1c, threads=threads)
    time.sleep(seconds)
    last = sample(w1c, threads=threads)
    while last["steps"] <= first["steps"] and last["t"] - first["t"] < WINDOW_LIMIT_S:
        w1c.check_alive()
        time.sleep(min(seconds, 0.25))
        last = sample(w1c, threads=threads)
    w1c.check_alive()
    if last["job_state"] != "running":
        raise RuntimeError(f"the job is {last['job_state']}, not running, at the end of the "
                           "measured window")
    if last["steps"] <= first["steps"]:
        raise RuntimeError(f"no step completed in the {last['t'] - first['t']:.0f} s measured")
    return first, last


def rates(first: dict, last: dict, workers: int) -> dict:
    """Steps/s over a window: the job's, the mean per worker, and each worker's."""
    elapsed = last["t"] - first["t"]
    steps = last["steps"] - first["steps"]
    each = {w: (n - first["worker_steps"].get(w, 0)) / elapsed
            for w, n in sorted(last["worker_steps"].items())}
    return {"steps": steps, "elapsed_s": elapsed, "steps_per_s": steps / elapsed,
            "per_worker_steps_per_s": steps / elapsed / workers,
            "worker_steps_per_s": each}


def cpu_ms_per_step(first: dict, last: dict) -> dict:
    """CPU ms per step of each process (from `sample`s taken without threads) and in all."""
    steps = last["steps"] - first["steps"]
    each = {name: 1e3 * (last["cpu"][name] - first["cpu"][name]) / steps
            for name in last["cpu"]}
    return {"total": sum(each.values()), "processes": each}


# ---- W1 ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--no-floor", action="store_true",
                        help="over gRPC (--no-shm), skip the floor: W1 on a minimal parameter "
                        "server over bare grpcio (benchmarks/grpc_floor.py)")
    parser.add_argument("--evaluate-every", type=int, default=0, metavar="N",
                        help="the job evaluates its held-out split after every N-th epoch "
                        "(default 0: never, as W1 and the compute-only baseline define a step)")
    parser.add_argument("--compute-only", type=float, metavar="SECONDS", help=argparse.SUPPRESS)
    harness.add_path_flag(parser)
    harness.add_quick_flag(parser)
    args = parser.parse_args(argv)
    if args.compute_only:
        print(json.dumps(compute_only_steps(args.compute_only)))
        return 0
    harness.apply_quick(parser, args, seconds=1.0, warmup=0.5)
    if args.seconds <= 0 or args.warmup < 0 or args.workers < 1 or args.servers < 1 \
            or args.evaluate_every < 0:
        parser.error("--seconds must be > 0, --warmup >= 0, --workers and --servers >= 1, "
                     "--evaluate-every >= 0")
    with harness.bounded(args.seconds * 2 + args.warmup + 240, "W1"):
        baseline = compute_only(min(args.seconds, 10.0), args.workers)
        together = compute_only_together(min(args.seconds, 10.0), args.workers)
        floor = None
        if args.no_shm and not args.no_floor:
            import grpc_floor

            floor = grpc_floor.run(
                ["--workload", "w1", "--seconds", repr(args.seconds), "--warmup",
                 repr(args.warmup), "--servers", str(args.servers), "--workers",
                 str(args.workers)], timeout_s=args.seconds + args.warmup + 300)
        with w1_cluster(args.servers, args.workers, not args.no_shm,
                        evaluate_every=args.evaluate_every) as w1c:
            wait_all_stepping(w1c)
            first, last = measure_window(w1c, args.warmup, args.seconds)
            rss = {s.name: s.peak_rss_bytes() for s in w1c.cluster.servers}
    measured = rates(first, last, args.workers)
    cpu = cpu_ms_per_step(first, last)
    rate, per_worker = measured["steps_per_s"], measured["per_worker_steps_per_s"]
    base = baseline["steps_per_s"]
    lost = 1.0 - per_worker / base
    report_rows = [
        ("model", model_text()),
        ("cluster", f"{args.servers} servers, {args.workers} workers, async, "
                    f"{harness.path_name(args)} path, " + (
                        f"held-out split evaluated every {args.evaluate_every} epoch(s)"
                        if args.evaluate_every else "no evaluation")),
        ("paramserve", f"{rate:.1f} steps/s total, {per_worker:.1f} per worker "
                       f"({measured['steps']} steps in {measured['elapsed_s']:.1f} s)"),
        ("compute only", f"{base:.1f} steps/s (same steps, one process with a worker's "
                         f"share of the cores, {baseline['blas_threads']} BLAS thread(s), "
                         "no server)"),
        ("total ratio", f"{rate / base:.2f}: total steps/s over the compute-only figure"),
        ("cores' ceiling", f"{together['steps_per_s']:.1f} steps/s with {args.workers} "
                           "compute-only processes at once, no server: the cluster reaches "
                           f"{rate / together['steps_per_s']:.2f} of it"),
        ("per worker", f"{per_worker / base:.2f}: {lost:.0%} of each worker step lost to the "
                       f"parameter server ({args.servers} servers and {args.workers} workers "
                       f"share {os.cpu_count()} cores)"),
        ("CPU per step", f"{cpu['total']:.1f} ms over every process of the cluster, beside "
                         f"{baseline['cpu_ms_per_step']:.1f} ms compute only "
                         f"({cpu['total'] / baseline['cpu_ms_per_step']:.2f}x)"),
    ]
    extra = {}
    if floor is not None:
        extra = {"floor": floor, "ratio_to_floor": rate / floor["steps_per_s"],
                 "floor_total_ratio": floor["steps_per_s"] / base}
        report_rows.append((
            "gRPC floor", f"{floor['steps_per_s']:.1f} steps/s on a minimal parameter server "
                          "over bare grpcio (benchmarks/grpc_floor.py: the same MLP steps, one "
                          "unary call of raw bytes per server a step, no checks, no ledger, "
                          f"no retries) = {extra['floor_total_ratio']:.2f}x compute only; "
                          f"{floor['cpu_ms_per_step']:.1f} CPU ms per step = servers "
                          f"{floor['cpu_ms_per_step_by_role']['servers']:.1f} + workers "
                          f"{floor['cpu_ms_per_step_by_role']['workers']:.1f}; paramserve "
                          f"{extra['ratio_to_floor']:.2f}x it"))
    harness.report("W1 dense-mlp", report_rows, {
        "steps_per_s": rate, "per_worker_steps_per_s": per_worker,
        "worker_steps_per_s": measured["worker_steps_per_s"],
        "compute_only_steps_per_s": base, "per_worker_ratio": per_worker / base,
        "total_ratio": rate / base,
        "compute_only_together_steps_per_s": together["steps_per_s"],
        "ratio_to_together": rate / together["steps_per_s"], "cpu_ms_per_step": cpu["total"],
        "cpu_ms_per_step_by_process": cpu["processes"],
        "compute_only_cpu_ms_per_step": baseline["cpu_ms_per_step"],
        "blas_threads": baseline["blas_threads"], "server_peak_rss_bytes": rss,
        "steps": measured["steps"], "elapsed_s": measured["elapsed_s"],
        "path": harness.path_name(args), "evaluate_every": args.evaluate_every, **extra},
        quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
