"""The commands' flags, TF_CONFIG and TLS settings: an error at the command line names the
flag or file at fault and exits non-zero, never with a traceback, and a value the rest of the
system cannot carry is refused there rather than breaking a daemon later.

Every command runs in-process through its own main or config function; no process is
started, every port is chosen by the OS."""

from __future__ import annotations

import pytest

from ps_common.certs import make_certs
from ps_proto.v1 import coordinator_pb2
from ps_server import cli as server_cli
from ps_server.coordinator import cli as coordinator_cli
from ps_worker import cli as worker_cli
from ps_worker import ctl


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    return out


# ---- TLS: a client CA file that holds PEM but no certificate ------------------------------

def _exit_code(main, argv: list[str]) -> int:
    """A command's exit status: what its main returns, or the usage error it exits with."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


def _tls_flags_with_a_key_as_client_ca(certs) -> list[str]:
    # The easy slip: client-key.pem where ca.pem was meant. It holds a PEM block.
    return ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "server.pem"),
            "--tls-key", str(certs / "server-key.pem"),
            "--tls-client-ca", str(certs / "client-key.pem")]


def test_coordinator_with_a_key_as_tls_client_ca_names_that_flag_not_the_address(
        certs, capsys):
    """A --tls-client-ca holding a private key (not a certificate) passed the PEM check; gRPC
    then could not build the server's credentials, which was reported as a port that cannot
    bind ("--host/--port ... address in use"): --tls-client-ca was never named."""
    code = _exit_code(coordinator_cli.main, ["--port", "0", "--recovery-grace", "0",
                                             *_tls_flags_with_a_key_as_client_ca(certs)])
    err = capsys.readouterr().err
    assert code != 0, err
    assert "--tls-client-ca" in err, err
    assert "--host/--port" not in err and "address in use" not in err, err


def test_server_with_a_key_as_tls_client_ca_names_that_flag_not_the_address(certs, capsys):
    """As the coordinator's test, for ps-server."""
    code = _exit_code(server_cli.server_main, ["--port", "0", "--no-shm",
                                               *_tls_flags_with_a_key_as_client_ca(certs)])
    err = capsys.readouterr().err
    assert code != 0, err
    assert "--tls-client-ca" in err, err
    assert "--host/--port" not in err and "address in use" not in err, err


# ---- sizes and counts the wire cannot carry -------------------------------------------------

def test_a_memory_budget_past_int64_is_refused_at_the_command_line(capsys):
    """`--memory-budget 8388608TiB` (2**63 bytes) was accepted; the server's registration
    (an int64 on the wire) then failed in its membership thread, and it never registered,
    with no word naming the flag."""
    parser = server_cli.build_parser()
    args = parser.parse_args(["--memory-budget", "8388608TiB", "--coordinator",
                              "127.0.0.1:9", "--no-shm"])
    try:
        config = server_cli.config_from_args(parser, args, environ={})
    except SystemExit as refused:
        assert refused.code == 2
        assert "--memory-budget" in capsys.readouterr().err
        return
    # Accepted: then the server must be able to send it (what app.py:_registration builds).
    try:
        coordinator_pb2.RegisterServerRequest(memory_budget_bytes=config.memory_budget_bytes)
    except ValueError as error:
        pytest.fail(f"--memory-budget {config.memory_budget_bytes} was accepted, but the "
                    f"server cannot register with it: {error}")


def test_a_number_of_epochs_past_int32_is_refused_at_the_command_line(capsys):
    """`ps-coordinator --epochs 2147483648` was accepted, and every status call then failed
    (epochs is an int32 on the wire): `ps-ctl status` said only INTERNAL."""
    parser = coordinator_cli.build_parser()
    args = parser.parse_args(["--epochs", str(2**31), "--recovery-grace", "0"])
    try:
        config, _ = coordinator_cli.config_and_task(parser, args, environ={})
    except SystemExit as refused:
        assert refused.code == 2
        assert "--epochs" in capsys.readouterr().err
        return
    try:
        coordinator_pb2.JobStatus(epochs=config.job.epochs)
    except ValueError as error:
        pytest.fail(f"--epochs {config.job.epochs} was accepted, but the coordinator cannot "
                    f"report its status with it: {error}")


# ---- TF_CONFIG that is not JSON a parser can take -------------------------------------------

DEEP = "[" * 100_000  # not JSON: an array that never closes, nested past the recursion limit


def test_a_deeply_nested_tf_config_is_a_usage_error_naming_it_for_the_daemons(capsys):
    """A bad TF_CONFIG is a usage error (exit 2) naming TF_CONFIG. A deeply nested text made
    json raise RecursionError, which escaped as a traceback."""
    parser = worker_cli.build_parser()
    args = parser.parse_args([])
    with pytest.raises(SystemExit) as refused:
        worker_cli.config_from_args(parser, args, environ={"TF_CONFIG": DEEP})
    assert refused.value.code == 2
    assert "TF_CONFIG" in capsys.readouterr().err


def test_a_deeply_nested_tf_config_is_a_usage_error_naming_it_for_ps_ctl(monkeypatch, capsys):
    """As above for `ps-ctl status` without --coordinator, which reads TF_CONFIG."""
    monkeypatch.setenv("TF_CONFIG", DEEP)
    monkeypatch.delenv("PARAMSERVE_TOKEN_FILE", raising=False)
    with pytest.raises(SystemExit) as refused:
        ctl.main(["status"])
    assert refused.value.code == 2
    assert "TF_CONFIG" in capsys.readouterr().err
