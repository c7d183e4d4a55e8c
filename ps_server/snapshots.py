"""A server's checkpoint: one consistent cut of its shards and its exactly-once ledger,
written to disk while training goes on.

The cut is an instant at which no push is between applying its values and recording itself
in the ledger (UpdateGate): every push is in the cut, with its ledger entry, or not at all.
Taking it costs only the bookkeeping of that instant. After it, shards are written one at a
time, read from the live values a block at a time (the shard's lock is held for one block's
copy, never for the disk). A push that reaches a shard not written yet first preserves the
shard as it was at the cut (copy-on-write), so it waits for one memory copy, never for the
disk; the writer then takes the rest of the shard from that copy. Only shards pushed to
during the checkpoint are ever copied, and those copies are bounded by `memory_bytes`: past
it, a push waits for the writer to reach its shard. So a checkpoint's extra memory is at
most `memory_bytes` (plus one block), and a push stalls for a shard's memory copy unless
that bound is hit.

A disk that stops answering (a hung network mount) would hold such pushes, and every later
checkpoint, for as long as it hangs: `save` gives up on a write that makes no progress for
its stall timeout. The pushes then go on, the checkpoint fails, and whatever the stuck
writer does once the disk answers again is thrown away.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ps_common.checkpoints import (
    FileRecord, TensorFileWriter, slot_name, values_name, write_json,
)
from ps_common.errors import CheckpointFailed
from ps_server.dynamic_rows import AGE_SLOT, AGO_SLOT, LastUseCut
from ps_server.ledger import PushLedger
from ps_server.memory import MIN_CHECKPOINT_MEMORY

log = logging.getLogger(__name__)

# The writer reads live values a block at a time, holding the shard's lock for one copy.
BLOCK_ELEMENTS = 1 << 20
# The servicer's default; ps-server's comes from ps_server.memory.default_checkpoint_memory.
DEFAULT_MEMORY_BYTES = MIN_CHECKPOINT_MEMORY
# ps-server --checkpoint-stall-timeout: a checkpoint's write that makes no progress this long
# (no block written, no file made durable) is given up. Files are flushed to the disk every
# SYNC_EVERY_BYTES (ps_common.checkpoints), so no single step waits for more than that.
DEFAULT_STALL_TIMEOUT_S = 300.0


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
    # A dynamic table's last use of each pool row (DynamicRows.last_use), and the instant
    # the copy was taken at: a pull that makes rows may copy a shard before the cut reaches
    # its lock, and then the copy is the cut.
    last_use: tuple[np.ndarray, np.ndarray] | None = None
    cut: LastUseCut | None = None

    @classmethod
    def of(cls, held) -> "ShardCopy":
        copy = cls(held.values.copy(), {k: v.copy() for k, v in held.state.slots.items()},
                   held.updates, held.state.steps)
        if held.dynamic is not None:
            copy.last_use = tuple(a.copy() for a in held.dynamic.last_use)
            copy.cut = held.dynamic.cut()
        return copy

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + sum(v.nbytes for v in self.slots.values()) + sum(
            a.nbytes for a in self.last_use or ())


def shard_bytes(held) -> int:
    """What ShardCopy.of(held) copies."""
    return held.values.nbytes + sum(v.nbytes for v in held.state.slots.values()) + (
        0 if held.dynamic is None else sum(a.nbytes for a in held.dynamic.last_use))


class Capture:
    """The shards of one cut that are not written yet, and the copies preserving them."""

    def __init__(self, shards: list, memory_bytes: int):
        self._pending = {id(h) for h in shards}
        self._copies: dict[int, ShardCopy] = {}
        self._memory = memory_bytes
        self._used = 0
        self._cond = threading.Condition()
        # Why the checkpoint was given up while its writer was still at work, if it was;
        # `_settled` once the writer has finished it (one or the other, never both).
        self.given_up: str | None = None
        self._settled = False
        self._progress_at = time.monotonic()

    def progressed(self) -> None:
        """The writer moved on (a block written, a file made durable)."""
        self._progress_at = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the writer last moved on."""
        return time.monotonic() - self._progress_at

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
            try:
                copy = ShardCopy.of(held)  # outside the condition: other shards' pushes go on
            except BaseException:
                self._give_back(size)
                raise
            with self._cond:
                # The writer may have finished the shard meanwhile (it reads the last block
                # under the shard's lock, then says so without it): then nobody needs the
                # copy, and `written` found none to free.
                if key in self._pending:
                    self._copies[key] = copy
                    continue
            self._give_back(size)
        return None

    def _give_back(self, size: int) -> None:
        with self._cond:
            self._used -= size
            self._cond.notify_all()

    def wait_written(self, held) -> None:
        with self._cond:
            while id(held) in self._pending:
                self._cond.wait()

    def copy_of(self, held) -> ShardCopy | None:
        """The copy a push made of `held` at the cut, if any (call with its lock held)."""
        with self._cond:
            return self._copies.get(id(held))

    def written(self, held) -> None:
        """`held` is on disk: pushes no longer preserve it, and its copy is freed."""
        with self._cond:
            self._pending.discard(id(held))
            copy = self._copies.pop(id(held), None)
            if copy is not None:
                self._used -= copy.nbytes
            self._cond.notify_all()

    def abandon(self) -> None:
        """Stop: nothing is waited for any more (the checkpoint is over)."""
        with self._cond:
            self._pending.clear()
            self._copies.clear()
            self._cond.notify_all()

    def give_up(self, reason: str) -> bool:
        """The writer is stuck: stop (as `abandon`) and have it keep nothing of what it does
        once it gets on (`check`, `settle`). False if it had finished already."""
        with self._cond:
            if self._settled:
                return False
            self.given_up = reason
        self.abandon()
        return True

    def check(self) -> None:
        """Raises CheckpointFailed if the checkpoint was given up."""
        if self.given_up is not None:
            raise CheckpointFailed(self.given_up)

    def settle(self) -> None:
        """The writer has written and committed everything: the checkpoint stands, unless it
        was given up first (CheckpointFailed: the caller removes what it committed)."""
        with self._cond:
            if self.given_up is None:
                self._settled = True
                return
        raise CheckpointFailed(self.given_up)


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
         memory_bytes: int = DEFAULT_MEMORY_BYTES,
         stall_timeout_s: float = 0.0) -> SaveOutcome:
    """Write this server's cut into `directory`: `<server_id>.safetensors` and
    `<server_id>.ledger.json`. Raises StaleEpoch or NotReady when the server is not at
    `epoch`. One at a time: pushes preserve shards for one cut only.

    `stall_timeout_s` (0: none): raise CheckpointFailed once the write has made no progress
    that long, or once an earlier checkpoint's writer, stuck that way, has held the next one
    back that long; the pushes it held go on. The write itself runs in a thread of its own,
    which a disk that hangs may keep for as long as it hangs."""
    if not stall_timeout_s:
        with store.saving:
            return _save(store, ledger, directory, server_id, epoch, memory_bytes)
    if not store.saving.acquire(timeout=stall_timeout_s):
        raise CheckpointFailed(
            f"server {server_id}: an earlier checkpoint's write has not returned for "
            f"{stall_timeout_s:g} s or more; it is stuck on the disk of --checkpoint-dir (or "
            "still writing a part its coordinator gave up on), and no checkpoint can be "
            "written here until it returns")
    started = threading.Event()
    captured: list[Capture] = []
    outcome: futures.Future = futures.Future()

    def write() -> None:
        try:
            outcome.set_result(_save(store, ledger, directory, server_id, epoch, memory_bytes,
                                     on_capture=lambda c: (captured.append(c), started.set())))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome.set_exception(error)
        finally:
            started.set()
            store.saving.release()

    try:
        threading.Thread(target=write, name="ps-checkpoint-write", daemon=True).start()
    except BaseException as error:  # no thread to be had for a moment (a pids limit)
        store.saving.release()
        raise CheckpointFailed(f"server {server_id}: cannot start a thread to write its "
                               f"checkpoint ({error}); the next checkpoint tries again") from error
    # The cut waits for pushes in progress, which finish on their own: only the writing
    # after it is watched.
    started.wait()
    while True:
        try:
            return outcome.result(timeout=stall_timeout_s / 4)
        except futures.TimeoutError:
            capture = captured[0]
            idle = capture.idle_s()
            if idle < stall_timeout_s:
                continue
            reason = (f"server {server_id}: its checkpoint write in {directory} made no "
                      f"progress for {idle:.0f} s (--checkpoint-stall-timeout "
                      f"{stall_timeout_s:g}): the disk of --checkpoint-dir does not "
                      "answer; training goes on without this checkpoint")
            if capture.give_up(reason):  # (else it has just finished: its outcome follows)
                store.end_capture(capture)
                log.error("%s", reason)
                raise CheckpointFailed(reason) from None


