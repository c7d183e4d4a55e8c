"""`ps-ctl make-certs --hosts` with the long DNS names Kubernetes gives Services."""

from __future__ import annotations

from cryptography import x509

from ps_worker import ctl

# 70 characters: a Service of a TFJob in a namespace with a descriptive name; a valid DNS name
# (labels under 63 characters, the whole under 253).
LONG_NAME = "*.paramserve-ps.recommendation-training-team-staging.svc.cluster.local"


def test_make_certs_takes_a_dns_name_longer_than_64_characters(tmp_path, capsys):
    """`--hosts` takes IP addresses and DNS names. The first one was also the server
    certificate's common name, which holds at most 64 characters: a longer valid DNS name
    was refused with an error naming neither the flag nor the host. Only the subject
    alternative name, which clients check, needs the whole name."""
    out = tmp_path / "certs"
    try:
        code = ctl.main(["make-certs", "--out", str(out), "--hosts", f"{LONG_NAME},127.0.0.1"])
    except SystemExit as refused:
        err = capsys.readouterr().err
        raise AssertionError(f"make-certs refused a valid DNS name (exit {refused.code}): "
                             f"{err.strip().splitlines()[-1]}") from None
    assert code == 0
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert LONG_NAME in names.get_values_for_type(x509.DNSName)
