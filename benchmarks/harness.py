"""Shared helpers of the benchmarks: real processes on 127.0.0.1, peak RSS, reporting.

Every process a benchmark starts is a child started by `spawn`, which waits (bounded) for
the line a daemon prints once it listens, and is ended by the `with` block that owns it:
SIGTERM, a bounded wait, then SIGKILL. Children run in their own session (a Ctrl-C reaches
the benchmark only, which then stops them in order) and get SIGTERM if the benchmark
process dies without cleaning up (Linux parent-death signal).

Nothing here imports the servers' internals: a cluster is a coordinator and N ps-server
processes started through their CLIs, exactly as an operator would start them.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import platform
import re
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
    """A child process started by `spawn`. `address` is the HOST:PORT it printed."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""

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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Returns the exit status."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
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


def spawn(name: str, argv: Sequence[str], *, log_dir: Path,
          timeout_s: float = STARTUP_TIMEOUT_S) -> Process:
    """Start `argv` (a daemon that prints `... listening on HOST:PORT`) and wait for that line.

    stdout and stderr go to `log_dir/name.log` (a file, so a chatty child never blocks on a
    full pipe). The caller must `stop()` the returned process (see `ProcessGroup`).
    """
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        popen = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            cwd=REPO_ROOT, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        log_file.close()
    process = Process(name, popen, log_path)
    try:
        process.address = process.wait_for_log(_LISTENING, timeout_s).group(1)
    except BaseException:
        process.stop()
        raise
    return process


class ProcessGroup:
    """Owns child processes; stops them in reverse start order on exit (any exit)."""

    def __init__(self, log_dir: Path | None = None):
        self._tmp = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="paramserve-bench-")
            log_dir = Path(self._tmp.name)
        self.log_dir = log_dir
        self.processes: list[Process] = []

    def spawn(self, name: str, argv: Sequence[str], **kwargs) -> Process:
        process = spawn(name, argv, log_dir=self.log_dir, **kwargs)
        self.processes.append(process)
        return process

    def close(self) -> None:
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
    """A coordinator plus `n_servers` ps-server processes (ids s0, s1, ...), each registered.

    Yields once every server has registered with the coordinator; stops them all on exit.
    """
    py = sys.executable
    with ProcessGroup() as group:
        coordinator = group.spawn("coordinator", [
            py, "-m", "ps_server.coordinator.cli", "--host", HOST, "--port", "0",
            "--recovery-grace", "0",
            "--grace", "1", "--log-level", log_level, *coordinator_args], timeout_s=timeout_s)
        servers = [group.spawn(f"s{i}", [
            py, "-m", "ps_server.cli", "--host", HOST, "--port", "0",
            "--coordinator", coordinator.address, "--server-id", f"s{i}", "--grace", "1",
            "--log-level", "info", *server_args], timeout_s=timeout_s)
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


def report(title: str, rows: Sequence[tuple[str, str]], record: dict) -> None:
    """Print `rows` as an aligned two-column table, then `record` as one JSON line."""
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
