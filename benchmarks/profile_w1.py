"""Where a W1 step's CPU goes, process by process and thread by thread.

Runs the W1 dense-mlp cluster (benchmarks/w1_dense_mlp.py: the coordinator with the W1 job,
`--servers` servers, `--workers` ps-worker processes) and, over `--seconds` after every
worker has done a task and `--warmup` more seconds:

  * reads every process's CPU time (user and system) and minor page faults from /proc, per
    thread, and divides it by the steps the coordinator counted in the window: CPU ms per
    step of the coordinator, each server and each worker, split by kind of thread (gRPC's
    C-core threads by their names, e.g. `event_engine`; Python threads, which keep the
    process's name, with any native thread that never named itself, e.g. OpenBLAS's);
  * beside it the baseline measured in the same run: the CPU ms of one compute-only step
    (the same MLP step in one process with a worker's share of the cores, no server);
  * then, where py-spy is installed (`pip install py-spy`; `--no-py-spy` to skip), samples
    every process for another `--seconds` (native frames, all threads), drops samples of
    waiting threads and sorts the rest into categories: the model's forward and backward
    (NumPy, BLAS), protobuf parse / serialize / build, copies, the optimizer, gRPC's Python
    and Cython code. Sampling slows the processes it samples a lot, hence its own window:
    the CPU figures above come from the window before, which nothing sampled.

    python benchmarks/profile_w1.py                 # 2 servers, 2 workers, 10 s
    python benchmarks/profile_w1.py --no-py-spy     # /proc only
    python benchmarks/profile_w1.py --quick         # a few seconds: does it run?

Raw py-spy stacks are kept under benchmarks/out/profile/ (flamegraph "collapsed" format).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
import w1_dense_mlp as w1

OUT_DIR = harness.REPO_ROOT / "benchmarks" / "out" / "profile"

# A sample with the model anywhere in its stack is the model's (its NumPy and BLAS calls
# included); the others go to the innermost matching category, W1's in front of the shared.
MODEL_CATEGORY = [("model forward + backward (NumPy, BLAS)", ("ps_worker/models/",))]
CATEGORIES = [("coordinator: job state, leases, status", ("ps_server/coordinator/",)),
              *harness.PY_SPY_CATEGORIES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=2, help="servers (default 2)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--seconds", type=float, default=10.0, help="profiled seconds (default 10)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds after every worker's first task, before profiling (default 3)")
    p.add_argument("--rate", type=int, default=100,
                   help="py-spy samples per second per process (default 100)")
    p.add_argument("--no-py-spy", action="store_true", help="only the /proc CPU accounting")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, seconds=1.0, warmup=0.3)
    if args.seconds <= 0 or args.warmup < 0 or args.servers < 1 or args.workers < 1:
        p.error("--seconds must be > 0, --warmup >= 0, --servers and --workers >= 1")
    use_py_spy = not args.no_py_spy and harness.py_spy_available()
    if not args.no_py_spy and not use_py_spy:
        print("profile_w1: py-spy is not installed (pip install py-spy): /proc accounting only",
              file=sys.stderr)
    OUT_DIR.mkdir(parents=True, exist_ok=True)

    spies: list[subprocess.Popen] = []
    files: dict[str, Path] = {}
    sampled: dict = {}
    with harness.bounded(2 * (args.seconds + args.warmup) + w1.STEPPING_TIMEOUT_S + 300,
                         "profile_w1"):
        baseline = w1.compute_only(min(args.seconds, 5.0), args.workers)
        with w1.w1_cluster(args.servers, args.workers, not args.no_shm) as w1c:
            w1.wait_all_stepping(w1c)
            # The CPU figures come from a window nobody samples; py-spy gets one of its own.
            first, last = w1.measure_window(w1c, args.warmup, args.seconds, threads=True)
            if use_py_spy:
                try:
                    for process in w1c.processes:
                        files[process.name] = OUT_DIR / f"w1-{process.name}.txt"
                        files[process.name].unlink(missing_ok=True)
                        spies.append(harness.start_py_spy(process.pid, files[process.name],
                                                          args.rate))
                    # py-spy attaches while the cluster gets used to being sampled.
                    sampled = w1.rates(*w1.measure_window(w1c, min(args.warmup, 1.0),
                                                          args.seconds), args.workers)
                finally:
                    for spy in spies:
                        harness.stop_py_spy(spy)
            roles = w1c.roles

    measured = w1.rates(first, last, args.workers)
    steps = measured["steps"]
    cpu = {name: harness.cpu_delta(first["cpu"][name], last["cpu"][name], steps)
           for name in last["cpu"]}
    total = sum(c["cpu_ms"] for c in cpu.values())
    by_role = {role: sum(cpu[name]["cpu_ms"] for name in names) for role, names in roles.items()}
    by_kind: dict[str, float] = {}
    for c in cpu.values():
        for kind, ms in c["by_thread_kind_ms"].items():
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
    record: dict = {
        "servers": args.servers, "workers": args.workers, **measured,
        "profiled_with": "py-spy" if use_py_spy else "none",
        "sampled_window": sampled,
        "cpu_ms_per_step": total, "cpu_ms_per_step_by_role": by_role,
        "cpu_ms_per_step_by_thread_kind": by_kind, "processes": cpu,
        "compute_only": baseline, "cpu_over_compute_only": total / baseline["cpu_ms_per_step"],
        "cores_busy": total * measured["steps_per_s"] / 1e3}

    each = ", ".join(f"{w} {r:.1f}" for w, r in measured["worker_steps_per_s"].items())
    rows = [
        ("model", w1.model_text()),
        ("cluster", f"{args.servers} servers, {args.workers} workers "
                    f"({baseline['blas_threads']} BLAS thread(s) each), {os.cpu_count()} cores"),
        ("steps", f"{steps} in {measured['elapsed_s']:.1f} s = {measured['steps_per_s']:.1f} "
                  f"steps/s ({each}), nothing sampling"),
        ("CPU per step, all processes", f"{total:.2f} ms = coordinator "
                                        f"{by_role['coordinator']:.2f} + servers "
                                        f"{by_role['servers']:.2f} + workers "
                                        f"{by_role['workers']:.2f}; {record['cores_busy']:.2f} "
                                        "cores busy"),
        ("compute only (baseline)", f"{baseline['cpu_ms_per_step']:.2f} ms per step "
                                    f"({baseline['steps_per_s']:.1f} steps/s, one process, "
                                    "no server); the cluster spends "
                                    f"{record['cpu_over_compute_only']:.2f}x that"),
    ]
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        rows.append((f"  {kind}", f"{ms:.2f} ms"))
    if use_py_spy:
        rows.append(("py-spy window", f"{sampled['steps']} steps in {sampled['elapsed_s']:.1f} "
                                      f"s = {sampled['steps_per_s']:.1f} steps/s while "
                                      f"{len(files)} processes were sampled at {args.rate}/s "
                                      "each: the py-spy rows below come from it"))
    for name, c in cpu.items():
        rows.append((f"{name} CPU / step", f"user {c['user_ms']:.2f} ms + sys {c['sys_ms']:.2f} "
                                           f"ms = {c['cpu_ms']:.2f} ms, "
                                           f"{c['minor_faults']:,.1f} minor faults"))
        for kind, ms in c["by_thread_kind_ms"].items():
            rows.append((f"  {kind}", f"{ms:.2f} ms"))
        if use_py_spy:
            profile = harness.classify(harness.read_stacks(files[name]), CATEGORIES,
                                       anywhere=MODEL_CATEGORY)
            record["processes"][name]["py_spy"] = profile
            working = profile["working_samples"] or 1
            rows.append((f"  {name} py-spy", f"{profile['working_samples']} working samples at "
                                             f"{args.rate}/s ({profile['idle_samples']} "
                                             "waiting, dropped)"))
            for category, count in profile["categories"].items():
                rows.append((f"    {category}", f"{100 * count / working:5.1f} %"))
    if use_py_spy:  # before the report: its JSON line stays the last line
        for name in cpu:
            print(f"-- {name}: innermost Python frame -> native leaf (working samples)")
            for frame, count in record["processes"][name]["py_spy"]["top_frames"].items():
                print(f"  {count:6d}  {frame}")
        print(f"raw stacks: {', '.join(str(f) for f in files.values())}")
    record["path"] = harness.path_name(args)
    rows.insert(0, ("path", harness.path_name(args)))
    harness.report("W1 profile", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
