"""TLS and mutual TLS (ps_common.tls) with in-process daemons: with the right CA a client
trains over both data paths; a wrong CA, a plaintext client and a client without the
certificate mutual TLS asks for are refused with a message saying what to check; keys stay
out of reprs; `ps-ctl make-certs` and `ps-ctl probe`; bad TLS flags name the flag."""

from __future__ import annotations

import stat
import subprocess
import sys

import numpy as np
import pytest

from ps_common.certs import FILES, make_certs
from ps_common.rpc import RetryPolicy
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_server.app import ServerConfig
from ps_server.testing import InProcessCluster
from ps_worker import PSClient
from ps_worker import ctl

# A refused connection is not worth long retries here: two attempts, short backoff.
FAIL_FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    return out


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("other-certs")
    make_certs(out)
    return out


def daemon_tls(certs, *, mutual: bool = False) -> TLS:
    return TLS.from_files(ca=certs / "ca.pem", cert=certs / "server.pem",
                          key=certs / "server-key.pem",
                          client_ca=certs / "ca.pem" if mutual else None)


@pytest.fixture(scope="module")
def tls_cluster(certs):
    with InProcessCluster(servers=2, split_threshold_bytes=100, tls=daemon_tls(certs)) as c:
        yield c


@pytest.fixture(scope="module")
def mutual_cluster(certs):
    with InProcessCluster(servers=1, tls=daemon_tls(certs, mutual=True)) as c:
        yield c


def train_a_little(ps: PSClient, name: str) -> None:
    ps.declare(name, shape=(64, 8), dtype="float32", init={"name": "constant", "value": 1.0},
               optimizer={"name": "sgd", "lr": 0.5}, seed=0)
    ps.push({name: np.ones((64, 8), np.float32)})
    np.testing.assert_array_equal(ps.pull(name), np.full((64, 8), 0.5, np.float32))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared memory", "gRPC"])
def test_with_the_right_ca_a_client_trains_over_tls(tls_cluster, certs, shared_memory):
    with PSClient(tls_cluster.coordinator_address, tls_ca=certs / "ca.pem",
                  shared_memory=shared_memory) as ps:
        train_a_little(ps, f"w_{shared_memory}")
        assert set(ps.data_paths.values()) == {"shm" if shared_memory else "grpc"}


def test_a_wrong_ca_fails_to_connect_saying_what_to_check(tls_cluster, other_certs):
    with pytest.raises(RemoteError) as refused:
        with PSClient(tls_cluster.coordinator_address, tls_ca=other_certs / "ca.pem",
                      retry=FAIL_FAST) as ps:
            ps.pull("anything")
    message = str(refused.value)
    assert refused.value.code().name == "UNAVAILABLE"
    assert "TLS handshake failed" in message and "--tls-ca" in message, message


def test_a_plaintext_client_of_a_tls_daemon_is_told_to_use_tls(tls_cluster):
    with pytest.raises(RemoteError) as refused:
        with PSClient(tls_cluster.coordinator_address, retry=FAIL_FAST) as ps:
            ps.pull("anything")
    assert "--tls-ca" in str(refused.value), str(refused.value)


def test_mutual_tls_refuses_a_client_without_a_certificate(mutual_cluster, certs, other_certs):
    address = mutual_cluster.coordinator_address
    for tls in (dict(tls_ca=certs / "ca.pem"),  # no certificate at all
                dict(tls_ca=certs / "ca.pem", tls_cert=other_certs / "client.pem",
                     tls_key=other_certs / "client-key.pem")):  # signed by another CA
        with pytest.raises(RemoteError) as refused:
            with PSClient(address, retry=FAIL_FAST, **tls) as ps:
                ps.pull("anything")
        assert refused.value.code().name == "UNAVAILABLE"
        assert "--tls-cert" in str(refused.value), str(refused.value)
    with PSClient(address, tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem",
                  tls_key=certs / "client-key.pem") as ps:
        train_a_little(ps, "w_mutual")


def test_keys_stay_out_of_reprs(certs):
    tls = daemon_tls(certs)
    key = (certs / "server-key.pem").read_text()
    assert key.splitlines()[1] not in repr(tls)
    assert key.splitlines()[1] not in repr(ServerConfig(tls=tls))


def test_make_certs_writes_five_files_keys_private_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "certs"
    assert ctl.main(["make-certs", "--out", str(out), "--hosts", "10.0.0.7,ps-0.example"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    for key in ("server-key.pem", "client-key.pem"):
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600
    from cryptography import x509  # the library make-certs uses
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert names.get_values_for_type(x509.DNSName) == ["ps-0.example"]
    before = (out / "server-key.pem").read_bytes()
    with pytest.raises(SystemExit) as refused:
        ctl.main(["make-certs", "--out", str(out)])
    assert refused.value.code == 2
    assert "--out" in capsys.readouterr().err
    assert (out / "server-key.pem").read_bytes() == before


def test_probe_answers_serving_over_tls_and_fails_without_it(tls_cluster, certs, capsys):
    address = tls_cluster.servers[0].bound_address
    assert ctl.main(["--tls-ca", str(certs / "ca.pem"), "probe", address]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert ctl.main(["--timeout", "2", "probe", address]) == 1
    assert "--tls-ca" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["ps_server.cli", "ps_server.coordinator.cli",
                                    "ps_worker.cli", "ps_worker.ctl"])
def test_bad_tls_flags_are_refused_naming_the_flag(module, certs, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    extra = {"ps_worker.ctl": ["status"], "ps_worker.cli": ["--coordinator", "127.0.0.1:9"]
             }.get(module, [])
    cases = [(["--tls-cert", str(certs / "server.pem")], "--tls-key"),
             (["--tls-cert", str(certs / "server.pem"), "--tls-key",
               str(certs / "client-key.pem")], "--tls-key"),  # another certificate's key
             (["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "ca.pem")],
              "--tls-key"),  # no key at all
             (["--tls-ca", str(not_pem)], "--tls-ca"),
             (["--tls-ca", str(tmp_path / "missing.pem")], "--tls-ca")]
    for flags, named in cases:
        done = subprocess.run([sys.executable, "-m", module, *flags, *extra],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and named in done.stderr, (flags, done.stderr)


@pytest.mark.parametrize("token, tls, expected", [
    (None, None, "without a token or client certificates"),
    (None, "server", "without a token or client certificates"),  # anyone may still call
    ("a-token", None, "without TLS"),  # the token crosses the network in clear text
    (None, "mutual", None),
    ("a-token", "server", None),
])
def test_a_daemon_open_to_the_network_warns_what_it_lacks(certs, caplog, token, tls,
                                                          expected):
    from ps_common.auth import warn_if_open
    settings = None if tls is None else daemon_tls(certs, mutual=tls == "mutual")
    warn_if_open("0.0.0.0", token, settings, "ps.v1.ParameterServer")
    warn_if_open("127.0.0.1", None, None, "ps.v1.ParameterServer")  # loopback: never
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and expected in warnings[0] and "0.0.0.0" in warnings[0]
        assert "a-token" not in warnings[0]


def test_a_pair_of_a_small_rsa_key_grpc_serves_is_not_refused(tmp_path):
    """The pair check asks only whether key and certificate belong together, not whether
    OpenSSL's default security level would take the key (gRPC serves RSA-1024)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    assert TLS.from_files(cert=tmp_path / "c.pem", key=tmp_path / "k.pem") is not None
