"""ps-cluster's last line is the job's outcome however the run ends: a --keep-serving run
ended by Ctrl-C after its job, and a run whose --log-dir filled up mid-job (the coordinator
cannot print its outcome: ps-cluster must neither hang nor lose it). Real processes, the
bundled digits data; every wait is bounded and every process ended."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from child_processes import EXIT_S, POLL_S

pytestmark = pytest.mark.system

JOB_S = 60.0  # a small job of these tests ends within this (a few seconds in practice)
# Coordinator: after its job, at most heartbeat timeout + 2 s telling members, then at most
# MAX_LINGER_S (15) for watchers; ps-cluster then stops the rest within its own bounds.
AFTER_JOB_S = 60.0


def ps_cluster(tmp_path, *args: str, preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ps_worker.cluster", "--log-dir", str(tmp_path / "logs"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=preexec_fn,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def end(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL of its process group after a bounded wait (its children end with
    it in either case)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5.0)


def output_of(proc: subprocess.Popen, timeout: float) -> str:
    """Everything ps-cluster printed once it has exited; fails (and ends it) if it has not
    exited within `timeout`."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end(proc)
        out, _ = proc.communicate(timeout=EXIT_S)
        pytest.fail(f"ps-cluster still running {timeout:g} s after it was expected to exit; "
                    f"its output:\n{out.decode(errors='replace')[-3000:]}")
    return out.decode(errors="replace")


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    """ps-cluster's output up to the first line holding `marker` (bounded wait)."""
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""
    deadline = time.monotonic() + timeout
    while marker.encode() not in seen:
        chunk = proc.stdout.read()
        if chunk:
            seen += chunk
        elif proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ps-cluster never printed {marker!r}:\n{seen.decode()[-3000:]}")
        else:
            time.sleep(POLL_S)
    os.set_blocking(proc.stdout.fileno(), True)
    return seen.decode(errors="replace")


def test_keep_serving_then_ctrl_c_still_reports_the_finished_job(tmp_path):
    """README: `--keep-serving` keeps the daemons up after the job 'until Ctrl-C', and the
    last line is the JSON object of the job's outcome ({"state": "done", "epochs": ...}).
    Ending a --keep-serving run the only way there is (Ctrl-C) must not turn a done job into
    {"state": "interrupted"} with its figures gone."""
    proc = ps_cluster(tmp_path, "--epochs", "1", "--keep-serving")
    try:
        before = read_until(proc, "servers keep serving", JOB_S)
        assert "epoch 1/1" in before, before
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out = before + output_of(proc, AFTER_JOB_S)
    finally:
        end(proc)
    outcome = json.loads(out.splitlines()[-1])
    assert outcome["state"] == "done", outcome
    assert outcome["epochs"] == 1 and outcome["accuracy"] is not None, outcome


def test_a_log_dir_that_fills_up_does_not_hang_ps_cluster_after_the_job(tmp_path):
    """The children's logs stop growing mid-job (a full --log-dir: here a file-size limit,
    which gives the same write error; Python ignores SIGXFSZ). Training does not need the
    logs: the job runs to its end. ps-cluster must then exit, reporting the job, instead of
    waiting forever for a coordinator that hangs on its final print."""
    limit = 8 * 1024  # the coordinator's log reaches it about half way through the job

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = ps_cluster(tmp_path, "--epochs", "100", "--tasks-per-epoch", "2",
                      preexec_fn=limit_file_size)
    try:
        before = read_until(proc, "epoch 100/100", JOB_S)  # the job itself ran to its end
        out = before + output_of(proc, AFTER_JOB_S)
    finally:
        end(proc)
    assert os.path.getsize(tmp_path / "logs" / "coordinator.log") >= limit  # it did fill
    outcome = json.loads(out.splitlines()[-1])
    assert outcome["state"] == "done" and outcome["epochs"] == 100, outcome
