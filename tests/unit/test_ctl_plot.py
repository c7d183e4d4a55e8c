"""ps-ctl plot: the per-epoch curves as an image (matplotlib, the optional extra `plot`), from
a status saved by `ps-ctl status --json`; without matplotlib it says what to install."""

from __future__ import annotations

import json
import sys

import pytest

from ps_worker import ctl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def a_status(epochs: int = 6, *, auc: bool = True) -> dict:
    metrics = [{"epoch": e, "loss": 1.0 / e, "accuracy": 0.7 + e / 40,
                "test_loss": 1.1 / e, "test_accuracy": 0.68 + e / 40,
                "test_auc": 0.75 + e / 100 if auc else None, "steps": 100,
                "examples": 3200} for e in range(1, epochs + 1)]
    # The epoch in progress: training figures so far, no evaluation yet.
    metrics.append({"epoch": epochs + 1, "loss": 0.1, "accuracy": 0.9, "test_loss": None,
                    "test_accuracy": None, "test_auc": None, "steps": 40, "examples": 1280})
    return {"job": {"state": "running", "epoch": epochs + 1, "epochs": 10,
                    "spec": {"model": "mlp", "data": "digits"}, "metrics": metrics}}


@pytest.mark.parametrize("auc", [True, False])
def test_plot_writes_a_png_of_the_curves(tmp_path, auc):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    assert ctl.plot(a_status(auc=auc), out) == 7
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_ps_ctl_plot_from_a_saved_status_needs_no_coordinator(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "status.json"
    saved.write_text(json.dumps(a_status()))
    out = tmp_path / "curve.png"
    assert ctl.main(["plot", "--from", str(saved), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert str(out) in capsys.readouterr().out


def test_ps_ctl_plot_of_a_job_without_metrics_or_a_bad_file_fails(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"job": {"state": "none", "epochs": 0, "metrics": []}}))
    not_status = tmp_path / "other.json"
    not_status.write_text("[1, 2]")
    for source in (empty, not_status, tmp_path / "missing.json"):
        assert ctl.main(["plot", "--from", str(source), "--out",
                         str(tmp_path / "x.png")]) == 1
    assert not (tmp_path / "x.png").exists()
    assert "ps-ctl plot" in capsys.readouterr().err


def test_ps_ctl_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None: the import raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    saved = tmp_path / "status.json"
    saved.write_text(json.dumps(a_status()))
    out = tmp_path / "curve.png"
    assert ctl.main(["plot", "--from", str(saved), "--out", str(out)]) == 1
    assert 'pip install "paramserve[plot]"' in capsys.readouterr().err
    assert not out.exists()
