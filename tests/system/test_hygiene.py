"""No process outlives its reason to run: ps-cluster's children end with it even when it is
SIGKILLed, and a worker waiting for an absent parameter server still exits on SIGTERM.

Real processes (`python -m MODULE`) on OS-chosen ports. Every wait is bounded, and every
process a test starts (ps-cluster's children included) is ended, pass or fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ps_worker.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.system

READY_S = 30.0  # a process is up (listening, training) within this
EXIT_S = 15.0  # a process told to finish exits within this
# Bounded waits for what the tests are about: far above the --grace periods involved, far
# below the two minutes a stuck worker took before.
ORPHANS_GONE_S = 60.0
WORKER_EXIT_S = 30.0
POLL_S = 0.05
LONG_JOB = ["--epochs", "1000", "--tasks-per-epoch", "2"]


# ---- processes we did not start: ps-cluster's children, found through /proc ----------------

@dataclass(frozen=True)
class Pid:
    """A process by pid and start time, so that a recycled pid is never taken for it."""

    pid: int
    start: int

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start and stat[2] not in "ZX"

    def describe(self) -> str:
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            argv = b"?"
        return f"{self.pid} ({_stat(self.pid)}): {argv.decode(errors='replace')}"

    def kill(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) from /proc/PID/stat; None once the pid is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), int(fields[19]), fields[0]


def logs_of(directory: Path) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-2000:]}"
                     for log in sorted(directory.glob("*.log")))


def live_children(parent: int) -> list[Pid]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] == parent and stat[2] not in "ZX":
            found.append(Pid(int(entry.name), stat[1]))
    return found


# ---- processes we start ---------------------------------------------------------------------

class Proc:
    """`python -m module args`, its stdout and stderr in files, detached by setsid."""

    def __init__(self, name: str, module: str, args: list[str], directory: Path):
        self.name = name
        self.out_path, self.err_path = directory / f"{name}.out", directory / f"{name}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def logs(self) -> str:
        return (f"--- {self.name} (exit {self.returncode}) stdout:\n"
                f"{self.out_path.read_text(errors='replace')[-3000:]}\n--- stderr:\n"
                f"{self.err_path.read_text(errors='replace')[-3000:]}")

    def address(self) -> str:
        """HOST:PORT from its 'listening on HOST:PORT' line (bounded wait)."""
        def listening() -> str | None:
            return next((line.rsplit(" ", 1)[-1] for line in
                         self.out_path.read_text(errors="replace").splitlines()
                         if " listening on " in line), None)

        wait_until(lambda: listening() is not None, f"{self.name} to listen", READY_S,
                   watch=(self,))
        return listening()

    def signal(self, signum: int) -> None:
        if self.returncode is None:
            self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout:g} s\n{self.logs()}")


def wait_until(predicate, what: str, timeout: float, watch: tuple[Proc, ...] = ()) -> None:
    """Poll `predicate` (bounded); fail at once if a watched process exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        # Exits first: a process that exits once what is awaited happened is seen with it.
        exited = [p for p in watch if p.returncode is not None]
        if predicate():
            return
        if exited or time.monotonic() > deadline:
            why = f"{exited[0].name} exited" if exited else f"{timeout:g} s passed"
            pytest.fail(f"{why} while waiting for {what}\n" + "\n".join(p.logs() for p in watch))
        time.sleep(POLL_S)


@pytest.fixture
def launch(tmp_path):
    """`launch(name, module, *args)` starts a process; after the test each one still
    running gets SIGCONT (a test may have paused it) and SIGTERM, then SIGKILL if it has not
    exited within a bounded wait."""
    started: list[Proc] = []

    def start(name: str, module: str, *args: str) -> Proc:
        started.append(Proc(name, module, list(args), tmp_path))
        return started[-1]

    yield start
    alive = [p for p in started if p.returncode is None]
    for proc in alive:
        proc.signal(signal.SIGCONT)
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + EXIT_S
    for proc in alive:
        try:
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(EXIT_S)


