"""Where a W2 round trip's time goes, on the client and on the server.

Runs the W2 loop (pull the whole variable, push a same-size gradient) for `--round-trips`
round trips after a warm-up, and meanwhile:

  * samples both processes with py-spy (`pip install py-spy`; native frames included, all
    threads), then drops samples of threads that are waiting (epoll, condition variables,
    locks) and sorts the rest into categories: protobuf parse / serialize / message build,
    the copies into and out of numpy arrays, the optimizer, the finiteness check, freeing
    buffers, gRPC's own Python and Cython code;
  * reads both processes' CPU time (user and system) and minor page faults from /proc,
    per thread, so that gRPC's C-core threads (`event_engine`, invisible to py-spy) and the
    system time of page faults are counted too.

    python benchmarks/profile_w2.py                   # 20 round trips of 64 MiB, shared memory
    python benchmarks/profile_w2.py --no-shm          # the same over gRPC
    python benchmarks/profile_w2.py --no-shm --tune-malloc  # ... with ps-worker's malloc
    python benchmarks/profile_w2.py --round-trips 1   # exactly one round trip
    python benchmarks/profile_w2.py --quick           # 2 round trips of 1 MiB: does it run?

Raw py-spy stacks are kept under benchmarks/out/profile/ (flamegraph "collapsed" format).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from ps_worker import PSClient

OUT_DIR = harness.REPO_ROOT / "benchmarks" / "out" / "profile"


def _allocation_frames() -> tuple[str, ...]:
    """Frames of the servicer line that allocates a push's gradient buffer (found in the
    source, so the profile keeps working when lines move)."""
    from ps_server.servicer import ParameterServerServicer
    lines, first = inspect.getsourcelines(ParameterServerServicer.Push)
    return tuple(f"<listcomp> (ps_server/servicer.py:{first + i})"
                 for i, line in enumerate(lines) if "bytearray(" in line)


def categories() -> list[tuple[str, tuple[str, ...]]]:
    """The shared py-spy categories, with W2's gradient-buffer allocation in front."""
    return [("allocate push buffer: bytearray(nbytes) (zero-fill + page faults)",
             _allocation_frames()), *harness.PY_SPY_CATEGORIES]


