"""A server's checkpoint: one consistent cut of its shards and its exactly-once ledger,
written to disk while training goes on.

The cut is an instant at which no push is between applying its values and recording itself
in the ledger (UpdateGate): every push is in the cut, with its ledger entry, or not at all.
Taking it costs only the bookkeeping of that instant. After it, shards are written one at a
time. A push that reaches a shard not written yet first preserves the shard as it was at
the cut (copy-on-write), so it never waits for the disk; the writer takes a shard nobody
pushed to by copying it under its lock (memory speed) and writes the copy. Copies held at
once are bounded by `memory_bytes`: past it, a push waits for the writer to reach its
shard, and a shard larger than the bound is written straight from its values with pushes
to it held meanwhile. So a checkpoint never needs twice the memory of the values, and
stalls a push only as long as copying a shard in memory takes while the bound is not hit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ps_common.checkpoints import (
    FileRecord, TensorFileWriter, slot_name, values_name, write_json,
)
from ps_server.ledger import PushLedger

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 256 << 20  # the servicer's default; ps-server uses ps_server.memory's


class UpdateGate:
    """Shared by pushes (from applying values to recording them in the ledger), exclusive
    for taking a cut. A waiting cut holds new pushes back, so it is never starved."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._cutting = False
        self._cut_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._cutting or self._cut_waiting:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cut_waiting += 1
            while self._cutting or self._active:
                self._cond.wait()
            self._cut_waiting -= 1
            self._cutting = True
        try:
            yield
        finally:
            with self._cond:
                self._cutting = False
                self._cond.notify_all()


@dataclass
class ShardCopy:
    values: np.ndarray
    slots: dict[str, np.ndarray]
    updates: int
    optimizer_steps: int

    @classmethod
    def of(cls, held) -> "ShardCopy":
        return cls(held.values.copy(), {k: v.copy() for k, v in held.state.slots.items()},
                   held.updates, held.state.steps)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + sum(v.nbytes for v in self.slots.values())


def shard_bytes(held) -> int:
    return held.values.nbytes + sum(v.nbytes for v in held.state.slots.values())


class Capture:
    """The shards of one cut that are not written yet, and the copies preserving them."""

    def __init__(self, shards: list, memory_bytes: int):
        self._pending = {id(h) for h in shards}
        self._copies: dict[int, ShardCopy] = {}
        self._memory = memory_bytes
        self._used = 0
        self._cond = threading.Condition()

    def preserve(self, targets: list):
        """Called by a push holding the locks of `targets`, before it changes them. Returns
        None once every target is preserved (or written), else a target to wait for."""
        for held in targets:
            with self._cond:
                key = id(held)
                if key not in self._pending or key in self._copies:
                    continue
                size = shard_bytes(held)
                if self._used + size > self._memory:
                    return held
                self._used += size
            copy = ShardCopy.of(held)  # outside the condition: other shards' pushes go on
            with self._cond:
                self._copies[key] = copy
        return None

    def wait_written(self, held) -> None:
        with self._cond:
            while id(held) in self._pending:
                self._cond.wait()

    def take(self, held) -> tuple[ShardCopy | None, bool]:
        """For the writer, holding the shard's lock: the preserved copy, else (None, whether
        a copy of it fits the memory bound, which is then reserved)."""
        with self._cond:
            copy = self._copies.pop(id(held), None)
            if copy is not None:
                return copy, True
            size = shard_bytes(held)
            if self._used + size <= self._memory:
                self._used += size
                return None, True
            return None, False

    def written(self, held, released_bytes: int) -> None:
        with self._cond:
            self._pending.discard(id(held))
            self._used -= released_bytes
            self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def abandon(self) -> None:
        """Stop: nothing is waited for any more (the checkpoint failed)."""
        with self._cond:
            self._pending.clear()
            self._copies.clear()
            self._cond.notify_all()


@dataclass(frozen=True)
class SavedShardInfo:
    variable: str
    index: int
    updates: int
    optimizer_steps: int
    file: str


@dataclass(frozen=True)
class SaveOutcome:
    files: list[FileRecord]
    shards: list[SavedShardInfo]
    pushes_recorded: int


def save(store, ledger: PushLedger, directory: Path, server_id: str, epoch: int,
         memory_bytes: int = DEFAULT_MEMORY_BYTES) -> SaveOutcome:
    """Write this server's cut into `directory`: `<server_id>.safetensors` and
    `<server_id>.ledger.json`. Raises StaleEpoch or NotReady when the server is not at
    `epoch`. One at a time: pushes preserve shards for one cut only."""
    with store.saving:
        return _save(store, ledger, directory, server_id, epoch, memory_bytes)


def _save(store, ledger: PushLedger, directory: Path, server_id: str, epoch: int,
          memory_bytes: int) -> SaveOutcome:
    with store.gate.exclusive():
        store.check_epoch(epoch)
        shards = sorted(store.held(), key=lambda h: h.key)
        ledger_state = ledger.export()
        capture = Capture(shards, memory_bytes)
        store.begin_capture(capture)
    try:
        ledger_file = write_json(directory / f"{server_id}.ledger.json", ledger_state)
        tensors_name = f"{server_id}.safetensors"
        tensors = []
        for held in shards:
            name, index = held.key
            tensors.append((values_name(name, index), str(held.values.dtype), held.shape))
            tensors += [(slot_name(name, index, slot), str(a.dtype), a.shape)
                        for slot, a in sorted(held.state.slots.items())]
        writer = TensorFileWriter(directory / tensors_name, tensors,
                                  {"format": "paramserve", "server_id": server_id,
                                   "epoch": str(epoch)})
        saved = []
        try:
            for held in shards:
                saved.append(_write_shard(writer, capture, held, tensors_name))
            tensors_file = writer.commit()
        except BaseException:
            writer.abort()
            raise
    finally:
        store.end_capture(capture)
        capture.abandon()
    pushes = sum(len(applied) + floor for _, floor, applied in ledger_state["clients"].values())
    return SaveOutcome([tensors_file, ledger_file], saved, pushes)


def _write_shard(writer: TensorFileWriter, capture: Capture, held, file: str) -> SavedShardInfo:
    name, index = held.key
    with held.lock:
        copy, fits = capture.take(held)
        if copy is None and fits:
            copy = ShardCopy.of(held)
        if copy is None:
            # Larger than the memory bound: written from the values themselves, pushes to
            # this shard waiting meanwhile.
            _write_arrays(writer, name, index, held.values, held.state.slots)
            info = SavedShardInfo(name, index, held.updates, held.state.steps, file)
            capture.written(held, 0)
            return info
        capture.written(held, 0)
    try:
        _write_arrays(writer, name, index, copy.values, copy.slots)
    finally:
        capture.release(copy.nbytes)
    return SavedShardInfo(name, index, copy.updates, copy.optimizer_steps, file)


def _write_arrays(writer, name: str, index: int, values, slots) -> None:
    writer.write(values_name(name, index), values)
    for slot in sorted(slots):
        writer.write(slot_name(name, index, slot), slots[slot])