# ---- ps-cluster killed ----------------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="children learn of ps-cluster's death through Linux's "
                           "PR_SET_PDEATHSIG")
def test_children_of_a_sigkilled_ps_cluster_all_exit(launch, tmp_path):
    cluster = launch("ps-cluster", "ps_worker.cluster", "--servers", "2", "--workers", "2",
                     "--log-dir", str(tmp_path / "cluster-logs"), *LONG_JOB)
    children: list[Pid] = []
    try:
        # Its first line: "coordinator on HOST:PORT; logs in DIR".
        wait_until(lambda: "coordinator on " in cluster.out_path.read_text(),
                   "ps-cluster to start its coordinator", READY_S, watch=(cluster,))
        address = cluster.out_path.read_text().split(" on ", 1)[1].split(";", 1)[0]
        with CoordinatorClient(address, give_up_after_s=5.0, rpc_timeout_s=5.0) as client:
            wait_until(lambda: [w["steps"] > 0 for w in client.status()["workers"]]
                       == [True, True], "both workers to train", READY_S, watch=(cluster,))
        children = live_children(cluster.popen.pid)
        assert len(children) == 5, (children, cluster.logs())  # coordinator, 2 + 2

        cluster.signal(signal.SIGKILL)
        assert cluster.wait(EXIT_S) == -signal.SIGKILL
        deadline = time.monotonic() + ORPHANS_GONE_S
        while any(c.alive() for c in children) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        left = [c for c in children if c.alive()]
        assert left == [], (f"children of the SIGKILLed ps-cluster still running after "
                            f"{ORPHANS_GONE_S:g} s: {[c.describe() for c in left]}\n"
                            + logs_of(tmp_path / "cluster-logs"))
    finally:
        for child in children:  # orphans left by a failure (ps-cluster stops the others)
            child.kill()


# ---- a worker whose parameter server is gone ------------------------------------------------

def start_training(launch) -> tuple[Proc, Proc, Proc, CoordinatorClient]:
    """A coordinator with a long job, one server and one worker (--grace 10), training."""
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", *LONG_JOB)
    address = coordinator.address()
    server = launch("ps-0", "ps_server.cli", "--port", "0", "--server-id", "ps-0",
                    "--coordinator", address, "--heartbeat-interval", "0.2")
    server.address()
    worker = launch("w0", "ps_worker.cli", "--coordinator", address, "--worker-id", "w0",
                    "--device", "cpu", "--grace", "10")
    client = CoordinatorClient(address, give_up_after_s=5.0, rpc_timeout_s=5.0)
    wait_until(lambda: client.status()["job"]["steps"] > 0, "training to start", READY_S,
               watch=(coordinator, server, worker))
    return coordinator, server, worker, client


def server_state(client: CoordinatorClient, server_id: str) -> str:
    return {s["id"]: s["state"] for s in client.status()["servers"]}[server_id]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_worker_waiting_for_a_lost_server_exits_cleanly_on_sigterm(launch, fault):
    """The server is SIGKILLed (gone) or SIGSTOPped (hung: a pull on the wire would wait for
    its deadline) mid-job and stays away: the worker waits for it (no exit of its own), and
    SIGTERM interrupts its client, retries and calls on the wire alike: a clean exit, well
    within its grace."""
    coordinator, server, worker, client = start_training(launch)
    try:
        server.signal(fault)
        if fault == signal.SIGKILL:
            assert server.wait(EXIT_S) == -signal.SIGKILL
        # By the time the coordinator notices, the worker (pulling every step) has too.
        wait_until(lambda: server_state(client, "ps-0") != "alive", "the server's lease to end",
                   READY_S, watch=(coordinator,))
    finally:
        client.close()
    assert worker.returncode is None, worker.logs()
    worker.signal(signal.SIGTERM)
    assert worker.wait(WORKER_EXIT_S) == 0, worker.logs()
