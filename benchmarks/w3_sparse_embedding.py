"""W3 sparse-emb: an embedding table over the servers; worker processes pull and push rows by id.

W3 of benchmarks/README.md: a 1,000,000 x 64 float32 table (256 MB) declared
with `PSClient.declare_embedding` (cut by id over every server, SGD on the servers), on a
coordinator and `--servers` real ps-server processes; `--workers` worker processes, each its
own PSClient, loop over steps:

    grads    = rows * 0.01                 # fake gradient of this step's rows (a reused buffer)
    next_ids = numpy.random.default_rng(seed).zipf(1.2, 4096) % 1_000_000  # worker and step
    rows     = client.push_pull_rows(table, ids, grads, next_ids, out=buffer)
    ids      = next_ids

`push_pull_rows` pushes the step's gradient (duplicates summed, SGD on the touched rows) and
then pulls the next step's rows (deduplicated), each server in parallel, both in one call per
server over gRPC: the same as `push_rows` followed by `pull_rows`, which `--separate-calls`
runs instead.

Each worker stamps the end of every step (CLOCK_MONOTONIC, shared by the processes); the
benchmark cuts the `--seconds` after `--warmup` into `--slices` slices and reports the
median over them of the total steps/s (every worker) and of the unique rows/s (the distinct
ids of each step, recounted afterwards from the seeds, off the clock). Beside them, measured
in the same run before the cluster starts: the **baseline**, the same steps in one process
and one thread with NumPy on a local table and no server (draw the ids, np.unique, gather,
scatter back into order, the fake gradient, sum the duplicates' gradients with the client's
`sum_duplicates`, SGD on the touched rows), cut into slices the same way; and the ratio,
the figure that travels across machines. Also: CPU ms per step of the servers, the workers
and the coordinator (from /proc, per thread kind), the servers' peak RSS against the table's
bytes, the unique ids per step, the targets (TF ParameterServerStrategy and torch RPC,
measured on this machine kind for this workload) and a check of the values (a row push with
repeated ids read back against NumPy) made before the workers start.

`--no-shm` (every call over gRPC) also runs, before the cluster, the same steps on a minimal
parameter server over bare grpcio (benchmarks/grpc_floor.py, `--no-floor` to skip): the
floor of any parameter server written in Python on grpcio, and paramserve's ratio to it.

`--py-spy`: after the measured window, py-spy samples every server and worker for
`--profile-seconds` more (sampling slows them, hence its own window) and the working samples
are sorted into categories; raw stacks go to benchmarks/out/profile/w3-*.txt.

    python benchmarks/w3_sparse_embedding.py              # shared memory, 20 s after 3 s
    python benchmarks/w3_sparse_embedding.py --no-shm     # every call over gRPC
    python benchmarks/w3_sparse_embedding.py --py-spy     # and where the time goes
    python benchmarks/w3_sparse_embedding.py --quick      # 10,000 x 8, a few seconds: does it run?
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

NAME = "w3"
ROWS, DIM, BATCH = 1_000_000, 64, 4096
ZIPF_A = 1.2
LR = 0.01
GRAD_SCALE = np.float32(0.01)  # the fake gradient: the pulled rows times this
INIT = {"name": "uniform", "minval": -0.05, "maxval": 0.05}
TABLE_SEED = 3
# Measured on this machine kind for this workload (2 servers, 2 workers, 4096 Zipf ids a step).
TF_PS_STEPS_PER_S = 352.0  # TensorFlow ParameterServerStrategy
TORCH_RPC_STEPS_PER_S = 483.0  # torch.distributed.rpc
TARGET_STEPS_PER_S = 725.0  # 1.5x the better of the two (1.5 x 483 = 724.5)
READY = "w3 worker ready"
READY_TIMEOUT_S = 120.0
WARM_STEPS = 3  # each worker's steps before it says it is ready (connections, shared-memory handshakes)
OUT_DIR = harness.REPO_ROOT / "benchmarks" / "out" / "profile"
# Seeds: stream 0 is the baseline's, stream w + 1 worker w's; a stream's warm-up steps
# count from WARM_OFFSET so they never reuse a measured step's ids.
STREAM_BITS = 40
WARM_OFFSET = 1 << 39

# py-spy categories of a W3 step, in front of the shared ones; a sample goes to the
# category of its innermost frame that matches (see harness.classify).
CATEGORIES = [
    ("draw ids (Generator.zipf)", ("zipf", "draw_ids")),
    ("dedup ids (np.unique)", ("dedup (",)),
    ("sum duplicates' gradients (np.add.at)", ("sum_duplicates", "_scatter_add_rows")),
    ("sparse SGD on touched rows (apply_rows)", ("apply_rows", "sparse_optimizers.py")),
    ("server: gather rows (_read_rows)", ("_read_rows",)),
    ("id checks, routing (rows_by_server)",
     ("check_ids", "local_rows", "rows_by_server", "owners_of", "_table (", "_row_ids")),
    # the same name as the shared category, so that their samples add up
    ("finiteness check (grad.sum(float64))", ("all_finite", "check_gradients", "isfinite")),
    ("thread handoff (ThreadPoolExecutor.submit, futures.wait)",
     ("ThreadPoolExecutor.submit", "_run_groups", "concurrent/futures/")),
    ("fake gradient (worker)", ("fake_gradient",)),
    ("client pull_rows/push_rows own lines", ("pull_rows (", "push_rows (", "_pull_rows_from",
                                              "push_pull_rows (", "_push_rows (")),
    ("shared memory (slots, handshakes)", ("shared_memory.py",)),
    *harness.PY_SPY_CATEGORIES,
]


def step_seed(stream: int, step: int) -> int:
    """The seed of `step` of `stream` (0: the baseline, w + 1: worker w)."""
    return (stream << STREAM_BITS) + step


def draw_ids(seed: int, rows: int, batch: int) -> np.ndarray:
    """The ids of one step: `batch` Zipf(1.2) draws modulo `rows`, int64."""
    return np.random.default_rng(seed).zipf(ZIPF_A, batch) % rows


def fake_gradient(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A gradient as cheap as it gets with the pulled rows' shape: rows times a constant, into
    a buffer reused step after step (as a trainer's gradient buffers are). A fresh 1 MiB array
    a step is what glibc's heap may hand back to the kernel at each free and fault in again
    at the next step, depending on the order of the step's other allocations: 240 page
    faults and 0.7 CPU ms a step in the workers, or none, for the same work."""
    return np.multiply(rows, GRAD_SCALE, out=out)


