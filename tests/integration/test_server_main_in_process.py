"""`server_main(argv) -> int` returns to an in-process caller (a launcher that embeds
ps-server and goes on after it, holding an idle thread pool of its own: a PSClient's, say):
only the ps-server command (`ps_server.cli.run`) ends the process past calls still running.

Deterministic: the child runs ps-server's own main with run_until_signal replaced by an
immediate graceful stop (no signal, no timing); the only difference between the two runs is
one idle executor thread of the caller's."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import os, sys
from concurrent.futures import ThreadPoolExecutor
import ps_server.cli as server_cli

def stop_at_once(stop, wait, announce, signals=None):
    announce()
    if signals is not None:
        signals.restore()
    stop()
    return 0

server_cli.run_until_signal = stop_at_once
if sys.argv[1] == "with-executor":
    caller_pool = ThreadPoolExecutor(max_workers=1)  # the caller's own, idle
    caller_pool.submit(int).result()
code = server_cli.server_main(["--host", "127.0.0.1", "--port", "0", "--grace", "0.2",
                               "--coordinator", "127.0.0.1:9", "--no-shm"])
print("caller goes on after server_main returned", code, flush=True)
# The caller's own ending, without the interpreter's teardown, which grpcio can hang when one
# of its daemon threads holds a lock (what the ps-server command avoids the same way).
sys.stdout.flush()
os._exit(code)
"""


def run_child(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_server_main_returns_to_an_in_process_caller_that_has_its_own_threads():
    control = run_child("alone")
    assert "caller goes on after server_main returned 0" in control.stdout, control.stderr
    assert control.returncode == 0

    child = run_child("with-executor")
    assert "caller goes on after server_main returned 0" in child.stdout, (
        f"server_main ended the caller's process (rc {child.returncode}); stderr tail:\n"
        + "\n".join(child.stderr.splitlines()[-3:]))
    assert child.returncode == 0
