"""The shared token with real processes: a ps-cluster whose processes get the token through
PARAMSERVE_TOKEN_FILE trains to completion and writes the token into no log; ps-ctl without
the token is refused (UNAUTHENTICATED, exit 1) and with --token-file reads the status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.auth import TOKEN_FILE_ENV
from test_training import ACCURACY, JOB_S, start_ps_cluster

pytestmark = pytest.mark.system

TOKEN = "system-test-token-5c1d"


def test_a_cluster_with_a_token_trains_and_logs_no_token(launch, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    proc, _, log_dir = start_ps_cluster(launch, tmp_path, "--epochs", "3")
    assert proc.wait(JOB_S) == 0, proc.logs()
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert outcome["state"] == "done" and outcome["epochs"] == 3, outcome
    assert outcome["accuracy"] >= ACCURACY - 0.1, outcome  # 3 epochs: a little short of 0.95
    logs = [p for p in log_dir.iterdir() if p.is_file()]
    assert logs
    assert not [p.name for p in logs if TOKEN in p.read_text(errors="replace")]
    assert TOKEN not in proc.logs()


def test_ps_ctl_needs_the_token_of_a_coordinator_that_checks_one(launch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--token-file", str(token_file))
    address = coordinator.address()
    ctl = [sys.executable, "-m", "ps_worker.ctl", "--coordinator", address, "--timeout", "5"]
    refused = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused
    assert "UNAUTHENTICATED" in refused.stderr and "--token-file" in refused.stderr
    allowed = subprocess.run([*ctl, "--token-file", str(token_file), "status", "--json"],
                             capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["job"]["state"] == "none"
    assert TOKEN not in coordinator.logs()
