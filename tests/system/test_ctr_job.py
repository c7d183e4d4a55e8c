"""The click-through job of the README, with real processes: `ps-cluster --model
embedding_mlp --data synthetic_ctr` trains on 2 servers and 2 workers (OS-chosen ports) and
reports held-out AUC beside accuracy. Every wait is bounded; every process it starts is
ended by the `launch` fixture, even when the test fails."""

from __future__ import annotations

import json
import re
import time

import pytest

from child_processes import POLL_S, READY_S

pytestmark = pytest.mark.system

# Bounds on waits, not on speed: the job takes about 20 s on 2 cores.
JOB_WAIT_S = 240.0
MIN_AUC = 0.75
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) .*held-out acc ([0-9.]+)  "
                        r"held-out AUC ([0-9.]+) \(chance 0\.5\)")


@pytest.mark.timeout(JOB_WAIT_S + 60)
def test_ps_cluster_trains_the_click_through_model_to_a_held_out_auc_of_0_75(launch, tmp_path):
    log_dir = tmp_path / "cluster-logs"
    proc = launch("ps-cluster", "ps_worker.cluster", "--model", "embedding_mlp",
                  "--data", "synthetic_ctr", "--log-dir", str(log_dir))
    deadline = time.monotonic() + READY_S
    while not proc.stdout():  # the first line: "coordinator on HOST:PORT; logs in DIR"
        if proc.returncode is not None or time.monotonic() > deadline:
            pytest.fail(f"ps-cluster did not start its coordinator\n{proc.logs()}")
        time.sleep(POLL_S)
    assert proc.wait(JOB_WAIT_S) == 0, proc.logs()
    lines = proc.stdout().splitlines()
    outcome = json.loads(lines[-1])
    assert outcome["state"] == "done", proc.logs()
    assert outcome["exit_codes"] == {"coordinator": 0, "server-0": 0, "server-1": 0,
                                     "worker-0": 0, "worker-1": 0}, outcome
    assert outcome["workers_dead"] == []
    assert outcome["auc"] >= MIN_AUC, outcome
    # The model's job defaults (ps_common.job.MODEL_DEFAULTS): 5 epochs.
    assert outcome["epochs"] == 5 and outcome["steps"] > 0
    assert 0.5 < outcome["accuracy"] <= 1.0
    epochs = [EPOCH_LINE.match(line) for line in lines]
    epochs = [match for match in epochs if match]
    assert [int(m.group(1)) for m in epochs] == [1, 2, 3, 4, 5], proc.stdout()
    assert float(epochs[-1].group(4)) == pytest.approx(outcome["auc"], abs=1e-4)
