"""A shared token on every RPC: the cluster's processes present it, daemons check it.

Every daemon given a token (`--token-file FILE`, or the file named by PARAMSERVE_TOKEN_FILE)
refuses every call that does not carry it as `authorization: Bearer <token>` metadata with
UNAUTHENTICATED, on every service but gRPC health (so that probes work). Clients made with
the token (PSClient(token=...), every command with --token-file) attach it to every call.
The shared-memory path needs no check of its own: its handshake is a gRPC call, and every
later call presents the connection's secret that only the handshake hands out.

The token is compared in constant time and never logged, echoed in an error or shown in
a status: configs hold it in fields kept out of their repr.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import grpc

from ps_common.status import bounded

log = logging.getLogger(__name__)

TOKEN_FILE_ENV = "PARAMSERVE_TOKEN_FILE"
_METADATA_KEY = "authorization"
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def read_token_file(path: str | os.PathLike) -> str:
    """The token in `path` (surrounding whitespace dropped). Raises ValueError naming the
    file when it cannot be read or holds no token."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"token file {path}: cannot be read ({error})") from None
    if not token:
        raise ValueError(f"token file {path}: is empty")
    if not token.isascii() or any(c.isspace() or not c.isprintable() for c in token):
        # gRPC metadata values are ASCII: another token would fail every call, unnamed.
        raise ValueError(f"token file {path}: the token must be one line of printable ASCII "
                         "characters without spaces")
    return token


def token_from(flag_value: str | None) -> str | None:
    """The token of a command: its --token-file, else the file PARAMSERVE_TOKEN_FILE names,
    else None (no token). Raises ValueError naming the flag or variable at fault, also when
    either is given but empty."""
    # An empty value (a templated `--token-file "$FILE"` whose variable is unset) is an
    # error, not "no token": a daemon must not come up open when its owner asked for a token.
    if flag_value is not None:
        if not flag_value:
            raise ValueError("--token-file: is empty: give the path of the token file")
        try:
            return read_token_file(flag_value)
        except ValueError as error:
            raise ValueError(f"--token-file: {error}") from None
    from_env = os.environ.get(TOKEN_FILE_ENV)
    if from_env is not None:
        if not from_env:
            raise ValueError(f"{TOKEN_FILE_ENV} is set but empty: give the path of the token "
                             "file, or unset it for no token")
        try:
            return read_token_file(from_env)
        except ValueError as error:
            raise ValueError(f"{TOKEN_FILE_ENV}: {error}") from None
    return None


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call but health's that does not carry `token`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_SERVICES):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(_METADATA_KEY, "")
        if isinstance(presented, str):
            presented = presented.encode()
        if secrets.compare_digest(presented, self._expected):
            return continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, bounded(
                f"{method}: missing or wrong token; give every process of the cluster the "
                f"same token (--token-file, or {TOKEN_FILE_ENV})"))

        # The refusal takes the method's own shape; one that does not exist is refused too
        # (an unauthenticated caller learns nothing, not even which methods there are).
        handler = continuation(handler_call_details)
        if handler is None:
            return grpc.unary_unary_rpc_method_handler(refuse)
        kind = ("unary_unary" if handler.unary_unary else "unary_stream"
                if handler.unary_stream else "stream_unary" if handler.stream_unary
                else "stream_stream")
        return handler._replace(**{kind: refuse})


class _WithToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._metadata = (_METADATA_KEY, f"Bearer {token}")

    def _details(self, details):
        metadata = [*(details.metadata or ()), self._metadata]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else \
            _CallDetails(details.method, details.timeout, metadata, details.credentials,
                         getattr(details, "wait_for_ready", None),
                         getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (
            credentials, wait_for_ready, compression)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel`, attaching `token` to every call (as it is, with no token)."""
    return channel if not token else grpc.intercept_channel(channel, _WithToken(token))


def server_interceptors(token: str | None) -> list:
    return [TokenCheck(token)] if token else []


def warn_if_open(host: str, token: str | None, tls, what: str) -> None:
    """Log a warning for a daemon reachable from other hosts that does not check who calls
    (no token, no client certificates), or that takes its token in clear text (no TLS)."""
    if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        return
    if not token and (tls is None or tls.client_ca is None):
        log.warning("%s listens on %s without a token or client certificates: anyone who "
                    "can reach it may read and change the model (give it --token-file, or "
                    "%s; or --tls-client-ca)", what, host, TOKEN_FILE_ENV)
    elif tls is None:
        log.warning("%s listens on %s without TLS: its token and the model's tensors cross "
                    "the network in clear text (give it --tls-cert and --tls-key)", what, host)
