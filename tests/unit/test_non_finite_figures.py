"""A model's loss may overflow to NaN or infinity, and a model without `evaluate` measures
nothing held out: the progress lines show `nan` / `inf` and `held-out: not evaluated`, ps-ctl's
text shows them too, and everything printed as JSON (the coordinator's outcome, ps-cluster's
last line, `ps-ctl status --json`) is strict JSON with null in their place."""

from __future__ import annotations

import io
import json
import math

import pytest

from ps_common.clock import FakeClock
from ps_common.job import JobSpec
from ps_common.progress import epoch_line, job_over_line, json_ready, strict_json
from ps_server.coordinator.jobs import JobRunner, Metrics
from ps_worker.cluster import Progress
from ps_worker.ctl import render, watch

EVALUATION = Metrics(loss_sum=1.0, examples=10, correct=8, steps=0, seconds=0.1)


def finish_one_epoch(train: Metrics, evaluation: Metrics = EVALUATION) -> JobRunner:
    runner = JobRunner(JobSpec(epochs=1, tasks_per_epoch=1), FakeClock(), heartbeat_timeout_s=10)
    incarnation = runner.register_worker("w0")
    for metrics in (train, evaluation):
        _, task = runner.lease("w0", incarnation)
        runner.complete("w0", incarnation, task.task_id, metrics)
    return runner


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("loss_sum", [math.nan, math.inf, -math.inf])
def test_the_outcome_has_null_for_a_training_loss_that_is_not_finite(loss_sum):
    summary = finish_one_epoch(Metrics(loss_sum, 4, 3, 1, 0.1)).summary()
    assert summary["state"] == "done" and summary["loss"] is None
    assert summary["train_accuracy"] == 0.75 and summary["accuracy"] == 0.8
    _strict(json.dumps(summary, allow_nan=False))
    assert "train loss" not in job_over_line(summary)  # no figure, rather than a wrong one


def test_an_evaluation_of_no_examples_gives_the_outcome_no_held_out_figures():
    summary = finish_one_epoch(Metrics(2.0, 4, 3, 1, 0.1), Metrics(seconds=0.1)).summary()
    assert summary["state"] == "done"
    assert (summary["accuracy"], summary["test_loss"], summary["auc"]) == (None, None, None)


@pytest.mark.parametrize("loss, shown", [(math.nan, "nan"), (math.inf, "inf"), (None, "-")])
def test_epoch_lines_show_a_loss_that_is_not_finite_as_such(loss, shown):
    line = epoch_line(1, 2, loss=loss, accuracy=0.5, test_accuracy=None, test_auc=None,
                      steps=8)
    assert line == (f"epoch 1/2  train loss {shown}  train acc 0.5000  "
                    "held-out: not evaluated  steps 8")


def _status(loss: float) -> dict:
    return {"job": {"state": "running", "epoch": 2, "epochs": 2, "tasks_done": 2,
                    "tasks_total": 4, "steps": 16, "elapsed_s": 1.0, "failure": "",
                    "mode": "async", "staleness": {"max": 0}, "dropped_stale_gradients": 0,
                    "epoch_tasks": 2, "epoch_tasks_done": 1, "spec": None,
                    "metrics": [{"epoch": e, "loss": loss, "accuracy": 0.5, "test_loss": None,
                                 "test_accuracy": None, "test_auc": None, "steps": 8,
                                 "examples": 64, "over": e == 1} for e in (1, 2)]},
            "workers": [], "servers": [], "shard_map_epoch": 0, "generation": 0,
            "awaiting_servers": [], "checkpoint_dir": None, "last_checkpoint": None,
            "shards_restored": 0, "tables": []}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("loss, shown", [(math.nan, "nan"), (math.inf, "inf")])
def test_ps_cluster_and_ps_ctl_show_a_loss_that_is_not_finite_and_print_null_as_json(
        loss, shown):
    piped, terminal = io.StringIO(), Terminal()
    Progress(piped, 2, width=200).update(_status(loss))
    Progress(terminal, 2, width=200).update(_status(loss))
    assert f"train loss {shown}" in piped.getvalue()  # the line of epoch 1, over
    assert f"train: loss {shown} acc 0.5000" in terminal.getvalue()  # the bar of epoch 2
    assert f" {shown} " in render(_status(loss))
    out = io.StringIO()
    done = {**_status(loss), "job": {**_status(loss)["job"], "state": "done"}}
    assert watch(lambda: done, interval_s=0.0, as_json=True, out=out) == 0
    assert _strict(out.getvalue())["job"]["metrics"][0]["loss"] is None


def test_strict_json_maps_every_non_finite_float_at_any_depth_to_null():
    value = {"a": [1.0, math.nan, {"b": (math.inf, -math.inf)}], "c": 3, "d": "nan"}
    assert json_ready(value) == {"a": [1.0, None, {"b": [None, None]}], "c": 3, "d": "nan"}
    assert _strict(strict_json(value, indent=1)) == json_ready(value)
