"""The shared-memory data path with real processes: a ps-server SIGKILLed under a client
that pulls and pushes through its segments, restarted on its port (its segments cleared,
the client back on shared memory), and the data path as ps-cluster and ps-ctl report it.

Every process is started as `python -m MODULE` on OS-chosen ports on 127.0.0.1, in its own
connection, and ended by the `launch` fixture whatever happens; every wait is bounded."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from child_processes import POLL_S, READY_S, Proc
from ps_common import shm
from ps_worker import PSClient, RetryPolicy

UNSUPPORTED = shm.supported()
pytestmark = [pytest.mark.system,
              pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")]

JOB_S = 60.0  # a ps-cluster job of these tests ends within this
CTL = [sys.executable, "-m", "ps_worker.ctl"]
# Calls wait for a server that is away (killed, restarting) for a bounded while.
PATIENT = RetryPolicy(max_attempts=60, initial_backoff_s=0.05, max_backoff_s=0.25)
SGD1 = {"name": "sgd", "lr": 1.0}
COUNT_UP = -np.ones(1, np.float32)  # SGD lr 1: every push adds exactly 1.0 to the counter


# ---- processes -----------------------------------------------------------------------------

def segments_of(pid: int) -> list[str]:
    """The shared-memory segments in /dev/shm named after server process `pid`."""
    return sorted(p.name for p in shm.DIRECTORY.iterdir()
                  if p.name.startswith(f"{shm.PREFIX}{pid}."))


def children_running(parent: int, module: str) -> list[int]:
    """Pids of live children of `parent` started as `python -m module`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            text = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) == parent and fields[0] not in "ZX" and module.encode() in argv:
            found.append(int(entry.name))
    return found


def wait_until(predicate, what: str, timeout: float, watch: tuple[Proc, ...] = ()):
    """Poll `predicate()` until it returns something true (returned); fail, bounded, with
    the logs of `watch`, or at once when a watched process exits."""
    deadline = time.monotonic() + timeout
    while True:
        # Exits first: a process that exits once what is awaited happened is seen with it.
        exited = [p for p in watch if p.returncode is not None]
        result = predicate()
        if result:
            return result
        if exited or time.monotonic() > deadline:
            why = f"{exited[0].name} exited" if exited else f"{timeout:g} s passed"
            pytest.fail(f"{why} while waiting for {what}\n" + "\n".join(p.logs() for p in watch))
        time.sleep(POLL_S)


# ---- a SIGKILLed server under a shared-memory client ---------------------------------------

def test_a_sigkilled_server_is_cleared_on_restart_and_its_shared_memory_client_carries_on(
        launch, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--grace", "1", "--recovery-grace", "0",
                         "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3600s")
    address = coordinator.address()
    server_args = ("--coordinator", address, "--server-id", "s0", "--grace", "1",
                   "--heartbeat-interval", "0.2")
    server = launch("server", "ps_server.cli", "--port", "0", *server_args)
    server_address = server.address()
    killed = server.pid
    rng = np.random.default_rng(5)
    with PSClient(address, retry=PATIENT, timeout_s=10) as ps:
        ps.declare("count", shape=(1,), init="zeros", optimizer=SGD1)
        ps.declare("w", shape=(256, 64), init="uniform", optimizer=SGD1, seed=3)
        for _ in range(5):
            ps.push({"count": COUNT_UP})
        ps.push({"w": rng.standard_normal((256, 64)).astype(np.float32)})
        w = ps.pull("w")
        assert ps.pull("count")[0] == 5.0
        assert ps.data_paths == {server_address: "shm"}
        assert any(name.endswith(".control") for name in segments_of(killed))
        assert any(name.endswith(".values") for name in segments_of(killed))

        taken = subprocess.run([*CTL, "--coordinator", address, "checkpoint"],
                               check=False, capture_output=True, text=True, timeout=60)
        assert taken.returncode == 0, taken.stderr
        checkpoint = json.loads(taken.stdout)["id"]
        for _ in range(3):  # acknowledged after the checkpoint: lost with the server
            ps.push({"count": COUNT_UP})
        assert ps.pull("count")[0] == 8.0

        server.popen.kill()
        assert server.wait() == -signal.SIGKILL
        assert segments_of(killed)  # nobody removed them: the server was killed
        # While it is down, pulls are copies of what it held when it died (no call made).
        assert ps.pull("count")[0] == 8.0
        np.testing.assert_array_equal(ps.pull("w"), w)
        # A push while it is down waits for it, then lands exactly once.
        waiting = threading.Thread(target=ps.push, args=({"count": COUNT_UP},),
                                   name="test-push-while-down")
        waiting.start()
        try:
            again = launch("server-again", "ps_server.cli",
                           "--port", server_address.rsplit(":", 1)[1], *server_args)
            assert again.address() == server_address
            # Cleared (marked retired, then removed) before the new server listened.
            assert segments_of(killed) == []
        finally:
            waiting.join(READY_S)
        assert not waiting.is_alive()

        assert ps.pull("count")[0] == 6.0  # the checkpoint's 5, then the push that waited
        for _ in range(4):
            ps.push({"count": COUNT_UP})
        assert ps.pull("count")[0] == 10.0
        np.testing.assert_array_equal(ps.pull("w"), w)  # restored as checkpointed
        assert ps.data_paths == {server_address: "shm"}  # a new connection on the new server
        assert segments_of(killed) == []
        # Its pushes go through a slot of the new server's, its pulls through its values.
        assert {"control", "values", "slot"} <= {n.rsplit(".", 1)[1]
                                                  for n in segments_of(again.pid)}

    assert re.search(r"restored variable 'count' shard 0 .* from checkpoint .*" + checkpoint,
                     again.err_path.read_text())
    assert again.terminate_and_wait() == 0
    assert coordinator.terminate_and_wait() == 0
    assert segments_of(killed) == [] and segments_of(again.pid) == []


