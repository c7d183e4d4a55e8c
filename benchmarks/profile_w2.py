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

    python benchmarks/profile_w2.py                   # 20 round trips of 64 MiB
    python benchmarks/profile_w2.py --round-trips 1   # exactly one round trip

Raw py-spy stacks are kept under benchmarks/out/profile/ (flamegraph "collapsed" format).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from ps_worker import PSClient

OUT_DIR = harness.REPO_ROOT / "benchmarks" / "out" / "profile"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# A sample whose innermost frames are one of these is a thread waiting, not working.
WAITING = ("epoll_wait", "pthread_cond_timedwait", "pthread_cond_wait", "sem_wait",
           "sem_timedwait", "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock",
           "poll (libc", "select (libc", "nanosleep", "accept", "recv (libc", "syscall (libc")

# (category, needles). Each working sample goes to the category of its innermost frame
# that matches a needle, so e.g. a protobuf parse called from gRPC's code counts as a parse.
CATEGORIES = [
    ("protobuf serialize (SerializeToString: a copy)",
     ("upb_Encode", "PyUpb_Message_SerializeInternal", "serialize (grpc/_common.py")),
    ("protobuf parse (FromString: a copy)",
     ("upb_Decode", "PyUpb_Message_FromString", "PyUpb_Message_MergeFromString",
      "deserialize (grpc/_common.py")),
    ("protobuf build PullChunk/PushChunk(data=...) (a copy)",
     ("PyUpb_Message_InitAttributes", "PyUpb_PyToUpb", "PyUpb_Message_New")),
    ("protobuf chunk.data getattr (a copy)", ("PyUpb_Message_GetAttr",)),
    ("protobuf message free", ("PyUpb_Message_Dealloc", "upb_Arena_Free")),
    ("free arrays / buffers (munmap)", ("array_dealloc", "munmap", "bytes_dealloc")),
    ("optimizer (sgd update)", ("apply_update", "optimizers.py")),
    ("finiteness check (grad.sum(float64))", ("check_gradients", "_methods.py", "isfinite")),
    ("copy: chunk -> destination (StreamAssembler.write)", ("StreamAssembler.write",)),
    ("copy: array -> bytes (array_reader: tobytes)", ("array_reader.<locals>.read",)),
    ("gRPC Python/Cython (send, receive, events)", ("cygrpc", "grpc/")),
    ("other paramserve Python", ("ps_common/", "ps_server/", "ps_worker/")),
]


def _allocation_frames() -> tuple[str, ...]:
    """Frames of the servicer line that allocates a push's gradient buffer (found in the
    source, so the profile keeps working when lines move)."""
    import inspect

    from ps_server.servicer import ParameterServerServicer
    lines, first = inspect.getsourcelines(ParameterServerServicer.Push)
    return tuple(f"<listcomp> (ps_server/servicer.py:{first + i})"
                 for i, line in enumerate(lines) if "bytearray(" in line)


# ---- /proc accounting -----------------------------------------------------------------

def _stat_fields(path: str) -> tuple[str, list[str]]:
    with open(path) as f:
        text = f.read()
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def cpu_snapshot(pid: int) -> dict:
    """Process totals (user, system seconds; minor faults) and per-thread CPU by name."""
    _, fields = _stat_fields(f"/proc/{pid}/stat")
    threads: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm, tf = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        threads[int(tid)] = (comm, (int(tf[11]) + int(tf[12])) / CLOCK_TICKS)
    return {"user_s": int(fields[11]) / CLOCK_TICKS, "sys_s": int(fields[12]) / CLOCK_TICKS,
            "minflt": int(fields[7]), "threads": threads}


def cpu_delta(before: dict, after: dict, round_trips: int) -> dict:
    """Per round trip: user/sys CPU ms, minor faults, and CPU ms by kind of thread."""
    by_kind: collections.Counter = collections.Counter()
    live = 0.0
    for tid, (comm, cpu) in after["threads"].items():
        spent = cpu - before["threads"].get(tid, (comm, 0.0))[1]
        kind = "gRPC C-core threads (event_engine)" if comm == "event_engine" else \
            "Python threads (handlers, main)"
        by_kind[kind] += spent
        live += spent
    total = (after["user_s"] - before["user_s"]) + (after["sys_s"] - before["sys_s"])
    by_kind["threads that ended (e.g. push request consumers)"] += max(0.0, total - live)
    per = 1e3 / round_trips
    return {"user_ms": (after["user_s"] - before["user_s"]) * per,
            "sys_ms": (after["sys_s"] - before["sys_s"]) * per,
            "minor_faults": (after["minflt"] - before["minflt"]) / round_trips,
            "by_thread_kind_ms": {k: v * per for k, v in by_kind.most_common()}}


