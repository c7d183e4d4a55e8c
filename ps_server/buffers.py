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
