"""The GPU backend; the only module of ours that imports CuPy.

Imported lazily by ``ps_worker.backend`` so that a CPU-only install never needs CuPy.
Several worker processes may share one GPU: nothing here limits or preallocates the
memory pools, and every copy runs on this backend's own stream.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import cupy
import cupyx
import numpy as np

from ps_worker.backend import HostBufferCache

__all__ = ["CUDA_ERRORS", "CupyBackend", "array_module", "device_count"]

# What CuPy raises when a GPU it lists cannot be used: another process holds it in
# EXCLUSIVE_PROCESS compute mode, its memory is full (workers sharing one GPU), a driver
# fault. (Looked up by name: which of them a CuPy release has, and where, varies.)
CUDA_ERRORS: tuple[type[BaseException], ...] = tuple(
    error for error in (
        getattr(getattr(cupy.cuda, "runtime", None), "CUDARuntimeError", None),
        getattr(getattr(cupy.cuda, "driver", None), "CUDADriverError", None),
        getattr(getattr(cupy.cuda, "memory", None), "OutOfMemoryError", None))
    if isinstance(error, type))


def device_count() -> tuple[int, str]:
    """(number of usable CUDA devices, the reason when it is 0)."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        # No driver or no device is reported as an error, not as a count of 0.
        return 0, f"CUDA reports no usable device ({exc})"
    return count, "" if count else "CUDA reports 0 devices"


def array_module(arr: Any) -> ModuleType:
    return cupy.get_array_module(arr)


class CupyBackend:
    """Computes on GPU ``index`` with CuPy; copies are asynchronous on a non-blocking stream.

    Host buffers are pinned so that copies overlap with compute. Ordering is kept with
    events: a copy to the device waits for work already queued on the caller's current
    stream (the destination block may be recycled from it) and that stream then waits for
    the copy; a copy to the host waits for the caller's stream to produce the array.

    Construction makes the device current for the calling thread, which must also be the
    thread that computes (CuPy's current device and stream are per thread). Not
    thread-safe apart from ``host_buffer``.
    """

    name = "cupy"
    xp: ModuleType = cupy

    def __init__(self, index: int) -> None:
        self._device = cupy.cuda.Device(index)
        self._device.use()
        self.device = f"cuda:{index}"
        with self._device:
            self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._host_buffers = HostBufferCache(
            lambda shape, dtype: cupyx.zeros_pinned(shape, dtype=dtype)
        )
        # Arrays read or written by copies still in flight; without these references a
        # freed source block could be reused by new kernels before the copy has read it.
        self._in_flight: list[Any] = []

    def host_buffer(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self._host_buffers.get(key, shape, dtype)

    def sum_rows(self, grads: cupy.ndarray, inverse: cupy.ndarray,
                 n_unique: int) -> cupy.ndarray:
        with self._device:
            summed = cupy.zeros((n_unique, *grads.shape[1:]), dtype=grads.dtype)
            cupyx.scatter_add(summed, inverse, grads)
            return summed

    def to_device(self, host_array: np.ndarray) -> cupy.ndarray:
        host = np.ascontiguousarray(host_array)
        with self._device:
            compute_stream = cupy.cuda.get_current_stream()
            device_array = cupy.empty(host.shape, dtype=host.dtype)
            self._copy_stream.wait_event(compute_stream.record())
            device_array.set(host, stream=self._copy_stream)
            compute_stream.wait_event(self._copy_stream.record())
        self._in_flight.append(host)
        return device_array

    def to_host(self, arr: Any, out: np.ndarray | None = None) -> np.ndarray:
        with self._device:
            source = cupy.ascontiguousarray(cupy.asarray(arr))
            if out is None:
                # A fresh pinned array: a shared one keyed by shape would be overwritten
                # by the next array of the same shape before the caller read it.
                out = cupyx.empty_pinned(source.shape, dtype=source.dtype)
            self._copy_stream.wait_event(cupy.cuda.get_current_stream().record())
            source.get(stream=self._copy_stream, out=out, blocking=False)
        self._in_flight.append(source)
        return out

    def synchronize(self) -> None:
        self._copy_stream.synchronize()
        self._in_flight.clear()

    def __repr__(self) -> str:
        return f"CupyBackend(device={self.device!r})"
