"""A starting ps-server and the /dev/shm entries of another user.

README: a SIGKILLed server's segments are removed by "the next paramserve server started
on the host by the same user"; ps_server.shared_memory.clear_dead skips files of another
user. /dev/shm is shared by every user of the host (mode 1777): a half-made control segment
(`.paramserve.<pid>.<start>.<serial>.control.<pid>.new`) that another user's server left
when it died, or that any user put there, cannot be removed by this user. It must not stop
this user's server from starting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ps_common import shm

UNSUPPORTED = shm.supported()
pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or ""),
    pytest.mark.skipif(os.geteuid() != 0,
                       reason="needs root to make a file of another user and run as nobody"),
]

WAIT_S = 30.0
NOBODY = 65534

# ps-server as user nobody: modules imported first (the interpreter's own files may lie where
# nobody cannot read them), then the identity dropped, then the ordinary main.
SERVER_AS_NOBODY = f"""
import os, sys
import concurrent.futures.thread
from ps_server.cli import server_main
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
sys.exit(server_main(["--port", "0", "--grace", "0.5"]))
"""


def run_server_as_nobody() -> tuple[int, str, str]:
    """Start ps-server as nobody; once it says it listens, SIGTERM it. (code, out, err)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER_AS_NOBODY], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        first = proc.stdout.readline()  # the ready line, or "" when it exited first
        proc.terminate()
        out, err = proc.communicate(timeout=WAIT_S)
        return proc.returncode, first + out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)


@pytest.fixture
def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait(WAIT_S) == 0
    return child.pid


def test_a_server_starts_beside_a_half_made_control_segment_of_another_user(dead_pid):
    # Made by root, as another user's server would have made it before it died.
    left = shm.DIRECTORY / f".{shm.PREFIX}{dead_pid}.777.1.control.{dead_pid}.new"
    fd = os.open(left, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        code, out, err = run_server_as_nobody()
    finally:
        shm.unlink(left)
    assert code == 0, f"ps-server as nobody exited {code}:\n{out}\n{err}"
    assert " listening on " in out
