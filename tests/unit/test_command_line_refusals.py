"""What a user sees when a flag, a file or an address given to a command is wrong: an error
that names it, exit status 2 (1 where the command ran), nothing started or made first.
Each docstring says what the command did before."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from ps_common.job import JobError, add_job_arguments, job_from_args
from ps_server.coordinator import cli as coordinator_cli
from ps_server.coordinator.app import STATE_FILE
from ps_worker import ctl
from ps_worker.data import load_dataset

REPO = Path(__file__).resolve().parents[2]
COMMAND_TIMEOUT_S = 90  # every command below ends in seconds; this only bounds a hang


def run_module(module: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TF_CONFIG", None)
    env.pop("PARAMSERVE_TOKEN_FILE", None)
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)


def parse_job(*argv: str):
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return job_from_args(parser.parse_args(list(argv)))


# ---- job files -----------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "text"), [
    ("job.json", '{"lr": 1e-3}'),          # valid JSON; PyYAML reads 1e-3 as a string
    ("job.yaml", "lr: 1e-3\n"),      # (2.5e-4, with a dot and a signed exponent, is read)
])
def test_a_job_file_lr_in_exponent_notation_is_a_number(tmp_path, name, text):
    """ps_common/job.py:187 loads JSON with yaml.safe_load (YAML 1.1): `1e-3` is a str
    there, and the job is refused with "job field 'lr': '1e-3' must be a finite number > 0"."""
    path = tmp_path / name
    path.write_text(text)
    job = parse_job("--job", str(path))
    assert job.lr == pytest.approx(float(text.split(":")[1].strip(" }\n")))


def test_an_empty_job_path_is_refused_not_taken_for_the_default_job():
    """`--job ""` (a templated `--job "$JOB"` whose variable is unset) ran the default job
    (the MLP on digits) without a word: ps_common/job.py:249 tests `if args.job:`."""
    with pytest.raises(JobError, match="--job"):
        parse_job("--job", "")


# ---- data files ----------------------------------------------------------------------------

def test_an_empty_data_file_is_refused_naming_it(tmp_path):
    """np.load raises EOFError on an empty file; ps_worker/data.py:306 catches OSError,
    ValueError and BadZipFile only, so ps-cluster (and a worker, which then never reports
    the job error to the coordinator) dies with a traceback."""
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.npz"):
        load_dataset(str(empty))
    done = run_module("ps_worker.cluster", "--log-dir", str(tmp_path / "logs"),
                      "--data", str(empty), cwd=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2 and "empty.npz" in done.stderr
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was started


def test_a_directory_given_as_the_data_file_is_not_said_to_be_missing(tmp_path):
    """ps_worker/data.py:302 says "does not exist" of a directory named like a data file."""
    directory = tmp_path / "data.npz"
    directory.mkdir()
    with pytest.raises(ValueError, match="data.npz") as refused:
        load_dataset(str(directory))
    assert "does not exist" not in str(refused.value)
    assert "directory" in str(refused.value)


def test_a_data_file_without_features_is_refused_naming_it(tmp_path):
    """x of shape (N, 0) loads; the job then fails in the model with "num_features must be a
    positive integer, got 0", which names neither the file nor the array."""
    path = tmp_path / "nofeatures.npz"
    np.savez(path, x=np.zeros((10, 0), np.float32), y=np.arange(10) % 2)
    with pytest.raises(ValueError, match="nofeatures.npz"):
        load_dataset(str(path))


# ---- ps-ctl --------------------------------------------------------------------------------

def _fake_matplotlib(monkeypatch):
    """Enough of matplotlib for ctl.plot to get past its import (it is an optional extra)."""
    class Anything:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return Anything()

        def __call__(self, *args, **kwargs):
            return Anything()

    modules = {name: types.ModuleType(name) for name in (
        "matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg",
        "matplotlib.figure")}
    modules["matplotlib.backends.backend_agg"].FigureCanvasAgg = Anything
    modules["matplotlib.figure"].Figure = Anything
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("saved", [
    {"job": {"state": "done"}},
    {"job": 7},
    {"job": {"state": "done", "epochs": 1, "metrics": [{"epoch": 1}]}},
])
def test_ps_ctl_plot_from_a_file_that_is_not_a_status_fails_naming_it(tmp_path, monkeypatch,
                                                                       capsys, saved):
    """_status_from (ps_worker/ctl.py:367) checks only that "job" is a key; plot() then
    raises KeyError/TypeError, which main (ctl.py:517) does not catch: a traceback."""
    _fake_matplotlib(monkeypatch)
    path = tmp_path / "status.json"
    path.write_text(json.dumps(saved))
    assert ctl.main(["plot", "--from", str(path), "--out", str(tmp_path / "c.png")]) == 1
    assert str(path) in capsys.readouterr().err


