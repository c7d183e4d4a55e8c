"""SIGTERM reaches a ps-server while it writes its part of a checkpoint: the process exits
(0) once its graceful stop is over, not when the write ends. The handler still writing runs
on a thread of the gRPC server's pool, which the interpreter would join at exit; the server
ends the process without it (ps_common.cli.exit_after_stop).

The checkpoint's file write is made slow deterministically: a hook in the server process
blocks the first write of checkpoint data until a file appears (at most BLOCK_S, far past
the wait for the exit).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from child_processes import EXIT_S
from ps_worker import PSClient, RetryPolicy

pytestmark = pytest.mark.system

COORDINATOR = [sys.executable, "-m", "ps_server.coordinator.cli"]
PATIENT = RetryPolicy(max_attempts=60, initial_backoff_s=0.05, max_backoff_s=0.25)
WAIT_S = 30.0  # bound of every wait on a condition
BLOCK_S = 100.0  # how long the hook holds the write at most (a disk that slow)

# The server process: ps-server's own main, with checkpoint writes that block (as on a very
# slow disk) until RELEASE exists; BLOCKED is created once a write is held.
DRIVER = r"""
import os, sys, time
from pathlib import Path
blocked, release = Path(sys.argv[1]), Path(sys.argv[2])
from ps_common import checkpoints
real_write = checkpoints._HashingFile.write
def slow_write(self, data):
    if self.path.suffix == ".safetensors":
        blocked.touch()
        deadline = time.monotonic() + %(block)r
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return real_write(self, data)
checkpoints._HashingFile.write = slow_write
from ps_server import cli
sys.argv[1:] = sys.argv[3:]
cli.run()  # what the ps-server command runs
""" % {"block": BLOCK_S}


def _address(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    for line in proc.stdout:
        if "listening on" in line:
            return line.rsplit(" ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no 'listening on' line; stderr:\n{log.read_text(errors='replace')}")


def test_sigterm_during_a_slow_checkpoint_write_exits_within_grace(tmp_path):
    blocked, release = tmp_path / "blocked", tmp_path / "release"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    procs: list[subprocess.Popen] = []
    logs = []

    def start(argv, name):
        log = tmp_path / f"{name}.stderr"
        logs.append(open(log, "wb"))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=logs[-1],
                                stdin=subprocess.DEVNULL, text=True)
        procs.append(proc)
        return proc, log

    try:
        coordinator, clog = start([*COORDINATOR, "--port", "0", "--grace", "1",
                                   "--recovery-grace", "0", "--checkpoint-dir",
                                   str(checkpoints)], "coordinator")
        coordinator_address = _address(coordinator, clog)
        server, slog = start([sys.executable, "-c", DRIVER, str(blocked), str(release),
                              "--port", "0", "--coordinator", coordinator_address,
                              "--server-id", "s0", "--grace", "1",
                              "--heartbeat-interval", "0.2"], "server")
        _address(server, slog)
        with PSClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
            ps.declare("w", shape=(64, 64), init="zeros", optimizer={"name": "sgd", "lr": 1.0})
            ps.push({"w": np.ones((64, 64), np.float32)})
        # A new variable goes into a checkpoint at once: wait until its write is held.
        deadline = time.monotonic() + WAIT_S
        while not blocked.exists():
            assert time.monotonic() < deadline, "no checkpoint write started"
            assert server.poll() is None, slog.read_text(errors="replace")
            time.sleep(0.02)

        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, (
            f"ps-server --grace 1 did not exit within {EXIT_S:g} s of SIGTERM while a "
            f"checkpoint write was in progress (it lives until the write ends); stderr tail:\n"
            f"{slog.read_text(errors='replace')[-2000:]}")
    finally:
        release.touch()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.kill()
            proc.wait(EXIT_S)
            proc.stdout.close()
        for file in logs:
            file.close()
