"""Array backends: where a worker's tensors live and how bytes move to and from there.

Model code is written once against an array module ``xp`` (NumPy or CuPy). A backend owns
the device side of a worker: it hands out reusable host buffers for pulled parameters and
outgoing gradients, copies them to and from the device, and says which ``xp`` to use.

CuPy is imported in exactly one module, ``ps_worker._cupy_backend``, and only when a GPU
backend is asked for (or probed by ``--device auto``), so a CPU-only install never needs it.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ps_common.rows import sum_duplicates

__all__ = [
    "ArrayBackend",
    "BackendUnavailable",
    "NumpyBackend",
    "array_module",
    "cuda_device_count",
    "select_backend",
]

_logger = logging.getLogger(__name__)

_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")
# Every value of --device, lower-cased (what select_backend takes).
DEVICE_VALUE = re.compile(r"auto|cpu|cuda(?::\d+)?")


def device_flag_problem(value: str) -> str | None:
    """Why `value` is no --device value (the message names the flag), or None."""
    if DEVICE_VALUE.fullmatch(value.strip().lower()):
        return None
    return f"--device {value!r}: expected auto, cpu, cuda or cuda:N"


class BackendUnavailable(ValueError):
    """The requested device cannot be used on this machine (no CuPy, or no such GPU)."""


@runtime_checkable
class ArrayBackend(Protocol):
    """Where a worker computes, and the host<->device copies around each step.

    Contract shared by every implementation (see ``tests/unit/test_backend.py``):

    * ``host_buffer(key, shape, dtype)`` returns the same array for the same key while the
      shape and dtype are unchanged; a different shape or dtype replaces it.
    * ``to_device(host)`` may be asynchronous: ``host`` must not be rewritten until
      ``synchronize()`` returns. Work later issued on the caller's current stream sees the data.
    * ``to_host(arr, out)`` may be asynchronous: the returned host array is valid only after
      ``synchronize()``. Pass ``out=host_buffer(...)`` to avoid allocating per step.

    A backend is meant to be driven by one worker thread; only ``host_buffer`` is thread-safe.
    """

    name: str
    xp: ModuleType
    device: str

    def host_buffer(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray: ...

    def to_device(self, host_array: np.ndarray) -> Any: ...

    def to_host(self, arr: Any, out: np.ndarray | None = None) -> np.ndarray: ...

    def synchronize(self) -> None: ...

    def sum_rows(self, grads: Any, inverse: Any, n_unique: int) -> Any:
        """(n_unique, dim) on the device: row i sums the rows of `grads` whose `inverse` is
        i (a batch's gradient per id occurrence, summed per distinct id)."""
        ...


class HostBufferCache:
    """Reusable host arrays keyed by name; thread-safe.

    Buffers are handed out, not lent: two threads asking for the same key get the same
    array, so callers use one key per concurrent use.
    """

    def __init__(self, allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray]) -> None:
        self._allocate = allocate
        self._buffers: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def get(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        shape = tuple(int(dim) for dim in shape)
        dtype = np.dtype(dtype)
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
                buffer = self._allocate(shape, dtype)
                self._buffers[key] = buffer
            return buffer


class NumpyBackend:
    """CPU backend: the device is host memory, so copies are no-ops.

    ``to_device`` returns its argument itself (zero-copy) and ``to_host`` returns the array
    unless ``out`` is given; both complete immediately. Thread-safety as ``ArrayBackend``.
    """

    name = "numpy"
    xp: ModuleType = np
    device = "cpu"

    def __init__(self) -> None:
        self._host_buffers = HostBufferCache(lambda shape, dtype: np.zeros(shape, dtype))

    def host_buffer(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self._host_buffers.get(key, shape, dtype)

    def to_device(self, host_array: np.ndarray) -> np.ndarray:
        return np.asarray(host_array)

    def to_host(self, arr: Any, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.asarray(arr)
        np.copyto(out, arr)
        return out

    def synchronize(self) -> None:
        pass

    def sum_rows(self, grads: np.ndarray, inverse: np.ndarray, n_unique: int) -> np.ndarray:
        return sum_duplicates(np.asarray(grads), inverse, n_unique)

    def __repr__(self) -> str:
        return "NumpyBackend(device='cpu')"


def array_module(arr: Any) -> ModuleType:
    """The array module (numpy or cupy) that owns ``arr``; numpy for anything not CuPy."""
    if isinstance(arr, (np.ndarray, np.generic)):
        return np
    # An object can only be a CuPy array if CuPy was already imported by someone.
    if "cupy" in sys.modules and type(arr).__module__.startswith("cupy"):
        from ps_worker import _cupy_backend

        return _cupy_backend.array_module(arr)
    return np


def _probe_cupy() -> tuple[ModuleType | None, int, str]:
    """(the CuPy backend module or None, GPU count, why there is none when it is 0)."""
    try:
        from ps_worker import _cupy_backend
    except ImportError as exc:
        return None, 0, f"CuPy is not importable ({exc})"
    count, problem = _cupy_backend.device_count()
    if count == 0:
        return _cupy_backend, 0, problem or "CuPy sees no CUDA device"
    return _cupy_backend, count, ""


def cuda_device_count() -> int:
    """How many CUDA devices CuPy can use here; 0 when CuPy or a driver is missing."""
    return _probe_cupy()[1]


def select_backend(device: str, log: Callable[[str], None] | None = None,
                   local_rank: int | None = None) -> ArrayBackend:
    """The backend for a ``--device`` value: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    ``auto`` picks CuPy on a GPU when CuPy imports and sees one, NumPy otherwise, and
    reports its choice and the reason through ``log`` (default: this module's logger at INFO).
    The GPU of ``auto`` and ``cuda`` is GPU 0, or with ``local_rank`` (the worker's index
    among the workers of its host) GPU ``local_rank`` mod the GPUs visible, so that the
    workers of a host spread over its GPUs; ``cuda:N`` is GPU N whatever the rank.

    Raises ``BackendUnavailable`` when a CUDA device is named but CuPy or that GPU is
    missing or cannot be used (``auto`` then picks NumPy), and ``ValueError`` for a value
    that names no device.
    """
    report = log if log is not None else _logger.info
    spec = device.strip().lower()
    if spec == "cpu":
        return NumpyBackend()
    if spec == "auto":
        cupy_backend, count, problem = _probe_cupy()
        if cupy_backend is None or count == 0:
            report(f"device auto: using numpy on the CPU because {problem}")
            return NumpyBackend()
        index = _gpu_of_rank(local_rank, count)
        backend, problem = _open_gpu(cupy_backend, index)
        if backend is None:
            report(f"device auto: using numpy on the CPU because {problem}")
            return NumpyBackend()
        report(f"device auto: using cupy on cuda:{index} ({count} CUDA device(s) visible"
               f"{'' if local_rank is None else f', local rank {local_rank}'})")
        return backend
    match = _CUDA_DEVICE.fullmatch(spec)
    if match is None:
        raise ValueError(f"device {device!r} is not one of 'auto', 'cpu', 'cuda' or 'cuda:N'")
    cupy_backend, count, problem = _probe_cupy()
    index = (int(match.group(1)) if match.group(1) is not None
             else _gpu_of_rank(local_rank, max(count, 1)))
    if cupy_backend is None:
        raise BackendUnavailable(
            f"device cuda:{index} was requested but {problem}; install paramserve[gpu] "
            "(cupy-cuda12x) or run with --device cpu"
        )
    if index >= count:
        reason = problem or f"only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
        raise BackendUnavailable(
            f"device cuda:{index} was requested but {reason}; check CUDA_VISIBLE_DEVICES "
            "or run with --device cpu"
        )
    backend, problem = _open_gpu(cupy_backend, index)
    if backend is None:
        raise BackendUnavailable(f"device cuda:{index} was requested but {problem}; check "
                                 "CUDA_VISIBLE_DEVICES and the GPU's compute mode and memory, "
                                 "or run with --device cpu")
    return backend


def _gpu_of_rank(local_rank: int | None, count: int) -> int:
    if local_rank is not None and local_rank < 0:
        raise ValueError(f"local rank {local_rank}: must be >= 0")
    return 0 if local_rank is None else local_rank % count


def _open_gpu(cupy_backend: ModuleType, index: int) -> tuple[ArrayBackend | None, str]:
    """(the CuPy backend on GPU `index`, "") or (None, why it cannot be used): a GPU that
    CUDA lists may still refuse a context (busy in EXCLUSIVE_PROCESS mode, memory full)."""
    try:
        return cupy_backend.CupyBackend(index), ""
    except cupy_backend.CUDA_ERRORS as exc:
        return None, f"cuda:{index} cannot be used ({exc})"