# ---- py-spy ---------------------------------------------------------------------------

def start_py_spy(pid: int, output: Path, rate: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
         "--native", "--threads", "--output", str(output), "--duration", "600"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_py_spy(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    if not path.exists():
        return stacks
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def _innermost_python(frames: list[str]) -> str:
    for frame in reversed(frames):
        if ".py:" in frame:
            return frame
    return frames[-1]


def classify(stacks: list[tuple[list[str], int]]) -> dict:
    """Working samples by category, and the innermost Python frames that take the most."""
    categories_ = [("allocate push buffer: bytearray(nbytes) (zero-fill + page faults)",
                    _allocation_frames()), *CATEGORIES]
    working = idle = 0
    categories: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    for stack, count in stacks:
        if any(w in ";".join(stack[-3:]) for w in WAITING):
            idle += count
            continue
        working += count
        categories[_category(stack, categories_)] += count
        frames[f"{_innermost_python(stack)} -> {stack[-1]}"] += count
    return {"working_samples": working, "idle_samples": idle,
            "categories": dict(categories.most_common()),
            "top_frames": dict(frames.most_common(12))}


def _category(stack: list[str], categories: list[tuple[str, tuple[str, ...]]]) -> str:
    for frame in reversed(stack):
        for name, needles in categories:
            if any(n in frame for n in needles):
                return name
    return "other"


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
    args = p.parse_args(argv)
    if args.round_trips < 1:
        p.error("--round-trips must be >= 1")
    use_py_spy = not args.no_py_spy
    if use_py_spy and shutil.which("py-spy") is None:
        p.error("py-spy is not installed: pip install py-spy (or pass --no-py-spy)")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    files = {"client": OUT_DIR / "client.txt", "server": OUT_DIR / "server.txt"}
    for f in files.values():
        f.unlink(missing_ok=True)

    spies: list[subprocess.Popen] = []
    with harness.bounded(300 + 10 * args.round_trips, "profile_w2"), \
            harness.cluster(1, log_level="warning") as c:
        try:
            with PSClient(c.address) as client:
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
                    spies = [start_py_spy(pid, files[name], args.rate) for name, pid in pids.items()]
                    time.sleep(1.0)  # let py-spy attach before the measured part
                before = {name: cpu_snapshot(pid) for name, pid in pids.items()}
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
                after = {name: cpu_snapshot(pid) for name, pid in pids.items()}
        finally:
            for spy in spies:
                stop_py_spy(spy)

    n = args.round_trips
    record: dict = {"round_trips": n, "size": args.size, "wall_ms_per_round_trip": 1e3 * elapsed / n,
                    "pull_ms": 1e3 * pull_s / n, "push_ms": 1e3 * push_s / n,
                    "profiled_with": "py-spy" if use_py_spy else "none", "pull_out": pull_out}
    timing = (f"wall {record['wall_ms_per_round_trip']:.0f} ms per round trip (pull "
              f"{record['pull_ms']:.0f}, push {record['push_ms']:.0f}"
              + ("; slowed by sampling)" if use_py_spy else ")"))
    lands = "one reused array (out=)" if pull_out else "a fresh array"
    rows = [("round trips", f"{n} x {harness.mib(4 * args.size)} each way; {timing}; pulls "
                            f"land in {lands}")]
    for name in ("client", "server"):
        cpu = cpu_delta(before[name], after[name], n)
        record[f"{name}_cpu"] = cpu
        rows.append((f"{name} CPU / round trip", f"user {cpu['user_ms']:.0f} ms + sys "
                                                 f"{cpu['sys_ms']:.0f} ms, "
                                                 f"{cpu['minor_faults']:,.0f} minor faults"))
        for kind, ms in cpu["by_thread_kind_ms"].items():
            rows.append((f"  {kind}", f"{ms:.0f} ms"))
        if use_py_spy:
            profile = classify(read_stacks(files[name]))
            record[f"{name}_py_spy"] = profile
            total = profile["working_samples"] or 1
            rows.append((f"{name} py-spy (Python threads)",
                         f"{profile['working_samples']} working samples at {args.rate}/s "
                         f"({profile['idle_samples']} waiting, dropped)"))
            for category, count in profile["categories"].items():
                rows.append((f"  {category}", f"{100 * count / total:5.1f} %"))
    harness.report("W2 profile", rows, record)
    if use_py_spy:
        for name in ("client", "server"):
            print(f"-- {name}: innermost Python frame -> native leaf (working samples)")
            for frame, count in record[f"{name}_py_spy"]["top_frames"].items():
                print(f"  {count:6d}  {frame}")
        print(f"raw stacks: {', '.join(str(f) for f in files.values())}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
