"""Shared helpers of the benchmarks: real processes on 127.0.0.1, peak RSS, reporting.

Every process a benchmark starts is a child started by `spawn`, which waits (bounded) for
the line a daemon prints once it listens (or by `start`, for a ps-worker, which prints none),
and is ended by the `with` block that owns it:
SIGTERM, a bounded wait, then SIGKILL. Children run in their own process group (a Ctrl-C reaches
the benchmark only, which then stops them in order) and get SIGTERM if the benchmark
process dies without cleaning up (Linux parent-death signal).

Nothing here imports the servers' internals: a cluster is a coordinator and N ps-server
processes started through their CLIs, exactly as an operator would start them.

Also: CPU accounting per process and per thread from /proc (gRPC's C-core threads count
too), py-spy sampling and the sorting of its stacks, the `--quick` flag every benchmark
offers (a check that it still runs, never a measurement) and the one-JSON-line report.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Benchmarks measure the checkout they live in (children run with cwd=REPO_ROOT, so `-m`
# imports from it too), whatever paramserve the environment has installed.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

_LISTENING = re.compile(r"listening on (\S+:\d+)")
# Where the coordinator does not implement GetStatus (older trees), a server's registration
# is read from the server's own log instead.
_REGISTERED = "registered with coordinator"


# ---- processes ------------------------------------------------------------------------

def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Process:
    """A child process started by `start` or `spawn`. `address`: the HOST:PORT it printed
    (`spawn` only)."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    _terminated: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_for_log(self, needle: str | re.Pattern, timeout_s: float) -> re.Match | str:
        """Poll this process's log until `needle` appears; bounded by `timeout_s`.

        Raises RuntimeError (with the log's tail) if the process exits or time runs out.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log_path.read_text(errors="replace")
            found = (needle.search(text) if isinstance(needle, re.Pattern)
                     else (needle if needle in text else None))
            if found:
                return found
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.popen.returncode} "
                                   f"before printing {needle!r}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not print {needle!r} within {timeout_s:g} s:"
                                   f"\n{self.log_tail()}")
            time.sleep(0.02)

    def terminate(self) -> None:
        """Send SIGTERM once (a second one may cut a graceful stop short); no wait."""
        if self.popen.poll() is None and not self._terminated:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Returns the exit status."""
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.popen.kill()
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)


def start(name: str, argv: Sequence[str], *, log_dir: Path,
          env: dict[str, str] | None = None) -> Process:
    """Start `argv` without waiting for anything (e.g. a ps-worker, which does not listen).

    stdout and stderr go to `log_dir/name.log` (a file, so a chatty child never blocks on a
    full pipe). `env` replaces the environment (default: this process's). The caller must
    `stop()` the returned process (see `ProcessGroup`).
    """
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "wb")
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    try:
        popen = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            cwd=REPO_ROOT, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        log_file.close()
    return Process(name, popen, log_path)


def spawn(name: str, argv: Sequence[str], *, log_dir: Path,
          timeout_s: float = STARTUP_TIMEOUT_S, env: dict[str, str] | None = None) -> Process:
    """Start `argv` (a daemon that prints `... listening on HOST:PORT`) and wait for that line.

    As `start`, then bounded by `timeout_s`; the process is stopped if it never listens.
    """
    process = start(name, argv, log_dir=log_dir, env=env)
    try:
        process.address = process.wait_for_log(_LISTENING, timeout_s).group(1)
    except BaseException:
        process.stop()
        raise
    return process


class ProcessGroup:
    """Owns child processes; stops them in reverse start order on exit (any exit).

    With `together=True` every process gets SIGTERM first and is then waited for (bounded),
    so that N peers (workers) stop in the time of one rather than of N.
    """

    def __init__(self, log_dir: Path | None = None, *, together: bool = False):
        self._tmp = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="paramserve-bench-")
            log_dir = Path(self._tmp.name)
        self.log_dir = log_dir
        self.together = together
        self.processes: list[Process] = []

    def spawn(self, name: str, argv: Sequence[str], **kwargs) -> Process:
        """`spawn` a daemon (waits for its `listening on` line)."""
        process = spawn(name, argv, log_dir=self.log_dir, **kwargs)
        self.processes.append(process)
        return process

    def start(self, name: str, argv: Sequence[str], **kwargs) -> Process:
        """`start` a process that prints nothing to wait for (e.g. a ps-worker)."""
        process = start(name, argv, log_dir=self.log_dir, **kwargs)
        self.processes.append(process)
        return process

    def close(self) -> None:
        if self.together:
            for process in self.processes:
                process.terminate()
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Cluster:
    coordinator: Process
    servers: list[Process] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.coordinator.address


