"""One shard of a dynamic embedding table: rows made on first use for any int64 id, held in
a pool that grows as ids arrive, and evicted least recently used first (capacity) or when
untouched for too long (ttl).

The pool is plain arrays (values, optimizer slots, the id of every pool row and whether it
holds one: every int64 is a valid id, so no id can mark a free row), so that checkpoints and
the sparse optimizers treat it like any shard's arrays.
Not thread-safe: the store calls it under the shard's lock.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ps_common.errors import InvalidArgument, ResourceExhausted

# Slots holding each pool row's id and whether the row is in use (1) or free (0); saved in
# checkpoints with the others.
IDS_SLOT = "ids"
HELD_SLOT = "held"
BOOKKEEPING_SLOTS = (IDS_SLOT, HELD_SLOT)
# Saved beside those (computed at the checkpoint's cut, never held as slots): when each pool
# row was last used, so that a restored table evicts the rows it would have evicted and its
# rows keep what was left of their ttl. Ages, not clock readings (a monotonic clock means
# nothing in another process), and requests since, which order rows used at one reading.
AGE_SLOT = "last_use_age"  # float64: seconds from the row's last use to the cut
AGO_SLOT = "last_use_ago"  # int64: requests to the shard since the row's last one, at the cut
FREE = -1  # find()'s answer for an id the table does not hold
MIN_POOL_ROWS = 64
EVICTION_BATCH = 64
# Bytes a held row costs beyond its values and slots: its id, flag, last use (tick and time)
# and its entry in the id -> row dict (a Python int key and value, and the dict's slot).
ROW_OVERHEAD_BYTES = 8 + 1 + 8 + 8 + 100


class DynamicRows:
    """`make_rows(ids)` gives the initial rows of new ids, `make_slots(n)` the optimizer
    slots of n new rows (a dict of arrays with n rows). `capacity` 0 means unlimited,
    `ttl_s` 0 means never expire; `clock()` is monotonic seconds. `admit(nbytes)`, called
    before the pool grows, raises to refuse the growth (a server's memory budget), else may
    return `settle(install)`: the pool calls it with the function that installs the grown
    arrays (None if making them failed), and it runs that as the admission's held room is
    given back."""

    def __init__(self, dim: int, dtype: str, *, capacity: int, ttl_s: float,
                 make_rows: Callable[[np.ndarray], np.ndarray],
                 make_slots: Callable[[int], dict[str, np.ndarray]],
                 clock: Callable[[], float],
                 admit: Callable[[int], Callable | None] | None = None):
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._make_rows = make_rows
        self._make_slots = make_slots
        self._clock = clock
        self._admit = admit  # raises when the pool may not grow by that much
        self.values = np.empty((0, dim), self.dtype)
        self.slots: dict[str, np.ndarray] = {**make_slots(0), IDS_SLOT: np.empty(0, np.int64),
                                             HELD_SLOT: np.empty(0, np.uint8)}
        self._index: dict[int, int] = {}
        self._free: list[int] = []
        self._last_tick = np.empty(0, np.int64)  # LRU order: the request that last touched it
        self._last_time = np.empty(0, np.float64)  # for the ttl
        self._tick = 0
        self._next_sweep = 0.0
        self.evictions = 0

    # ---- what it holds -----------------------------------------------------------------

    @property
    def rows_held(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (free rows included) and of the index (estimated)."""
        return (self.values.nbytes + sum(a.nbytes for a in self.slots.values())
                + self._last_tick.nbytes + self._last_time.nbytes + 100 * len(self._index))

    @property
    def row_bytes(self) -> int:
        """Bytes of one pool row: its values and slots."""
        return self.values.itemsize * self.dim + sum(
            array.itemsize * math.prod(array.shape[1:]) for array in self.slots.values())

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The pool rows of `ids` (-1 where not held), touching nothing."""
        get = self._index.get
        return np.fromiter((get(i, FREE) for i in ids.tolist()), np.int64, len(ids))

    # ---- use ---------------------------------------------------------------------------

    def check_request(self, distinct_ids: int, what: str) -> None:
        if self.capacity and distinct_ids > self.capacity:
            raise InvalidArgument(
                f"{what}: {distinct_ids} distinct ids in one request, more than this shard's "
                f"share of the table's capacity ({self.capacity} rows): send fewer ids at once "
                "or declare a larger capacity")

    def reserve(self, ids: np.ndarray) -> None:
        """Grow the pool now, if `locate(ids)` would need it to: the only step of `locate`
        that may be refused (the memory budget). Changes no row: a push to several tables
        reserves for every one before it locates any (ShardStore.apply). Rows past their
        ttl are freed first, as `locate` frees them, so that their room is used."""
        now = self._clock()
        self.expire(now)
        rows = self._find_live(ids, now)
        new = int(np.count_nonzero(rows == FREE))
        if new:
            self.check_request(len(ids), "dynamic table")
            self._reserve_free(new - self._evictions_for(new, kept=len(ids) - new))

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """The pool rows of `ids` (distinct), making the missing ones (and those past the
        ttl) from the initializer (evicting the least recently used rows not in this request
        when the capacity is reached) and marking all of them used now. The pool grows, if it
        must, before any row is evicted: a refused growth leaves every row held as it was."""
        now = self._clock()
        self.expire(now)
        rows = self._find_live(ids, now)
        missing = rows == FREE
        if missing.any():
            self.check_request(len(ids), "dynamic table")
            new_ids = ids[missing]
            keep = rows[~missing]
            evicting = self._evictions_for(len(new_ids), kept=len(keep))
            self._reserve_free(len(new_ids) - evicting)
            if evicting:
                self._evict_lru(evicting, keep=keep)
            fresh = self._allocate(len(new_ids))
            self.values[fresh] = self._make_rows(new_ids)
            for name, array in self._make_slots(len(new_ids)).items():
                self.slots[name][fresh] = array
            self.slots[IDS_SLOT][fresh] = new_ids
            self.slots[HELD_SLOT][fresh] = 1
            self._index.update(zip(new_ids.tolist(), fresh.tolist()))
            rows[missing] = fresh
        self._tick += 1
        self._last_tick[rows] = self._tick
        self._last_time[rows] = now
        return rows

    def _find_live(self, ids: np.ndarray, now: float) -> np.ndarray:
        """`find(ids)`, first releasing (as evicted) those of their rows past the ttl: the
        sweep (`expire`) runs only every quarter ttl, so it may not have reached them yet,
        and a row untouched for longer than the ttl must start again from its initial row."""
        rows = self.find(ids)
        if not self.ttl_s:
            return rows
        held = rows[rows != FREE]
        stale = np.unique(held[self._last_time[held] < now - self.ttl_s])
        if not len(stale):
            return rows
        self._release(stale)
        rows[np.isin(rows, stale)] = FREE
        return rows

    def _evictions_for(self, new: int, kept: int) -> int:
        """Rows to evict so that `new` rows fit the capacity beside the `kept` ones a request
        also names. A sweep reads the whole pool: when one runs, it frees a 64th of the
        capacity (the least recently used rows still), so that a full table's requests do
        not each pay for one."""
        if not self.capacity:
            return 0
        over = len(self._index) + new - self.capacity
        if over <= 0:
            return 0
        return min(max(over, self.capacity // EVICTION_BATCH), len(self._index) - kept)

    def _reserve_free(self, count: int) -> None:
        """At least `count` free pool rows, growing the pool (admitted) if need be."""
        if len(self._free) < count:
            self._grow(len(self.values) + count - len(self._free))

    def expire(self, now: float | None = None) -> int:
        """Evict the rows untouched for ttl_s; returns how many. Sweeps at most every
        quarter ttl (a sweep reads the whole pool): it frees memory, while `locate` and
        `reserve` release a request's own rows past the ttl whenever they look them up."""
        if not self.ttl_s:
            return 0
        now = self._clock() if now is None else now
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + self.ttl_s / 4
        stale = np.flatnonzero(self.slots[HELD_SLOT].view(bool)
                               & (self._last_time < now - self.ttl_s))
        self._release(stale)
        return len(stale)

    def _evict_lru(self, count: int, keep: np.ndarray) -> None:
        held = np.flatnonzero(self.slots[HELD_SLOT].view(bool))
        if len(keep):
            held = held[~np.isin(held, keep)]
        if count < len(held):
            oldest = np.argpartition(self._last_tick[held], count - 1)[:count]
            held = held[oldest]
        self._release(held)

    def _release(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        for identifier in self.slots[IDS_SLOT][rows].tolist():
            del self._index[identifier]
        self.slots[HELD_SLOT][rows] = 0
        self._free.extend(rows.tolist())
        self.evictions += len(rows)

    def _allocate(self, count: int) -> np.ndarray:
        self._reserve_free(count)
        taken, self._free = self._free[-count:], self._free[:-count]
        return np.array(taken, np.int64)

    def _grow(self, at_least: int) -> None:
        """Double the pool (or more): amortized O(1) per row, like a list."""
        old = len(self.values)
        size = max(at_least, 2 * old, MIN_POOL_ROWS)
        if self.capacity:
            size = max(min(size, self.capacity), at_least)
        admitted = None
        while self._admit is not None:
            try:
                admitted = self._admit((size - old) * (self.row_bytes + ROW_OVERHEAD_BYTES))
                break
            except ResourceExhausted:
                # No room to double: as much more as fits, down to what is needed now, so
                # that the table grows until its server's budget is full.
                if size <= at_least:
                    raise
                size = max(at_least, old + (size - old) // 2)

        def grown(array: np.ndarray, fill) -> np.ndarray:
            bigger = np.empty((size, *array.shape[1:]), array.dtype)
            bigger[:old] = array
            bigger[old:] = fill
            return bigger

        # Every array made before any is installed: a failure (out of memory) leaves the
        # pool as it was, and the pool changes at one instant for the budget's count.
        try:
            values = grown(self.values, 0)
            slots = {name: grown(array, 0) for name, array in self.slots.items()}
            last_tick, last_time = grown(self._last_tick, 0), grown(self._last_time, 0.0)
        except BaseException:
            if admitted is not None:
                admitted(None)
            raise

        def install() -> None:
            self.values, self.slots = values, slots
            self._last_tick, self._last_time = last_tick, last_time
            # Reversed, so that rows are taken from the front of the new space first.
            self._free.extend(range(size - 1, old - 1, -1))

        if admitted is None:
            install()
        else:
            admitted(install)

    # ---- checkpoints -------------------------------------------------------------------

    @property
    def last_use(self) -> tuple[np.ndarray, np.ndarray]:
        """Every pool row's last request (tick) and clock reading: the arrays themselves, for
        a checkpoint to copy or read (under the shard's lock) and convert with `cut`."""
        return self._last_tick, self._last_time

    def cut(self) -> "LastUseCut":
        """The instant a checkpoint's cut is taken at, to turn `last_use` into ages."""
        return LastUseCut(self._tick, self._clock())

    def adopt(self, values: np.ndarray, slots: dict[str, np.ndarray],
              last_use: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Take over a pool read back from a checkpoint. `last_use`: each pool row's age and
        requests ago at the cut (AGE_SLOT, AGO_SLOT), which may come from several saved
        shards; without it (a checkpoint written before they were saved) every row counts
        as used now."""
        held = np.flatnonzero(slots[HELD_SLOT].view(bool))
        ids = slots[IDS_SLOT][held]
        if len(np.unique(ids)) != len(held):
            raise ValueError("a dynamic table's checkpointed ids repeat")
        now = self._clock()
        self.values, self.slots = values, dict(slots)
        self._index = dict(zip(ids.tolist(), held.tolist()))
        self._free = np.flatnonzero(~slots[HELD_SLOT].view(bool))[::-1].tolist()
        self._last_tick = np.zeros(len(values), np.int64)
        self._last_time = np.full(len(values), now, np.float64)
        self._tick = 0
        if last_use is not None and len(held):
            self._rebuild_lru(held, last_use, now)
        # Rows saved by fewer servers are dealt to this shard by id: it may get more than
        # its share of the capacity, which the least recently used give back.
        over = len(self._index) - self.capacity
        if self.capacity and over > 0:
            self._evict_lru(over, keep=np.empty(0, np.int64))

    def _rebuild_lru(self, held: np.ndarray, last_use: tuple[np.ndarray, np.ndarray],
                     now: float) -> None:
        # fmax maps NaN to 0 too: a row used at the cut, never one past every ttl.
        age = np.fmax(np.asarray(last_use[0], np.float64)[held], 0.0)
        ago = np.asarray(last_use[1], np.int64)[held]
        # The LRU order, rebuilt as ticks 1..n: least recently used first by age (the one
        # scale that saved shards merged into this one share), then by requests ago (rows of
        # one saved shard used at one clock reading, as a coarse or fake clock gives). Rows
        # of one request keep one tick.
        order = np.lexsort((-ago, -age))
        step = (np.diff(age[order]) != 0) | (np.diff(ago[order]) != 0)
        ticks = np.empty(len(held), np.int64)
        ticks[order] = np.concatenate(([1], 1 + np.cumsum(step)))
        self._last_tick[held] = ticks
        self._last_time[held] = now - age  # what was left of the ttl at the cut is left now
        self._tick = int(ticks.max())


class LastUseCut:
    """A shard's last request and clock reading at a checkpoint's cut: converts blocks of
    DynamicRows.last_use (rows as they were at the cut) into what a checkpoint saves."""

    def __init__(self, tick: int, time: float):
        self.tick, self.time = tick, time

    def ago(self, ticks: np.ndarray) -> np.ndarray:
        return self.tick - ticks

    def age(self, times: np.ndarray) -> np.ndarray:
        # A free row's time may be 0 (never used): its age is saved, and never read back.
        return np.maximum(self.time - times, 0.0)