def test_ps_ctl_checkpoint_keeps_a_timeout_given_abbreviated(monkeypatch, capsys):
    """argparse takes `--time 1` for --timeout, but ctl.py:466 looks for the literal text
    "--timeout" in argv and, not finding it, replaces the user's 1 s with 600 s."""
    seen = {}

    class Client:
        def __init__(self, address, **kwargs):
            seen.update(kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def checkpoint(self):
            return {"id": "ckpt-1", "step": 1}

    monkeypatch.setattr(ctl, "CoordinatorClient", Client)
    try:
        code = ctl.main(["--coordinator", "127.0.0.1:1", "--time", "1", "checkpoint"])
    except SystemExit as refused:  # a fix that refuses abbreviations (allow_abbrev=False)
        assert refused.code == 2
        return
    assert code == 0
    assert seen["give_up_after_s"] == 1.0


@pytest.fixture
def not_a_coordinator():
    """A gRPC daemon that serves health only, as a ps-server (or any other gRPC service)
    does for the Coordinator's methods: the address a user mistyped."""
    pool = futures.ThreadPoolExecutor(max_workers=2)
    server = grpc.server(pool)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(5)
        pool.shutdown(wait=True)


def test_ps_ctl_pointed_at_a_daemon_that_is_no_coordinator_says_so(not_a_coordinator, capsys):
    """ps-ctl printed "ps-ctl: HOST:PORT: UNIMPLEMENTED: Method not found!", naming neither
    the flag to check nor that no coordinator answers there (the UNAVAILABLE case does)."""
    assert ctl.main(["--coordinator", not_a_coordinator, "--timeout", "2", "status"]) == 1
    err = capsys.readouterr().err
    assert "--coordinator" in err and "ps-coordinator" in err, err


def test_ps_worker_pointed_at_a_daemon_that_is_no_coordinator_says_so(not_a_coordinator,
                                                                      tmp_path):
    """The same for ps-worker: "ps-worker: HOST:PORT: UNIMPLEMENTED: Method not found!"."""
    done = run_module("ps_worker.cli", "--coordinator", not_a_coordinator, "--device", "cpu",
                      "--coordinator-timeout", "2", cwd=tmp_path)
    assert done.returncode == 1
    assert "--coordinator" in done.stderr and "ps-coordinator" in done.stderr, done.stderr


# ---- ps-cluster: refused before anything starts --------------------------------------------

@pytest.mark.parametrize(("argv", "flag"), [
    (["--device", "bogus"], "--device"),
    (["--checkpoint-dir", "ck", "--checkpoint-every", "often"], "--checkpoint-every"),
    (["--heartbeat-interval", "6"], "--heartbeat-interval"),  # default timeout is 5
    (["--split-threshold", "0"], "--split-threshold"),
])
def test_ps_cluster_refuses_a_bad_value_for_its_children_before_starting_any(tmp_path, argv,
                                                                             flag):
    """ps-cluster passes these on unchecked (ps_worker/cluster.py:436-468): the coordinator
    (or, for --device, every server and worker too) is started and refuses them, and
    ps-cluster exits 1 after it, not 2 before anything runs."""
    logs = tmp_path / "logs"
    done = run_module("ps_worker.cluster", "--log-dir", str(logs), "--epochs", "1", *argv,
                      cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:])
    assert flag in done.stderr
    assert not list(logs.glob("*.log")), "a child was started"


# ---- ps-coordinator --------------------------------------------------------------------------

def test_a_state_file_that_is_a_directory_is_refused_naming_it(tmp_path, capsys):
    """With DIR/coordinator-state.json a directory, the coordinator starts (load() warns
    and starts fresh), then logs "cannot save the coordinator's state" every half second for
    its whole life: the progress --state-dir was given for is never kept."""
    state_dir = tmp_path / "state"
    (state_dir / STATE_FILE).mkdir(parents=True)
    parser = coordinator_cli.build_parser()
    with pytest.raises(SystemExit) as exited:
        coordinator_cli.config_and_task(
            parser, parser.parse_args(["--state-dir", str(state_dir), "--epochs", "1"]),
            environ={})
    assert exited.value.code == 2
    assert str(state_dir / STATE_FILE) in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "bad"), [
    ("--checkpoint-dir", ["--keep-checkpoints", "0"]),
    ("--state-dir", ["--heartbeat-interval", "20"]),
    ("--checkpoint-dir", ["--tls-ca", "missing-ca.pem"]),
])
def test_a_refused_coordinator_flag_leaves_no_directory_behind(tmp_path, capsys, flag, bad):
    """config_and_task (ps_server/coordinator/cli.py:117-125) makes the checkpoint and state
    directories before the rest of the flags are checked: a refused command line leaves
    them made."""
    directory = tmp_path / "new" / "dir"
    parser = coordinator_cli.build_parser()
    with pytest.raises(SystemExit):
        coordinator_cli.config_and_task(parser, parser.parse_args([flag, str(directory), *bad]),
                                        environ={})
    capsys.readouterr()
    assert not directory.exists()


def test_a_refused_state_file_leaves_no_checkpoint_directory_behind(tmp_path, capsys):
    """Commit b397064 moved making the directories after the flags' checks ("a refused
    command line leaves nothing behind"), but the check that the state file is a file comes
    after the directories are made: --checkpoint-dir NEW with a --state-dir whose state file
    is a directory is refused (exit 2) with NEW made."""
    state_dir = tmp_path / "state"
    (state_dir / STATE_FILE).mkdir(parents=True)
    checkpoints = tmp_path / "new" / "ckpt"
    parser = coordinator_cli.build_parser()
    with pytest.raises(SystemExit) as exited:
        coordinator_cli.config_and_task(
            parser, parser.parse_args(["--checkpoint-dir", str(checkpoints), "--state-dir",
                                       str(state_dir), "--epochs", "1"]), environ={})
    assert exited.value.code == 2
    assert str(state_dir / STATE_FILE) in capsys.readouterr().err
    assert not checkpoints.exists()
