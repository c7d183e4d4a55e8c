"""The floor over gRPC: W1's or W3's steps on a minimal parameter server over bare grpcio.

What the leanest parameter server written in Python on grpcio does with a workload's steps,
measured the same way as paramserve: the fastest any library built like paramserve (Python
over grpcio) could go, and so what a target over gRPC can be held against. It keeps none of
paramserve's promises: no check of ids, shapes or finiteness, no exactly-once ledger, no
shard map or epochs, no retries, no consistent reads, no metrics (its calls do carry a
deadline, as paramserve's do). Each worker step is one unary call per server, raw bytes in
and out (identity serializers, no protobuf), the first made in the worker's thread and the
others in a thread pool, as PSClient makes them.

- `--workload w3` (the default): each server holds the rows whose `id % servers` is its index
  (cheaper than paramserve's hash); a call carries the summed gradient rows of the step's
  distinct ids and the next step's distinct ids, and is answered with those rows (as
  `push_pull_rows`: the push applied, then the next rows read). The workers do the same NumPy
  work as paramserve's client: draw the ids, deduplicate them (once a step: the pull's
  `np.unique` serves the push that follows), sum the duplicates' gradients with the client's
  `sum_duplicates`, scatter the rows back into the ids' order.
- `--workload w1`: W1's MLP variables placed whole (largest first, to the emptiest server);
  a call carries the gradient of the server's variables and is answered with their values
  after SGD; the workers compute the MLP's forward and backward on the batches of W1's
  compute-only baseline.

    python benchmarks/grpc_floor.py                   # W3: 2 servers, 2 workers, 20 s after 3 s
    python benchmarks/grpc_floor.py --workload w1     # W1
    python benchmarks/grpc_floor.py --quick           # a few seconds: does it run?

`w1_dense_mlp.py --no-shm` and `w3_sparse_embedding.py --no-shm` run it before their cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bare_grpc
import harness
import w1_dense_mlp as w1
import w3_sparse_embedding as w3

METHOD = "/floor.MinimalPS/PushThenPull"
READY = "floor worker ready"
_COUNTS = struct.Struct("<qq")  # distinct ids pushed, distinct ids pulled
# Bounded, as every wait in the benchmarks: a worker that cannot reach a server gives up.
CONNECT_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0
OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
           ("grpc.max_send_message_length", 64 * 1024 * 1024)]


def _identity(data: bytes) -> bytes:
    return data


# ---- W3: rows of an embedding table ---------------------------------------------------

def local_rows(index: int, servers: int, rows: int) -> int:
    """Rows held by server `index`: the ids i < rows with i % servers == index."""
    return (rows - index + servers - 1) // servers


def w3_handler(index: int, spec: dict):
    """Server `index`'s answer to a step: SGD on the pushed rows, then the asked rows."""
    servers, dim = spec["servers"], spec["dim"]
    rng = np.random.default_rng(w3.TABLE_SEED + index)
    table = rng.uniform(-0.05, 0.05,
                        (local_rows(index, servers, spec["rows"]), dim)).astype(np.float32)
    lr = np.float32(w3.LR)

    def push_then_pull(request: bytes, context) -> bytes:
        pushed, pulled = _COUNTS.unpack_from(request)
        offset = _COUNTS.size
        ids = np.frombuffer(request, np.int64, pushed, offset)
        offset += ids.nbytes
        grads = np.frombuffer(request, np.float32, pushed * dim, offset).reshape(pushed, dim)
        offset += grads.nbytes
        next_ids = np.frombuffer(request, np.int64, pulled, offset)
        if pushed:
            table[ids // servers] -= lr * grads  # the ids are distinct: no sum needed here
        return table[next_ids // servers].tobytes()

    return push_then_pull


def w3_steps(spec: dict, call_all):
    """A worker's step: `one_step(step)` pushes the rows in hand and pulls the next ones."""
    from ps_common.rows import sum_duplicates

    servers, rows, dim, batch = spec["servers"], spec["rows"], spec["dim"], spec["batch"]
    stream = spec["index"] + 1
    out = np.empty((batch, dim), np.float32)
    grad_buffer = np.empty((batch, dim), np.float32)
    no_ids, no_rows = np.empty(0, np.int64), np.empty((0, dim), np.float32)
    held = None  # (distinct ids, inverse, each server's mask of them) of the rows in `out`

    def one_step(step: int) -> None:
        nonlocal held
        next_ids = w3.draw_ids(w3.step_seed(stream, step), rows, batch)
        next_unique, next_inverse = np.unique(next_ids, return_inverse=True)
        next_owner = next_unique % servers
        next_masks = [next_owner == k for k in range(servers)]
        if held is None:
            pushes = [(no_ids, no_rows)] * servers
        else:
            unique, inverse, masks = held
            summed = sum_duplicates(w3.fake_gradient(out, grad_buffer), inverse, len(unique))
            pushes = [(unique[mask], summed[mask]) for mask in masks]
        answers = call_all([b"".join((_COUNTS.pack(len(ids), int(np.count_nonzero(mask))),
                                      ids.tobytes(), grads.tobytes(),
                                      next_unique[mask].tobytes()))
                            for (ids, grads), mask in zip(pushes, next_masks)])
        gathered = np.empty((len(next_unique), dim), np.float32)
        for mask, answer in zip(next_masks, answers):
            gathered[mask] = np.frombuffer(answer, np.float32).reshape(-1, dim)
        next_inverse = next_inverse.reshape(-1)
        np.take(gathered, next_inverse, axis=0, out=out)
        held = (next_unique, next_inverse, next_masks)

    return one_step, w3.WARM_OFFSET


# ---- W1: a dense MLP -------------------------------------------------------------------

def w1_placement(servers: int) -> list[list[str]]:
    """The MLP's variables of each server: whole variables, largest first, each to the
    server holding the fewest bytes (as paramserve places small variables)."""
    from ps_worker.models import MLP

    held: list[list[str]] = [[] for _ in range(servers)]
    sizes = [0] * servers
    variables = MLP(w1.FEATURES, w1.CLASSES, hidden=w1.HIDDEN).variables()
    for var in sorted(variables, key=lambda v: -int(np.prod(v.shape))):
        k = sizes.index(min(sizes))
        held[k].append(var.name)
        sizes[k] += int(np.prod(var.shape))
    return held


def w1_handler(index: int, spec: dict):
    """Server `index`'s answer to a step: SGD with the pushed gradient of its variables
    (back to back in placement order; none on a worker's first call), then their values."""
    from ps_worker.models import MLP, initial_values

    names = w1_placement(spec["servers"])[index]
    initial = initial_values(MLP(w1.FEATURES, w1.CLASSES, hidden=w1.HIDDEN).variables(), seed=0)
    values = np.concatenate([initial[n].astype(np.float32).ravel() for n in names])
    lr = np.float32(w1.LR)

    def push_then_pull(request: bytes, context) -> bytes:
        if request:
            values[:] -= lr * np.frombuffer(request, np.float32, values.size)
        return values.tobytes()

    return push_then_pull


def w1_steps(spec: dict, call_all):
    """A worker's step: push the gradient of the values in hand, get the new values, compute
    the next gradient on the next batch (the model and data of W1's compute-only baseline)."""
    from ps_worker.data import iter_batches, load_dataset
    from ps_worker.models import MLP

    placement = w1_placement(spec["servers"])
    model = MLP(w1.FEATURES, w1.CLASSES, hidden=w1.HIDDEN)
    shapes = {v.name: tuple(v.shape) for v in model.variables()}
    with tempfile.TemporaryDirectory() as tmp:
        w1.make_data(Path(tmp) / "w1.npz")
        data = load_dataset(str(Path(tmp) / "w1.npz"))
    batches = list(iter_batches(data, np.arange(data.num_train), w1.BATCH))
    grads: dict | None = None

    def one_step(step: int) -> None:
        nonlocal grads
        answers = call_all([b"" if grads is None else
                            b"".join(grads[n].astype(np.float32, copy=False).tobytes()
                                     for n in names) for names in placement])
        params = {}
        for names, answer in zip(placement, answers):
            offset = 0
            for n in names:
                count = int(np.prod(shapes[n]))
                params[n] = np.frombuffer(answer, np.float32, count, offset).reshape(shapes[n])
                offset += 4 * count
        _, grads = model.loss_and_grads(params, batches[step % len(batches)])

    return one_step, 0


WORKLOADS = {"w3": (w3_handler, w3_steps), "w1": (w1_handler, w1_steps)}


# ---- a server and a worker process -----------------------------------------------------

def serve(index: int, spec: dict) -> int:
    """Serve server `index`'s part of spec["workload"] until SIGTERM; prints `listening on
    HOST:PORT`."""
    handler = WORKLOADS[spec["workload"]][0](index, spec)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    service, method = METHOD.split("/")[1:]
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
        method: grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=_identity, response_serializer=_identity)})])
    bound = server.add_insecure_port(f"{harness.HOST}:0")
    return bare_grpc.serve_until_signalled(server,
                                           f"minimal-ps listening on {harness.HOST}:{bound}")


