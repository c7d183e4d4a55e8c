"""W1's data path alone: each step's push_pull of the MLP's gradients and values (2.7 MB each
way) against 2 servers, with no model, and CPU milliseconds per step of the client and of
each server (from /proc). Beside it, in the same run, the baseline: the same steps against
the gRPC floor's minimal servers (benchmarks/grpc_floor.py: bare grpcio, raw bytes, one
unary call per server a step, nothing checked), from a client that joins the gradients into
bytes and reads the answers as arrays, as the floor's workers do.

W1's figure is the model's compute plus this; what a step costs here beyond the floor is
paramserve's own (its checks, exactly-once ledger, consistent reads, the client's threads),
measured without the model's noise. The values are checked at the end against the same SGD
steps made in NumPy.

    python benchmarks/w1_data_path.py              # shared memory, 2000 steps
    python benchmarks/w1_data_path.py --no-shm     # over gRPC
    python benchmarks/w1_data_path.py --quick      # a few steps: does it run?
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc_floor
import harness
import w1_dense_mlp as w1

from ps_worker import PSClient
from ps_worker.models import MLP

LR = 0.01


def _gradients() -> dict[str, np.ndarray]:
    model = MLP(w1.FEATURES, w1.CLASSES, hidden=w1.HIDDEN)
    rng = np.random.default_rng(0)
    return {v.name: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32)
            for v in model.variables()}


def _timed(step, warmup: int, steps: int, pids: dict[str, int]) -> dict:
    """Run `step(i)` `warmup` times, then `steps` times measured: steps/s and CPU ms per step
    of this process (the client) and of each of `pids`."""
    for i in range(warmup):
        step(i)
    before = {"client": harness.cpu_snapshot("self"),
              **{name: harness.cpu_snapshot(pid) for name, pid in pids.items()}}
    started = time.monotonic()
    for i in range(steps):
        step(warmup + i)
    elapsed = time.monotonic() - started
    cpu = {name: harness.cpu_delta(before[name], after, steps)["cpu_ms"]
           for name, after in {"client": harness.cpu_snapshot("self"),
                               **{n: harness.cpu_snapshot(p) for n, p in pids.items()}}.items()}
    return {"steps_per_s": steps / elapsed, "cpu_ms_per_step": sum(cpu.values()),
            "cpu_ms_per_step_by_process": cpu}


def paramserve(args, grads: dict[str, np.ndarray]) -> dict:
    names = list(grads)
    with harness.cluster(2, log_level="warning", server_args=harness.no_shm_args(args)) as c, \
            PSClient(c.address, **harness.client_path_args(args)) as ps:
        for name, grad in grads.items():
            ps.declare(name, grad.shape, init="zeros", optimizer={"name": "sgd", "lr": LR})
        buffers = [{n: np.empty_like(g) for n, g in grads.items()} for _ in range(2)]
        measured = _timed(lambda i: ps.push_pull(grads, names, out=buffers[i % 2]),
                          args.warmup, args.steps, {s.name: s.pid for s in c.servers})
        expected = {n: np.zeros_like(g) for n, g in grads.items()}
        for _ in range(args.warmup + args.steps):
            for name, grad in grads.items():
                expected[name] -= grad * np.float32(LR)  # as the server's SGD computes it
        for name, values in ps.pull(names).items():
            if not np.array_equal(values, expected[name]):
                raise RuntimeError(f"{name}: the values pulled are not the SGD steps pushed")
        measured["data_paths"] = sorted(set(ps.data_paths.values()))
    return measured


def floor(args, grads: dict[str, np.ndarray]) -> dict:
    spec = {"workload": "w1", "servers": 2}
    placement = grpc_floor.w1_placement(2)
    with harness.ProcessGroup() as group:
        servers = [group.spawn(f"floor-s{k}", [sys.executable, grpc_floor.__file__, "--serve",
                                               str(k), "--spec", json.dumps(spec)])
                   for k in range(2)]
        channels = [grpc.insecure_channel(s.address, options=grpc_floor.OPTIONS) for s in servers]
        try:
            for channel in channels:
                grpc.channel_ready_future(channel).result(timeout=grpc_floor.CONNECT_TIMEOUT_S)
            calls = [ch.unary_unary(grpc_floor.METHOD, request_serializer=grpc_floor._identity,
                                    response_deserializer=grpc_floor._identity)
                     for ch in channels]
            with futures.ThreadPoolExecutor(1) as pool:

                def step(_):
                    requests = [b"".join(grads[n].tobytes() for n in names) for names in placement]
                    other = pool.submit(calls[1], requests[1], timeout=grpc_floor.CALL_TIMEOUT_S)
                    answers = [calls[0](requests[0], timeout=grpc_floor.CALL_TIMEOUT_S),
                               other.result()]
                    return [np.frombuffer(a, np.float32) for a in answers]

                return _timed(step, args.warmup, args.steps, {s.name: s.pid for s in servers})
        finally:
            for channel in channels:
                channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="measured steps (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="steps before (default 200)")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, steps=5, warmup=2)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    grads = _gradients()
    # Bounded: two clusters' startup, and steps at <= 50 ms each.
    with harness.bounded(180 + 2 * (args.steps + args.warmup) * 0.05, "w1_data_path"):
        base = floor(args, grads)
        ours = paramserve(args, grads)
    record = {"path": harness.path_name(args), "steps": args.steps,
              "bytes_each_way": sum(g.nbytes for g in grads.values()),
              "paramserve": ours, "floor": base,
              # (None when /proc's clock ticks saw none of the floor's CPU: a quick run)
              "cpu_over_floor": (ours["cpu_ms_per_step"] / base["cpu_ms_per_step"]
                                 if base["cpu_ms_per_step"] else None)}

    def line(r: dict) -> str:
        by = "  ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_step_by_process"].items())
        return (f"{r['steps_per_s']:7.1f} steps/s, {r['cpu_ms_per_step']:.3f} CPU ms a step "
                f"({by})")

    rows = [("path", f"{record['path']} ({', '.join(ours['data_paths'])})"),
            ("steps", f"{args.steps} after {args.warmup}, {record['bytes_each_way'] / 2**20:.2f} "
                      "MiB each way, 2 servers"),
            ("paramserve push_pull", line(ours)),
            ("floor (bare grpcio)", line(base)),
            ("CPU a step, paramserve / floor", "n/a" if record["cpu_over_floor"] is None
             else f"{record['cpu_over_floor']:.2f}x")]
    harness.report("W1 data path", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
