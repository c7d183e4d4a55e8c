"""A job whose data or model the workers cannot load, or whose model breaks its contract as
it trains, fails fast with their message, instead of leaving the coordinator waiting for
progress that never comes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.system


def _start(argv: list[str], cwd=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def _address(proc: subprocess.Popen, deadline: float) -> str:
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " listening on " in line:
            return line.split()[-1]
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{proc.args} did not start: {proc.stderr.read()}")


def _job_fails(job_flags: list[str], message: str, worker_cwd=None) -> None:
    """A coordinator with `job_flags`, a server and a worker (in `worker_cwd`): the worker
    and the coordinator exit 1 saying `message`, the server 0; every process is ended."""
    procs = []
    try:
        coordinator = _start(["ps_server.coordinator.cli", "--port", "0", *job_flags,
                              "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"])
        procs.append(coordinator)
        address = _address(coordinator, time.monotonic() + 30)
        server = _start(["ps_server.cli", "--port", "0", "--coordinator", address,
                         "--heartbeat-interval", "0.2"])
        procs.append(server)
        _address(server, time.monotonic() + 30)
        worker = _start(["ps_worker.cli", "--coordinator", address, "--worker-id", "w0"],
                        cwd=worker_cwd)
        procs.append(worker)
        assert worker.wait(60) == 1
        assert message in worker.stderr.read()
        assert coordinator.wait(60) == 1  # the job failed
        assert message in coordinator.stderr.read()
        assert server.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_job_with_missing_data_fails_and_every_process_exits(tmp_path):
    missing = tmp_path / "missing.npz"
    _job_fails(["--data", str(missing)], str(missing))


FORGETS_THE_BIAS = '''
from ps_worker.models.example_user_model import SoftmaxRegression


class ForgetsTheBias(SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        loss, grads = super().loss_and_grads(params, batch)
        del grads["bias"]
        return loss, grads
'''


def test_a_model_that_breaks_its_contract_in_training_fails_the_job_with_its_message(tmp_path):
    """A cluster run by hand: the worker's error reaches the coordinator (ReportJobError, as
    for a model that does not load), which fails the job instead of waiting for the task."""
    (tmp_path / "user_models.py").write_text(FORGETS_THE_BIAS)
    # In the model's directory: a worker finds a module in its working directory.
    _job_fails(["--model", "user_models:ForgetsTheBias", "--epochs", "1"],
               "loss_and_grads returned no gradient for 'bias'", worker_cwd=tmp_path)


@pytest.mark.parametrize("flags, named", [
    (["--model", "nosuch"], "--model"),
    (["--data", "mnist"], "--data"),
])
def test_a_malformed_model_or_data_is_refused_at_start(flags, named):
    result = subprocess.run([sys.executable, "-m", "ps_server.coordinator.cli", "--port", "0",
                             *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert named in result.stderr
