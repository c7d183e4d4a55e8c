"""Child processes of the system tests: `python -m MODULE args` in a process group of its own,
stdout and stderr in files; every wait bounded. The `launch` fixture (conftest.py) starts
them and ends them after each test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

READY_S = 30.0  # a process prints its "listening on" line within this
EXIT_S = 15.0  # a process told to finish exits within this
POLL_S = 0.05


class Proc:
    """One child process (`python -m module args`), stdout and stderr in files."""

    def __init__(self, name: str, module: str, args: list[str], directory: Path,
                 cwd: Path | None = None):
        self.name = name
        self.out_path = directory / f"{name}.out"
        self.err_path = directory / f"{name}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def logs(self) -> str:
        return (f"--- {self.name} (pid {self.pid}, exit {self.returncode}) stdout:\n"
                f"{self.stdout()[-3000:]}\n--- stderr:\n{self.stderr()[-3000:]}")

    def address(self, timeout: float = READY_S) -> str:
        """HOST:PORT from the process's 'listening on HOST:PORT' line (bounded wait)."""
        return self.last_word_of(" listening on ", "was ready", timeout)

    def last_word_of(self, marker: str, what: str, timeout: float = READY_S) -> str:
        """The last word of the first stdout line holding `marker`, once there (bounded
        wait; failing at once if the process exits first). `what` names the wait."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stdout().splitlines():
                if marker in line:
                    return line.rsplit(" ", 1)[-1]
            if self.returncode is not None:
                pytest.fail(f"{self.name} exited before it {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: not {what} within {timeout:g} s\n{self.logs()}")
            time.sleep(POLL_S)

    def wait(self, timeout: float = EXIT_S) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout:g} s\n{self.logs()}")

    def signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate_and_wait(self) -> int:
        self.signal(signal.SIGTERM)
        return self.wait()


def end_all(procs: list[Proc]) -> None:
    """SIGCONT (in case a test paused one) and SIGTERM to each one still running, then
    SIGKILL of its process group (its own: only it) after a bounded wait."""
    alive = [p for p in procs if p.returncode is None]
    for proc in alive:
        proc.signal(signal.SIGCONT)
        proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + EXIT_S
    for proc in alive:
        try:
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.popen.wait(5.0)
