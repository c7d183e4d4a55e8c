"""Coordinator scale: the cost of one JobRunner call as a job grows, in one process.

A JobRunner on a FakeClock runs a whole job (default 100 epochs of 1,000 train tasks plus
each epoch's evaluation: 100,100 tasks) for 8 workers taking turns: on its turn a worker
reports the task it holds, if any, and leases the next (so up to 8 tasks are out at once,
and workers wait at the end of an epoch as real ones do). The baseline is measured in the
same run: lease and complete calls over the first 1,000 tasks done, against the same calls
over the last 1,000; snapshot() (what GetStatus reads) at the start against the end of the
job. Each figure is printed with its ratio to its baseline: flat per-call cost reads ~1.0x.
Times are microseconds of wall-clock time per call (time.perf_counter_ns).

    python benchmarks/coordinator_scale.py [--epochs 100] [--tasks-per-epoch 1000]
    python benchmarks/coordinator_scale.py --old ../paramserve-3c4d8f1    # another checkout's JobRunner
    python benchmarks/coordinator_scale.py --quick    # 3 epochs of 20 tasks: does it run?

No processes, no grpc: it measures the coordinator's job state alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

HEARTBEAT_TIMEOUT_S = 10.0
TURN_S = 0.001  # fake time per turn: a worker acts every 8 ms, far inside its lease


def load_runner(old: str | None):
    """JobRunner and friends from this checkout, or from the checkout at `old` (a tree
    from before this benchmark existed: only the arguments every version takes are used)."""
    if old is not None:
        root = Path(old).resolve()
        if not (root / "ps_server" / "coordinator" / "jobs.py").is_file():
            raise SystemExit(f"--old {old}: no ps_server/coordinator/jobs.py there")
        sys.path.insert(0, str(root))  # ahead of harness's REPO_ROOT: ps_common comes too
    from ps_common.clock import FakeClock
    from ps_common.job import JobSpec
    from ps_server.coordinator import jobs
    return jobs, FakeClock, JobSpec


def timed_snapshots(runner, at_least: int, min_s: float = 0.2, at_most: int = 2000) -> float:
    """Median us of snapshot() over at least `at_least` calls and `min_s` seconds."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < at_least or (time.perf_counter() - started < min_s
                                    and len(times) < at_most):
        t0 = time.perf_counter_ns()
        runner.snapshot()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def drive(jobs, clock_type, spec_type, *, epochs: int, tasks_per_epoch: int, workers: int,
          window: int, snapshots: int, progress: bool) -> dict:
    clock = clock_type()
    job = spec_type(epochs=epochs, tasks_per_epoch=tasks_per_epoch)
    # first_incarnation is taken by every version of JobRunner.
    runner = jobs.JobRunner(job, clock, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                            first_incarnation=1)
    members = [(f"w{n}", runner.register_worker(f"w{n}")) for n in range(workers)]
    total = epochs * (tasks_per_epoch + 1)
    if total < 2 * window:
        raise SystemExit(f"a job of {total} tasks is too small for two windows of {window}")
    snapshot_start = timed_snapshots(runner, snapshots)

    # Per window: [lease calls, lease ns, complete calls, complete ns, tasks done].
    first, last = [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]
    held: dict[str, object] = {}
    done = 0
    turn = 0
    clock_ns = time.perf_counter_ns
    report_every = max(1, total // 10)
    while runner.state is jobs.JobState.RUNNING:
        worker_id, incarnation = members[turn % workers]
        turn += 1
        clock.advance(TURN_S)
        bucket = first if done < window else last if done >= total - window else None
        task = held.pop(worker_id, None)
        if task is not None:
            metrics = jobs.Metrics(loss_sum=1.0, examples=32, correct=16,
                                   steps=1 if task.kind == "train" else 0, seconds=0.01)
            t0 = clock_ns()
            duplicate = runner.complete(worker_id, incarnation, task.task_id, metrics)
            elapsed = clock_ns() - t0
            if duplicate:
                raise RuntimeError(f"task {task.task_id} was reported as a duplicate")
            if bucket is not None:
                bucket[2] += 1
                bucket[3] += elapsed
                bucket[4] += 1
            done += 1
            if progress and done % report_every == 0:
                print(f"  ... {done:,} of {total:,} tasks", file=sys.stderr, flush=True)
            if runner.state is not jobs.JobState.RUNNING:
                break
        t0 = clock_ns()
        outcome, task = runner.lease(worker_id, incarnation)
        elapsed = clock_ns() - t0
        if bucket is not None:
            bucket[0] += 1
            bucket[1] += elapsed
        if outcome == "task":
            held[worker_id] = task
        elif outcome != "wait":
            raise RuntimeError(f"lease by {worker_id} answered {outcome!r} mid-job")
    snapshot_end = timed_snapshots(runner, snapshots)

    snap = runner.snapshot()
    if (snap["state"] is not jobs.JobState.DONE or snap["tasks_done"] != total
            or snap["steps"] != epochs * tasks_per_epoch or len(snap["metrics"]) != epochs):
        raise RuntimeError(f"the job did not end as it should: {snap['state']}, "
                           f"{snap['tasks_done']} tasks, {snap['steps']} steps")

    def figures(b: list[int]) -> dict:
        return {"lease_calls": b[0], "lease_us": b[1] / b[0] / 1e3,
                "complete_calls": b[2], "complete_us": b[3] / b[2] / 1e3,
                "tasks": b[4], "lease_complete_us_per_task": (b[1] + b[3]) / b[4] / 1e3}

    record = {"epochs": epochs, "tasks_per_epoch": tasks_per_epoch, "tasks": total,
              "workers": workers, "window": window, "jobs_module": jobs.__file__,
              "first": figures(first), "last": figures(last),
              "snapshot_start_us": snapshot_start, "snapshot_end_us": snapshot_end}
    for name in ("tracked_tasks", "tracked_workers"):  # newer runners only
        if hasattr(runner, name):
            record[f"{name}_at_end"] = getattr(runner, name)()
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=100, help="epochs of the job (default 100)")
    p.add_argument("--tasks-per-epoch", type=int, default=1000,
                   help="train tasks per epoch, each epoch has one evaluation more (default 1000)")
    p.add_argument("--workers", type=int, default=8, help="workers taking turns (default 8)")
    p.add_argument("--window", type=int, default=1000,
                   help="tasks timed at the start and at the end of the job (default 1000)")
    p.add_argument("--snapshots", type=int, default=5,
                   help="snapshot() calls timed at least, at the start and at the end; the "
                        "median is shown (default 5, more while under 0.2 s)")
    p.add_argument("--old", metavar="CHECKOUT",
                   help="measure the JobRunner of another checkout (e.g. ../paramserve-3c4d8f1)")
    p.add_argument("--progress", action="store_true", help="print progress to stderr")
    p.add_argument("--bound", type=float, default=3600.0,
                   help="wall-clock bound in seconds (default 3600: the old runner is slow)")
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, epochs=3, tasks_per_epoch=20, workers=4, window=20,
                        snapshots=2)
    if min(args.epochs, args.tasks_per_epoch, args.workers, args.window, args.snapshots) < 1:
        p.error("--epochs, --tasks-per-epoch, --workers, --window and --snapshots must be >= 1")
    jobs, clock_type, spec_type = load_runner(args.old)
    with harness.bounded(args.bound, "coordinator_scale"):
        record = drive(jobs, clock_type, spec_type, epochs=args.epochs,
                       tasks_per_epoch=args.tasks_per_epoch, workers=args.workers,
                       window=args.window, snapshots=args.snapshots, progress=args.progress)
    first, last = record["first"], record["last"]
    record["ratio_lease_complete"] = (last["lease_complete_us_per_task"]
                                      / first["lease_complete_us_per_task"])
    record["ratio_lease"] = last["lease_us"] / first["lease_us"]
    record["ratio_complete"] = last["complete_us"] / first["complete_us"]
    record["ratio_snapshot"] = record["snapshot_end_us"] / record["snapshot_start_us"]

    def calls(b: dict) -> str:
        return (f"{b['lease_complete_us_per_task']:9.1f} us per task  (lease {b['lease_us']:.1f} "
                f"us x {b['lease_calls']:,}, complete {b['complete_us']:.1f} us x "
                f"{b['complete_calls']:,})")

    n = f"{args.window:,}"
    rows = [("job", f"{args.epochs:,} epochs x ({args.tasks_per_epoch:,} train + 1 evaluation)"
                    f" = {record['tasks']:,} tasks, {args.workers} workers taking turns"),
            ("JobRunner", record["jobs_module"]),
            (f"lease+complete, first {n} tasks", calls(first) + "  (baseline)"),
            (f"lease+complete, last {n} tasks", calls(last)),
            ("  ratio to baseline", f"{record['ratio_lease_complete']:.2f}x  (lease "
                                    f"{record['ratio_lease']:.2f}x, complete "
                                    f"{record['ratio_complete']:.2f}x)"),
            ("snapshot(), start of the job", f"{record['snapshot_start_us']:9.1f} us  (baseline)"),
            ("snapshot(), end of the job", f"{record['snapshot_end_us']:9.1f} us"),
            ("  ratio to baseline", f"{record['ratio_snapshot']:.2f}x")]
    if "tracked_tasks_at_end" in record:
        rows.append(("held at the end", f"{record['tracked_tasks_at_end']} tasks, "
                                        f"{record['tracked_workers_at_end']} workers"))
    harness.report("coordinator scale", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