def work(spec: dict) -> int:
    """Warm up, say READY, wait for the go file, which holds the time (CLOCK_MONOTONIC,
    shared by the processes) to step until; then write every step's end time to
    spec["result"]."""
    channels = [grpc.insecure_channel(a, options=OPTIONS) for a in spec["addresses"]]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
    calls = [c.unary_unary(METHOD, request_serializer=_identity,
                           response_deserializer=_identity) for c in channels]
    pool = futures.ThreadPoolExecutor(max_workers=max(1, len(calls) - 1))

    def call_all(requests: list[bytes]) -> list[bytes]:
        """One call per server, all at once: the first in this thread, as PSClient does."""
        others = [pool.submit(call, request, timeout=CALL_TIMEOUT_S)
                  for call, request in zip(calls[1:], requests[1:])]
        return [calls[0](requests[0], timeout=CALL_TIMEOUT_S), *(f.result() for f in others)]

    one_step, warm_offset = WORKLOADS[spec["workload"]][1](spec, call_all)
    for k in range(w3.WARM_STEPS):
        one_step(warm_offset + k)
    print(READY, flush=True)
    go = Path(spec["go"])
    deadline = time.monotonic() + w3.READY_TIMEOUT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {go} within {w3.READY_TIMEOUT_S:g} s")
        time.sleep(0.002)
    stop = float(go.read_text())
    times: list[float] = []
    step = 0
    while time.monotonic() < stop:
        one_step(step)
        times.append(time.monotonic())
        step += 1
    pool.shutdown()
    for channel in channels:
        channel.close()
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps({"times": times}))
    tmp.rename(spec["result"])
    return 0