def _save(store, ledger: PushLedger, directory: Path, server_id: str, epoch: int,
          memory_bytes: int, on_capture=lambda capture: None) -> SaveOutcome:
    with store.gate.exclusive():
        store.check_epoch(epoch)
        shards = sorted(store.held(), key=lambda h: h.key)
        ledger_state = ledger.export()
        capture = Capture(shards, memory_bytes)
        store.begin_capture(capture)
        # The tensors' shapes at the cut. A dynamic table's arrays grow (are replaced) as
        # rows are made, but any change after this point preserves a copy first (the
        # shapes are then the copy's: a pull that makes rows is not held back by the gate),
        # and a change begun before it has ended once its lock is ours.
        # A dynamic table's rows' last use is saved as ages at this instant (`cuts`).
        layout, cuts = {}, {}
        for held in shards:
            with held.lock:
                copy = capture.copy_of(held)
                if held.dynamic is not None:
                    cuts[id(held)] = copy.cut if copy is not None else held.dynamic.cut()
                layout[id(held)] = [
                    (tensor, str(array.dtype), array.shape) for tensor, array, _ in
                    _tensors_of(held, _arrays(held, copy), cuts.get(id(held)))]
    on_capture(capture)
    ledger_path = directory / f"{server_id}.ledger.json"
    tensors_name = f"{server_id}.safetensors"
    try:
        ledger_file = write_json(ledger_path, ledger_state, on_progress=capture.progressed)
        capture.check()
        tensors = [entry for held in shards for entry in layout[id(held)]]
        writer = TensorFileWriter(directory / tensors_name, tensors,
                                  {"format": "paramserve", "server_id": server_id,
                                   "epoch": str(epoch)}, on_progress=capture.progressed)
        saved = []
        try:
            for held in shards:
                capture.check()  # given up: the shards' copies are gone, the cut with them
                saved.append(_write_shard(writer, capture, held, tensors_name,
                                          layout[id(held)], cuts.get(id(held))))
            capture.check()
            tensors_file = writer.commit()
        except BaseException:
            writer.abort()
            raise
        capture.settle()
    except BaseException:
        if capture.given_up is not None:  # what it committed once the disk answered goes
            for path in (ledger_path, directory / tensors_name):
                path.unlink(missing_ok=True)
        raise
    finally:
        store.end_capture(capture)
        capture.abandon()
    pushes = sum(len(applied) + floor for _, floor, applied in ledger_state["clients"].values())
    return SaveOutcome([tensors_file, ledger_file], saved, pushes)


