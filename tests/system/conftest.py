from __future__ import annotations

import pytest

from child_processes import Proc, end_all


@pytest.fixture
def launch(tmp_path):
    """`launch(name, module, *args, cwd=None)` starts a child process
    (child_processes.Proc); all are ended after the test, whatever happened."""
    started: list[Proc] = []

    def start(name: str, module: str, *args: str, cwd=None) -> Proc:
        proc = Proc(name, module, list(args), tmp_path, cwd=cwd)
        started.append(proc)
        return proc

    yield start
    end_all(started)