# ---- the run ---------------------------------------------------------------------------

def measure(workload: dict, *, workers: int, warmup: float, seconds: float,
            slices: int) -> dict:
    """Start the servers and `workers` workers of `workload` ({"workload": "w3" or "w1",
    "servers", and for W3 "rows", "dim", "batch"}), measure `seconds` after `warmup`:
    steps/s (and W3's unique rows/s; medians over `slices`, as W3's figures), CPU ms per
    step by process and role."""
    from ps_worker.cluster import worker_environment

    servers = workload["servers"]
    with tempfile.TemporaryDirectory(prefix="paramserve-floor-") as tmp_name, \
            harness.ProcessGroup(together=True) as group:
        tmp = Path(tmp_name)
        # The servers never multiply matrices: one BLAS thread each, as ps-cluster's.
        server_env = {**os.environ, **{k: "1" for k in ("OPENBLAS_NUM_THREADS",
                                                        "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
        server_procs = [group.spawn(f"s{k}", [sys.executable, __file__, "--serve", str(k),
                                              "--spec", json.dumps(workload)], env=server_env)
                        for k in range(servers)]
        specs = [{**workload, "index": i, "addresses": [p.address for p in server_procs],
                  "go": str(tmp / "go"), "result": str(tmp / f"w{i}.json")}
                 for i in range(workers)]
        worker_procs = [group.start(f"w{i}", [sys.executable, __file__, "--work",
                                              json.dumps(spec)],
                                    env=worker_environment(workers))
                        for i, spec in enumerate(specs)]
        processes = [*server_procs, *worker_procs]
        for process in worker_procs:
            process.wait_for_log(READY, w3.READY_TIMEOUT_S)
        start = time.monotonic() + warmup
        (tmp / "go.tmp").write_text(repr(start + seconds + 0.5))
        (tmp / "go.tmp").rename(tmp / "go")  # whole, never half-written
        w3.sleep_until(start, processes)
        first = w3.snapshot(processes)
        w3.sleep_until(start + seconds, processes)
        last = w3.snapshot(processes)
        for process in worker_procs:
            process.popen.wait(timeout=CALL_TIMEOUT_S + 10.0)
            if process.popen.returncode != 0:
                raise RuntimeError(f"floor worker {process.name} exited with status "
                                   f"{process.popen.returncode}:\n{process.log_tail()}")
        results = [json.loads(Path(spec["result"]).read_text()) for spec in specs]
    times, weights = [], []
    for i, result in enumerate(results):
        t = np.asarray(result["times"])
        inside = np.flatnonzero((t >= start) & (t < start + seconds))
        times.append(t[inside])
        weights.append(np.ones(len(inside)) if workload["workload"] != "w3" else
                       w3.unique_counts(i + 1, inside, workload["rows"],
                                        workload["batch"]).astype(np.float64))
    steps = sum(len(t) for t in times)
    if steps == 0:
        raise RuntimeError(f"the floor's workers completed no step in the {seconds:g} s measured")
    cpu = {name: harness.cpu_delta(first[name], last[name], steps) for name in last}
    by_role = {"servers": sum(cpu[f"s{k}"]["cpu_ms"] for k in range(servers)),
               "workers": sum(cpu[f"w{i}"]["cpu_ms"] for i in range(workers))}
    sliced = w3.sliced(times, weights, start, start + seconds, slices)
    if workload["workload"] != "w3":
        sliced = {k: v for k, v in sliced.items() if "unique_rows" not in k}
    return {"workload": workload["workload"], **sliced, "steps": steps,
            "cpu_ms_per_step": sum(by_role.values()), "cpu_ms_per_step_by_role": by_role,
            "cpu_ms_per_step_by_process": {n: c["cpu_ms"] for n, c in cpu.items()}}


def run(argv: list[str], timeout_s: float) -> dict:
    """This script with `argv` in a child process (as W1 and W3 run it, before their
    cluster): its JSON record."""
    done = subprocess.run([sys.executable, __file__, *argv], cwd=harness.REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the gRPC floor exited with status {done.returncode}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w3",
                   help="w3: rows of an embedding table (default); w1: W1's dense MLP")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--slices", type=int, default=10)
    p.add_argument("--rows", type=int, default=w3.ROWS, help="W3's table rows")
    p.add_argument("--dim", type=int, default=w3.DIM, help="W3's row length")
    p.add_argument("--batch", type=int, default=w3.BATCH, help="W3's ids a step")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--serve", type=int, metavar="INDEX", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--work", metavar="SPEC", help=argparse.SUPPRESS)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, json.loads(args.spec))
    if args.work:
        return work(json.loads(args.work))
    harness.apply_quick(p, args, rows=10_000, dim=8, seconds=1.0, warmup=0.3, slices=2)
    if (args.seconds <= 0 or args.warmup < 0 or args.slices < 1 or args.rows < 2
            or args.dim < 1 or args.batch < 1 or args.servers < 1 or args.workers < 1):
        p.error("--seconds must be > 0, --warmup >= 0; --slices, --dim, --batch, --servers, "
                "--workers >= 1; --rows >= 2")
    workload = {"workload": args.workload, "servers": args.servers}
    if args.workload == "w3":
        workload.update(rows=args.rows, dim=args.dim, batch=args.batch)
        setup = f"{args.rows:,} x {args.dim} float32 rows, {args.batch} ids a step"
    else:
        setup = f"{w1.model_text()}, async"
    with harness.bounded(args.warmup + args.seconds + 180, f"{args.workload} floor"):
        record = measure(workload, workers=args.workers, warmup=args.warmup,
                         seconds=args.seconds, slices=args.slices)
    roles = record["cpu_ms_per_step_by_role"]
    unique = ("" if "unique_rows_per_s" not in record else
              f", {record['unique_rows_per_s']:,.0f} unique rows/s")
    rows = [
        ("setup", f"{args.servers} minimal servers on bare grpcio, {args.workers} workers; "
                  + setup),
        ("floor", f"{record['steps_per_s']:.1f} steps/s{unique} (medians of {args.slices} "
                  "slices)"),
        ("CPU per step", f"{record['cpu_ms_per_step']:.2f} ms = servers "
                         f"{roles['servers']:.2f} + workers {roles['workers']:.2f}"),
    ]
    harness.report(f"{args.workload.upper()} floor over bare grpcio", rows, record,
                   quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