@contextlib.contextmanager
def cluster(n_servers: int = 1, *, server_args: Sequence[str] = (),
            coordinator_args: Sequence[str] = (), log_level: str = "info",
            timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[Cluster]:
    """A coordinator plus `n_servers` ps-server processes (ids s0, s1, ...), each registered,
    each with ps-cluster's environment for them (one BLAS thread).

    Yields once every server has registered with the coordinator; stops them all on exit.
    """
    from ps_worker.cluster import daemon_environment

    py, env = sys.executable, daemon_environment()
    with ProcessGroup() as group:
        coordinator = group.spawn("coordinator", [
            py, "-m", "ps_server.coordinator.cli", "--host", HOST, "--port", "0",
            "--recovery-grace", "0",
            "--grace", "1", "--log-level", log_level, *coordinator_args], timeout_s=timeout_s,
            env=env)
        servers = [group.spawn(f"s{i}", [
            py, "-m", "ps_server.cli", "--host", HOST, "--port", "0",
            "--coordinator", coordinator.address, "--server-id", f"s{i}", "--grace", "1",
            "--log-level", "info", *server_args], timeout_s=timeout_s, env=env)
            for i in range(n_servers)]
        wait_registered(coordinator, servers, timeout_s)
        yield Cluster(coordinator, servers)


def wait_registered(coordinator: Process, servers: list[Process], timeout_s: float) -> None:
    """Block (bounded) until the coordinator reports every server alive."""
    import grpc

    from ps_proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    wanted = {s.name for s in servers}
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while True:
            try:
                status = stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5.0)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                for server in servers:
                    server.wait_for_log(_REGISTERED, max(0.1, deadline - time.monotonic()))
                return
            alive = {s.server_id for s in status.servers if s.state == "alive"}
            if wanted <= alive:
                return
            for process in (coordinator, *servers):
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{process.name} exited with status "
                                       f"{process.popen.returncode}:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"servers {sorted(wanted - alive)} did not register within "
                                   f"{timeout_s:g} s")
            time.sleep(0.05)


# ---- memory ---------------------------------------------------------------------------

