"""The floor of W3 over gRPC: a minimal parameter server on bare grpcio, with no promises.

What the leanest parameter server written in Python on grpcio does with W3's steps on this
machine, measured the same way as paramserve: the fastest any library built like paramserve
(Python over grpcio) could go, and so what a W3 target over gRPC can be held against. It
keeps none of paramserve's promises: no check of ids, shapes or finiteness, no
exactly-once ledger, no shard map or epochs, no retries or deadlines, no consistent reads,
no metrics. Each server holds the rows whose `id % servers` is its index (cheaper than
paramserve's hash) in a NumPy array; each worker step is one unary call per server with raw
bytes in and out (identity serializers, no protobuf), carrying the summed gradient rows of
the step's distinct ids and the next step's distinct ids, and answered with those rows (as
`push_pull_rows`: the push applied, then the next rows read). The workers do the same NumPy
work as paramserve's client: draw the ids, deduplicate them (once per step: the pull's
`np.unique` serves the push that follows), sum the duplicates' gradients with the client's
`sum_duplicates`, scatter the rows back into the ids' order. The first server's call is
made in the worker's thread, the others' in a thread pool, as PSClient does.

    python benchmarks/grpc_floor.py                 # 2 servers, 2 workers, 20 s after 3 s
    python benchmarks/grpc_floor.py --quick         # a 10,000 x 8 table, 1 s: does it run?

`w3_sparse_embedding.py --no-shm` runs it in the same run as paramserve's cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
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


# ---- a server --------------------------------------------------------------------------

def local_rows(index: int, servers: int, rows: int) -> int:
    """Rows held by server `index`: the ids i < rows with i % servers == index."""
    return (rows - index + servers - 1) // servers


def serve(index: int, servers: int, rows: int, dim: int) -> int:
    """Serve the rows of server `index` until SIGTERM; prints `listening on HOST:PORT`."""
    rng = np.random.default_rng(w3.TABLE_SEED + index)
    table = rng.uniform(-0.05, 0.05, (local_rows(index, servers, rows), dim)).astype(np.float32)
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

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        METHOD.split("/")[1], {METHOD.split("/")[2]: grpc.unary_unary_rpc_method_handler(
            push_then_pull, request_deserializer=_identity, response_serializer=_identity)})])
    bound = server.add_insecure_port(f"{harness.HOST}:0")
    stopping = [False]  # a plain flag, as bare_grpc's server: no lock in a signal handler

    def on_signal(signum, frame):
        stopping[0] = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    server.start()
    print(f"minimal-ps listening on {harness.HOST}:{bound}", flush=True)
    while not stopping[0]:
        time.sleep(0.1)
    server.stop(1.0).wait(2.0)
    return 0


# ---- a worker --------------------------------------------------------------------------

def work(spec: dict) -> int:
    """Warm up, say READY, wait for the go file, which holds the time (CLOCK_MONOTONIC,
    shared by the processes) to step until; then write every step's end time to
    spec["result"]."""
    from ps_common.rows import sum_duplicates

    index, rows, dim, batch = spec["index"], spec["rows"], spec["dim"], spec["batch"]
    servers = len(spec["addresses"])
    stream = index + 1
    channels = [grpc.insecure_channel(a, options=OPTIONS) for a in spec["addresses"]]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
    calls = [c.unary_unary(METHOD, request_serializer=_identity,
                           response_deserializer=_identity) for c in channels]
    pool = futures.ThreadPoolExecutor(max_workers=max(1, servers - 1))
    out = np.empty((batch, dim), np.float32)
    grad_buffer = np.empty((batch, dim), np.float32)
    no_ids, no_rows = np.empty(0, np.int64), np.empty((0, dim), np.float32)
    held = None  # (distinct ids, inverse) of the rows in `out`

    def one_step(seed: int) -> None:
        nonlocal held
        next_ids = w3.draw_ids(seed, rows, batch)
        next_unique, next_inverse = np.unique(next_ids, return_inverse=True)
        next_owner = next_unique % servers
        if held is None:
            pushes = [(no_ids, no_rows)] * servers
        else:
            unique, inverse = held
            summed = sum_duplicates(w3.fake_gradient(out, grad_buffer), inverse, len(unique))
            owner = unique % servers
            pushes = [(unique[owner == k], summed[owner == k]) for k in range(servers)]
        requests = [b"".join((_COUNTS.pack(len(ids), int(np.count_nonzero(next_owner == k))),
                              ids.tobytes(), grads.tobytes(),
                              next_unique[next_owner == k].tobytes()))
                    for k, (ids, grads) in enumerate(pushes)]
        others = [pool.submit(calls[k], requests[k], timeout=CALL_TIMEOUT_S)
                  for k in range(1, servers)]
        answers = [calls[0](requests[0], timeout=CALL_TIMEOUT_S),
                   *(f.result() for f in others)]
        gathered = np.empty((len(next_unique), dim), np.float32)
        for k, answer in enumerate(answers):
            gathered[next_owner == k] = np.frombuffer(answer, np.float32).reshape(-1, dim)
        next_inverse = next_inverse.reshape(-1)
        np.take(gathered, next_inverse, axis=0, out=out)
        held = (next_unique, next_inverse)

    for k in range(w3.WARM_STEPS):
        one_step(w3.step_seed(stream, w3.WARM_OFFSET + k))
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
        one_step(w3.step_seed(stream, step))
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

def measure(*, servers: int, workers: int, rows: int, dim: int, batch: int, warmup: float,
            seconds: float, slices: int) -> dict:
    """Start the servers and workers, measure `seconds` after `warmup`: steps/s and unique
    rows/s (medians over `slices`, as W3's), CPU ms per step by process and role."""
    from ps_worker.cluster import worker_environment

    with tempfile.TemporaryDirectory(prefix="paramserve-floor-") as tmp_name, \
            harness.ProcessGroup(together=True) as group:
        tmp = Path(tmp_name)
        server_env = {**os.environ, **{k: "1" for k in ("OPENBLAS_NUM_THREADS",
                                                        "OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
        server_procs = [group.spawn(f"s{k}", [sys.executable, __file__, "--serve", str(k),
                                              "--servers", str(servers), "--rows", str(rows),
                                              "--dim", str(dim)], env=server_env)
                        for k in range(servers)]
        specs = [{"index": i, "addresses": [p.address for p in server_procs], "rows": rows,
                  "dim": dim, "batch": batch, "go": str(tmp / "go"),
                  "result": str(tmp / f"w{i}.json")}
                 for i in range(workers)]
        worker_procs = [group.start(f"w{i}", [sys.executable, __file__, "--work",
                                              json.dumps(spec)],
                                    env=worker_environment(workers))
                        for i, spec in enumerate(specs)]
        processes = [*server_procs, *worker_procs]
        for process in worker_procs:
            process.wait_for_log(READY, w3.READY_TIMEOUT_S)
        start = time.monotonic() + warmup
        go = tmp / "go"
        (tmp / "go.tmp").write_text(repr(start + seconds + 0.5))
        (tmp / "go.tmp").rename(go)  # whole, never half-written
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
        weights.append(w3.unique_counts(i + 1, inside, rows, batch).astype(np.float64))
    steps = sum(len(t) for t in times)
    if steps == 0:
        raise RuntimeError(f"the floor's workers completed no step in the {seconds:g} s measured")
    cpu = {name: harness.cpu_delta(first[name], last[name], steps) for name in last}
    by_role = {"servers": sum(cpu[f"s{k}"]["cpu_ms"] for k in range(servers)),
               "workers": sum(cpu[f"w{i}"]["cpu_ms"] for i in range(workers))}
    return {**w3.sliced(times, weights, start, start + seconds, slices), "steps": steps,
            "cpu_ms_per_step": sum(by_role.values()), "cpu_ms_per_step_by_role": by_role,
            "cpu_ms_per_step_by_process": {n: c["cpu_ms"] for n, c in cpu.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--slices", type=int, default=10)
    p.add_argument("--rows", type=int, default=w3.ROWS)
    p.add_argument("--dim", type=int, default=w3.DIM)
    p.add_argument("--batch", type=int, default=w3.BATCH)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--serve", type=int, metavar="INDEX", help=argparse.SUPPRESS)
    p.add_argument("--work", metavar="SPEC", help=argparse.SUPPRESS)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args.servers, args.rows, args.dim)
    if args.work:
        return work(json.loads(args.work))
    harness.apply_quick(p, args, rows=10_000, dim=8, seconds=1.0, warmup=0.3, slices=2)
    if (args.seconds <= 0 or args.warmup < 0 or args.slices < 1 or args.rows < 2
            or args.dim < 1 or args.batch < 1 or args.servers < 1 or args.workers < 1):
        p.error("--seconds must be > 0, --warmup >= 0; --slices, --dim, --batch, --servers, "
                "--workers >= 1; --rows >= 2")
    with harness.bounded(args.warmup + args.seconds + 180, "W3 floor"):
        record = measure(servers=args.servers, workers=args.workers, rows=args.rows,
                         dim=args.dim, batch=args.batch, warmup=args.warmup,
                         seconds=args.seconds, slices=args.slices)
    roles = record["cpu_ms_per_step_by_role"]
    rows = [
        ("setup", f"{args.servers} minimal servers on bare grpcio, {args.workers} workers, "
                  f"{args.rows:,} x {args.dim} float32 rows, {args.batch} ids a step"),
        ("floor", f"{record['steps_per_s']:.1f} steps/s, {record['unique_rows_per_s']:,.0f} "
                  f"unique rows/s (medians of {args.slices} slices)"),
        ("CPU per step", f"{record['cpu_ms_per_step']:.2f} ms = servers "
                         f"{roles['servers']:.2f} + workers {roles['workers']:.2f}"),
    ]
    harness.report("W3 floor over bare grpcio", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
