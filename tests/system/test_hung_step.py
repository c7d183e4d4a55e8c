"""A training step that never returns (a hung kernel, a deadlock in the model, a read that
never ends) while the worker's heartbeats go on: with `--stall-timeout`, ps-worker exits 3
naming the flag, the coordinator hands its task to another worker once the heartbeats stop,
and the job ends done. Time spent waiting in paramserve's own calls does not count. Every
wait is bounded; every process is ended."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.system

JOB_S = 120.0
EXIT_S = 60.0

MODEL = '''
import threading
from pathlib import Path

from ps_worker.models.example_user_model import SoftmaxRegression

HUNG = Path(__file__).with_name("hung-once")


class HangsOnce(SoftmaxRegression):
    """The first step of the first worker to train never returns; every other step does."""

    def loss_and_grads(self, params, batch):
        if not HUNG.exists():
            HUNG.touch()
            threading.Event().wait()
        return super().loss_and_grads(params, batch)
'''


def test_a_worker_whose_step_hangs_exits_and_its_task_is_trained_by_another(launch, tmp_path):
    (tmp_path / "user_models.py").write_text(MODEL)
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--model", "user_models:HangsOnce", "--epochs", "1",
                         "--tasks-per-epoch", "2", "--heartbeat-interval", "0.2",
                         "--heartbeat-timeout", "2", cwd=tmp_path)
    address = coordinator.address()
    server = launch("server", "ps_server.cli", "--port", "0", "--coordinator", address,
                    "--heartbeat-interval", "0.2")
    server.address()
    hung = launch("hung", "ps_worker.cli", "--coordinator", address, "--worker-id", "w0",
                  "--stall-timeout", "1", cwd=tmp_path)
    assert hung.wait(EXIT_S) == 3, hung.logs()
    assert "--stall-timeout" in hung.stderr() and (tmp_path / "hung-once").exists()
    healthy = launch("healthy", "ps_worker.cli", "--coordinator", address, "--worker-id",
                     "w1", "--stall-timeout", "1", cwd=tmp_path)
    assert coordinator.wait(JOB_S) == 0, coordinator.logs() + healthy.logs()
    assert healthy.wait(EXIT_S) == 0, healthy.logs()
