"""One coordinator per checkpoint and state directory (ps_server.coordinator.directory_lock).

Two coordinators on one --checkpoint-dir would prune each other's checkpoints and overwrite
each other's job state; the second one refuses to start, naming the flag, the directory and
the holder, and exits 1. The lock goes with its holder, however that ends: a coordinator
restarted after a SIGKILL starts at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.directory_lock import LOCK_FILE, DirectoryInUse, DirectoryLock

WAIT_S = 60.0  # a bound a sound build never reaches
JOB = JobSpec(epochs=1, tasks_per_epoch=1)


def coordinator(**dirs) -> Coordinator:
    return Coordinator(CoordinatorConfig(job=JOB, checkpoint_every=None, **dirs))


def test_a_second_coordinator_on_a_checkpoint_dir_is_refused_until_the_first_stops(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = coordinator(checkpoint_dir=ckpt)
    try:
        with pytest.raises(DirectoryInUse) as refused:
            coordinator(checkpoint_dir=ckpt)
        message = str(refused.value)
        assert f"--checkpoint-dir {ckpt}" in message
        assert f"pid {os.getpid()}" in message, message
    finally:
        first.stop(grace_s=0)
    coordinator(checkpoint_dir=ckpt).stop(grace_s=0)  # free again


def test_a_state_dir_is_locked_too_and_a_refused_start_keeps_no_lock(tmp_path):
    ckpt, state, other = tmp_path / "ckpt", tmp_path / "state", tmp_path / "other"
    first = coordinator(checkpoint_dir=other, state_dir=state)
    try:
        # Its checkpoint dir is free, its state dir is not: refused, holding neither.
        with pytest.raises(DirectoryInUse, match="--state-dir"):
            coordinator(checkpoint_dir=ckpt, state_dir=state)
        lock = DirectoryLock(ckpt, "--checkpoint-dir")
        lock.acquire()
        lock.release()
    finally:
        first.stop(grace_s=0)


def test_the_same_directory_for_checkpoints_and_state_is_one_lock(tmp_path):
    both = tmp_path / "both"
    coordinator(checkpoint_dir=both, state_dir=both).stop(grace_s=0)
    assert (both / LOCK_FILE).exists()


def test_ps_coordinator_refused_exits_1_naming_the_flag(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = coordinator(checkpoint_dir=ckpt)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ps_server.coordinator.cli", "--port", "0",
             "--checkpoint-dir", str(ckpt), "--epochs", "1"],
            capture_output=True, text=True, timeout=WAIT_S)
    finally:
        holder.stop(grace_s=0)
    assert done.returncode == 1, done.stderr
    assert f"--checkpoint-dir {ckpt}: another ps-coordinator uses it" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_killed_holder_leaves_the_directory_free(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path\n"
         "from ps_server.coordinator.directory_lock import DirectoryLock\n"
         f"DirectoryLock(Path({str(ckpt)!r}), '--checkpoint-dir').acquire()\n"
         "print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryInUse, match=f"pid {holder.pid} "):
            DirectoryLock(ckpt, "--checkpoint-dir").acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=WAIT_S)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=WAIT_S)
    lock = DirectoryLock(ckpt, "--checkpoint-dir")
    lock.acquire()
    lock.release()
