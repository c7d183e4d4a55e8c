"""README, Security, "What a wrong setting looks like": "a plaintext client of a TLS daemon,
or a client without the certificate mutual TLS asks for, is told that the daemon closed the
connection before any call and which flags to give": the commands that reach the
coordinator through CoordinatorClient (ps-ctl, ps-worker, ps-cluster) as PSClient does,
rather than blaming a handshake and a --tls-ca they were never given."""

from __future__ import annotations

import pytest

from ps_common.certs import make_certs
from ps_common.tls import TLS
from ps_worker import ctl

CLOSED = "the daemon closed the connection before any call"
HANDSHAKE = "the TLS handshake failed"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    return out


def daemon_tls(certs, *, mutual: bool) -> TLS:
    return TLS.from_files(ca=certs / "ca.pem", cert=certs / "server.pem",
                          key=certs / "server-key.pem",
                          client_ca=certs / "ca.pem" if mutual else None)


def status_error(address: str, *flags: str, capsys) -> str:
    code = ctl.main(["--coordinator", address, "--timeout", "1", *flags, "status"])
    err = capsys.readouterr().err
    assert code == 1, err
    return err


def test_ps_ctl_as_a_plaintext_client_of_a_tls_coordinator_is_told_it_closed_the_connection(
        make_cluster, certs, capsys):
    cluster = make_cluster(servers=1, tls=daemon_tls(certs, mutual=False))
    err = status_error(cluster.coordinator_address, capsys=capsys)
    assert CLOSED in err and "--tls-ca" in err, err
    assert HANDSHAKE not in err, err


def test_ps_ctl_without_the_client_certificate_mutual_tls_asks_for_is_told_so(
        make_cluster, certs, capsys):
    cluster = make_cluster(servers=1, tls=daemon_tls(certs, mutual=True))
    err = status_error(cluster.coordinator_address, "--tls-ca", str(certs / "ca.pem"),
                       capsys=capsys)
    assert CLOSED in err and "--tls-cert" in err, err
    assert HANDSHAKE not in err, err