# ---- what ps-cluster and ps-ctl report ------------------------------------------------------

def run_ps_cluster(launch, tmp_path, *args: str) -> tuple[dict, Proc]:
    """Run ps-cluster to its end (bounded); its final JSON line and the process."""
    proc = launch("ps-cluster", "ps_worker.cluster", "--log-dir", str(tmp_path / "logs"), *args)
    assert proc.wait(JOB_S) == 0, proc.logs()
    return json.loads(proc.stdout().splitlines()[-1]), proc


@pytest.mark.parametrize("flags,path", [((), "shm"), (("--no-shm",), "grpc")],
                         ids=["shm", "no-shm"])
def test_ps_cluster_reports_the_data_path_of_its_workers(launch, tmp_path, flags, path):
    outcome, _ = run_ps_cluster(launch, tmp_path, "--servers", "1", "--workers", "2",
                                "--epochs", "2", *flags)
    assert outcome["state"] == "done", outcome
    assert outcome["exit_codes"] == {"coordinator": 0, "server-0": 0, "worker-0": 0,
                                     "worker-1": 0}
    # A worker that started after the other had done every task has used no server.
    assert outcome["data_paths"], outcome
    assert set(outcome["data_paths"]) <= {"worker-0", "worker-1"}, outcome
    worked = {f"worker-{i}": (tmp_path / "logs" / f"worker-{i}.log").read_text()
              for i in range(2)}
    worked = {name: log for name, log in worked.items() if re.search(r"task \d+ .* done", log)}
    assert worked
    if path == "grpc":
        assert set(outcome["data_paths"].values()) == {"grpc"}, outcome
        assert not any("shared memory" in log for log in worked.values())
    else:
        assert all("server ps-0: pulls and pushes go through shared memory" in log
                   for log in worked.values()), worked
        assert {outcome["data_paths"][name] for name in worked} == {"shm"}, outcome


def test_ps_cluster_reports_the_data_path_of_a_job_shorter_than_a_heartbeat(launch, tmp_path):
    outcome, _ = run_ps_cluster(launch, tmp_path, "--servers", "1", "--workers", "1",
                                "--epochs", "1", "--heartbeat-interval", "3",
                                "--heartbeat-timeout", "15")
    assert outcome["state"] == "done", outcome
    assert outcome["data_paths"] == {"worker-0": "shm"}, outcome


def test_ps_ctl_status_shows_the_shared_memory_data_path_of_a_worker(launch, tmp_path):
    cluster = launch("ps-cluster", "ps_worker.cluster", "--servers", "1", "--workers", "2",
                     "--epochs", "2", "--heartbeat-interval", "0.05", "--keep-serving",
                     "--log-dir", str(tmp_path / "logs"))
    # The first line names the coordinator: "coordinator on HOST:PORT; logs in DIR".
    first = wait_until(lambda: cluster.stdout().splitlines()[:1], "ps-cluster's first line",
                       READY_S, watch=(cluster,))
    address = first[0].split(" on ", 1)[1].split(";", 1)[0]

    def worker_line() -> str | None:
        shown = subprocess.run([*CTL, "--coordinator", address, "status"],
                               check=False, capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        header = next((line for line in lines if line.split()[:1] == ["worker"]), None)
        if header is None:  # no worker has registered yet
            return None
        column = header.index("data path")  # the table's columns are aligned
        return next((line for line in lines if re.match(r"\s+worker-\d\s", line)
                     and line[column:].split()[:1] == ["shm"]), None)

    # (Any of the two: either may report "grpc" last, see the test above.)
    wait_until(worker_line, "ps-ctl status to show a worker on shared memory", JOB_S,
               watch=(cluster,))

    (server,) = wait_until(lambda: children_running(cluster.pid, "ps_server.cli"),
                           "ps-cluster's server", READY_S, watch=(cluster,))
    assert any(name.endswith(".control") for name in segments_of(server))
    cluster.terminate_and_wait()  # stops its children with SIGTERM: each cleans up
    assert children_running(cluster.pid, "ps_server.cli") == []
    assert segments_of(server) == []
