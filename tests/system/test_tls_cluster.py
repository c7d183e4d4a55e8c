"""TLS with real processes: a ps-cluster under mutual TLS and a token trains to completion
and writes no key into a log; ps-ctl reaches a mutual-TLS coordinator only with a client
certificate signed by the cluster's CA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.certs import make_certs
from test_training import ACCURACY, JOB_S, start_ps_cluster

pytestmark = pytest.mark.system


@pytest.fixture
def certs(tmp_path):
    make_certs(tmp_path / "certs")
    return tmp_path / "certs"


def tls_flags(certs, *, client_ca: bool) -> list[str]:
    return ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "server.pem"),
            "--tls-key", str(certs / "server-key.pem"),
            *(["--tls-client-ca", str(certs / "ca.pem")] if client_ca else [])]


def test_a_cluster_under_mutual_tls_trains_and_logs_no_key(launch, tmp_path, certs):
    token_file = tmp_path / "token"
    token_file.write_text("tls-system-test-token")
    proc, _, log_dir = start_ps_cluster(launch, tmp_path, "--epochs", "3",
                                        "--token-file", str(token_file),
                                        *tls_flags(certs, client_ca=True))
    assert proc.wait(JOB_S) == 0, proc.logs()
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert outcome["state"] == "done" and outcome["epochs"] == 3, outcome
    assert outcome["accuracy"] >= ACCURACY - 0.1, outcome  # 3 epochs: a little short of 0.95
    key_line = (certs / "server-key.pem").read_text().splitlines()[1]
    logs = [p for p in log_dir.iterdir() if p.is_file()]
    assert logs
    assert not [p.name for p in logs if key_line in p.read_text(errors="replace")]


def test_ps_ctl_needs_a_client_certificate_for_a_mutual_tls_coordinator(launch, certs,
                                                                         tmp_path):
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         *tls_flags(certs, client_ca=True))
    address = coordinator.address()
    ctl = [sys.executable, "-m", "ps_worker.ctl", "--coordinator", address, "--timeout", "3",
           "--tls-ca", str(certs / "ca.pem")]
    refused = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused
    assert "--tls-cert" in refused.stderr, refused.stderr
    allowed = subprocess.run([*ctl, "--tls-cert", str(certs / "client.pem"),
                              "--tls-key", str(certs / "client-key.pem"), "status", "--json"],
                             capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["job"]["state"] == "none"
