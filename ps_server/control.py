"""Which coordinator a parameter server obeys, and what it last heard from it.

Control-plane calls (AssignShards) are accepted only with the generation and random token
the server received when it registered: workers never see the token, and a coordinator
that restarted has a new generation and token, so a stale or foreign caller cannot change
or erase what the server holds. No grpc here.
"""

from __future__ import annotations

import hmac
import logging
import threading

from ps_common.errors import NotAuthorized, StaleEpoch
from ps_common.shardmap import EMPTY_MAP, ShardMap

log = logging.getLogger(__name__)


class CoordinatorFence:
    """Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._generation = 0
        self._token = b""
        self._last_map = EMPTY_MAP
        self._retired_through = 0
        self._min_epoch = 0  # assignments older than this were built before registering
        self._assigned_in_full = False  # this process has applied an assignment in full

    def note_assigned_in_full(self) -> None:
        """An assignment was applied with every shard it places here created or kept."""
        with self._lock:
            self._assigned_in_full = True

    @property
    def reported_generation(self) -> int:
        """The generation a registration reports: 0 until this process has applied an
        assignment in full. A coordinator takes a server that reports 0 for a new process,
        and the shards its map places there that the server does not hold for lost: so
        they are, until an assignment restores them. A server that reported the generation
        it registered with before that would have a restarted coordinator take them for
        shards never delivered (a declaration cut short) and create them empty."""
        with self._lock:
            return self._generation if self._assigned_in_full else 0

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def last_map(self) -> ShardMap:
        """The whole shard map of the last assignment accepted (reported on registration)."""
        with self._lock:
            return self._last_map

    @property
    def retired_through(self) -> int:
        with self._lock:
            return self._retired_through

    def adopt(self, generation: int, token: bytes, min_epoch: int = 0) -> None:
        """Obey the coordinator whose registration reply carried these (from now on), in
        assignments of `min_epoch` or later."""
        with self._lock:
            self._min_epoch = min_epoch
            if generation < self._generation:
                log.warning("registered with coordinator generation %d, older than %d seen "
                            "before: its clock may have gone back", generation, self._generation)
            if generation != self._generation:
                self._retired_through = 0  # a new coordinator's log of retired clients
            self._generation, self._token = generation, token

    def check(self, generation: int, token: bytes, epoch: int | None = None) -> None:
        """Raise NotAuthorized unless the call comes from the coordinator this server obeys;
        StaleEpoch when it assigns an `epoch` built before this server registered."""
        with self._lock:
            ok = (bool(self._token) and generation == self._generation
                  and hmac.compare_digest(token, self._token))
            current, floor = self._generation, self._min_epoch
        if not ok:
            raise NotAuthorized(
                f"control-plane call refused: it does not come from the coordinator this "
                f"server registered with (generation {current or 'none yet'}; the call "
                f"names generation {generation})")
        if epoch is not None and epoch < floor:
            raise StaleEpoch(epoch, floor)

    def remember_map(self, shard_map: ShardMap) -> None:
        with self._lock:
            if shard_map.epoch >= self._last_map.epoch:
                self._last_map = shard_map

    def advance_retired(self, generation: int, through: int) -> None:
        with self._lock:
            if generation == self._generation and through > self._retired_through:
                self._retired_through = through