def unique_counts(stream: int, steps: np.ndarray, rows: int, batch: int) -> np.ndarray:
    """Distinct ids of each of `steps` of `stream`, recounted from their seeds."""
    return np.array([len(np.unique(draw_ids(step_seed(stream, int(k)), rows, batch)))
                     for k in steps], dtype=np.int64)


def sliced(times: list[np.ndarray], weights: list[np.ndarray], start: float, stop: float,
           slices: int) -> dict:
    """Steps/s and unique rows/s in each of `slices` equal slices of [start, stop], summed
    over the series (one per worker) of step end times and their unique ids; medians."""
    edges = np.linspace(start, stop, slices + 1)
    width = (stop - start) / slices
    steps = sum(np.histogram(t, edges)[0] for t in times)
    rows = sum(np.histogram(t, edges, weights=w)[0] for t, w in zip(times, weights))
    steps_per_s = (np.asarray(steps) / width).tolist()
    rows_per_s = (np.asarray(rows) / width).tolist()
    return {"steps_per_s": float(np.median(steps_per_s)),
            "unique_rows_per_s": float(np.median(rows_per_s)),
            "slice_steps_per_s": steps_per_s, "slice_unique_rows_per_s": rows_per_s,
            "slice_s": width}


# ---- the baseline: the same steps in one process, no server ------------------------------

