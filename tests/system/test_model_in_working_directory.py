"""`--model mymodel:Model` for a `mymodel.py` in the directory a command is started from works
without PYTHONPATH=.: ps-cluster checks the job with it, its workers import it, and a ps-worker
started by hand imports it. The commands are started as installed commands are (a script
outside that directory, so that Python puts no working directory on sys.path), and with
PYTHONSAFEPATH=1 ps-cluster's `python -m` children get none from Python either. Every wait is
bounded; every process is ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ps_worker.cluster import with_model_directory

pytestmark = pytest.mark.system

READY_S = 60.0
JOB_S = 90.0
EXIT_S = 30.0

MODEL = '''
from ps_worker.models.example_user_model import SoftmaxRegression


class Model(SoftmaxRegression):
    """A user model in the working directory."""
'''

# What an installed console script does: import the command's main and run it.
COMMAND = '''
import sys
from {module} import {function}
sys.exit({function}())
'''


class Command:
    def __init__(self, script: Path, args: list[str], cwd: Path, logs: Path):
        self.out, self.err = logs / f"{script.stem}.out", logs / f"{script.stem}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd,
                                          env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def logs(self) -> str:
        return (f"exit {self.popen.poll()}\n--- stdout:\n{self.stdout()[-3000:]}\n--- stderr:\n"
                f"{self.err.read_text(errors='replace')[-3000:]}")

    def wait_for(self, predicate, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            # Its exit first: output written just before it exits is then read.
            exited = self.popen.poll() is not None
            if found := predicate(self.stdout()):
                return found
            if exited or time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout:g} s\n{self.logs()}")
            time.sleep(0.05)

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(EXIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5.0)


def test_a_model_module_in_the_working_directory_needs_no_pythonpath(tmp_path):
    project, bin_dir, logs = tmp_path / "project", tmp_path / "bin", tmp_path / "logs"
    for directory in (project, bin_dir, logs):
        directory.mkdir()
    (project / "mymodel.py").write_text(MODEL)
    cluster_script, worker_script = bin_dir / "ps_cluster.py", bin_dir / "ps_worker.py"
    cluster_script.write_text(COMMAND.format(module="ps_worker.cluster", function="main"))
    worker_script.write_text(COMMAND.format(module="ps_worker.cli", function="worker_main"))
    started = []
    try:
        cluster = Command(cluster_script, [
            "--servers", "1", "--workers", "1", "--epochs", "1", "--tasks-per-epoch", "2",
            "--model", "mymodel:Model", "--keep-serving", "--log-dir", str(logs / "cluster")],
            project, logs)
        started.append(cluster)
        first = cluster.wait_for(lambda out: out.splitlines()[:1], "ps-cluster's first line",
                                 READY_S)
        address = first[0].split(" on ", 1)[1].split(";", 1)[0]
        # Its worker (a child) trained the model: the job is done, not failed.
        cluster.wait_for(lambda out: "job done; servers keep serving" in out,
                         "the job to be done", JOB_S)
        assert "held-out acc" in cluster.stdout()
        worker = Command(worker_script, ["--coordinator", address, "--worker-id", "by-hand",
                                         "--device", "cpu"], project, logs)
        started.append(worker)
        # It builds the job's model as it joins (and then hears the job is over).
        assert worker.popen.wait(JOB_S) == 0, worker.logs()
        assert "runs mymodel:Model" in worker.err.read_text(), worker.logs()
    finally:
        for command in reversed(started):
            command.end()


def test_ps_cluster_puts_its_working_directory_first_on_its_workers_pythonpath():
    assert with_model_directory({"A": "1"}, "/home/me/project") == {
        "A": "1", "PYTHONPATH": "/home/me/project"}
    assert with_model_directory({"PYTHONPATH": os.pathsep.join(["/lib", "/home/me/project"])},
                                "/home/me/project")["PYTHONPATH"] == os.pathsep.join(
        ["/home/me/project", "/lib"])


def test_the_working_directory_goes_on_sys_path_once_as_pythonpath_would(monkeypatch, tmp_path):
    from ps_worker.models.registry import find_models_in

    monkeypatch.setattr(sys, "path", ["/venv/bin", "/lib/python"])
    find_models_in(str(tmp_path))
    assert sys.path == ["/venv/bin", str(tmp_path), "/lib/python"]
    find_models_in(str(tmp_path / "."))
    assert len(sys.path) == 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", "/lib/python"])  # `python -c`: "" is the directory
    find_models_in(str(tmp_path))
    assert sys.path == ["", "/lib/python"]
