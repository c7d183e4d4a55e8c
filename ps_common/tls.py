"""TLS and mutual TLS between the cluster's processes.

A daemon given a certificate and key (`--tls-cert`, `--tls-key`) serves only TLS; given
`--tls-client-ca` too, it also requires every caller to present a certificate signed by that
CA (mutual TLS), and refuses the handshake of one that does not. Clients (workers, ps-ctl,
PSClient) check the daemon's certificate against `--tls-ca` and, for mutual TLS, present
their own (`--tls-cert`, `--tls-key`). Daemons call each other (servers register with the
coordinator, the coordinator assigns shards to servers), so a daemon's TLS settings serve
both directions: its certificate is also its client certificate, its --tls-ca checks the
daemons it calls.

A client checks that the certificate names the address it dials (IP or DNS subject
alternative name): `ps-ctl make-certs --hosts` writes one that does. TLS and the shared
token (ps_common.auth) are independent: TLS keeps the wire private and proves who the
daemon is; the token (or a client certificate) proves who the caller is.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_PEM_MARKER = b"-----BEGIN "


@dataclass(frozen=True)
class TLS:
    """One process's TLS settings: PEM bytes, read once (`from_files`)."""

    ca: bytes | None = None          # roots that sign the daemons this process calls
    cert: bytes | None = None        # this process's certificate chain
    key: bytes | None = field(default=None, repr=False)  # its private key: a secret
    client_ca: bytes | None = None   # a daemon's: callers must present a cert it signed

    @classmethod
    def from_files(cls, *, ca: str | os.PathLike | None = None,
                   cert: str | os.PathLike | None = None,
                   key: str | os.PathLike | None = None,
                   client_ca: str | os.PathLike | None = None) -> "TLS | None":
        """The settings the files give, or None when no file is given. Raises ValueError
        naming the flag at fault: a file that cannot be read or holds no PEM block, a
        certificate without its key or a key without its certificate."""
        if (cert is None) != (key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if ca is None and cert is None and client_ca is None:
            return None
        tls = cls(ca=_read_certificates("--tls-ca", ca),
                  cert=_read_certificates("--tls-cert", cert), key=_read_pem("--tls-key", key),
                  client_ca=_read_certificates("--tls-client-ca", client_ca))
        if cert is not None:
            _check_pair(cert, key)
        return tls

    def check_daemon(self) -> None:
        """Raise ValueError unless these settings can serve: a daemon needs its certificate
        and key; a client CA alone would check callers of a plaintext server."""
        if self.cert is None:
            raise ValueError("--tls-cert and --tls-key: a daemon serving TLS needs its "
                             "certificate and key (--tls-ca and --tls-client-ca alone do not "
                             "make it serve TLS)")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For dialling a daemon: check its certificate against `ca` (the system's roots
        when None); present `cert` for mutual TLS."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


def _check_pair(cert: str | os.PathLike, key: str | os.PathLike) -> None:
    """Raise ValueError unless `key` is the private key of `cert`: gRPC would only say so
    as a failure to bind the port (a daemon) or to connect (a client)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Level 0: OpenSSL's default level refuses keys gRPC serves with (RSA-1024, say); only
    # whether the two belong together is checked here.
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        # The password callback answers an encrypted key's prompt: gRPC cannot use one.
        context.load_cert_chain(certfile=cert, keyfile=key, password=lambda: b"")
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"--tls-key {key}: not the (unencrypted) private key of --tls-cert "
                         f"{cert} ({getattr(error, 'reason', None) or error})") from None


def _read_pem(flag: str, path: str | os.PathLike | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be read ({error.strerror or error})") from None
    if _PEM_MARKER not in data:
        raise ValueError(f"{flag} {path}: holds no PEM block (-----BEGIN ...); give a "
                         "PEM file, e.g. one `ps-ctl make-certs` wrote")
    return data


_CERTIFICATE_BLOCK = re.compile(
    rb"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]*-----END CERTIFICATE-----")


def _read_certificates(flag: str, path: str | os.PathLike | None) -> bytes | None:
    """`_read_pem` for a file that must hold certificates: a key given in its place (an easy
    slip) is refused naming the flag, not found later by gRPC as a port that cannot bind."""
    data = _read_pem(flag, path)
    if data is None:
        return None
    # Only the certificate blocks are looked at: a CA bundle may carry comments in any
    # encoding between them (certifi's names issuers in UTF-8), which gRPC skips too.
    blocks = _CERTIFICATE_BLOCK.findall(data)
    try:
        if not blocks:
            raise ValueError("no -----BEGIN CERTIFICATE----- block")
        ssl.create_default_context(cadata=b"\n".join(blocks).decode("ascii"))
    except (ssl.SSLError, ValueError, TypeError) as error:
        raise ValueError(f"{flag} {path}: holds no certificate ({error}); give a PEM "
                         "certificate file, e.g. one `ps-ctl make-certs` wrote") from None
    return data


def looks_like_handshake_failure(message: str) -> bool:
    """Whether gRPC's UNAVAILABLE message says the TLS handshake failed (rather than that
    nothing listens): the two need different fixes."""
    lowered = message.lower()
    return any(s in lowered for s in ("handshake", "ssl", "certificate", "tsi_"))


HANDSHAKE_HINT = ("the TLS handshake failed: check that --tls-ca holds the CA that signed "
                  "the daemon's certificate, that the certificate names the address dialled "
                  "(`ps-ctl make-certs --hosts`), that a daemon requiring client certificates "
                  "(--tls-client-ca) gets one (--tls-cert, --tls-key), and that client and "
                  "daemon both use TLS or neither does")