def baseline_steps(spec: dict) -> dict:
    """NumPy on a local `rows` x `dim` float32 table in this process (one thread): each step
    draws its ids, deduplicates them (np.unique), gathers the unique rows, scatters them back
    into the ids' order, computes the fake gradient, sums the duplicates' gradients (the
    client's ps_common.rows.sum_duplicates) and applies SGD to the touched rows. Runs
    `warmup` then `seconds`; steps/s and unique rows/s over `slices` slices of the latter."""
    from ps_common.rows import sum_duplicates

    rows, dim, batch = spec["rows"], spec["dim"], spec["batch"]
    table = np.random.default_rng(TABLE_SEED).uniform(-0.05, 0.05, (rows, dim)).astype(np.float32)
    pulled = np.empty((batch, dim), np.float32)
    grad_buffer = np.empty((batch, dim), np.float32)
    lr = np.float32(LR)
    times: list[float] = []
    uniques: list[int] = []
    draw_s = 0.0
    started = time.monotonic()
    measure_from = started + spec["warmup"]
    stop = measure_from + spec["seconds"]
    cpu0 = None
    step = 0
    while True:
        t0 = time.monotonic()
        if t0 >= stop:
            break
        if cpu0 is None and t0 >= measure_from:
            cpu0, steps0 = time.process_time(), step
        ids = draw_ids(step_seed(0, step), rows, batch)
        t1 = time.monotonic()
        unique, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(-1)
        gathered = table[unique]
        np.take(gathered, inverse, axis=0, out=pulled)
        grads = fake_gradient(pulled, grad_buffer)
        summed = sum_duplicates(grads, inverse, len(unique))
        summed *= lr
        table[unique] -= summed
        end = time.monotonic()
        step += 1
        if t0 >= measure_from:
            draw_s += t1 - t0
            times.append(end)
            uniques.append(len(unique))
    cpu = time.process_time() - cpu0 if cpu0 is not None else 0.0
    measured = max(1, step - steps0) if cpu0 is not None else 1
    result = sliced([np.array(times)], [np.array(uniques, dtype=np.float64)], measure_from,
                    stop, spec["slices"])
    return {**result, "steps": len(times), "cpu_ms_per_step": 1e3 * cpu / measured,
            # Below ~1.0: it did not have a core to itself (other work on the machine).
            "cpu_share": cpu / spec["seconds"],
            "draw_ms_per_step": 1e3 * draw_s / max(1, len(times)),
            "unique_ids_per_step_median": float(np.median(uniques)) if uniques else 0.0}


def baseline(spec: dict) -> dict:
    """`baseline_steps` in a child process with one thread for BLAS/OpenMP (so that
    nothing else of this process's state, or a thread pool, helps or hinders it)."""
    env = {**os.environ, **{k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                             "MKL_NUM_THREADS")}}
    out = subprocess.run(
        [sys.executable, __file__, "--baseline-spec", json.dumps(spec)], cwd=harness.REPO_ROOT,
        env=env, capture_output=True, text=True,
        timeout=spec["warmup"] + spec["seconds"] + 300, check=True).stdout
    return json.loads(out.splitlines()[-1])


# ---- a worker process ----------------------------------------------------------------------

