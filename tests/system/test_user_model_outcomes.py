"""ps-cluster with a user model without `evaluate` (README "The job": optional; its epochs
have no held-out figures) or with a training loss that is NaN or infinite (shown as `nan` or
`inf`, `null` in the JSON): the job ends as the coordinator says, and the last line is strict
JSON. Each run is bounded; ps-cluster ends its own children, and its process group is killed
if it outlives the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

RUN_S = 120.0

MODELS = '''
from ps_worker.models.example_user_model import SoftmaxRegression


class NoEvaluate:
    """variables() and loss_and_grads() only: README says evaluate() is optional."""

    def __init__(self, num_features, num_classes):
        self._inner = SoftmaxRegression(num_features, num_classes)

    def variables(self):
        return self._inner.variables()

    def loss_and_grads(self, params, batch):
        return self._inner.loss_and_grads(params, batch)


class NanLoss(SoftmaxRegression):
    """Finite gradients, but a NaN loss (what a model's loss overflow looks like)."""

    def loss_and_grads(self, params, batch):
        _, grads = super().loss_and_grads(params, batch)
        return float("nan"), grads


class InfLoss(SoftmaxRegression):
    """Finite gradients, an infinite loss: -log(p) of a probability that underflowed to 0."""

    def loss_and_grads(self, params, batch):
        _, grads = super().loss_and_grads(params, batch)
        return float("inf"), grads
'''


def _run_cluster(tmp_path: Path, model: str) -> tuple[int, str, Path]:
    (tmp_path / "user_models.py").write_text(MODELS)
    logs = tmp_path / "logs"
    out = tmp_path / "cluster.out"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ps_worker.cluster", "--model", f"user_models:{model}",
             "--epochs", "1", "--workers", "1", "--servers", "1", "--log-dir", str(logs)],
            cwd=tmp_path, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(RUN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            pytest.fail(f"ps-cluster still running after {RUN_S:g} s:\n{out.read_text()}")
    return code, out.read_text(errors="replace"), logs


def _coordinator_outcome(logs: Path) -> dict:
    for line in (logs / "coordinator.log").read_text(errors="replace").splitlines():
        if line.startswith("ps-coordinator finished: "):
            return json.loads(line[len("ps-coordinator finished: "):])
    raise AssertionError("the coordinator printed no outcome")


def _strict_json(text: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_user_model_without_evaluate_trains_to_done(tmp_path):
    code, out, logs = _run_cluster(tmp_path, "NoEvaluate")
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["state"] == "done", out
    assert code == 0, out
    # No figures held out: shown as for an epoch the job does not evaluate.
    assert "held-out: not evaluated" in out and outcome["accuracy"] is None, out


def test_a_nan_training_loss_does_not_crash_ps_cluster(tmp_path):
    code, out, logs = _run_cluster(tmp_path, "NanLoss")
    assert "unexpected" not in out, out
    outcome = json.loads(out.strip().splitlines()[-1])
    # The coordinator ran the job to its end ("train loss nan" in its log): so must ps-cluster.
    assert _coordinator_outcome(logs)["state"] == "done"
    assert outcome["state"] == "done", out
    assert code == 0, out
    assert "train loss nan" in out and outcome["loss"] is None, out


def test_the_last_line_is_json_when_the_training_loss_is_infinite(tmp_path):
    code, out, logs = _run_cluster(tmp_path, "InfLoss")
    last = out.strip().splitlines()[-1]
    outcome = _strict_json(last)  # README: "prints as its last line a JSON object"
    assert outcome["state"] == "done", out
    assert "train loss inf" in out and outcome["loss"] is None, out
