"""`ps-cluster --checkpoint-dir` and `ps-cluster --chaos` as real processes (the chaos
schedule's decisions alone: tests/unit/test_chaos_schedule.py).

The chaos run is the README's command: the default job while a worker, a server and the
coordinator are SIGKILLed one after another and restarted as a supervisor would; it must end
as a clean run does. ps-cluster bounds each recovery itself; this test bounds the whole run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ACCURACY = 0.95
CHECKPOINT_RUN_S = 60.0  # a one-epoch job with checkpoints ends within this
# The chaos run takes about 10 s on 2 cores; a recovery that never comes costs ps-cluster 60 s
# before it gives up, so this bound only catches a ps-cluster that hangs.
CHAOS_RUN_S = 240.0
EXIT_S = 15.0  # ps-cluster stops its children within this once interrupted


def run_ps_cluster(tmp_path: Path, *args: str, timeout: float) -> tuple[int, dict, str]:
    """Run ps-cluster in `tmp_path` to the end (bounded); returns its exit code, its last
    line as JSON and its whole output. On timeout it is interrupted (it then stops its
    children, as on Ctrl-C) and the test fails with its output."""
    out_path = tmp_path / "ps-cluster.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ps_worker.cluster", *args], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(EXIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own process group: only ps-cluster
                proc.wait(EXIT_S)
            pytest.fail(f"ps-cluster still running after {timeout:g} s:\n"
                        f"{out_path.read_text(errors='replace')[-5000:]}")
    output = out_path.read_text(errors="replace")
    return code, json.loads(output.splitlines()[-1]), output


@pytest.mark.system
def test_ps_cluster_with_a_checkpoint_dir_leaves_a_complete_checkpoint(tmp_path):
    # A relative directory: taken relative to where ps-cluster runs.
    code, outcome, output = run_ps_cluster(
        tmp_path, "--epochs", "1", "--checkpoint-dir", "ckpt", "--log-dir", "logs",
        timeout=CHECKPOINT_RUN_S)
    assert code == 0, output
    assert outcome["state"] == "done", output
    complete = [d for d in (tmp_path / "ckpt").glob("ckpt-*") if (d / "manifest.json").is_file()]
    assert complete, sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    manifest = json.loads((max(complete) / "manifest.json").read_text())
    assert manifest["job"]["state"] == "done"  # the end-of-job checkpoint
    assert "chaos" not in outcome


@pytest.mark.system
@pytest.mark.timeout(CHAOS_RUN_S + 2 * EXIT_S + 30)
def test_chaos_run_kills_a_worker_a_server_and_the_coordinator_and_the_job_ends_well(
        tmp_path):
    code, outcome, output = run_ps_cluster(tmp_path, "--chaos", "--chaos-seed", "1",
                                           "--log-dir", "logs", timeout=CHAOS_RUN_S)
    assert code == 0, output
    assert outcome["state"] == "done", output
    chaos = outcome["chaos"]
    assert chaos["seed"] == 1
    targets = [kill["target"] for kill in chaos["kills"]]
    assert len(targets) == 3, chaos
    assert targets[0] in ("worker-0", "worker-1"), chaos
    assert targets[1] in ("server-0", "server-1"), chaos
    assert targets[2] == "coordinator", chaos
    for kill in chaos["kills"]:
        assert kill["signal"] == "SIGKILL" and kill["restarted"] is True, kill
        assert kill["recovered_after_s"] is not None and kill["recovered_after_s"] >= 0, kill
    steps = [kill["at_step"] for kill in chaos["kills"]]
    assert steps == sorted(steps) and steps[-1] < outcome["steps"], chaos
    assert isinstance(chaos["updates_lost"], int) and chaos["updates_lost"] >= 0
    # The final incarnation of every child, killed ones included, exited 0.
    assert outcome["exit_codes"] == {"coordinator": 0, "server-0": 0, "server-1": 0,
                                     "worker-0": 0, "worker-1": 0}, output
    assert outcome["accuracy"] >= ACCURACY, outcome
    logs = tmp_path / "logs"
    for target in targets:  # a restarted child logs beside its first incarnation
        assert (logs / f"{target}.log").is_file() and (logs / f"{target}.restart-1.log").is_file()
