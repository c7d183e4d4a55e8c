"""W5 scale for W1: the W1 dense-mlp job with 1, 2, 4 and 8 workers
and 1, 2 and 4 servers, a fresh cluster for each configuration: how the cost of a step grows
with the cluster.

For each configuration, over `--seconds` after every worker has done a task and `--warmup`
more seconds: total steps/s (the coordinator's count), the mean per worker and the slowest
and fastest worker, the CPU per step summed over every process of the cluster (coordinator,
servers, workers: user + system time from /proc/PID/stat, every thread) and split by role,
and how many of the machine's cores were busy. Beside them, the in-run baseline as W1 has it:
the same MLP steps in one process with no server, with a worker's share of the cores (the
BLAS threads each worker of that configuration gets: the cores split evenly, at least 1),
measured once per thread count in the same run; the ratios are total steps/s / compute-only
steps/s and per-worker steps/s / compute-only steps/s.

    python benchmarks/w5_scale.py [--workers 1,2,4,8] [--servers 1,2,4] [--seconds 10] [--warmup 3]
    python benchmarks/w5_scale.py --quick          # 2 servers x 1 and 2 workers, briefly: does it run?

The coordinator counts a task's steps when the task is reported (16 steps a task:
w1_dense_mlp.STEPS_PER_TASK), so a window's count is off by at most 16 steps per worker:
keep `--seconds` long enough that this is small against the steps counted (the table shows
them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
import w1_dense_mlp as w1


def counts(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (each >= 1, no repeats, order kept)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected counts like 1,2,4") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct counts >= 1")
    return values


def run_config(servers: int, workers: int, warmup: float, seconds: float,
               shared_memory: bool = True) -> dict:
    """One configuration on a fresh cluster: rates, CPU per step by process and role."""
    with w1.w1_cluster(servers, workers, shared_memory) as w1c:
        w1.wait_all_stepping(w1c)
        first, last = w1.measure_window(w1c, warmup, seconds)
        server_rss = max(s.peak_rss_bytes() for s in w1c.cluster.servers)
        roles = w1c.roles
    measured = w1.rates(first, last, workers)
    cpu = w1.cpu_ms_per_step(first, last)
    by_role = {role: sum(cpu["processes"][name] for name in names)
               for role, names in roles.items()}
    each = measured["worker_steps_per_s"].values()
    return {"servers": servers, "workers": workers, **measured,
            "slowest_worker_steps_per_s": min(each), "fastest_worker_steps_per_s": max(each),
            "cpu_ms_per_step": cpu["total"], "cpu_ms_per_step_by_role": by_role,
            "cpu_ms_per_step_by_process": cpu["processes"],
            "cores_busy": cpu["total"] * measured["steps_per_s"] / 1e3,
            "server_peak_rss_bytes": server_rss, "blas_threads": w1.blas_threads(workers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=counts, default=[1, 2, 4, 8],
                   help="worker counts (default 1,2,4,8)")
    p.add_argument("--servers", type=counts, default=[1, 2, 4],
                   help="server counts (default 1,2,4)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="measured seconds per configuration (default 10)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds after every worker's first task, before measuring (default 3)")
    p.add_argument("--compute-seconds", type=float, default=None,
                   help="length of each compute-only baseline (default: --seconds, at most 10)")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, workers=[1, 2], servers=[2], seconds=1.0, warmup=0.3)
    if args.seconds <= 0 or args.warmup < 0:
        p.error("--seconds must be > 0 and --warmup >= 0")
    compute_s = args.compute_seconds or min(args.seconds, 10.0)
    configs = [(s, w) for s in args.servers for w in args.workers]
    # One worker count per BLAS thread count measures the baseline for all of them.
    by_threads = {w1.blas_threads(w): w for w in sorted(args.workers, reverse=True)}
    bound = (len(by_threads) * (compute_s + 120)
             + len(configs) * (args.warmup + args.seconds + w1.STEPPING_TIMEOUT_S + 120))

    with harness.bounded(bound, "W5 scale"):
        baselines = {threads: w1.compute_only(compute_s, workers)
                     for threads, workers in sorted(by_threads.items())}
        results = []
        for servers, workers in configs:
            result = run_config(servers, workers, args.warmup, args.seconds, not args.no_shm)
            base = baselines[result["blas_threads"]]
            result["compute_only_steps_per_s"] = base["steps_per_s"]
            result["ratio"] = result["steps_per_s"] / base["steps_per_s"]
            result["per_worker_ratio"] = (result["per_worker_steps_per_s"]
                                          / base["steps_per_s"])
            results.append(result)

    rows = [("model", w1.model_text()),
            ("window", f"{args.seconds:g} s per configuration after every worker's first task "
                       f"and {args.warmup:g} s more; {os.cpu_count()} cores")]
    for threads, base in sorted(baselines.items()):
        rows.append((f"compute only, {threads} BLAS thread(s)",
                     f"{base['steps_per_s']:7.1f} steps/s  {base['cpu_ms_per_step']:5.1f} CPU "
                     "ms/step (one process, no server: the baseline)"))
    rows.append(("servers x workers",
                 "steps/s total | per worker (slowest-fastest) | CPU ms/step all (coordinator "
                 "+ servers + workers) | cores busy | total / compute-only | per worker / "
                 "compute-only | steps counted"))
    for r in results:
        role = r["cpu_ms_per_step_by_role"]
        spread = f"{r['slowest_worker_steps_per_s']:.1f}-{r['fastest_worker_steps_per_s']:.1f}"
        rows.append((f"{r['servers']} x {r['workers']}",
                     f"{r['steps_per_s']:7.1f} | {r['per_worker_steps_per_s']:6.1f} ({spread})"
                     f" | {r['cpu_ms_per_step']:5.1f} ({role['coordinator']:.1f} + "
                     f"{role['servers']:.1f} + {role['workers']:.1f}) | {r['cores_busy']:.2f} | "
                     f"{r['ratio']:.2f} | {r['per_worker_ratio']:.2f} | {r['steps']}"))
    rows.insert(0, ("path", harness.path_name(args)))
    harness.report("W5 scale (W1)", rows, {"path": harness.path_name(args),
        "seconds": args.seconds, "warmup": args.warmup,
        "compute_only": {str(k): v for k, v in sorted(baselines.items())},
        "configs": results}, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