def _status_kib(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(f"{key} not in /proc/{pid}/status")


def thread_census() -> str:
    """How many threads this machine runs against its limits on them, for the message of a
    child that died: a thread that cannot be created (pthread_create: EAGAIN) aborts grpcio's
    C core, and this tells a machine out of threads from a fault of the child's own."""
    import resource

    threads = processes = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                threads += len(os.listdir(f"/proc/{entry.name}/task"))
                processes += 1
    limits = [f"RLIMIT_NPROC {resource.getrlimit(resource.RLIMIT_NPROC)[0]}"]
    for name, path in (("pids.max", "/sys/fs/cgroup/pids.max"),
                       ("pids.max", "/sys/fs/cgroup/pids/pids.max"),
                       ("threads-max", "/proc/sys/kernel/threads-max"),
                       ("pid_max", "/proc/sys/kernel/pid_max")):
        with contextlib.suppress(OSError):
            limits.append(f"{name} {Path(path).read_text().strip()}")
    return (f"this machine: {threads} threads in {processes} processes, "
            f"{os.cpu_count()} cores; limits: {', '.join(limits)}")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's peak resident set size so far (VmHWM)."""
    return _status_kib(pid, "VmHWM") * 1024


def rss_bytes(pid: int | str = "self") -> int:
    """The process's current resident set size (VmRSS)."""
    return _status_kib(pid, "VmRSS") * 1024


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- CPU accounting (/proc) -----------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Thread names (/proc/PID/task/TID/comm, 15 characters at most) of gRPC's C-core threads.
# Python threads keep the process's own name (Python < 3.14 names no OS thread), and so do
# native threads that never name themselves (e.g. OpenBLAS's).
GRPC_CORE_THREADS = ("event_engine", "grpc_global_tim", "lifeguard", "default-executo",
                     "resolver-execut", "timer_manager", "grpc_")
GRPC_THREADS_KIND = "gRPC C-core threads (event_engine, timer, lifeguard)"
PYTHON_THREADS_KIND = "Python threads (and unnamed native ones)"
ENDED_THREADS_KIND = "threads that ended meanwhile"


def _stat_fields(path: str) -> tuple[str, list[str]]:
    """(comm, the fields after it) of a /proc/.../stat file; the fields are numbered from 3
    in proc(5), so utime (14) is fields[11] and stime (15) fields[12]."""
    with open(path) as f:
        text = f.read()
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process so far: all its threads, ended ones included."""
    _, fields = _stat_fields(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _thread_cpu_seconds(task: str) -> tuple[str, float]:
    """(name, CPU seconds) of one thread (/proc/PID/task/TID): from `schedstat` (nanoseconds
    on the CPU) where the kernel has it, else from `stat` (whole clock ticks, each rounded
    on its own: summed over dozens of mostly idle threads they can miss the process total
    by a few percent)."""
    with open(f"{task}/comm") as f:
        name = f.read().rstrip("\n")
    try:
        with open(f"{task}/schedstat") as f:
            return name, int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        _, fields = _stat_fields(f"{task}/stat")
        return name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_snapshot(pid: int | str) -> dict:
    """Process totals (user, system seconds; minor faults) and per-thread CPU with names."""
    comm, fields = _stat_fields(f"/proc/{pid}/stat")
    threads: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            threads[int(tid)] = _thread_cpu_seconds(f"/proc/{pid}/task/{tid}")
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return {"comm": comm, "user_s": int(fields[11]) / CLOCK_TICKS,
            "sys_s": int(fields[12]) / CLOCK_TICKS, "minflt": int(fields[7]),
            "threads": threads}


def thread_kind(comm: str, process_comm: str) -> str:
    """What a thread is, from its name: gRPC C-core, Python (the process's own name), or
    another native thread that named itself (listed under its name)."""
    if comm.startswith(GRPC_CORE_THREADS):
        return GRPC_THREADS_KIND
    if comm == process_comm:
        return PYTHON_THREADS_KIND
    return f"native thread {comm!r}"


def cpu_delta(before: dict, after: dict, per: float) -> dict:
    """CPU between two `cpu_snapshot`s of one process, per unit of work (`per` units, e.g.
    steps or round trips): user and system ms, minor faults, and ms by kind of thread. CPU
    of threads that ended between the snapshots is the process total less the live ones'."""
    by_kind: collections.Counter = collections.Counter()
    live = 0.0
    for tid, (comm, cpu) in after["threads"].items():
        spent = cpu - before["threads"].get(tid, (comm, 0.0))[1]
        by_kind[thread_kind(comm, after["comm"])] += spent
        live += spent
    user = after["user_s"] - before["user_s"]
    system = after["sys_s"] - before["sys_s"]
    ended = user + system - live
    # The process totals count whole clock ticks: within 2 ticks of the threads' sum is
    # rounding, not threads that ended.
    if ended > 2.0 / CLOCK_TICKS:
        by_kind[ENDED_THREADS_KIND] += ended
    scale = 1e3 / per
    return {"user_ms": user * scale, "sys_ms": system * scale,
            "cpu_ms": (user + system) * scale,
            "minor_faults": (after["minflt"] - before["minflt"]) / per,
            "by_thread_kind_ms": {k: v * scale for k, v in by_kind.most_common()}}


# ---- py-spy ---------------------------------------------------------------------------

# A sample whose innermost frames are one of these is a thread waiting, not working.
PY_SPY_WAITING = ("epoll_wait", "pthread_cond_timedwait", "pthread_cond_wait", "sem_wait",
                  "sem_timedwait", "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock",
                  "poll (libc", "select (libc", "nanosleep", "accept", "recv (libc",
                  "syscall (libc")

# (category, needles) shared by the profiles. Each working sample goes to the category of
# its innermost frame that matches a needle, so e.g. a protobuf parse called from gRPC's
# code counts as a parse. A profile puts its own categories in front of these.
PY_SPY_CATEGORIES = [
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


def py_spy_available() -> bool:
    return shutil.which("py-spy") is not None


def start_py_spy(pid: int, output: Path, rate: int) -> subprocess.Popen:
    """py-spy sampling every thread of `pid`, native frames included, into `output` (raw,
    "collapsed" stacks) until `stop_py_spy`. Needs `pip install py-spy`."""
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


def _category(stack: list[str], categories: Sequence[tuple[str, tuple[str, ...]]]) -> str:
    for frame in reversed(stack):
        for name, needles in categories:
            if any(n in frame for n in needles):
                return name
    return "other"


def classify(stacks: list[tuple[list[str], int]],
             categories: Sequence[tuple[str, tuple[str, ...]]] = PY_SPY_CATEGORIES, *,
             anywhere: Sequence[tuple[str, tuple[str, ...]]] = ()) -> dict:
    """Working samples by category, and the innermost Python frames that take the most;
    samples of waiting threads are counted apart and dropped. A sample with a frame
    matching one of `anywhere` goes to that category whatever its inner frames are (e.g.
    every NumPy call made by the model counts as the model), else to `categories`'s."""
    working = idle = 0
    by_category: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    for stack, count in stacks:
        if any(w in ";".join(stack[-3:]) for w in PY_SPY_WAITING):
            idle += count
            continue
        working += count
        outer = next((name for name, needles in anywhere
                      if any(n in frame for frame in stack for n in needles)), None)
        by_category[outer or _category(stack, categories)] += count
        frames[f"{_innermost_python(stack)} -> {stack[-1]}"] += count
    return {"working_samples": working, "idle_samples": idle,
            "categories": dict(by_category.most_common()),
            "top_frames": dict(frames.most_common(12))}


# ---- time bounds ----------------------------------------------------------------------

class BenchmarkTimeout(Exception):
    """The whole benchmark ran past its wall-clock bound."""


@contextlib.contextmanager
def bounded(total_s: float, what: str = "benchmark") -> Iterator[None]:
    """Raise BenchmarkTimeout in the main thread after `total_s`; SIGTERM ends it cleanly.

    Turns SIGTERM into SystemExit so that every `with` block (hence every child process)
    is closed on the way out, as it is for Ctrl-C (KeyboardInterrupt).
    """
    def on_alarm(signum, frame):
        raise BenchmarkTimeout(f"{what} ran past its bound of {total_s:g} s")

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = {signal.SIGALRM: signal.signal(signal.SIGALRM, on_alarm),
                signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    signal.setitimer(signal.ITIMER_REAL, total_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_main(main) -> None:
    """`sys.exit(main())`, with Ctrl-C (exit 130) and a blown time bound (exit 124) reported
    in one line instead of a traceback; children are already stopped by then."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; every process this benchmark started has been stopped",
              file=sys.stderr)
        code = 130
    except BenchmarkTimeout as error:
        print(f"{error}; every process this benchmark started has been stopped",
              file=sys.stderr)
        code = 124
    sys.exit(code)


# ---- --quick --------------------------------------------------------------------------

QUICK_HELP = ("catch breakage, not a measurement: tiny sizes and durations (a few seconds) "
              "through every step and check of the run; flags given explicitly still win")


def add_quick_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)


def add_path_flag(parser: argparse.ArgumentParser) -> None:
    """--no-shm: measure the gRPC path (as for workers on another host): servers started
    with --no-shm, clients with shared_memory=False. Default: shared memory, which every
    client of these benchmarks can use (they run on the servers' host)."""
    parser.add_argument("--no-shm", action="store_true",
                        help="measure the gRPC path (servers and clients with --no-shm), as "
                        "for workers on another host; default: the shared-memory path")


def path_name(args: argparse.Namespace) -> str:
    return "grpc" if args.no_shm else "shm"


def no_shm_args(args: argparse.Namespace) -> list[str]:
    return ["--no-shm"] if args.no_shm else []


def client_path_args(args: argparse.Namespace) -> dict:
    """PSClient keyword arguments for the path measured (none by default, so that the
    benchmarks also run against checkouts older than the shared-memory path)."""
    return {"shared_memory": False} if args.no_shm else {}


def tune_client_malloc() -> str:
    """Set this process's malloc as ps-worker sets its own (ps_worker.tune_malloc); what
    was done, for the report. A checkout older than tune_malloc leaves glibc's defaults.

    Not for a process that also runs a baseline's client (W2's bare grpcio client runs in
    W2's process): the baseline would run with paramserve's tuning, not as grpcio comes."""
    try:
        from ps_worker import tune_malloc
    except ImportError:
        return "glibc's defaults (this checkout has no ps_worker.tune_malloc)"
    return "as ps-worker's (ps_worker.tune_malloc)" if tune_malloc() else "glibc's defaults"


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, **small) -> None:
    """With `--quick`, set each of `small` (dest=value) that is still at its default."""
    if getattr(args, "quick", False):
        for dest, value in small.items():
            if getattr(args, dest) == parser.get_default(dest):
                setattr(args, dest, value)


# ---- reporting ------------------------------------------------------------------------

def git_commit() -> str:
    """`git rev-parse --short HEAD`, with "-dirty" when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (head or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        ram = int(meminfo.readline().split()[1]) * 1024
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_bytes": ram,
            "python": platform.python_version()}


def context() -> dict:
    """Where and when a result was measured: goes into every JSON line."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine(), "argv": sys.argv,
            # Other work on the machine skews every figure; the baseline ratio less so.
            "loadavg_1m": os.getloadavg()[0]}


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def report(title: str, rows: Sequence[tuple[str, str]], record: dict, *,
           quick: bool = False) -> None:
    """Print `rows` as an aligned two-column table, then `record` as one JSON line.
    `quick`: a `--quick` run, said in the table and in the record ("quick": true)."""
    if quick:
        rows = [("--quick", "a check that every step runs: tiny sizes and durations, the "
                            "figures mean nothing"), *rows]
        record = {**record, "quick": True}
    width = max((len(label) for label, _ in rows), default=0)
    lines = [f"== {title}", *(f"  {label.ljust(width)}  {value}" for label, value in rows),
             json.dumps({"benchmark": title, **record, **context()}, separators=(",", ":"))]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # e.g. `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), -(-len(sorted_values) * q // 100)))
    return sorted_values[int(rank) - 1]
