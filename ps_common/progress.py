"""The lines a user reads about a job's progress, one format wherever they are printed:
ps-cluster's progress and ps-coordinator's log both show `epoch_line` as each epoch is
over, and ps-coordinator ends with `job_over_line`.

Two accuracies are in play and each line says which: the *training* accuracy (of the
batches an epoch trained on, measured while training) and the *held-out* accuracy (of the
evaluation task after the epoch, on data the job never trains on). The JSON outcome's
`accuracy` is the held-out one and `train_accuracy` the training one. Pure: no grpc.
"""

from __future__ import annotations


def epoch_line(epoch: int, epochs: int, *, loss: float, accuracy: float,
               test_accuracy: float | None, test_auc: float | None, steps: int) -> str:
    """The line shown once an epoch is over: its training loss and accuracy, the held-out
    accuracy (and held-out AUC where the model gives scores; "not evaluated" for an epoch
    the job does not evaluate: `test_accuracy` None), and `steps`, the training steps of
    the job up to the end of that epoch."""
    if test_accuracy is None:
        held_out = "held-out: not evaluated"
    else:
        auc = f"  held-out AUC {test_auc:.4f} (chance 0.5)" if test_auc is not None else ""
        held_out = f"held-out acc {test_accuracy:.4f}{auc}"
    return (f"epoch {epoch}/{epochs}  train loss {loss:.4f}  train acc {accuracy:.4f}  "
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
