"""Exactly-once pushes: which (client, incarnation, sequence) a server has applied.

State per client is bounded: a client reports `acked_through` (every sequence at or below it
has finished on the client and will never be resent), and the ledger forgets those. A push
more than `max_pending` sequences above that floor is refused with RESOURCE_EXHAUSTED, so at
most `max_pending` sequences are remembered per client. (Never guessed at: folding old
sequences into the floor would answer a late retry 'duplicate' without applying it, a lost
update.) PSClient never runs that far ahead of its acknowledgements.

The number of clients is bounded too, but never by forgetting a client that may still
retry: a client the ledger does not know yet is refused with RESOURCE_EXHAUSTED while
`max_clients` live clients are held. A client leaves the live table only when the
coordinator declares its incarnation gone (`retire`): it closed, it was declared dead, or a
newer incarnation replaced it. What remains of it is a fence (client id -> incarnation): a
late push of that incarnation or an older one is refused as fenced. Fences are small; at
most `max_clients` are kept, and the oldest fence is the one forgotten when more are needed.

The ledger also counts, for metrics, the pushes it recorded as applied and those it found
applied already (duplicates: retries whose first answer was lost); `counts()` reads them.
Each client's counts move under that client's lock, which its push holds anyway, and fold
into the ledger's totals when its record goes, so the totals never go down.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ps_common.errors import FencedIncarnation, ResourceExhausted


@dataclass
class _ClientRecord:
    incarnation: int
    floor: int = 0  # every sequence <= floor counts as applied
    applied: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    retired: bool = False  # this incarnation is gone: only its fence matters
    # Pushes recorded as applied, and found applied already (under `lock`).
    applied_count: int = 0
    duplicate_count: int = 0


@contextlib.contextmanager
def _held(lock: threading.Lock):
    """Release an already acquired lock on leaving the block."""
    try:
        yield
    finally:
        lock.release()


class PushLedger:
    """Thread-safe. Pushes of one client are applied one at a time; clients run in parallel."""

    def __init__(self, max_clients: int = 65536, max_pending: int = 4096):
        self._max_clients = max_clients
        self._max_pending = max_pending
        self._clients: dict[str, _ClientRecord] = {}  # live clients
        self._fences: OrderedDict[str, int] = OrderedDict()  # retired client -> incarnation
        self._lock = threading.Lock()
        # The counts of records no longer in the table, and duplicates answered for a record
        # retired meanwhile (under _lock).
        self._gone_applied = 0
        self._gone_duplicates = 0

    def _record(self, client_id: str, incarnation: int) -> _ClientRecord:
        with self._lock:
            record = self._clients.get(client_id)
            if record is not None:
                return record
            fenced = self._fences.get(client_id)
            if fenced is not None and incarnation <= fenced:
                raise _gone(client_id, incarnation, fenced)
            if len(self._clients) >= self._max_clients:
                raise ResourceExhausted(
                    f"this server holds the exactly-once state of {self._max_clients} live "
                    f"clients, its limit; client {client_id!r} is refused until clients close "
                    "(PSClient.close) or are declared gone by the coordinator")
            self._fences.pop(client_id, None)
            record = self._clients[client_id] = _ClientRecord(incarnation)
            return record

    def retire(self, client_id: str, incarnation: int) -> None:
        """The coordinator says `incarnation` of `client_id` will never push again: forget its
        dedup state, keep a fence against it. A newer live incarnation is left alone.

        Waits for this client's push in progress only; the record leaves the table while its
        lock is held, so a push that waited for it finds the table as it is now (lock order:
        a record's lock, then the table's; nothing takes them the other way round)."""
        with self._lock:
            record = self._clients.get(client_id)
        if record is not None:
            with record.lock:
                if record.incarnation > incarnation:
                    return
                record.retired = True
                self._retire_locked(client_id, incarnation, record)
        else:
            self._retire_locked(client_id, incarnation, None)

    def _retire_locked(self, client_id: str, incarnation: int, record) -> None:
        with self._lock:
            if record is not None and self._clients.get(client_id) is record:
                del self._clients[client_id]
                self._fold(record)
            if incarnation > self._fences.get(client_id, 0):
                self._fences[client_id] = incarnation
                self._fences.move_to_end(client_id)
            while len(self._fences) > self._max_clients:
                self._fences.popitem(last=False)

    def _fold(self, record: _ClientRecord) -> None:
        """A record leaves the table: keep its counts (expects _lock held)."""
        self._gone_applied += record.applied_count
        self._gone_duplicates += record.duplicate_count

    def check_live(self, client_id: str, incarnation: int) -> None:
        """Raises FencedIncarnation, worded as for its push, for an incarnation that a push
        would be refused for (retired by the coordinator, or older than one seen): such a
        client may not join the steps again (JoinSteps), where it would count as a member
        whose pushes are all refused."""
        with self._lock:
            record = self._clients.get(client_id)
            fenced = self._fences.get(client_id)
        if record is not None and not record.retired:
            if incarnation < record.incarnation:
                raise _replaced(client_id, incarnation, record.incarnation)
        elif fenced is not None and incarnation <= fenced:
            raise _gone(client_id, incarnation, fenced)

    def live_clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def counts(self) -> tuple[int, int]:
        """(pushes recorded as applied, pushes found applied already) since this ledger was
        made; both only grow. Costs one step per live client."""
        with self._lock:
            records = list(self._clients.values())
            applied, duplicates = self._gone_applied, self._gone_duplicates
        return (applied + sum(r.applied_count for r in records),
                duplicates + sum(r.duplicate_count for r in records))

    @contextlib.contextmanager
    def exactly_once(self, client_id: str, incarnation: int, sequence: int, acked_through: int):
        """Yields True if this push was already applied (skip it), else False (apply it).

        The push counts as applied only if the with-block exits without an exception.
        Raises FencedIncarnation for an incarnation older than one already seen.
        """
        while True:
            record = self._record(client_id, incarnation)
            record.lock.acquire()
            if not record.retired:
                break
            # Retired (and taken out of the table) while we waited for its lock: look again,
            # which finds the fence (refused) or, for a newer incarnation, a fresh record.
            record.lock.release()
        with _held(record.lock):
            if incarnation < record.incarnation:
                raise _replaced(client_id, incarnation, record.incarnation)
            if incarnation > record.incarnation:
                record.incarnation, record.floor = incarnation, 0
                record.applied.clear()
            if acked_through < sequence:  # (a client never acknowledges what it still sends)
                self._compact(record, acked_through)
            duplicate = sequence <= record.floor or sequence in record.applied
            if not duplicate and sequence - record.floor > self._max_pending:
                raise ResourceExhausted(
                    f"client {client_id!r} pushed sequence {sequence}, more than "
                    f"{self._max_pending} above its acknowledged sequence {record.floor}: "
                    "acknowledge (acked_through) before pushing further ahead")
            yield duplicate
            if duplicate:
                record.duplicate_count += 1
            else:
                record.applied.add(sequence)
                record.applied_count += 1
            self._compact(record, acked_through)

    def _compact(self, record: _ClientRecord, acked_through: int) -> None:
        if acked_through > record.floor:
            record.floor = acked_through
            record.applied = {s for s in record.applied if s > acked_through}
        while record.floor + 1 in record.applied:
            record.floor += 1
            record.applied.discard(record.floor)

    def applied(self, client_id: str, incarnation: int, sequence: int) -> bool:
        """True if this push was applied already (a retry whose first answer was lost); the
        caller answers it as a duplicate, and it is counted as one."""
        with self._lock:
            record = self._clients.get(client_id)
        if record is None:
            return False
        with record.lock:
            found = incarnation == record.incarnation and (
                sequence <= record.floor or sequence in record.applied)
            if found:
                if record.retired:
                    # Its counts went into the totals already (lock order: a record's lock,
                    # then the table's).
                    with self._lock:
                        self._gone_duplicates += 1
                else:
                    record.duplicate_count += 1
            return found

    def export(self) -> dict:
        """The whole ledger as plain values (for a checkpoint). The caller makes sure no push
        is between applying its values and recording itself here (see UpdateGate)."""
        with self._lock:
            return {"clients": {cid: [r.incarnation, r.floor, sorted(r.applied)]
                                for cid, r in self._clients.items() if not r.retired},
                    "fences": dict(self._fences)}

    def restore(self, state: dict) -> None:
        """Adopt a checkpointed ledger, before any push reaches the shards restored with it.
        What this ledger learned since it started (nothing, on a server that restarts) is
        kept where it is newer."""
        merges = []
        with self._lock:
            for cid, incarnation in state.get("fences", {}).items():
                if incarnation > self._fences.get(cid, 0) and cid not in self._clients:
                    self._fences[cid] = incarnation
            for cid, (incarnation, floor, applied) in state.get("clients", {}).items():
                known = self._clients.get(cid)
                if known is not None and known.incarnation > incarnation:
                    continue
                if known is not None and known.incarnation == incarnation:
                    merges.append((cid, known, incarnation, floor, applied))  # record lock first
                    continue
                if self._fences.get(cid, 0) >= incarnation:
                    continue
                self._fences.pop(cid, None)
                if known is not None:
                    self._fold(known)
                self._clients[cid] = _ClientRecord(incarnation, floor, set(applied))
            while len(self._fences) > self._max_clients:
                self._fences.popitem(last=False)
        # Pushes since this server started (to shards that were not restored with these,
        # say) and those the checkpoint holds: both were applied. Each record's lock is taken
        # without the table's, as everywhere (a record's lock, then the table's).
        for cid, known, incarnation, floor, applied in merges:
            with known.lock:
                with self._lock:
                    current = self._clients.get(cid) is known and not known.retired
                if current and known.incarnation == incarnation:
                    known.applied |= set(applied)
                    self._compact(known, max(known.floor, floor))

    def pending(self, client_id: str) -> int:
        """How many sequences above the floor are remembered for `client_id` (for tests)."""
        with self._lock:
            record = self._clients.get(client_id)
        return len(record.applied) if record else 0


def _gone(client_id: str, incarnation: int, fenced: int) -> FencedIncarnation:
    return FencedIncarnation(
        f"client {client_id!r} incarnation {incarnation} is gone (the coordinator retired "
        f"incarnation {fenced}): register again")


def _replaced(client_id: str, incarnation: int, newer: int) -> FencedIncarnation:
    return FencedIncarnation(
        f"client {client_id!r} pushed with incarnation {incarnation}, but incarnation {newer} "
        "has already been seen: this client was replaced; register again")