def worker_main(spec: dict) -> int:
    """One worker: its own PSClient; WARM_STEPS steps, then READY on stdout; waits for the
    go file, steps until the stop file appears (or the deadline), then writes the end time
    of every step (and its data paths, its peak RSS) to its result file as JSON."""
    from ps_worker import PSClient

    index, rows, dim, batch = spec["index"], spec["rows"], spec["dim"], spec["batch"]
    stream = index + 1
    go, stop = Path(spec["go"]), Path(spec["stop"])
    kwargs = {} if spec["shared_memory"] else {"shared_memory": False}
    with PSClient(spec["coordinator"], client_id=f"w3-w{index}-{os.getpid()}",
                  **kwargs) as client:
        out = np.empty((batch, dim), np.float32)
        grad_buffer = np.empty((batch, dim), np.float32)
        ids = draw_ids(step_seed(stream, WARM_OFFSET), rows, batch)
        pulled = client.pull_rows(NAME, ids, out=out)

        def one_step(seed: int) -> None:
            """Push the gradient of the rows in hand; pull the rows of the ids of `seed`."""
            nonlocal ids, pulled
            grads = fake_gradient(pulled, grad_buffer)
            next_ids = draw_ids(seed, rows, batch)
            if spec["separate_calls"]:
                client.push_rows(NAME, ids, grads)
                pulled = client.pull_rows(NAME, next_ids, out=out)
            else:
                pulled = client.push_pull_rows(NAME, ids, grads, next_ids, out=out)
            ids = next_ids

        for k in range(1, WARM_STEPS + 1):
            one_step(step_seed(stream, WARM_OFFSET + k))
        print(READY, flush=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no go file {go} within {READY_TIMEOUT_S:g} s")
            time.sleep(0.002)
        deadline = time.monotonic() + spec["max_seconds"]
        times: list[float] = []
        step = 0
        while not stop.exists() and time.monotonic() < deadline:
            one_step(step_seed(stream, step))
            times.append(time.monotonic())
            step += 1
        paths = client.data_paths
    result = {"times": times, "paths": paths, "peak_rss_bytes": harness.peak_rss_bytes()}
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(spec["result"])
    return 0


# ---- the values check --------------------------------------------------------------------

def check_values(client, rows: int, dim: int) -> dict:
    """Pull rows with repeated ids, push a gradient for them, pull again: every row must be
    its old value less lr times the sum of its ids' gradients (NumPy's np.add.at)."""
    ids = np.array([1, 5, 1, rows - 1, 2, 5, 1, 0], np.int64)
    before = client.pull_rows(NAME, ids)
    grads = np.random.default_rng(0).standard_normal((len(ids), dim)).astype(np.float32)
    client.push_rows(NAME, ids, grads)
    after = client.pull_rows(NAME, ids)
    unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    summed = np.zeros((len(unique), dim), np.float32)
    np.add.at(summed, inverse, grads)
    expected = before[first] - np.float32(LR) * summed
    repeats_equal = bool((before == before[first][inverse]).all())
    ok = repeats_equal and bool(np.allclose(after, expected[inverse], rtol=1e-5, atol=1e-6))
    in_init_range = bool((np.abs(before) <= 0.05).all())
    return {"ok": ok and in_init_range, "repeats_equal": repeats_equal,
            "in_init_range": in_init_range, "ids": ids.tolist()}


# ---- the run -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0,
                   help="measured seconds, after the warm-up (default 20)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds of steps before the measured ones (default 3)")
    p.add_argument("--slices", type=int, default=10,
                   help="the measured seconds are cut in this many slices; figures are "
                   "medians over them (default 10)")
    p.add_argument("--baseline-seconds", type=float, default=10.0,
                   help="measured seconds of the baseline, after --warmup (default 10)")
    p.add_argument("--rows", type=int, default=ROWS, help=f"table rows (default {ROWS:,})")
    p.add_argument("--dim", type=int, default=DIM, help=f"row length (default {DIM})")
    p.add_argument("--batch", type=int, default=BATCH,
                   help=f"ids drawn per step (default {BATCH})")
    p.add_argument("--servers", type=int, default=2, help="servers (default 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--separate-calls", action="store_true",
                   help="push_rows then pull_rows, two calls per server a step, instead of "
                   "push_pull_rows (one)")
    p.add_argument("--no-floor", action="store_true",
                   help="over gRPC (--no-shm), skip the floor: W3 on a minimal parameter "
                   "server over bare grpcio (benchmarks/grpc_floor.py)")
    p.add_argument("--py-spy", action="store_true",
                   help="after the measured window, sample every server and worker with "
                   "py-spy for --profile-seconds and sort the samples into categories")
    p.add_argument("--profile-seconds", type=float, default=10.0,
                   help="seconds py-spy samples (default 10)")
    p.add_argument("--rate", type=int, default=100,
                   help="py-spy samples per second per process (default 100)")
    p.add_argument("--worker-spec", help=argparse.SUPPRESS)
    p.add_argument("--baseline-spec", help=argparse.SUPPRESS)
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    return p


def grpc_floor(args) -> dict:
    """W3's steps on a minimal parameter server over bare grpcio (benchmarks/grpc_floor.py),
    with the same servers, workers, table, ids and window, in a child process: the fastest a
    parameter server written in Python on grpcio goes here, promises aside."""
    import grpc_floor as floor

    return floor.run(["--workload", "w3", "--seconds", repr(args.seconds),
                      "--warmup", repr(args.warmup), "--slices", str(args.slices),
                      "--rows", str(args.rows), "--dim", str(args.dim),
                      "--batch", str(args.batch), "--servers", str(args.servers),
                      "--workers", str(args.workers)],
                     timeout_s=args.warmup + args.seconds + 300)


def start_workers(group: harness.ProcessGroup, address: str, args, tmp: Path) -> list[dict]:
    """Start the worker processes and wait (bounded) until each has said READY."""
    from ps_worker.cluster import worker_environment

    env = worker_environment(args.workers)
    workers = []
    for i in range(args.workers):
        spec = {"index": i, "coordinator": address, "rows": args.rows, "dim": args.dim,
                "batch": args.batch, "shared_memory": not args.no_shm,
                "separate_calls": args.separate_calls,
                "go": str(tmp / "go"), "stop": str(tmp / "stop"),
                "result": str(tmp / f"w{i}.json"),
                "max_seconds": args.warmup + args.seconds + args.profile_seconds + 300}
        process = group.start(f"w{i}", [sys.executable, __file__, "--worker-spec",
                                        json.dumps(spec)], env=env)
        workers.append({"process": process, "spec": spec})
    for worker in workers:
        worker["process"].wait_for_log(READY, READY_TIMEOUT_S)
    return workers


