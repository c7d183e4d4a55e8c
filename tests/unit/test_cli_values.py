"""Command-line values refused before anything starts, each error naming the flag or file at
fault: seconds that are not finite (NaN passes every comparison), booleans given as counts in
a job file, a job file that is not text, a token gRPC cannot carry, a log directory that
cannot be one, and checkpoints asked for without a place to put them."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from ps_common.auth import read_token_file
from ps_common.cli import parse_address
from ps_common.job import JobError, JobSpec, add_job_arguments, job_from_args
from ps_server import cli as server_cli
from ps_server.coordinator import cli as coordinator_cli
from ps_worker import cli as worker_cli
from ps_worker import cluster as cluster_cli
from ps_worker import ctl

SERVER_FLAGS = ["--coordinator", "127.0.0.1:1"]
CASES = [
    (server_cli.build_parser, SERVER_FLAGS, "--grace", ["nan", "inf", "-1"]),
    (server_cli.build_parser, SERVER_FLAGS, "--heartbeat-interval", ["nan", "0", "-1"]),
    (server_cli.build_parser, SERVER_FLAGS, "--stream-idle-timeout", ["nan"]),
    (coordinator_cli.build_parser, [], "--heartbeat-interval", ["nan", "0"]),
    (coordinator_cli.build_parser, [], "--heartbeat-timeout", ["nan"]),
    (coordinator_cli.build_parser, [], "--server-timeout", ["nan", "inf"]),
    (coordinator_cli.build_parser, [], "--grace", ["nan", "-0.5"]),
    (coordinator_cli.build_parser, [], "--recovery-grace", ["inf"]),
    (worker_cli.build_parser, SERVER_FLAGS, "--coordinator-timeout", ["nan", "-1"]),
    (worker_cli.build_parser, SERVER_FLAGS, "--grace", ["nan"]),
    (cluster_cli.build_parser, [], "--heartbeat-interval", ["nan"]),
]


@pytest.mark.parametrize(("build", "base", "flag", "values"), CASES,
                         ids=[f"{c[0].__module__.split('.')[-1]}{c[2]}" for c in CASES])
def test_seconds_that_are_not_finite_or_in_range_are_refused_naming_the_flag(
        build, base, flag, values, capsys):
    for value in values:
        with pytest.raises(SystemExit) as exited:
            build().parse_args([*base, flag, value])
        assert exited.value.code == 2
        assert f"argument {flag}: {value!r}" in capsys.readouterr().err


def test_ps_ctl_timeouts_are_checked_too(capsys):
    with pytest.raises(SystemExit):
        ctl.build_parser().parse_args(["--timeout", "-1", "status"])
    assert "argument --timeout" in capsys.readouterr().err
    assert ctl.build_parser().parse_args(["--timeout", "2.5", "status"]).timeout == 2.5


def parse_job(*argv: str) -> JobSpec | None:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return job_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("field", ["epochs: true", "batch_size: true", "lr: true",
                                   "seed: false", "tasks_per_epoch: true", "hidden: [true]",
                                   "evaluate_every: false"])
def test_a_boolean_is_no_count_in_a_job_file(tmp_path, field):
    path = tmp_path / "job.yaml"
    path.write_text(field + "\n")
    with pytest.raises(JobError, match=field.split(":")[0]):
        parse_job("--job", str(path))


def test_a_job_file_that_is_not_text_is_refused_naming_it(tmp_path):
    path = tmp_path / "job.json"
    path.write_bytes(b"\xff\xfe\x00epochs")
    with pytest.raises(JobError, match=f"--job {path}: not UTF-8"):
        parse_job("--job", str(path))


def test_a_token_grpc_metadata_cannot_carry_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("t\u00f6k\u00e9n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"token file {path}: .*ASCII"):
        read_token_file(path)


def test_a_log_dir_that_cannot_be_a_directory_is_refused_naming_the_flag(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(SystemExit) as exited:
        cluster_cli.main(["--log-dir", str(taken / "logs")])
    assert exited.value.code == 2
    assert f"--log-dir {taken / 'logs'}" in capsys.readouterr().err


def test_checkpoint_every_without_a_checkpoint_dir_is_refused(capsys):
    parser = coordinator_cli.build_parser()
    with pytest.raises(SystemExit):
        coordinator_cli.config_and_task(parser, parser.parse_args(["--checkpoint-every", "30s"]),
                                        environ={})
    assert "--checkpoint-every: needs --checkpoint-dir" in capsys.readouterr().err
    for argv in ([], ["--checkpoint-every", "off"]):  # the default, and off, need none
        config, _ = coordinator_cli.config_and_task(parser, parser.parse_args(argv), environ={})
        assert config.checkpoint_dir is None


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--state-dir"])
def test_a_directory_that_cannot_be_made_names_its_flag(tmp_path, capsys, flag):
    taken = tmp_path / "a-file"
    taken.write_text("")
    parser = coordinator_cli.build_parser()
    with pytest.raises(SystemExit):
        coordinator_cli.config_and_task(parser, parser.parse_args([flag, str(taken / "dir")]),
                                        environ={})
    assert f"{flag} {taken / 'dir'}: cannot make it a directory" in capsys.readouterr().err


def test_ps_cluster_checks_sizes_and_names_a_childs_refusal(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cluster_cli.build_parser().parse_args(["--split-threshold", "lots"])
    assert "argument --split-threshold: 'lots'" in capsys.readouterr().err
    log = tmp_path / "coordinator.log"
    log.write_text("usage: ps-coordinator ...\nps-coordinator: error: argument "
                   "--checkpoint-every: 'often': expected seconds\n")
    child = SimpleNamespace(name="coordinator", log_path=log)
    assert "--checkpoint-every: 'often'" in cluster_cli._last_error(child)


def test_a_server_that_fails_to_start_gives_the_signals_back(monkeypatch):
    import signal
    import socket

    monkeypatch.setattr(server_cli, "setup_logging", lambda level: None)  # process-wide:
    monkeypatch.setattr(server_cli, "tune_malloc", lambda **kwargs: True)  # not in a test
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            assert server_cli.server_main(["--port", str(port), "--no-shm"]) == 1
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("text", ["::1:2222", "host", "host:0", "host:\u0663"])
def test_an_address_flag_that_is_not_host_port_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_address(text)


@pytest.mark.parametrize("text", ["[::1]:2222", "127.0.0.1:50050", "job-ps-0.ns.svc:2222"])
def test_an_address_flag_of_host_port_is_taken(text):
    assert parse_address(text) == text