def _arrays(held, copy: ShardCopy | None):
    """The shard's values, slots and (a dynamic table's) last use: from the copy a push
    preserved, if any, else the live ones."""
    if copy is not None:
        return copy.values, copy.slots, copy.last_use
    return (held.values, held.state.slots,
            None if held.dynamic is None else held.dynamic.last_use)


def _tensors_of(held, arrays, cut: LastUseCut | None):
    """A shard's tensors in file order: its values, its slots by name, then a dynamic
    table's last use. Each with what turns a block of it into what is written: last use is
    held as ticks and clock readings, and saved as requests and seconds before the cut."""
    name, index = held.key
    values, slots, last_use = arrays
    tensors = [(values_name(name, index), values, None)] + [
        (slot_name(name, index, slot), slots[slot], None) for slot in sorted(slots)]
    if last_use is not None:
        ticks, times = last_use
        tensors += [(slot_name(name, index, AGE_SLOT), times, cut.age),
                    (slot_name(name, index, AGO_SLOT), ticks, cut.ago)]
    return tensors


def _write_shard(writer: TensorFileWriter, capture: Capture, held, file: str,
                 layout: list, cut: LastUseCut | None) -> SavedShardInfo:
    """Write one shard as it was at the cut. Blocks are read from the live values under the
    shard's lock (held for one block's copy, never for the disk); once a push has preserved
    the shard (it copies it before changing it), the rest comes from that copy."""
    name, index = held.key
    with held.lock:
        copy = capture.copy_of(held)
        info = (SavedShardInfo(name, index, copy.updates, copy.optimizer_steps, file) if copy
                else SavedShardInfo(name, index, held.updates, held.state.steps, file))
    for position_in_shard, (tensor, _, shape) in enumerate(layout):
        writer.begin(tensor)
        position = 0
        total = math.prod(shape)
        while position < total:
            with held.lock:
                copy = copy or capture.copy_of(held)
                if copy is None:
                    _, array, convert = _tensors_of(held, _arrays(held, None), cut)[
                        position_in_shard]
                    block = array.reshape(-1)[position:position + BLOCK_ELEMENTS].copy()
            if copy is not None:
                _, array, convert = _tensors_of(held, _arrays(held, copy), cut)[
                    position_in_shard]
                # A converted block is new memory: one block's, as for live reads.
                stop = total if convert is None else position + BLOCK_ELEMENTS
                block = array.reshape(-1)[position:stop]
            if convert is not None:
                block = convert(block)
            if not block.size:
                raise RuntimeError(f"{held.describe()}: {tensor} holds fewer than the "
                                   f"{total} elements it had at the checkpoint's cut")
            writer.append(block)
            position += block.size
        writer.end()
    capture.written(held)
    return info
