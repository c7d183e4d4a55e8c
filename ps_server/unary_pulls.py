"""Answers to repeated one-message pulls, without parsing and checking each request again.

A worker pulls the same variables step after step, and its requests are byte for byte the
same while the shard map stands. For a small variable, parsing such a request and checking it
against the store (its epoch, its shards, its wire dtype) costs more than moving the values,
so a checked pull of whole shards is remembered under its request's bytes for as long as the
store's placement (the shards it holds and its epoch) is the one it was checked against. Its
answer is then built as an unremembered one is: the same header, and the shards' values as
they are now, read under their locks in key order (one consistent cut of all of them).

Row pulls are not remembered: their rows are located per request.
"""

from __future__ import annotations

import numpy as np

from ps_common.tensors import attached_field, chunk_prefix, wire_bytes, wire_raw_dtype
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_server.store import CheckedRead, ShardStore

# Distinct requests remembered at most (a worker sends a few: one per set of variables it
# pulls from this server); when full, all are forgotten and remembered again as they come.
MAX_REMEMBERED = 256
# Longer requests are neither looked up nor remembered: a key's bytes are hashed on every
# lookup, and a row pull's request (never remembered) may carry many KiB of ids. A request
# naming 100 shards is about 3 KiB.
MAX_REQUEST_BYTES = 4096


class RememberedPull:
    """A checked pull of whole shards and the start of its answer."""

    __slots__ = ("version", "_locks", "_parts", "_conversions")

    def __init__(self, version: int, checked: list[CheckedRead]):
        self.version = version
        self._locks = [read.held.lock for read in sorted(checked, key=lambda r: r.held.key)]
        header = pb.PullHeader(tensors=[read.meta.to_proto() for read in checked])
        # The answer's pieces: where the values are their own wire encoding, a view of them
        # made once (updates are made in place: it reads their bytes as they are when the
        # answer is joined); the others are converted per answer (`_conversions`).
        self._parts: list = [chunk_prefix(header.SerializeToString(),
                                          sum(read.meta.nbytes for read in checked))]
        self._conversions = []
        for read in checked:
            values = read.held.values
            what = read.held.describe()
            # Decided without converting: a conversion may refuse the values (OutOfRange),
            # and remembering must not fail where the answer alone may (PushThenPull applies
            # its push before it answers).
            if wire_raw_dtype(read.wire) == values.dtype and values.flags.c_contiguous:
                self._parts.append(memoryview(values.reshape(-1).view(np.uint8)))
            else:
                self._conversions.append((len(self._parts), values, read.wire, what))
                self._parts.append(None)

    def answer(self, attached=None) -> bytes:
        """The answer message, with `attached` (serialized) as its field 3."""
        parts = self._parts
        for lock in self._locks:
            lock.acquire()
        try:
            if self._conversions or attached is not None:
                parts = list(parts)
                for i, values, wire, what in self._conversions:
                    parts[i] = wire_bytes(values, wire, what)
                if attached is not None:
                    parts.append(attached_field(attached))
            return b"".join(parts)
        finally:
            for lock in self._locks:
                lock.release()


class UnaryPulls:
    """The remembered pulls of one store, keyed by request bytes. Thread-safe (each step is
    one dict operation; a race between two threads at worst remembers a pull twice)."""

    def __init__(self, store: ShardStore):
        self._store = store
        self._remembered: dict[bytes, RememberedPull] = {}

    def find(self, request: bytes | memoryview) -> RememberedPull | None:
        """The pull remembered for these request bytes, if the placement is unchanged."""
        if len(request) > MAX_REQUEST_BYTES:
            return None
        # A memoryview is looked up by a copy of its bytes: hashing a view hashes the whole
        # object it views first (PushThenPull's pull is a view of a message that carries a
        # push: over 1 MiB hashed per call, where the copy is a few dozen bytes).
        key = bytes(request)
        pull = self._remembered.get(key)
        if pull is None or pull.version == self._store.placement_version:
            return pull
        self._remembered.pop(key, None)
        return None

    def remember(self, request: bytes | memoryview, version: int,
                 checked: list[CheckedRead]) -> RememberedPull | None:
        """Remember a pull checked at placement `version` (read before the check), unless
        the placement has changed since or it reads rows; returns it, or None."""
        if (version != self._store.placement_version or len(request) > MAX_REQUEST_BYTES
                or any(read.ids is not None for read in checked)):
            return None
        if len(self._remembered) >= MAX_REMEMBERED:
            self._remembered.clear()
        # Kept as bytes: a view would keep the whole message it is part of alive.
        request = bytes(request)
        pull = self._remembered[request] = RememberedPull(version, checked)
        if version != self._store.placement_version:  # changed meanwhile, maybe forgotten
            self._remembered.pop(request, None)  # (else it would keep dropped shards alive)
        return pull

    def forget(self) -> None:
        """Drop every remembered pull (after the placement changed: the shards they name may
        be gone, and their arrays need not be kept alive)."""
        self._remembered.clear()
