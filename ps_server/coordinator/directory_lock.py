"""One coordinator per checkpoint (and state) directory.

Two coordinators given the same --checkpoint-dir (an old one still running beside its
replacement, a copy-pasted command) would each write checkpoints, prune the other's, and
overwrite the job's state file with their own progress: whichever wrote last decides what
a restart resumes, and a restore could read a checkpoint the other one is deleting. So a
coordinator holds an exclusive `flock` on a lock file in each directory it writes, for as
long as it runs; a second one refuses to start, naming the directory and the holder. The
kernel drops the lock when its holder exits, however it exits (SIGKILL included), so a
restarted coordinator never waits for a dead one. Across hosts this relies on the shared
file system honouring flock (local disks, NFSv4 and most cluster file systems do).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "coordinator.lock"


class DirectoryInUse(OSError):
    """Another coordinator holds the directory's lock."""


class DirectoryLock:
    """The lock of `directory` (given as `flag` in messages). `acquire` raises
    DirectoryInUse when another process (or another DirectoryLock) holds it."""

    def __init__(self, directory: Path, flag: str):
        self.path = Path(directory) / LOCK_FILE
        self._flag = flag
        self._directory = directory
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DirectoryInUse(
                f"{self._flag} {self._directory}: another ps-coordinator uses it ({holder}); "
                f"two would overwrite each other's checkpoints and job state: stop that one "
                f"first, or give this one a directory of its own") from None
        except BaseException:
            os.close(fd)
            raise
        # Who holds it, for the message a second coordinator prints (not needed for the
        # lock itself, which is the flock).
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()}, since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the directory go (idempotent). The lock file stays: removing it could let a
        third coordinator lock a new file while a second still waits on the old one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "its holder did not say who it is"
