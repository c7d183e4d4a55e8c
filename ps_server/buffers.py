"""Reusable receive buffers for pushed gradients.

A fresh multi-MiB buffer per push costs more than the push's copy itself: the allocator
hands back new pages and every one of them faults on first write (about 85 ms for 64 MiB
here). Shard sizes repeat step after step, so buffers are kept by exact size and reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np


class BufferPool:
    """Thread-safe. Keeps at most `max_cached_bytes` (a number, or a callable that says it
    now) of idle buffers; past it, the buffers idle longest go first, so sizes that stopped
    coming back (row pushes change size every step) do not hold the room."""

    def __init__(self, max_cached_bytes: int | Callable[[], int] = 1 << 30):
        self._max = max_cached_bytes if callable(max_cached_bytes) else (
            lambda: max_cached_bytes)
        self._idle: list[np.ndarray] = []  # oldest release first
        self._cached = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly `nbytes` (contents undefined). A new one is
        made only once the idle buffers fit the room the limit leaves now: with a limit
        that counts the buffers in use (PushStaging), idle and in use stay within it."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # the most recently released
                if self._idle[i].nbytes == nbytes:
                    self._cached -= nbytes
                    return self._idle.pop(i)
            limit = self._max()
            while self._idle and self._cached > limit:
                self._cached -= self._idle.pop(0).nbytes
        return np.empty(nbytes, dtype=np.uint8)

    def release(self, buffer: np.ndarray) -> None:
        with self._lock:
            limit = self._max()
            if buffer.nbytes > limit:
                return
            while self._cached + buffer.nbytes > limit:
                self._cached -= self._idle.pop(0).nbytes
            self._idle.append(buffer)
            self._cached += buffer.nbytes

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._cached


class ByteBudget:
    """Bytes lent out at once, at most `capacity`. Thread-safe.

    Bounds the memory that pull snapshots take beside the values they copy: a request
    waits (bounded) while others hold the budget. A request larger than the whole budget is
    served when nothing else is out, so a shard of any size can still be pulled."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._out = 0
        self._changed = threading.Condition()

    def acquire(self, nbytes: int, timeout_s: float) -> bool:
        """Take `nbytes`; False if they did not become free within `timeout_s`."""
        with self._changed:
            fits = lambda: self._out == 0 or self._out + nbytes <= self.capacity  # noqa: E731
            if not self._changed.wait_for(fits, timeout=timeout_s):
                return False
            self._out += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._changed:
            self._out -= nbytes
            self._changed.notify_all()

    @property
    def out(self) -> int:
        with self._changed:
            return self._out
