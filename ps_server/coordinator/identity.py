"""Numbers a coordinator hands out that must never repeat across its restarts.

A coordinator's *generation* is the wall-clock millisecond it started at (and never below a
floor it is given, e.g. a generation a server reports). Shard-map epochs and incarnations
are `generation << 20` plus a counter, so every number a coordinator issues is above every
number any predecessor issued, as long as each lives through fewer than 2**20 of them per
millisecond of its successor's head start: no state file is needed for this. No grpc here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ps_common.errors import ResourceExhausted

COUNTER_BITS = 20


def new_generation(floor: int = 0) -> int:
    return max(time.time_ns() // 1_000_000, floor + 1)


def first_number(generation: int) -> int:
    """The lowest epoch or incarnation generation `generation` issues."""
    return generation << COUNTER_BITS


class Incarnations:
    """Thread-safe source of incarnations, unique across coordinator restarts."""

    def __init__(self, generation: int):
        self._next = first_number(generation)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def raise_floor(self, generation: int) -> None:
        """Hand out only numbers of `generation` or later from now on (a server reported a
        generation at or above this coordinator's: the clock went back)."""
        with self._lock:
            self._next = max(self._next, first_number(generation))


@dataclass(frozen=True)
class Retired:
    client_id: str
    incarnation: int


class RetiredLog:
    """Client incarnations that will never push again, numbered from 1, for servers to
    read from a cursor (they then drop those clients' dedup state). Thread-safe.

    Bounded: only the last `capacity` entries are kept. A server whose cursor fell behind
    the oldest one kept just misses those retirements and keeps the clients' state: the
    safe direction (it never forgets a client that may still retry)."""

    def __init__(self, capacity: int = 100_000):
        self._entries: deque[tuple[int, Retired]] = deque(maxlen=capacity)
        self._last = 0
        self._lock = threading.Lock()

    def append(self, client_id: str, incarnation: int) -> None:
        with self._lock:
            self._last += 1
            self._entries.append((self._last, Retired(client_id, incarnation)))

    def since(self, cursor: int, limit: int = 1000) -> tuple[list[Retired], int]:
        """Entries after `cursor` (at most `limit`) and the cursor after them."""
        with self._lock:
            if cursor > self._last:  # a cursor from another coordinator generation
                cursor = 0
            first = self._entries[0][0] if self._entries else self._last + 1
            start = max(0, cursor + 1 - first)
            batch = [self._entries[i] for i in range(start, min(len(self._entries),
                                                                start + limit))]
            return [r for _, r in batch], (batch[-1][0] if batch else max(cursor, first - 1))


class ClientRegistry:
    """The PSClient instances the coordinator handed incarnations to. Thread-safe.

    Registering a client id again (a restarted trainer) retires the previous incarnation;
    releasing retires the given one. Bounded: at `capacity` live clients a new client id is
    refused with RESOURCE_EXHAUSTED rather than forgetting one that may still push."""

    def __init__(self, incarnations: Incarnations, retired: RetiredLog, capacity: int = 65536):
        self._incarnations = incarnations
        self._retired = retired
        self._capacity = capacity
        self._live: dict[str, int] = {}
        self._lock = threading.Lock()

    def register(self, client_id: str) -> int:
        with self._lock:
            previous = self._live.get(client_id)
            if previous is None and len(self._live) >= self._capacity:
                raise ResourceExhausted(
                    f"the coordinator tracks {self._capacity} live clients, its limit; close "
                    "PSClients that are done (PSClient.close) before starting more")
            incarnation = self._live[client_id] = self._incarnations()
        if previous is not None:
            self._retired.append(client_id, previous)
        return incarnation

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def release(self, client_id: str, incarnation: int) -> None:
        with self._lock:
            if self._live.get(client_id) == incarnation:
                del self._live[client_id]
        self._retired.append(client_id, incarnation)
