"""ps-ctl's errors name where the coordinator's address came from: given no --coordinator,
ps-ctl asks TF_CONFIG's `cluster.chief` (README), and an unreachable chief is then reported
as TF_CONFIG's, as ps-worker reports it ("--coordinator" if given, else "TF_CONFIG
cluster.chief")."""

from __future__ import annotations

import json

from ps_worker import ctl

NOBODY = "127.0.0.1:1"  # nothing listens on port 1


def test_an_unreachable_chief_from_tf_config_is_named_as_tf_configs(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": [NOBODY], "ps": ["127.0.0.1:2"]},
        "task": {"type": "ps", "index": 0}}))
    assert ctl.main(["--timeout", "0.5", "status"]) == 1
    err = capsys.readouterr().err
    assert NOBODY in err
    # No --coordinator was given: the message must send the user to TF_CONFIG's chief.
    assert "TF_CONFIG" in err, err
    assert not err.startswith(f"ps-ctl: --coordinator {NOBODY}"), err
    assert "--coordinator" not in err, err


def test_ps_worker_names_tf_config_too(monkeypatch, capsys):
    from ps_worker import cli

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": [NOBODY], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]},
        "task": {"type": "worker", "index": 0}}))
    assert cli.worker_main(["--coordinator-timeout", "0.5", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert f"TF_CONFIG cluster.chief {NOBODY}" in err, err
    assert "--coordinator" not in err, err
