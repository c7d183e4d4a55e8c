"""ps-ctl inside a TF_CONFIG launcher's container (e.g. `kubectl exec` into a TFJob's pod):
with no --coordinator it asks TF_CONFIG's chief; --coordinator still wins; a bad TF_CONFIG
is a usage error naming it."""

from __future__ import annotations

import json

import pytest

from ps_worker import ctl


def tf_config(chief: str) -> str:
    return json.dumps({"cluster": {"chief": [chief], "ps": ["127.0.0.1:1"]},
                       "task": {"type": "ps", "index": 0}})


def test_ps_ctl_finds_the_coordinator_in_tf_config(cluster, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config(cluster.coordinator_address))
    assert ctl.main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["state"] == "none"


def test_the_coordinator_flag_wins_over_tf_config(cluster, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config("127.0.0.1:1"))  # nothing listens there
    assert ctl.main(["--coordinator", cluster.coordinator_address, "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["servers"]


def test_a_bad_tf_config_is_a_usage_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(SystemExit) as refused:
        ctl.main(["status"])
    assert refused.value.code == 2
    assert "TF_CONFIG" in capsys.readouterr().err