def check_alive(processes: list[harness.Process]) -> None:
    for process in processes:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with status {process.popen.returncode}:"
                               f"\n{process.log_tail()}")


def sleep_until(t: float, processes: list[harness.Process]) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        check_alive(processes)
        time.sleep(min(left, 0.25))


def snapshot(processes: list[harness.Process]) -> dict:
    return {p.name: harness.cpu_snapshot(p.pid) for p in processes}


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy so far (/proc/stat: all but idle
    and iowait), to tell the cluster's CPU from other work on a shared machine."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / harness.CLOCK_TICKS


def profile(processes: list[harness.Process], args) -> tuple[dict[str, Path], float, float]:
    """py-spy on each of `processes` for --profile-seconds (after 1 s to attach); returns
    the raw stack files and the window sampled."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    spies = []
    try:
        for process in processes:
            files[process.name] = OUT_DIR / f"w3-{harness.path_name(args)}-{process.name}.txt"
            files[process.name].unlink(missing_ok=True)
            spies.append(harness.start_py_spy(process.pid, files[process.name], args.rate))
        sleep_until(time.monotonic() + 1.0, processes)
        start = time.monotonic()
        sleep_until(start + args.profile_seconds, processes)
        return files, start, time.monotonic()
    finally:
        for spy in spies:
            harness.stop_py_spy(spy)


def run(args) -> dict:
    """The baseline, then the cluster: values check, workers, the measured window (and the
    py-spy one). Returns the raw figures."""
    from ps_worker import PSClient

    base = baseline({"rows": args.rows, "dim": args.dim, "batch": args.batch,
                     "warmup": args.warmup, "seconds": args.baseline_seconds,
                     "slices": args.slices})
    out: dict = {"baseline": base}
    if args.no_shm and not args.no_floor:
        out["floor"] = grpc_floor(args)
    with tempfile.TemporaryDirectory(prefix="paramserve-w3-") as tmp_name, \
            harness.cluster(args.servers, server_args=harness.no_shm_args(args),
                            log_level="warning") as c, \
            harness.ProcessGroup(together=True) as group:
        tmp = Path(tmp_name)
        out["server_idle_rss_bytes"] = {s.name: s.rss_bytes() for s in c.servers}
        with PSClient(c.address, **harness.client_path_args(args)) as client:
            t0 = time.monotonic()
            client.declare_embedding(NAME, args.dim, args.rows, init=INIT,
                                     optimizer={"name": "sgd", "lr": LR}, seed=TABLE_SEED)
            out["declare_s"] = time.monotonic() - t0
            out["check"] = check_values(client, args.rows, args.dim)
        out["server_declared_rss_bytes"] = {s.name: s.rss_bytes() for s in c.servers}
        workers = start_workers(group, c.address, args, tmp)
        processes = [c.coordinator, *c.servers, *(w["process"] for w in workers)]
        go = time.monotonic()
        (tmp / "go").touch()
        sleep_until(go + args.warmup, processes)
        start, first, busy0 = time.monotonic(), snapshot(processes), machine_busy_s()
        sleep_until(start + args.seconds, processes)
        stop, last, busy1 = time.monotonic(), snapshot(processes), machine_busy_s()
        if args.py_spy:
            out["py_spy_files"], p_start, p_stop = profile(
                [*c.servers, *(w["process"] for w in workers)], args)
        (tmp / "stop").touch()
        for worker in workers:
            try:  # it finishes its step, writes its result and exits
                worker["process"].popen.wait(timeout=60.0)
            except subprocess.TimeoutExpired:
                pass
            status = worker["process"].stop()  # SIGTERM, SIGKILL if it is still running
            result = Path(worker["spec"]["result"])
            if not result.exists():
                raise RuntimeError(f"{worker['process'].name} wrote no result (exit status "
                                   f"{status}):\n{worker['process'].log_tail()}")
            worker["result"] = json.loads(result.read_text())
        out["server_peak_rss_bytes"] = {s.name: s.peak_rss_bytes() for s in c.servers}
    out["window"] = {"start": start, "stop": stop}
    out["machine_cores_busy"] = (busy1 - busy0) / (stop - start)
    out["cpu"] = {"first": first, "last": last}
    out["roles"] = {"coordinator": ["coordinator"],
                    "servers": [f"s{i}" for i in range(args.servers)],
                    "workers": [f"w{i}" for i in range(args.workers)]}
    out["workers"] = [{"name": w["process"].name, **w["result"]} for w in workers]
    if args.py_spy:
        out["py_spy_window"] = {"start": p_start, "stop": p_stop}
    return out


def figures(args, raw: dict) -> dict:
    """Steps, unique rows and CPU per step over the measured window, from the raw run."""
    start, stop = raw["window"]["start"], raw["window"]["stop"]
    times, weights, worker_rates, uniques = [], [], {}, []
    for i, worker in enumerate(raw["workers"]):
        t = np.asarray(worker["times"])
        inside = np.flatnonzero((t >= start) & (t < stop))
        counts = unique_counts(i + 1, inside, args.rows, args.batch)
        times.append(t[inside])
        weights.append(counts.astype(np.float64))
        uniques.append(counts)
        worker_rates[worker["name"]] = len(inside) / (stop - start)
    result = sliced(times, weights, start, stop, args.slices)
    steps = sum(len(t) for t in times)
    if steps == 0:
        raise RuntimeError(f"no step completed in the {stop - start:.1f} s measured")
    all_uniques = np.concatenate(uniques)
    cpu = {name: harness.cpu_delta(raw["cpu"]["first"][name], raw["cpu"]["last"][name], steps)
           for name in raw["cpu"]["last"]}
    by_role = {role: sum(cpu[n]["cpu_ms"] for n in names) for role, names in raw["roles"].items()}
    total = sum(c["cpu_ms"] for c in cpu.values())
    record = {**result, "steps": steps, "elapsed_s": stop - start,
              "mean_steps_per_s": steps / (stop - start), "worker_steps_per_s": worker_rates,
              "unique_ids_per_step_median": float(np.median(all_uniques)),
              "unique_ids_per_step_mean": float(np.mean(all_uniques)),
              "cpu_ms_per_step": total, "cpu_ms_per_step_by_role": by_role,
              "cpu_ms_per_step_by_process": {n: c["cpu_ms"] for n, c in cpu.items()},
              "cpu_by_process": cpu, "cores_busy": total * steps / (stop - start) / 1e3,
              "machine_cores_busy": raw["machine_cores_busy"]}
    if "py_spy_window" in raw:
        p0, p1 = raw["py_spy_window"]["start"], raw["py_spy_window"]["stop"]
        sampled = sum(int(((np.asarray(w["times"]) >= p0) & (np.asarray(w["times"]) < p1)).sum())
                      for w in raw["workers"])
        record["py_spy_steps_per_s"] = sampled / (p1 - p0)
    return record


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.worker_spec:
        return worker_main(json.loads(args.worker_spec))
    if args.baseline_spec:
        print(json.dumps(baseline_steps(json.loads(args.baseline_spec))))
        return 0
    harness.apply_quick(p, args, rows=10_000, dim=8, seconds=1.0, warmup=0.3, slices=2,
                        baseline_seconds=0.5, profile_seconds=1.0)
    if (args.seconds <= 0 or args.warmup < 0 or args.slices < 1 or args.baseline_seconds <= 0
            or args.rows < 2 or args.dim < 1 or args.batch < 1 or args.servers < 1
            or args.workers < 1 or args.profile_seconds <= 0 or args.rate < 1):
        p.error("--seconds, --baseline-seconds, --profile-seconds must be > 0, --warmup >= 0; "
                "--slices, --dim, --batch, --servers, --workers, --rate >= 1; --rows >= 2")
    if args.py_spy and not harness.py_spy_available():
        p.error("--py-spy: py-spy is not installed (pip install py-spy)")
    table_bytes = args.rows * args.dim * 4
    if 4 * table_bytes + 2**30 > harness.mem_available_bytes():
        p.error(f"a {args.rows:,} x {args.dim} table needs about "
                f"{harness.mib(4 * table_bytes + 2**30)} of memory (baseline and servers)")
    bound = (2 * args.warmup + args.baseline_seconds + args.seconds
             + (args.profile_seconds + 60 if args.py_spy else 0) + 300)
    with harness.bounded(bound, "W3"):
        raw = run(args)
    fig = figures(args, raw)
    base = raw["baseline"]
    rate, rows_rate = fig["steps_per_s"], fig["unique_rows_per_s"]
    ratio = rate / base["steps_per_s"]
    roles = fig["cpu_ms_per_step_by_role"]
    peak = raw["server_peak_rss_bytes"]
    idle = raw["server_idle_rss_bytes"]
    paths = {w["name"]: sorted(set(w["paths"].values())) for w in raw["workers"]}
    table_per_server = table_bytes / args.servers
    record: dict = {
        "path": harness.path_name(args), "separate_calls": args.separate_calls,
        "rows": args.rows, "dim": args.dim,
        "batch": args.batch, "servers": args.servers, "workers": args.workers,
        "table_bytes": table_bytes, **{k: v for k, v in fig.items() if k != "cpu_by_process"},
        "cpu_by_process": fig["cpu_by_process"],
        "baseline": base, "ratio_to_baseline": ratio,
        "tf_ps_steps_per_s": TF_PS_STEPS_PER_S, "torch_rpc_steps_per_s": TORCH_RPC_STEPS_PER_S,
        "target_steps_per_s": TARGET_STEPS_PER_S, "target_met": rate >= TARGET_STEPS_PER_S,
        "server_idle_rss_bytes": idle,
        "server_declared_rss_bytes": raw["server_declared_rss_bytes"],
        "server_peak_rss_bytes": peak,
        "server_peak_over_table": sum(peak.values()) / table_bytes,
        "server_peak_above_idle_over_table": (sum(peak.values()) - sum(idle.values()))
        / table_bytes,
        "worker_peak_rss_bytes": {w["name"]: w["peak_rss_bytes"] for w in raw["workers"]},
        "worker_data_paths": paths, "declare_s": raw["declare_s"], "check": raw["check"],
        "values_ok": raw["check"]["ok"]}
    floor = raw.get("floor")
    if floor is not None:
        record["floor"] = floor
        record["ratio_to_floor"] = rate / floor["steps_per_s"]

    each = ", ".join(f"{w} {r:.1f}" for w, r in fig["worker_steps_per_s"].items())
    slices = ", ".join(f"{r:.0f}" for r in fig["slice_steps_per_s"])
    rows = [
        ("path", f"{harness.path_name(args)}: workers' data paths "
                 + "; ".join(f"{w} {'/'.join(v)}" for w, v in paths.items())
                 + (" (servers and clients --no-shm: every call over gRPC)" if args.no_shm
                    else " (servers on this host offer shared memory)")),
        ("table", (f"{args.rows:,} x {args.dim} float32 = {table_bytes / 1e6:,.0f} MB "
                  f"({harness.mib(table_bytes)}), uniform +-0.05, sgd lr {LR}, cut by id over "
                  f"{args.servers} servers (declared in {raw['declare_s']:.1f} s)")),
        ("workload", (f"{args.workers} worker processes, each step: {args.batch} ids "
                     f"zipf({ZIPF_A}) % {args.rows:,}; grad = the step's rows x "
                     f"{float(GRAD_SCALE):g}; "
                     + ("push_rows, then pull_rows of the next step's ids"
                        if args.separate_calls else
                        "push_pull_rows: the push, and the next step's ids' rows back")
                     + f"; {os.cpu_count()} cores")),
        ("paramserve", (f"{rate:.1f} steps/s total (median of {args.slices} slices of "
                       f"{fig['slice_s']:.1f} s: {slices}); {fig['steps']} steps in "
                       f"{fig['elapsed_s']:.1f} s after {args.warmup:g} s warm-up; per worker "
                       f"{each}")),
        ("unique rows", (f"{rows_rate:,.0f} unique rows/s (median over slices); "
                        f"{fig['unique_ids_per_step_median']:.0f} unique ids per step "
                        f"(median; mean {fig['unique_ids_per_step_mean']:.1f}) of {args.batch}")),
        ("baseline", (f"{base['steps_per_s']:.1f} steps/s, {base['unique_rows_per_s']:,.0f} "
                     "unique rows/s (the same steps: draw, np.unique, gather, scatter back, "
                     "grad, sum duplicates, SGD, with NumPy on a local table in one process, "
                     f"one thread, no server; {base['cpu_ms_per_step']:.2f} CPU ms per step, "
                     f"of which drawing the ids {base['draw_ms_per_step']:.2f} ms; it had "
                     f"{base['cpu_share']:.2f} of a core)")),
        ("ratio", (f"{ratio:.2f}x the baseline's steps/s (the figure that travels across "
                  "machines)")),
        *([] if floor is None else [
            ("gRPC floor", (f"{floor['steps_per_s']:.1f} steps/s on a minimal parameter server "
                           "over bare grpcio (benchmarks/grpc_floor.py: the same steps, one "
                           "unary call of raw bytes per server a step, no checks, no ledger, "
                           "no retries), measured before the cluster; "
                           f"{floor['cpu_ms_per_step']:.2f} CPU ms per step = servers "
                           f"{floor['cpu_ms_per_step_by_role']['servers']:.2f} + workers "
                           f"{floor['cpu_ms_per_step_by_role']['workers']:.2f}; paramserve "
                           f"{record['ratio_to_floor']:.2f}x it; the floor "
                           f"{floor['steps_per_s'] / TARGET_STEPS_PER_S:.2f} of the target"))]),
        ("targets", (f"TF ParameterServerStrategy {TF_PS_STEPS_PER_S:g} steps/s "
                    f"({rate / TF_PS_STEPS_PER_S:.2f}x), torch RPC {TORCH_RPC_STEPS_PER_S:g} "
                    f"steps/s ({rate / TORCH_RPC_STEPS_PER_S:.2f}x), measured on this machine "
                    f"kind; target >= {TARGET_STEPS_PER_S:.0f} steps/s (1.5x the better): "
                    f"{'met' if record['target_met'] else 'not met'} "
                    f"({rate / TARGET_STEPS_PER_S:.2f} of it)")),
        ("CPU per step", (f"{fig['cpu_ms_per_step']:.2f} ms over every process = servers "
                         f"{roles['servers']:.2f} + workers {roles['workers']:.2f} + "
                         f"coordinator {roles['coordinator']:.2f}; the baseline's step "
                         f"{base['cpu_ms_per_step']:.2f} ms")),
        ("cores busy", (f"{fig['cores_busy']:.2f} of {os.cpu_count()} by the cluster; "
                        f"{fig['machine_cores_busy']:.2f} by the whole machine in the window "
                        "(the rest: this script and any other work)")),
    ]
    for name, c in fig["cpu_by_process"].items():
        kinds = ", ".join(f"{k.split(' (')[0]} {ms:.2f}"
                          for k, ms in c["by_thread_kind_ms"].items())
        rows.append((f"  {name}", (f"{c['cpu_ms']:.2f} ms (user {c['user_ms']:.2f} + sys "
                                  f"{c['sys_ms']:.2f}; {kinds}; {c['minor_faults']:,.1f} minor "
                                  "faults)")))
    rows += [
        ("server peak RSS", (f"{harness.mib(sum(peak.values()))} over {args.servers} servers "
                            f"({', '.join(harness.mib(v) for v in peak.values())}) = "
                            f"{record['server_peak_over_table']:.2f}x the table's "
                            f"{harness.mib(table_bytes)} ({harness.mib(table_per_server)} a "
                            f"server); above idle ({harness.mib(sum(idle.values()))}): "
                            f"{record['server_peak_above_idle_over_table']:.2f}x")),
        ("worker peak RSS", ", ".join(f"{w} {harness.mib(v)}" for w, v in
                                      record["worker_peak_rss_bytes"].items())),
        ("values", (f"{'OK' if record['values_ok'] else 'WRONG'}: a push with repeated ids "
                   "read back against NumPy, before the workers started")),
    ]
    if args.py_spy:
        record["profiled_with"] = "py-spy"
        record["py_spy"] = {}
        rows.append(("py-spy window", (f"{fig['py_spy_steps_per_s']:.1f} steps/s while "
                                      f"{len(raw['py_spy_files'])} processes were sampled at "
                                      f"{args.rate}/s each (the rows below come from it)")))
        for name, path in raw["py_spy_files"].items():
            prof = harness.classify(harness.read_stacks(path), CATEGORIES)
            record["py_spy"][name] = prof
            working = prof["working_samples"] or 1
            rows.append((f"{name} py-spy", (f"{prof['working_samples']} working samples "
                                           f"({prof['idle_samples']} waiting, dropped)")))
            for category, count in prof["categories"].items():
                rows.append((f"  {category}", f"{100 * count / working:5.1f} %"))
        for name in raw["py_spy_files"]:  # before the report: its JSON line stays last
            print(f"-- {name}: innermost Python frame -> native leaf (working samples)")
            for frame, count in record["py_spy"][name]["top_frames"].items():
                print(f"  {count:6d}  {frame}")
        print(f"raw stacks: {', '.join(str(f) for f in raw['py_spy_files'].values())}")
    harness.report("W3 sparse-emb", rows, record, quick=args.quick)
    return 0 if record["values_ok"] else 1


if __name__ == "__main__":
    harness.run_main(main)
