"""Taking checkpoints (every --checkpoint-every, on request, at the end of a job) and knowing
which one to restore from.

A checkpoint is taken at one shard-map epoch: every server holding shards writes its own
files (its cut, see ps_server/snapshots.py), then the coordinator writes the manifest, which
makes the checkpoint exist, and prunes all but the newest --keep-checkpoints. One is taken
at a time. No grpc here: `save_on(member, directory, epoch)` is the call to one server.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ps_common.checkpoints import (
    CheckpointError, FileRecord, Interval, Manifest, ShardRecord, checkpoint_ids,
    new_checkpoint_dir, carry_forward, newest_good, prune, verify, write_manifest,
)
from ps_common.errors import CheckpointFailed, NotReady, PSError

log = logging.getLogger(__name__)

ATTEMPTS = 5  # a checkpoint races a map change at most this often before it gives up
RETRY_AFTER_FAILURE_S = 5.0


class Catalog:
    """The checkpoint to restore from: the newest good one, or an older one once a newer
    one turned out unreadable. Thread-safe."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.Lock()
        self._bad: set[str] = set()
        manifest, skipped = newest_good(root)
        for cid, why in skipped:
            self._bad.add(cid)
            log.error("checkpoint %s is unusable (%s); skipping it", root / cid, why)
        self._current = manifest
        if manifest is not None:
            log.info("newest good checkpoint: %s (step %d, %d variable(s))", manifest.directory,
                     manifest.step, len(manifest.variables))

    def current(self) -> Manifest | None:
        with self._lock:
            return self._current

    def adopt(self, manifest: Manifest) -> None:
        """A checkpoint just written (and so known good) becomes the one to restore from."""
        with self._lock:
            self._current = manifest

    def fall_back(self, failed_directory, reason: str) -> Manifest | None:
        """The checkpoint in `failed_directory` cannot be read after all: if it is the
        current one, the previous good one becomes current. Returns the current one. The
        candidates are verified (every file read whole: minutes for a large model) with no
        lock held: the coordinator answers meanwhile, and `current()` is the failed one
        until a good one is found."""
        with self._lock:
            failed = self._current
            if failed is None or str(failed.directory) != str(failed_directory):
                return failed
            self._bad.add(failed.id)
            candidates = [cid for cid in reversed(checkpoint_ids(self.root))
                          if cid not in self._bad and cid < failed.id]
        for cid in candidates:
            try:
                manifest = verify(self.root / cid)
            except CheckpointError as error:
                with self._lock:
                    self._bad.add(cid)
                log.error("checkpoint %s is unusable (%s); skipping it", cid, error)
                continue
            with self._lock:
                if self._current is not failed:  # a newer one taken, or fallen back already
                    return self._current
                self._current = manifest
            log.error("checkpoint %s cannot be restored (%s); using the previous good "
                      "checkpoint %s (step %d)", failed.id, reason, cid, manifest.step)
            return manifest
        with self._lock:
            if self._current is not failed:
                return self._current
            self._current = None
        log.error("checkpoint %s cannot be restored (%s) and no older good checkpoint "
                  "is left", failed.id, reason)
        return None


def _prune(root: Path, keep: int, protect: list[str]) -> list[str]:
    """prune(), whose failure (a file this process may not remove) is logged: it never
    changes the outcome of the checkpoint being taken."""
    try:
        return prune(root, keep, protect=protect)
    except OSError as error:
        log.warning("cannot remove old checkpoints from --checkpoint-dir %s: %s", root,
                    error.strerror or error)
        return []


@dataclass(frozen=True)
class SavedPart:
    """One server's answer to SaveCheckpoint."""

    files: list[FileRecord]
    shards: dict[tuple[str, int], tuple[int, int, str]]  # key -> (updates, steps, file)


