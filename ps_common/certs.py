"""`ps-ctl make-certs`: a throwaway certificate authority, and a server and a client
certificate it signs, for trying TLS and mutual TLS (ps_common.tls) without a PKI.

The files: `ca.pem` (give it to every process as --tls-ca, and to daemons as --tls-client-ca
for mutual TLS), `server.pem` + `server-key.pem` (every daemon's --tls-cert/--tls-key: the
certificate is valid for serving and, because daemons call each other, as a client
certificate too), `client.pem` + `client-key.pem` (workers, ps-ctl and PSClient under mutual
TLS). Keys are written readable by their owner only. The server certificate names every
host in `hosts`: IP addresses as IP subject alternative names, the rest as DNS names
(wildcards such as `*.ps.default.svc.cluster.local` allowed), because clients check the
address they dial against it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def make_certs(out: str | os.PathLike, hosts=DEFAULT_HOSTS, *, days: int = 365) -> list[Path]:
    """Write FILES into `out` (created if missing); returns their paths. Raises ValueError
    naming the flag at fault (--hosts, --days, --out) for an empty host list, a host name the
    certificate cannot hold, an end date past the year 9999, an `out` that is not a directory
    or cannot be created, or one that already holds one of the files (never overwrites a
    key). Every flag is checked before anything is written."""
    # Imported here: only this command needs the cryptography library.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ValueError("--hosts: give at least one host name or IP address")
    alt_names = [_alt_name(x509, host) for host in hosts]
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    except OverflowError:  # datetime ends with the year 9999
        raise ValueError(f"--days {days}: the certificates would end after the year 9999; "
                         "give fewer days") from None
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent that is a file, no permission, a read-only disk
        raise ValueError(f"--out {out}: cannot create the directory: "
                         f"{error.strerror or error}") from None
    existing = [name for name in FILES if (out / name).exists()]
    if existing:
        raise ValueError(f"--out {out}: already holds {', '.join(existing)}; "
                         "choose an empty directory (keys are never overwritten)")

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "paramserve"),
                          x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("paramserve throwaway CA")
    ca = (builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))

    def leaf(common: str, usages: list, alt_names: list):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (builder(name(common), ca_name, key.public_key())
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False))
        if alt_names:
            cert = cert.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        return cert.sign(ca_key, hashes.SHA256()), key

    # Clients check the names in the subject alternative name; the common name, which may
    # hold at most 64 characters, only labels the certificate.
    server, server_key = leaf(hosts[0][:64], [ExtendedKeyUsageOID.SERVER_AUTH,
                                         ExtendedKeyUsageOID.CLIENT_AUTH], alt_names)
    client, client_key = leaf("paramserve client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])

    def pem(cert) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    contents = {"ca.pem": (pem(ca), 0o644), "server.pem": (pem(server), 0o644),
                "server-key.pem": (key_pem(server_key), 0o600),
                "client.pem": (pem(client), 0o644),
                "client-key.pem": (key_pem(client_key), 0o600)}
    written = []
    for filename in FILES:
        data, mode = contents[filename]
        path = out / filename
        try:
            # O_EXCL: never replace a file that appeared since the check above.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except OSError as error:  # a directory that exists but is not writable, say
            raise ValueError(f"--out {out}: cannot write {filename}: "
                             f"{error.strerror or error}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        written.append(path)
    return written


def _alt_name(x509, host: str):
    """The subject alternative name for `host`: an IP address, else a DNS name; ValueError
    naming --hosts for a name the certificate cannot hold as it is."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if not host.isascii():
        # A certificate holds the ASCII (IDNA) form of a name, which is what clients compare.
        try:
            hint = f" ({host.encode('idna').decode('ascii')})"
        except UnicodeError:
            hint = ""
        raise ValueError(f"--hosts {host}: give the name's ASCII (IDNA) form{hint}")
    try:
        return x509.DNSName(host)
    except ValueError as error:
        raise ValueError(f"--hosts {host}: {error}") from None
