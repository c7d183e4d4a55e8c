"""paramserve's worker side: the PSClient library and (with the training runtime) ps-worker."""

from ps_common.malloc import tune_malloc
from ps_common.rpc import RetryPolicy
from ps_common.status import RemoteError
from ps_worker.client import PSClient

__all__ = ["PSClient", "RemoteError", "RetryPolicy", "tune_malloc"]