class Checkpointer:
    """Takes checkpoints into `catalog.root`. `save_on(server_id, address, directory,
    epoch) -> SavedPart` asks one server to write its part; `progress()` returns (step,
    job state as plain values or None)."""

    def __init__(self, catalog: Catalog, state, sync: Callable[[], object],
                 save_on: Callable[[str, str, Path, int], SavedPart],
                 progress: Callable[[], tuple[int, dict | None]], *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"--keep-checkpoints {keep} must be >= 1")
        self.catalog = catalog
        self._state = state
        self._sync = sync
        self._save_on = save_on
        self._progress = progress
        self._keep = keep
        self._lock = threading.Lock()  # one checkpoint at a time
        self._closed = False
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ps-ckpt")
        self.last: Manifest | None = catalog.current()
        self.last_taken_at_step = self.last.step if self.last else 0

    def take(self, reason: str, *, unless: Callable[[], bool] = lambda: False) -> Manifest | None:
        """A complete checkpoint of every shard, now. Raises CheckpointFailed. `unless`,
        looked at once no other checkpoint is being taken, skips it (returns None): a
        periodic checkpoint that another one, taken meanwhile, made unnecessary."""
        with self._lock:
            if self._closed:
                raise CheckpointFailed("the coordinator is stopping: no checkpoint is taken")
            if unless():
                return None
            error: PSError | None = None
            for _ in range(ATTEMPTS):
                try:
                    return self._take_once(reason)
                except NotReady as raced:  # the map moved, or a server is away: again
                    error = raced
                    time.sleep(0.2)
            raise CheckpointFailed(f"no checkpoint after {ATTEMPTS} attempts: {error}")

    def unready(self) -> str:
        """Why no checkpoint can be taken now ("" if one can): a server holding shards has
        not registered with this coordinator (it is away, or the coordinator just started)."""
        shard_map = self._state.shard_map
        holders = {s.server_id for shards in shard_map.shards.values() for s in shards}
        missing = sorted(holders - {m.server_id for m in self._state.live_servers()})
        if missing:
            return f"server(s) {', '.join(missing)} holding shards are not registered"
        return ""

    def _take_once(self, reason: str) -> Manifest:
        unready = self.unready()
        if unready:
            raise NotReady(unready)
        self._sync()  # every server at the current epoch before it is asked for its cut
        shard_map = self._state.shard_map
        step, job = self._progress()
        holders = sorted({s.server_id for shards in shard_map.shards.values() for s in shards})
        started = time.monotonic()
        try:
            directory = new_checkpoint_dir(self.catalog.root)
        except OSError as error:
            raise _unwritable(self.catalog.root, error) from error
        parts: dict[str, futures.Future] = {}
        try:
            parts = {sid: self._pool.submit(self._save_on, sid, shard_map.servers.get(sid, ""),
                                            directory, shard_map.epoch) for sid in holders}
            saved = {sid: part.result() for sid, part in parts.items()}
            _check_visible(directory, saved)
            shards, files = [], {}
            for sid, part in saved.items():
                files.update({f.name: f for f in part.files})
            for name, placed in shard_map.shards.items():
                for shard in placed:
                    got = saved[shard.server_id].shards.get(shard.key)
                    if got is None:
                        raise CheckpointFailed(f"server {shard.server_id} did not save shard "
                                               f"{shard.index} of {name!r}")
                    updates, steps, file = got
                    shards.append(ShardRecord(name, shard.index, shard.row_start,
                                              shard.row_stop, shard.server_id, file, updates,
                                              steps, shard.stride))
            variables = dict(shard_map.variables)
            previous = self.catalog.current()
            if previous is not None and previous.directory is not None:
                try:
                    carried, carried_shards, carried_files = carry_forward(
                        previous, directory, shard_map.variables)
                except OSError as error:
                    raise _unwritable(directory, error) from error
                variables.update(carried)
                shards += carried_shards
                files.update(carried_files)
            manifest = Manifest(
                id=directory.name, step=step, epoch=shard_map.epoch, created_unix_s=time.time(),
                variables=variables, shards=shards, files=files,
                ledgers={sid: f"{sid}.ledger.json" for sid in holders}, job=job,
                directory=directory)
            try:
                write_manifest(manifest)
            except OSError as error:
                raise _unwritable(directory, error) from error
        except BaseException:
            # This attempt's files go (once no server writes them any more): a directory
            # without a manifest is never read, and on a disk that filled up they would take
            # the room every later checkpoint needs.
            futures.wait(parts.values())
            shutil.rmtree(directory, ignore_errors=True)
            # Neither the newest checkpoint taken nor the one restores come from now (an
            # older one, after a fall-back) may go, whatever --keep-checkpoints says.
            current = self.catalog.current()
            _prune(self.catalog.root, self._keep,
                   protect=[*(m.id for m in (self.last, current) if m is not None),
                            *self._state.restore_sources()])
            raise
        self.last, self.last_taken_at_step = manifest, step
        self.catalog.adopt(manifest)
        # Restores decided before this checkpoint read from the one current then.
        removed = _prune(self.catalog.root, self._keep,
                         protect=[manifest.id, *self._state.restore_sources()])
        log.info("checkpoint %s complete (%s): step %d, %d shard(s), %.1f MiB in %.2f s%s",
                 manifest.id, reason, step, len(shards), manifest.bytes / 2**20,
                 time.monotonic() - started,
                 f"; removed {', '.join(removed)}" if removed else "")
        return manifest

    def uncovered(self) -> list[str]:
        """Variables of the shard map that the newest checkpoint does not hold (as declared)."""
        held = self.last.variables if self.last else {}
        return [name for name, spec in self._state.shard_map.variables.items()
                if held.get(name) != spec]

    def close(self) -> None:
        """Take no more checkpoints; the one being taken ends soon (its parts not started
        are cancelled): `wait_idle` waits for it."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until no checkpoint is being taken: True if none is."""
        if not self._lock.acquire(timeout=timeout_s):
            return False
        self._lock.release()
        return True


