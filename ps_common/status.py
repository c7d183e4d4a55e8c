"""Status <-> exception translation: the one bridge between the error catalog and gRPC.

Servers wrap every handler in `translate_errors(context, method)`: a `PSError` becomes its
status code and public message (plus a typed detail where the client must act on it, e.g.
StaleEpoch); anything else is logged and becomes INTERNAL without leaking `str(e)`.
Clients turn `grpc.RpcError` into `RemoteError` and dispatch on `.code()` and typed details,
never on message text.
"""

from __future__ import annotations

import contextlib
import logging

import grpc
from google.protobuf import any_pb2
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ps_common.errors import ERROR_DOMAIN, Overloaded, PSError, StaleEpoch
from ps_common.tls import HANDSHAKE_HINT, looks_like_handshake_failure
from ps_proto.v1 import tensor_pb2

log = logging.getLogger(__name__)


def connection_hint(message: str) -> str | None:
    """What to check when gRPC's UNAVAILABLE `message` says a connection failed for a
    reason of TLS: a handshake that failed, or a daemon that closed the connection before
    any call (a TLS daemon dialled without TLS, or one requiring a client certificate).
    None for any other message."""
    if "failed to connect" not in message:
        return None
    if looks_like_handshake_failure(message):
        return HANDSHAKE_HINT
    if "Socket closed" in message:
        return ("the daemon closed the connection before any call: if it serves TLS, give "
                "--tls-ca; if it requires client certificates, --tls-cert and --tls-key too")
    return None


# A status travels in the answer's trailing metadata, twice (grpc-message, percent-encoded,
# and the google.rpc.Status beside it), which a client refuses past 8-16 KiB: it would then
# see RESOURCE_EXHAUSTED from its own transport instead of the error. A message that quotes
# a long request (a made-up name of a megabyte) keeps its start and its end.
MAX_MESSAGE_BYTES = 1024


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, shortened in the middle to at most about `limit` bytes of UTF-8."""
    encoded = message.encode()
    if len(encoded) <= limit:
        return message
    head = encoded[:limit * 3 // 4].decode(errors="ignore")
    tail = encoded[-(limit // 4):].decode(errors="ignore")
    return f"{head} [... {len(encoded) - len(head.encode()) - len(tail.encode())} bytes ...] {tail}"


def status_of(error: PSError) -> status_pb2.Status:
    """The google.rpc.Status a handler that raised `error` ends with: its code, public
    message and typed details (StaleEpoch, RetryInfo)."""
    details = []
    if isinstance(error, StaleEpoch):
        detail = any_pb2.Any()
        detail.Pack(tensor_pb2.StaleEpoch(
            request_epoch=error.request_epoch, current_epoch=error.current_epoch))
        details.append(detail)
    if isinstance(error, Overloaded):
        detail = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(detail)
    if error.reason:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN))
        details.append(detail)
    return status_pb2.Status(code=getattr(code_pb2, error.code),
                             message=bounded(error.message), details=details)


def internal_status(method: str) -> status_pb2.Status:
    """What a handler that failed for a reason of the server's own ends with (the reason
    itself goes to the server's log, never to the client)."""
    return status_pb2.Status(code=code_pb2.INTERNAL,
                             message=f"internal error in {method}; see the server log")


@contextlib.contextmanager
def translate_errors(context: grpc.ServicerContext, method: str):
    """Run a handler body; turn what it raises into the right status and abort the RPC."""
    try:
        yield
    except PSError as error:
        context.abort_with_status(rpc_status.to_status(status_of(error)))
    except grpc.RpcError:
        # The caller's request stream broke (cancelled, deadline, disconnect): it is not
        # waiting for an answer, and this is no server fault worth a traceback.
        log.debug("request stream of %s ended early", method)
        context.abort(grpc.StatusCode.CANCELLED, f"the request stream of {method} ended early")
    except Exception:
        # abort() itself raises a bare Exception subclass to unwind the handler: keep it.
        if context.code() is not None:
            raise
        log.exception("internal error in %s", method)
        context.abort_with_status(rpc_status.to_status(internal_status(method)))


class RemoteError(Exception):
    """A failed RPC as the client library raises it: `.code()` is the grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str, *, target: str = "",
                 stale_epoch: tensor_pb2.StaleEpoch | None = None,
                 retry_after_s: float | None = None, reason: str = ""):
        prefix = f"{target}: " if target else ""
        super().__init__(f"{prefix}{code.name}: {message}")
        self._code = code
        self._message = message
        self.target = target
        self.stale_epoch = stale_epoch
        # The cause, where the server named one (ps_common.errors' reasons: a push refused
        # for a non-finite gradient, a fenced incarnation, a step waited its longest).
        self.reason = reason
        # Set when the server asked to be retried after a delay (google.rpc.RetryInfo).
        self.retry_after_s = retry_after_s
        # What to check when the connection failed for a reason of TLS (connection_hint of
        # gRPC's own message; the message then leads with it).
        self.connection_hint: str | None = None

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, *, target: str = "") -> "RemoteError":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        message = (error.details() if hasattr(error, "details") else None) or str(error)
        status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
        # A status with details was answered by a daemon's handler: a connection it names as
        # failed is the daemon's own (a coordinator that cannot reach a server), not ours.
        hint = connection_hint(message) \
            if code == grpc.StatusCode.UNAVAILABLE and status is None else None
        if hint is not None:
            message = f"{hint} (gRPC: {message})"
        made = cls._with_details(code, message, status.details if status is not None else (),
                                 target)
        made.connection_hint = hint
        return made

    @classmethod
    def from_status(cls, status: status_pb2.Status, *, target: str = "") -> "RemoteError":
        """The error a call that ended with `status` (a google.rpc.Status) raises."""
        try:
            code = grpc.StatusCode[code_pb2.Code.Name(status.code)]
        except (ValueError, KeyError):
            code = grpc.StatusCode.UNKNOWN
        return cls._with_details(code, status.message, status.details, target)

    @classmethod
    def _with_details(cls, code: grpc.StatusCode, message: str, details,
                      target: str) -> "RemoteError":
        stale, retry_after, reason = None, None, ""
        for detail in details:
            candidate = tensor_pb2.StaleEpoch()
            retry = error_details_pb2.RetryInfo()
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(candidate):
                stale = candidate
            elif detail.Unpack(retry):
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
            elif detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                reason = info.reason
        return cls(code, message, target=target, stale_epoch=stale, retry_after_s=retry_after,
                   reason=reason)