# ---- run ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round-trips", type=int, default=20, help="profiled round trips (default 20)")
    p.add_argument("--size", type=int, default=16_777_216, help="float32 elements (default 64 MiB)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    p.add_argument("--no-py-spy", action="store_true", help="only the /proc CPU accounting")
    p.add_argument("--no-pull-out", dest="pull_out", action="store_false",
                   help="pull into a fresh array each time instead of reusing one via "
                   "pull(..., out=) (the default where the client offers `out`)")
    p.add_argument("--tune-malloc", action="store_true",
                   help="set the client's malloc as ps-worker sets its own "
                   "(ps_worker.tune_malloc); default: glibc's, as in w2_big_dense")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    # 2 round trips of 1 MiB; py-spy only where it is installed.
    harness.apply_quick(p, args, round_trips=2, size=262_144)
    if args.round_trips < 1:
        p.error("--round-trips must be >= 1")
    use_py_spy = not args.no_py_spy
    if use_py_spy and not harness.py_spy_available():
        if not args.quick:
            p.error("py-spy is not installed: pip install py-spy (or pass --no-py-spy)")
        print("profile_w2 --quick: py-spy is not installed, profiling with /proc only",
              file=sys.stderr)
        use_py_spy = False
    client_malloc = (harness.tune_client_malloc() if args.tune_malloc
                     else "glibc's defaults, as w2_big_dense's client")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    files = {"client": OUT_DIR / "client.txt", "server": OUT_DIR / "server.txt"}
    for f in files.values():
        f.unlink(missing_ok=True)

    spies: list[subprocess.Popen] = []
    with harness.bounded(300 + 10 * args.round_trips, "profile_w2"), \
            harness.cluster(1, log_level="warning", server_args=harness.no_shm_args(args)) as c:
        try:
            with PSClient(c.address, **harness.client_path_args(args)) as client:
                client.declare("w2", (args.size,), "float32",
                               optimizer={"name": "sgd", "lr": 0.01})
                grad = np.random.default_rng(2).standard_normal(args.size, dtype=np.float32)
                pull_out = args.pull_out and "out" in inspect.signature(PSClient.pull).parameters
                out = {"w2": np.empty(args.size, np.float32)} if pull_out else None
                kw = {"out": out} if pull_out else {}
                for _ in range(2):  # warm-up: connection, first-touch of the server's values
                    client.pull("w2", **kw)
                    client.push({"w2": grad})
                pids = {"client": os.getpid(), "server": c.servers[0].pid}
                if use_py_spy:
                    spies = [harness.start_py_spy(pid, files[name], args.rate)
                             for name, pid in pids.items()]
                    time.sleep(1.0)  # let py-spy attach before the measured part
                before = {name: harness.cpu_snapshot(pid) for name, pid in pids.items()}
                pull_s = push_s = 0.0
                start = time.perf_counter()
                for _ in range(args.round_trips):
                    t0 = time.perf_counter()
                    values = client.pull("w2", **kw)
                    t1 = time.perf_counter()
                    client.push({"w2": grad})
                    pull_s, push_s = pull_s + t1 - t0, push_s + time.perf_counter() - t1
                    del values
                elapsed = time.perf_counter() - start
                after = {name: harness.cpu_snapshot(pid) for name, pid in pids.items()}
        finally:
            for spy in spies:
                harness.stop_py_spy(spy)

    n = args.round_trips
    record: dict = {"path": harness.path_name(args), "client_malloc": client_malloc,
                    "round_trips": n, "size": args.size, "wall_ms_per_round_trip": 1e3 * elapsed / n,
                    "pull_ms": 1e3 * pull_s / n, "push_ms": 1e3 * push_s / n,
                    "profiled_with": "py-spy" if use_py_spy else "none", "pull_out": pull_out}
    timing = (f"wall {record['wall_ms_per_round_trip']:.0f} ms per round trip (pull "
              f"{record['pull_ms']:.0f}, push {record['push_ms']:.0f}"
              + ("; slowed by sampling)" if use_py_spy else ")"))
    lands = "one reused array (out=)" if pull_out else "a fresh array"
    rows = [("path", harness.path_name(args)), ("client malloc", client_malloc),
            ("round trips", f"{n} x {harness.mib(4 * args.size)} each way; {timing}; pulls "
                            f"land in {lands}")]
    for name in ("client", "server"):
        cpu = harness.cpu_delta(before[name], after[name], n)
        record[f"{name}_cpu"] = cpu
        rows.append((f"{name} CPU / round trip", f"user {cpu['user_ms']:.0f} ms + sys "
                                                 f"{cpu['sys_ms']:.0f} ms, "
                                                 f"{cpu['minor_faults']:,.0f} minor faults"))
        for kind, ms in cpu["by_thread_kind_ms"].items():
            rows.append((f"  {kind}", f"{ms:.0f} ms"))
        if use_py_spy:
            profile = harness.classify(harness.read_stacks(files[name]), categories())
            record[f"{name}_py_spy"] = profile
            total = profile["working_samples"] or 1
            rows.append((f"{name} py-spy (Python threads)",
                         f"{profile['working_samples']} working samples at {args.rate}/s "
                         f"({profile['idle_samples']} waiting, dropped)"))
            for category, count in profile["categories"].items():
                rows.append((f"  {category}", f"{100 * count / total:5.1f} %"))
    if use_py_spy:  # before the report: its JSON line stays the last line
        for name in ("client", "server"):
            print(f"-- {name}: innermost Python frame -> native leaf (working samples)")
            for frame, count in record[f"{name}_py_spy"]["top_frames"].items():
                print(f"  {count:6d}  {frame}")
        print(f"raw stacks: {', '.join(str(f) for f in files.values())}")
    harness.report("W2 profile", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