def run_periodically(checkpointer: Checkpointer, every: Interval | None,
                     steps: Callable[[], int], stopping: threading.Event,
                     paused: Callable[[], bool]) -> None:
    """Take a checkpoint every `every` (None: never by the clock or the steps) until
    `stopping` is set (a thread's body). A variable no checkpoint holds yet goes into one at
    once, whatever `every` says: until then, losing its server would lose it, rather than at
    most one interval of its training."""
    last = {"time": time.monotonic(), "step": checkpointer.last_taken_at_step}
    not_before = 0.0  # after a failure, a pause before the next try

    def due() -> str:
        if checkpointer.uncovered():
            return "new variables"
        if every is None:
            return ""
        if every.steps:
            since = steps() - max(last["step"], checkpointer.last_taken_at_step)
            return f"every {every.describe()}" if since >= every.steps else ""
        return f"every {every.describe()}" if (
            time.monotonic() - last["time"] >= every.seconds) else ""

    while not stopping.wait(0.2):
        reason = ("" if paused() or time.monotonic() < not_before or checkpointer.unready()
                  else due())
        if not reason:
            continue
        try:
            checkpointer.take(reason, unless=lambda: not due())
        except (PSError, OSError) as error:
            not_before = time.monotonic() + RETRY_AFTER_FAILURE_S
            log.error("checkpoint (%s) failed: %s; trying again in %g s", reason,
                      getattr(error, "message", error), RETRY_AFTER_FAILURE_S)
        last.update(time=time.monotonic(), step=steps())


def take_last(checkpointer: Checkpointer, reason: str, *, give_up_after_s: float,
              stopping: threading.Event, retry_every_s: float = 1.0,
              clock: Callable[[], float] = time.monotonic) -> Manifest | None:
    """A checkpoint that has no next one to make up for it (the job's last, before servers
    are told to exit and take what it did not save with them): tried again while it fails,
    e.g. while a server holding shards restarts, for up to `give_up_after_s` (a server away
    that long is lost anyway) or until `stopping` is set. Returns it, or None, logged."""
    give_up_at = clock() + give_up_after_s
    while True:
        try:
            return checkpointer.take(reason)
        except Exception as error:  # noqa: BLE001 - what comes after it must still happen
            message = getattr(error, "message", error)
            if stopping.is_set() or clock() >= give_up_at:
                log.error("the %s checkpoint failed: %s", reason, message)
                return None
            log.warning("the %s checkpoint failed (%s); trying again", reason, message)
        if stopping.wait(retry_every_s):
            log.error("the %s checkpoint was not taken: the coordinator is stopping", reason)
            return None


def _check_visible(directory: Path, saved: dict[str, SavedPart]) -> None:
    """Raise CheckpointFailed unless the coordinator sees every file the servers say they
    wrote into `directory`, at its size: a --checkpoint-dir that is not one shared directory
    (a volume per container, say) leaves checkpoints that no restore can read, and that
    would only show when a server is lost."""
    for server_id, part in sorted(saved.items()):
        for record in part.files:
            path = directory / record.name
            try:
                size = path.stat().st_size
            except OSError as error:
                seen = f"not there ({error.strerror or error})"
            else:
                if size == record.bytes:
                    continue
                seen = f"{size} bytes there, not the {record.bytes} it wrote"
            raise CheckpointFailed(
                f"server {server_id} wrote {record.name} into {directory}, but the coordinator "
                f"finds it {seen}: --checkpoint-dir must be one directory shared by the "
                "coordinator and every server (the same volume, mounted at the same path), or "
                "no restore can read the checkpoints; nothing of this checkpoint is used")


def _unwritable(path: Path, error: OSError) -> CheckpointFailed:
    return CheckpointFailed(f"the coordinator cannot write checkpoint {path}: "
                            f"{error.strerror or error} (disk full, no permission or a "
                            "read-only volume?); nothing of this checkpoint is used")
