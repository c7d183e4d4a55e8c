"""The error catalog: every domain failure that may reach a remote caller.

Each exception names the gRPC status code it maps to (as a plain string, so that domain
modules raising these need not import grpc) and carries a message written for the user: it
names the variable, flag or value at fault and what was expected against what came.
`ps_common.status` is the one place that turns these into gRPC statuses and back.
"""

from __future__ import annotations


# The domain of the reasons below (google.rpc.ErrorInfo.domain).
ERROR_DOMAIN = "paramserve"
# Reasons (google.rpc.ErrorInfo.reason): causes a client acts on, not by a message's words.
NON_FINITE_GRADIENT = "NON_FINITE_GRADIENT"
FENCED_INCARNATION = "FENCED_INCARNATION"
STEP_TIMEOUT = "STEP_TIMEOUT"


class PSError(Exception):
    """Base of every error that crosses the wire. `code` is a grpc.StatusCode name;
    `reason`, where set, travels as a google.rpc.ErrorInfo (RemoteError.reason)."""

    code = "INTERNAL"
    reason = ""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(PSError):
    """The request itself is wrong (dtype, shape, row range, non-finite values, bad spec)."""

    code = "INVALID_ARGUMENT"


class NonFiniteGradient(InvalidArgument):
    """A gradient, or a sum or average of gradients, holds NaN or Inf: nothing was applied.
    A model that sends one has diverged (or its data holds NaN)."""

    reason = NON_FINITE_GRADIENT


class OutOfRange(PSError):
    """An id outside a fixed embedding table's rows; values beyond a pull's wire dtype."""

    code = "OUT_OF_RANGE"


class NotFound(PSError):
    code = "NOT_FOUND"


class UnknownVariable(NotFound):
    pass


class SpecConflict(PSError):
    """A variable was declared again with a different spec."""

    code = "FAILED_PRECONDITION"


class TrainedShardConflict(PSError):
    """An assignment would drop or re-create a shard that holds trained values."""

    code = "FAILED_PRECONDITION"


class NotAuthorized(PSError):
    """A control-plane call that does not come from the coordinator this server obeys."""

    code = "PERMISSION_DENIED"


class DataLost(PSError):
    """Trained values are gone (a server came back without the shards it held)."""

    code = "DATA_LOSS"


class CheckpointFailed(PSError):
    """A checkpoint cannot be written or read (no checkpoint directory, disk full, no
    permission, a corrupt file): the message names the path and the cause."""

    code = "FAILED_PRECONDITION"


class FailedPrecondition(PSError):
    """The request is well formed but the server's state does not allow it now (e.g. a
    stepped push from a client that has not joined the server's steps)."""

    code = "FAILED_PRECONDITION"


class FencedIncarnation(FailedPrecondition):
    """A client pushed with an incarnation older than one the server has already seen, one
    the coordinator retired, or one no longer in the server's steps: it must register again."""

    code = "FAILED_PRECONDITION"
    reason = FENCED_INCARNATION


class StaleEpoch(PSError):
    """The request used an outdated shard map: refresh it from the coordinator and retry."""

    code = "ABORTED"

    def __init__(self, request_epoch: int, current_epoch: int):
        super().__init__(
            f"shard map epoch {request_epoch} is stale; the current epoch is {current_epoch}: "
            "refresh the shard map from the coordinator and retry"
        )
        self.request_epoch = request_epoch
        self.current_epoch = current_epoch


class NotReady(PSError):
    """Transient: the callee cannot serve this yet (no servers, epoch not yet delivered)."""

    code = "UNAVAILABLE"


class StepTimeout(PSError):
    """A stepped push (ssp:K, sync) waited its longest for other clients of its step."""

    code = "DEADLINE_EXCEEDED"
    reason = STEP_TIMEOUT


class ResourceExhausted(PSError):
    code = "RESOURCE_EXHAUSTED"


class Overloaded(ResourceExhausted):
    """Transient overload (every stream slot taken): the status carries a google.rpc.RetryInfo
    delay, and clients retry after it with backoff. Other RESOURCE_EXHAUSTED errors (no room
    for a variable, too many clients) are not retried."""

    def __init__(self, message: str, retry_after_s: float = 0.05):
        super().__init__(message)
        self.retry_after_s = retry_after_s
