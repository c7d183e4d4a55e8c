"""ps-cluster's progress, piped and on a terminal, from a scripted sequence of statuses and a
fake clock: piped lines come at regular points (each epoch's line carries the steps up to the
end of that epoch, however late the status was read; a line every interval while an epoch
runs), the terminal's bar never wraps, and every line names training and held-out figures."""

from __future__ import annotations

import io
import re

from ps_worker.cluster import Progress

STEPS_PER_EPOCH = 48


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def a_status(evaluated: int, *, steps: int, state: str = "running", epochs: int = 5) -> dict:
    """`evaluated` epochs over and evaluated; the next one has trained `steps` beyond them
    (when the job runs): 8 training tasks and an evaluation an epoch."""
    metrics = [{"epoch": e, "loss": 0.5 / e, "accuracy": 0.8 + e / 100, "test_loss": 0.4 / e,
                "test_accuracy": 0.85 + e / 100, "test_auc": None, "steps": STEPS_PER_EPOCH,
                "examples": 1536, "over": True} for e in range(1, evaluated + 1)]
    in_progress = steps - evaluated * STEPS_PER_EPOCH
    if state == "running":
        metrics.append({"epoch": evaluated + 1, "loss": 0.1, "accuracy": 0.97,
                        "test_loss": None, "test_accuracy": None, "test_auc": None,
                        "steps": in_progress, "examples": in_progress * 32, "over": False})
    return {"job": {"state": state, "epoch": len(metrics), "epochs": epochs,
                    "tasks_done": evaluated * 9, "tasks_total": epochs * 9, "steps": steps,
                    "epoch_tasks": 9, "epoch_tasks_done": in_progress * 8 // STEPS_PER_EPOCH,
                    "metrics": metrics},
            "workers": [{"state": "alive"}, {"state": "alive"}]}


def steps_of(lines: list[str]) -> list[int]:
    return [int(re.search(r"  steps (\d+)", line).group(1)) for line in lines]


def test_an_epoch_evaluated_before_the_one_before_it_waits_for_that_ones_line():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, 5, clock=clock, interval_s=10.0)
    status = a_status(2, steps=110)
    first = status["job"]["metrics"][0]
    evaluated = {key: first[key] for key in ("test_loss", "test_accuracy", "over")}
    first.update(test_loss=None, test_accuracy=None, over=False)  # its evaluation still runs
    progress.update(status)
    assert out.getvalue() == ""
    first.update(evaluated)
    clock.now += 1.0
    progress.update(status)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/5", "2/5"]
    assert steps_of(lines) == [48, 96]


def test_piped_epoch_lines_carry_each_epochs_steps_however_late_the_status_came():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, 5, clock=clock, interval_s=10.0)
    # Read once epoch 1 was evaluated and 30 steps of epoch 2 were done; then once epochs
    # 2 and 3 were both evaluated (the reader was slow); then at the end of the job.
    for status in (a_status(0, steps=20), a_status(1, steps=78), a_status(3, steps=150),
                   a_status(5, steps=240, state="done")):
        clock.now += 1.0
        progress.update(status)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert steps_of(lines) == [48, 96, 144, 192, 240]
    assert "\r" not in out.getvalue()
    assert lines[0] == ("epoch 1/5  train loss 0.5000  train acc 0.8100  "
                        "held-out acc 0.8600  steps 48")


def test_piped_a_line_every_interval_while_an_epoch_runs_with_the_steps_so_far():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, 5, clock=clock, interval_s=10.0)
    shown = []
    for at, status in [(5, a_status(0, steps=10)), (10, a_status(0, steps=20)),
                       (15, a_status(0, steps=30)), (20, a_status(0, steps=40)),
                       (21, a_status(1, steps=50)), (30, a_status(1, steps=60)),
                       (31, a_status(1, steps=70))]:
        clock.now = 100.0 + at
        before = len(out.getvalue().splitlines())
        progress.update(status)
        shown.append((at, out.getvalue().splitlines()[before:]))
    printed_at = {at: lines for at, lines in shown if lines}
    # At 10 and 20 (10 s without a line); at 21 the epoch's line; at 31 (10 s after it).
    assert sorted(printed_at) == [10, 20, 21, 31]
    running = [printed_at[10][0], printed_at[20][0], printed_at[31][0]]
    assert all(line.startswith(("epoch 1/5  training", "epoch 2/5  training"))
               for line in running), running
    assert steps_of(running) == [20, 40, 70]
    assert "2 steps/s" in running[1]  # (40 - 20) steps over the 10 s since the last one
    assert "workers 2" in running[0]


def test_piped_nothing_more_once_the_job_is_over():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, 1, clock=clock, interval_s=10.0)
    clock.now += 60
    progress.update(a_status(1, steps=48, state="done", epochs=1))
    progress.update(a_status(1, steps=48, state="done", epochs=1))
    assert len(out.getvalue().splitlines()) == 1


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_terminal_bar_shows_the_current_epochs_tasks_done():
    out = Terminal()
    status = a_status(1, steps=70)
    job = status["job"]
    job["metrics"][0].update(test_loss=None, test_accuracy=None, over=False)  # evaluating
    job["tasks_done"], job["epoch_tasks_done"] = 8 + 4, 4  # 4 of epoch 2's 9 tasks
    Progress(out, 5, clock=Clock(), width=80).update(status)
    assert "epoch 2/5 [#####.......]" in out.getvalue()  # 4 of 9


def test_the_terminal_bar_fits_the_width_and_says_train():
    out, clock = Terminal(), Clock()
    progress = Progress(out, 5, clock=clock, width=60)
    for step in (10, 30):
        clock.now += 1.0
        progress.update(a_status(0, steps=step))
    drawn = out.getvalue().split("\r\033[K")
    assert drawn[-1].startswith("epoch 1/5 [")
    assert all(len(bar) <= 59 for bar in drawn)
    wide = Terminal()
    Progress(wide, 5, clock=clock, width=200).update(a_status(0, steps=10))
    assert "workers 2  train: loss 0.1000 acc 0.9700" in wide.getvalue()
    clock.now += 1.0
    progress.update(a_status(1, steps=50))
    assert "\r\033[Kepoch 1/5  train loss" in out.getvalue()  # the epoch line replaces it


def test_an_epoch_the_job_does_not_evaluate_has_its_line_once_it_is_over():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, 5, clock=clock, interval_s=10.0)
    status = a_status(2, steps=110)
    first = status["job"]["metrics"][0]
    first.update(test_loss=None, test_accuracy=None)  # evaluate_every 2: epoch 1 is not
    progress.update(status)
    lines = out.getvalue().splitlines()
    assert lines == ["epoch 1/5  train loss 0.5000  train acc 0.8100  held-out: not evaluated"
                     "  steps 48",
                     "epoch 2/5  train loss 0.2500  train acc 0.8200  held-out acc 0.8700"
                     "  steps 96"]
