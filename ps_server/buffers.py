"""Reusable receive buffers for pushed gradients.

A fresh multi-MiB buffer per push costs more than the push's copy itself: the allocator
hands back new pages and every one of them faults on first write (about 85 ms for 64 MiB
here). Shard sizes repeat step after step, so buffers are kept by exact size and reused.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np


class BufferPool:
    """Thread-safe. Keeps at most `max_cached_bytes` of idle buffers."""

    def __init__(self, max_cached_bytes: int = 1 << 30):
        self._max = max_cached_bytes
        self._idle: dict[int, list[np.ndarray]] = defaultdict(list)
        self._cached = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly `nbytes` (contents undefined)."""
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                self._cached -= nbytes
                return idle.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def release(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._cached + buffer.nbytes <= self._max:
                self._idle[buffer.nbytes].append(buffer)
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
