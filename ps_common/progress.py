"""The lines a user reads about a job's progress, one format wherever they are printed:
ps-cluster's progress and ps-coordinator's log both show `epoch_line` as each epoch is
over, and ps-coordinator ends with `job_over_line`.

Two accuracies are in play and each line says which: the *training* accuracy (of the
batches an epoch trained on, measured while training) and the *held-out* accuracy (of the
evaluation task after the epoch, on data the job never trains on). The JSON outcome's
`accuracy` is the held-out one and `train_accuracy` the training one. Pure: no grpc.

A model's loss may overflow: the lines show such a figure as `nan` or `inf`, and what is
printed as JSON has `null` in its place (`strict_json`), since NaN and Infinity are not JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: float | None) -> float | None:
    """`value`, or None where it is not a finite number (JSON has no NaN nor Infinity)."""
    return value if value is not None and math.isfinite(value) else None


def json_ready(value: Any) -> Any:
    """`value` with every non-finite float in it, at any depth, replaced by None."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def strict_json(value: Any, **kwargs) -> str:
    """`value` as JSON that any parser reads: non-finite floats as null (`json_ready`)."""
    return json.dumps(json_ready(value), allow_nan=False, **kwargs)


def figure(value: float | None) -> str:
    """A loss or an accuracy as the lines show it: 4 decimals, `nan` or `inf` where the
    model's loss overflowed, `-` where there is none."""
    return "-" if value is None else f"{value:.4f}"


def epoch_line(epoch: int, epochs: int, *, loss: float | None, accuracy: float | None,
               test_accuracy: float | None, test_auc: float | None, steps: int) -> str:
    """The line shown once an epoch is over: its training loss and accuracy (`figure`: a
    loss that overflowed shows as `nan` or `inf`), the held-out accuracy (and held-out AUC
    where the model gives scores; "not evaluated" where there is no held-out figure:
    `test_accuracy` None, for an epoch the job does not evaluate or a model without
    `evaluate`), and `steps`, the training steps of the job up to the end of that epoch."""
    if test_accuracy is None:
        held_out = "held-out: not evaluated"
    else:
        auc = f"  held-out AUC {figure(test_auc)} (chance 0.5)" if test_auc is not None else ""
        held_out = f"held-out acc {figure(test_accuracy)}{auc}"
    return (f"epoch {epoch}/{epochs}  train loss {figure(loss)}  train acc {figure(accuracy)}  "
            f"{held_out}  steps {steps}")


def job_over_line(summary: dict) -> str:
    """One line for a job that has ended, from the coordinator's summary (the dict whose
    JSON ps-coordinator prints as it finishes): its state, epochs, steps and rate, and the
    last epoch's figures or the failure."""
    steps, elapsed = summary.get("steps") or 0, summary.get("job_elapsed_s") or 0.0
    rate = f", {steps / elapsed:.1f} steps/s" if elapsed else ""
    line = (f"job {summary['state']}: {summary.get('epochs') or 0} epoch(s), {steps} step(s) "
            f"in {elapsed:.1f} s{rate}")
    figures = [f"{label} {summary[key]:.4f}" for key, label in (
        ("loss", "train loss"), ("train_accuracy", "train acc"), ("accuracy", "held-out acc"),
        ("auc", "held-out AUC")) if summary.get(key) is not None]
    if figures:
        line += "; " + ", ".join(figures)
    if summary.get("failure"):
        line += f"; {summary['failure']}"
    return line
