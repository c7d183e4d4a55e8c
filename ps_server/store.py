"""The shards a parameter server holds, and the validated pull/push operations on them.

No grpc here: the servicer decodes requests into plain values, calls these methods and
encodes what they return. Everything in a request is checked before anything is applied.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ps_common.errors import (
    InvalidArgument, NonFiniteGradient, NotReady, OutOfRange, ResourceExhausted, StaleEpoch,
    TrainedShardConflict, UnknownVariable,
)
from ps_common.rows import dedup, sum_duplicates
from ps_common.shardmap import (
    EMPTY_MAP, Shard, ShardMap, VariableSpec, owners_of, shard_capacity,
)
from ps_common.shm import VERSION
from ps_common.tensors import (
    ByteReader, TensorMeta, all_finite, array_reader, check_narrowing, count_non_finite,
    wire_itemsize,
)
from ps_server.footprint import footprint
from ps_server.dynamic_rows import BOOKKEEPING_SLOTS, DynamicRows
from ps_server.initializers import initialize_ids, initialize_rows, validate_initializer
from ps_server.live_reads import preserve_for_reads
from ps_server.optimizers import (
    ShardOptimizerState, apply_update, compute_dtype, make_state, resolve_knobs,
)
from ps_server.snapshots import UpdateGate
from ps_server.sparse_optimizers import apply_rows, make_row_slots

log = logging.getLogger(__name__)


@dataclass
class HeldShard:
    """One shard's values and optimizer state. `lock` guards both."""

    spec: VariableSpec
    shard: Shard
    values: np.ndarray
    state: ShardOptimizerState
    knobs: dict[str, float]
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0  # pushes applied (under `lock`): > 0 means trained values
    # The header words of the shared-memory segment holding `values` (ps_common.shm), whose
    # sequence lock apply() bumps around every update; None in ordinary memory.
    seqlock: np.ndarray | None = None
    # A dynamic table's shard: its id -> row index; `values` and `state.slots` are its pool.
    dynamic: DynamicRows | None = None
    # Pulls streaming `values` piece by piece (ps_server.live_reads), under `lock`: an update
    # gives them a copy first.
    live_reads: list = field(default_factory=list)
    # (the epoch it was held at, the epoch of the assignment that dropped or replaced it),
    # set under `lock`: a push planned before then is refused (StaleEpoch), never applied
    # to values no longer held.
    dropped: tuple[int, int] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.shard.key

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def describe(self) -> str:
        s = self.shard
        if s.stride > 1 or self.spec.is_table:
            return f"table {s.variable!r} shard {s.index} of {s.stride}"
        return f"variable {s.variable!r} shard {s.index} (rows {s.row_start}:{s.row_stop})"

    def local_rows(self, ids: np.ndarray) -> np.ndarray:
        """A fixed table shard's rows of `ids` (refused unless every id is this shard's)."""
        spec, shard = self.spec, self.shard
        if ids.size and (ids.min() < 0 or ids.max() >= spec.rows):
            bad = ids[(ids < 0) | (ids >= spec.rows)][0]
            raise OutOfRange(f"table {spec.name!r}: id {bad} is outside its rows 0:{spec.rows}")
        self.check_own_ids(ids)
        return ids // shard.stride

    def check_own_ids(self, ids: np.ndarray) -> None:
        """Refuse `ids` unless every one is this table shard's (a fixed or dynamic table)."""
        shard = self.shard
        if ids.size and shard.stride > 1 and \
                np.any(owners_of(self.spec, ids, shard.stride) != shard.index):
            raise InvalidArgument(f"{self.describe()}: some ids belong to other shards (the "
                                  "client's shard map is not this server's)")

    def sync_pool(self) -> None:
        """After the dynamic table's pool grew: point at its arrays."""
        self.values, self.state.slots = self.dynamic.values, self.dynamic.slots

    @property
    def optimizer_slots(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.state.slots.items() if k not in BOOKKEEPING_SLOTS}


def make_shard_state(spec: VariableSpec, shape: tuple[int, ...]) -> ShardOptimizerState:
    """Fresh optimizer state: dense slots, or a table's per-row ones (lazy: only touched
    rows' slots ever change)."""
    return ShardOptimizerState(make_row_slots(spec, shape)) if spec.is_table else \
        make_state(spec, shape)


def _shard_fits(spec: VariableSpec, shard: Shard) -> bool:
    if spec.is_table:
        return 0 <= shard.row_start < shard.stride and shard.row_stop == spec.rows
    return shard.stride == 1 and 0 <= shard.row_start < shard.row_stop <= spec.rows


def _refuse_dropping_trained(epoch: int, leaving: list[HeldShard], wanted: dict,
                             superseded: frozenset) -> None:
    """TrainedShardConflict if an assignment of `epoch` would drop or re-create a shard of
    `leaving` (held shards it does not keep) that holds trained values, unless superseded."""
    for held in leaving:
        if held.updates and held.key not in superseded:
            raise TrainedShardConflict(
                f"assignment of epoch {epoch} would "
                f"{'drop' if held.key not in wanted else 're-create'} {held.describe()}, "
                f"which holds trained values ({held.updates} update(s)); refused")


@dataclass(frozen=True)
class TableStats:
    variable: str
    index: int
    rows: int
    evictions: int
    nbytes: int


class PlainMemory:
    """Where a store keeps shard values: ordinary memory. (ps_server.shared_memory keeps
    them in shared-memory segments, with the same four methods.)"""

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.empty(shape, dtype)

    @staticmethod
    def seqlock(values: np.ndarray) -> None:
        return None

    @staticmethod
    def retire(values: np.ndarray) -> None:
        pass

    @staticmethod
    def set_epoch(epoch: int) -> None:
        pass


@dataclass(frozen=True)
class AssignOutcome:
    created: int
    failed: list[tuple[Shard, str]]  # shards that could not be created, and why


@dataclass(frozen=True)
class CheckedRead:
    """One shard of a validated pull: its wire dtype and, for a row pull, the ids (a
    dynamic table's distinct, with `inverse` back to the request's order) or a fixed
    table's local rows."""

    held: HeldShard
    wire: str
    ids: np.ndarray | None = None
    local: np.ndarray | None = None
    inverse: np.ndarray | None = None

    @property
    def meta(self) -> TensorMeta:
        """What the read puts on the wire."""
        if self.ids is None:
            return TensorMeta(self.wire, self.held.shape)
        count = len(self.ids if self.inverse is None else self.inverse)
        return TensorMeta(self.wire, (count, *self.held.shape[1:]))


@dataclass(frozen=True)
class GatheredRows:
    """A row pull's rows, read at one instant: each distinct id's row once (`distinct`), and
    `order`, the row of `distinct` for each id in the request's order (None: `distinct` is
    in that order). A repeated id costs the server one row, not one per repeat: a request
    naming one id 400,000 times would otherwise make it hold 400,000 rows until sent."""

    distinct: np.ndarray
    order: np.ndarray | None = None

    def whole(self) -> np.ndarray:
        """The rows in the request's order (for an answer in one message: bounded)."""
        return self.distinct if self.order is None else self.distinct[self.order]

    def reader(self, wire_dtype: str, what: str = "the rows") -> ByteReader:
        """The rows (`what`) in the request's order, encoded as `wire_dtype`, gathered a
        chunk's rows at a time."""
        row_bytes = wire_itemsize(wire_dtype) * math.prod(self.distinct.shape[1:])
        if self.order is None or row_bytes == 0:
            return array_reader(self.whole(), wire_dtype, what=what)

        def read(offset: int, length: int) -> bytes:
            first, last = offset // row_bytes, -(-(offset + length) // row_bytes)
            rows = self.distinct[self.order[first:last]]
            return array_reader(rows, wire_dtype, what=what)(offset - first * row_bytes, length)

        return read


class ShardStore:
    """Thread-safe. Holds shards keyed by (variable, shard index) and the shard-map epoch."""

    def __init__(self, *, allow_non_finite: bool = False, memory=None, clock=time.monotonic,
                 memory_budget: int = 0):
        self.allow_non_finite = allow_non_finite
        self.memory_budget = memory_budget  # bytes; 0 = none (dynamic tables grow within it)
        self.clock = clock  # dynamic tables' ttl
        self.memory = memory or PlainMemory()
        self._shards: dict[tuple[str, int], HeldShard] = {}
        self._epoch = 0
        # Bumped (under `_lock`) whenever the shards held or the epoch change: what was
        # checked against one placement holds while this is unchanged (ps_server.unary_pulls).
        self.placement_version = 0
        self._lock = threading.Lock()
        self._assign_lock = threading.Lock()
        self._budget_lock = threading.Lock()
        self._growing = 0  # bytes of dynamic-table growth admitted and not yet made
        # Pushes hold it shared from applying to recording in the ledger; a checkpoint's cut
        # holds it exclusive (snapshots.py).
        self.gate = UpdateGate()
        self._capture = None  # the checkpoint being written, if any
        self.saving = threading.Lock()  # one checkpoint at a time (snapshots.save)
        # This server's id and address and the whole shard map it last accepted (set by
        # ps_server.app): a request for a shard that map places on another server id at this
        # address was meant for a server that listened here before (a restart under another
        # id), so it is told to wait for the coordinator to move it, not that the variable
        # does not exist.
        self.server_id = self.address = ""
        self.last_map: Callable[[], ShardMap] = lambda: EMPTY_MAP

    def begin_capture(self, capture) -> None:
        with self._lock:
            self._capture = capture

    def end_capture(self, capture) -> None:
        with self._lock:
            if self._capture is capture:
                self._capture = None

    # ---- placement ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def assign(self, epoch: int, specs: dict[str, VariableSpec], shards: list[Shard],
               restore=None, superseded: frozenset[tuple[str, int]] = frozenset(),
               ) -> AssignOutcome:
        """Hold exactly `shards` from `epoch` on: create missing ones, drop unlisted ones.

        Idempotent, and serialized: a repeated delivery of the same assignment (the
        coordinator resends it while a large shard is still being initialized) waits for
        the first and then finds every shard in place, so no shard is ever created twice and
        no applied push is lost to a fresh copy.

        Refused, changing nothing: an assignment older than the held epoch (StaleEpoch), and
        one that would drop or re-create a shard holding trained values (any applied push):
        TrainedShardConflict. A shard that cannot be created (its memory runs out) is
        reported in the outcome and never blocks the others: the rest are created and the
        epoch is adopted.

        `restore` (a prepared ShardRestore) gives the shards it names, read from a
        checkpoint, instead of their initializers; a shard the server holds already is kept
        as it is. `superseded` names trained shards that may be dropped all the same: the
        coordinator placed them elsewhere from a checkpoint while this server was away.
        """
        # Every array made for this call, restored ones included: whatever is not installed
        # when it ends (refused, out of memory, a repeated delivery that found its shards in
        # place) is retired, so that no segment outlives its use.
        made: list[np.ndarray] = [] if restore is None else [
            held.values for held in restore.created.values()]
        try:
            for shard in shards:
                spec = specs.get(shard.variable)
                if spec is None:
                    raise InvalidArgument(
                        f"assignment names shard of undeclared {shard.variable!r}")
                validate_initializer(spec)
                resolve_knobs(spec)
                if not _shard_fits(spec, shard):
                    raise InvalidArgument(f"{shard.describe()} does not fit {spec.describe()}")
            with self._assign_lock:
                with self._lock:
                    if epoch < self._epoch:
                        raise StaleEpoch(epoch, self._epoch)
                    current = dict(self._shards)
                wanted = {s.key: s for s in shards}
                kept = {key: held for key, held in current.items() if key in wanted
                        and held.shard == wanted[key] and held.spec == specs[key[0]]}
                leaving = sorted((held for key, held in current.items()
                                  if kept.get(key) is not held), key=lambda held: held.key)
                _refuse_dropping_trained(epoch, leaving, wanted, superseded)
                created: dict[tuple[str, int], HeldShard] = {}
                failed: list[tuple[Shard, str]] = []
                for key, shard in wanted.items():
                    spec = specs[shard.variable]
                    held = current.get(key)
                    if held is not None and held.spec == spec and held.shard == shard:
                        continue
                    # Initialization of a large shard takes seconds: outside the store lock, so
                    # pulls and pushes of other shards go on meanwhile.
                    try:
                        if restore is not None and key in restore.shards:
                            held = restore.created.get(key)
                            if held is None:  # the checkpoint could not give it
                                failed.append((shard, restore.failure(shard)))
                            else:
                                created[key] = held
                            continue
                        if spec.dynamic:
                            created[key] = self.new_dynamic(spec, shard)
                            continue
                        values = self.memory.empty(shard.shape(spec), spec.dtype)
                        made.append(values)
                        if spec.is_table:
                            initialize_ids(spec.initializer, spec.seed, np.arange(
                                shard.row_start, shard.row_stop, shard.stride), spec.shape[1],
                                spec.dtype, num_rows=spec.rows, out=values)
                        else:
                            initialize_rows(spec, shard.row_start, shard.row_stop, out=values)
                        state = make_shard_state(spec, values.shape)
                    except MemoryError:
                        failed.append((shard, (
                            f"out of memory creating shard {shard.index} of {spec.name!r} (rows "
                            f"{shard.row_start}:{shard.row_stop}, "
                            f"{shard.nbytes(spec) / 2**20:.1f} MiB of values)")))
                        continue
                    created[key] = HeldShard(spec, shard, values, state, resolve_knobs(spec))
                for held in created.values():
                    held.seqlock = self.memory.seqlock(held.values)
                with contextlib.ExitStack() as locked:
                    for held in leaving:  # in key order, as pushes take them
                        locked.enter_context(held.lock)
                    # Again under their locks: a push planned at the held epoch may have been
                    # applied while the new shards were made.
                    _refuse_dropping_trained(epoch, leaving, wanted, superseded)
                    with self._lock:
                        for held in leaving:
                            held.dropped = (self._epoch, epoch)
                        self._shards = {**kept, **created}
                        self._epoch = epoch
                        self.placement_version += 1
                self.memory.set_epoch(epoch)
                for key, held in current.items():
                    if kept.get(key) is not held:
                        self.memory.retire(held.values)
        finally:
            with self._lock:
                live = {id(held.values) for held in self._shards.values()}
            for values in made:
                if id(values) not in live:
                    self.memory.retire(values)
        if created or failed:
            log.info("epoch %d: created %d shard(s), holding %d%s", epoch, len(created),
                     len(wanted) - len(failed),
                     f"; could not create {len(failed)}" if failed else "")
        for _, message in failed:
            log.error("%s", message)
        return AssignOutcome(len(created), failed)

    def new_dynamic(self, spec: VariableSpec, shard: Shard) -> HeldShard:
        dim = spec.shape[1]
        capacity = shard_capacity(spec, shard)
        rows = DynamicRows(
            dim, spec.dtype, capacity=capacity, ttl_s=spec.ttl_seconds,
            make_rows=lambda ids: initialize_ids(spec.initializer, spec.seed, ids, dim,
                                                 spec.dtype, num_rows=None),
            make_slots=lambda n: make_row_slots(spec, (n, dim)), clock=self.clock,
            admit=lambda nbytes: self._admit(nbytes, capped=capacity > 0))
        return HeldShard(spec, shard, rows.values, ShardOptimizerState(rows.slots),
                         resolve_knobs(spec), dynamic=rows)

    def check_epoch(self, request_epoch: int) -> None:
        current = self.epoch
        if request_epoch < current:
            raise StaleEpoch(request_epoch, current)
        if request_epoch > current:
            raise NotReady(
                f"this server holds shard map epoch {current}, the request names epoch "
                f"{request_epoch}: its assignment has not arrived yet; retry"
            )

    def held(self) -> list[HeldShard]:
        with self._lock:
            return list(self._shards.values())

    def nbytes(self) -> int:
        """Bytes of values plus optimizer slots held."""
        return sum(
            h.values.nbytes + sum(s.nbytes for s in h.state.slots.values()) for h in self.held()
        )

    def lookup(self, refs: list[tuple[str, int]]) -> list[HeldShard]:
        if not refs:
            raise InvalidArgument("request names no shards")
        if len(set(refs)) != len(refs):
            raise InvalidArgument("request names the same shard more than once")
        with self._lock:
            found = [self._shards.get(ref) for ref in refs]
            known = {name for name, _ in self._shards}
        for ref, held in zip(refs, found):
            if held is None:
                name, index = ref
                self._check_not_placed_elsewhere(name, index)
                if name in known:
                    raise InvalidArgument(f"variable {name!r} has no shard {index} on this server")
                raise UnknownVariable(f"variable {name!r} is not held by this server")
        return found  # type: ignore[return-value]

    def _check_not_placed_elsewhere(self, name: str, index: int) -> None:
        """Raise NotReady (UNAVAILABLE: clients retry and refresh their map, as for a server
        that does not answer) if the last accepted map places this shard on another server
        id at this server's address: it was asked of a server that no longer listens here.
        A shard placed on a server elsewhere was misrouted: the caller's error, as before."""
        last = self.last_map()
        owner = next((s.server_id for s in last.shards.get(name, ()) if s.index == index), "")
        if (owner and self.server_id and owner != self.server_id
                and last.servers.get(owner) == self.address):
            raise NotReady(
                f"this is parameter server {self.server_id}; variable {name!r} shard {index} "
                f"is on {owner} (shard map epoch {last.epoch}), which no longer listens at "
                f"this address ({self.address}): retry until the coordinator moves its shards "
                "or it is back")

    # ---- data path ---------------------------------------------------------------------

    def plan_pull(self, epoch: int, refs: list[tuple[str, int]], wire_dtype: str | None,
                  row_ids: list[np.ndarray | None] | None = None,
                  ) -> list[tuple[HeldShard, TensorMeta, GatheredRows | None]]:
        """Validate a pull; returns each shard with the metadata of its wire encoding, and
        for a row pull (`row_ids[i]` not None) the rows themselves, read at one instant."""
        return self.read_pull(self.check_pull(epoch, refs, wire_dtype, row_ids))

    def check_pull(self, epoch: int, refs: list[tuple[str, int]], wire_dtype: str | None,
                   row_ids: list[np.ndarray | None] | None = None) -> list[CheckedRead]:
        """Validate a pull without reading anything (PushThenPull checks its pull before it
        applies its push): raises as plan_pull would."""
        self.check_epoch(epoch)
        row_ids = row_ids or [None] * len(refs)
        checked = []
        for held, ids in zip(self.lookup(refs), row_ids):
            spec = held.spec
            wire = wire_dtype or spec.dtype
            check_narrowing(spec.dtype, wire, variable=spec.name)
            if ids is None:
                if spec.dynamic:
                    raise InvalidArgument(f"{held.describe()}: a dynamic table cannot be pulled "
                                          "whole (its rows are any int64 ids); use pull_rows")
                checked.append(CheckedRead(held, wire))
            elif not spec.is_table:
                raise InvalidArgument(f"variable {spec.name!r} is dense, not an embedding "
                                      "table: pull it whole (pull_rows is for tables)")
            elif held.dynamic is None:
                checked.append(CheckedRead(held, wire, ids, held.local_rows(ids)))
            else:
                unique, inverse = dedup(ids)
                held.check_own_ids(unique)
                held.dynamic.check_request(len(unique), held.describe())
                checked.append(CheckedRead(held, wire, unique, inverse=inverse))
        return checked

    def read_pull(self, checked: list[CheckedRead]
                  ) -> list[tuple[HeldShard, TensorMeta, GatheredRows | None]]:
        """plan_pull's answer for a checked pull: a row pull's rows are read now."""
        return [(read.held, read.meta, None if read.ids is None else self._read_rows(read))
                for read in checked]

    def _read_rows(self, read: CheckedRead) -> GatheredRows:
        held = read.held
        if held.dynamic is None:
            local, order = read.local, None
            if len(local) > 1 and not np.all(local[1:] > local[:-1]):  # PSClient's are sorted
                distinct, inverse = np.unique(local, return_inverse=True)
                if len(distinct) < len(local):
                    local, order = distinct, inverse
            with held.lock:
                return GatheredRows(held.values[local], order)
        # Making the rows of unseen ids changes the shard: as a push does (checkpoints).
        with self._updating([held]):
            local = held.dynamic.locate(read.ids)
            held.sync_pool()
            return GatheredRows(held.values[local], read.inverse)

    def plan_push(self, epoch: int, refs: list[tuple[str, int]], metas: list[TensorMeta],
                  row_ids: list[np.ndarray | None] | None = None) -> list[HeldShard]:
        """Validate a push's header before any of its bytes are accepted."""
        self.check_epoch(epoch)
        if len(refs) != len(metas):
            raise InvalidArgument(
                f"push header names {len(refs)} shard(s) but describes {len(metas)} tensor(s)"
            )
        # No shards: a stepped push's step on a server it has no gradients for (see
        # PushReceiver); lookup refuses an empty list, a mistake in every other request.
        targets = self.lookup(refs) if refs else []
        for held, meta, ids in zip(targets, metas, row_ids or [None] * len(refs)):
            if meta.dtype not in ("float32", "float64", "float16", "bfloat16"):
                raise InvalidArgument(f"{held.describe()}: gradient dtype {meta.dtype}")
            check_narrowing(held.spec.dtype, meta.dtype, variable=held.spec.name)
            if ids is None and held.spec.is_table:
                raise InvalidArgument(f"{held.describe()}: an embedding table takes gradients "
                                      "of rows (push_rows), not of the whole table")
            if ids is not None and not held.spec.is_table:
                raise InvalidArgument(f"variable {held.spec.name!r} is dense, not an embedding "
                                      "table: push a gradient of its whole shape")
            want = held.shape if ids is None else (len(ids), *held.spec.shape[1:])
            if meta.shape != want:
                raise InvalidArgument(
                    f"{held.describe()}: gradient shape {list(meta.shape)} does not match "
                    f"{'the shard' if ids is None else 'its ids and the row'}'s shape "
                    f"{list(want)}"
                )
            if ids is not None and held.dynamic is None:
                held.local_rows(ids)  # every id in range and on this shard
            elif ids is not None:
                held.check_own_ids(ids)
                held.dynamic.check_request(len(np.unique(ids)), held.describe())
        return targets

    def refuses_non_finite(self, client_refuses: bool) -> bool:
        """Whether a push is refused for a non-finite gradient: unless the server was started
        with --allow-non-finite, and then if its client refuses them (its header says so)."""
        return client_refuses or not self.allow_non_finite

    def _accept_them(self, client_refuses: bool) -> str:
        """How a user gets non-finite gradients accepted: the end of a refusal's message."""
        if self.allow_non_finite:
            return "the pushing client refuses them (PSClient(allow_non_finite=True) sends them)"
        if client_refuses:
            return ("to accept them, start the server with --allow-non-finite and push with "
                    "PSClient(allow_non_finite=True)")
        return "start the server with --allow-non-finite to accept them"

    def check_gradients(self, targets: list[HeldShard], grads: list[np.ndarray],
                        read_block=None, finite: frozenset[int] = frozenset(), *,
                        client_refuses: bool = False) -> None:
        """Refuse non-finite gradients (see `refuses_non_finite`). `read_block(block)`, if
        given, returns the contents of each block of a gradient to check (a large push, read
        from its file instead of its mapping: ps_common.shm.BlockReader). `finite`: positions
        of gradients already found finite, not read again."""
        if not self.refuses_non_finite(client_refuses):
            return
        for i, (held, grad) in enumerate(zip(targets, grads)):
            if i not in finite and grad.size and not all_finite(grad, read_block):
                bad = count_non_finite(grad, read_block)
                raise NonFiniteGradient(
                    f"{held.describe()}: gradient has {bad} non-finite value(s) (NaN or Inf); "
                    f"nothing was applied ({self._accept_them(client_refuses)})")

    def sum_rows(self, targets: list[HeldShard], grads: list[np.ndarray],
                 row_ids: list[np.ndarray | None] | None, *,
                 client_refuses: bool = False) -> list | None:
        """For each row push: its distinct ids and the sum of each one's gradient rows, in the
        optimizer's compute dtype, refused (nothing applied) if a sum is not finite: finite
        gradients of a repeated id may overflow together. None for the other pushes."""
        if row_ids is None:
            return None
        rows = []
        for held, grad, ids in zip(targets, grads, row_ids):
            if ids is None:
                rows.append(None)
                continue
            grad = grad.astype(compute_dtype(held.spec.dtype), copy=False)
            if len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1])):
                # Distinct already (PSClient sends each id once, sorted): nothing to sum.
                unique, summed = ids, grad
            else:
                unique, inverse = dedup(ids)
                with np.errstate(over="ignore"):  # an overflow is refused just below
                    summed = sum_duplicates(grad, inverse, len(unique))
            if self.refuses_non_finite(client_refuses) and summed.size \
                    and not all_finite(summed):
                raise NonFiniteGradient(
                    f"{held.describe()}: the gradients of a repeated id sum to a non-finite "
                    f"value (NaN or Inf); nothing was applied "
                    f"({self._accept_them(client_refuses)})")
            rows.append((unique, summed))
        return rows

    def apply(self, targets: list[HeldShard], grads: list[np.ndarray],
              read_block=None, rows: list | None = None) -> None:
        """Apply validated gradients, all shards or none: locks are taken in key order.
        `read_block` as for check_gradients. A row push (`rows[i]`, from sum_rows, not None)
        updates the touched rows only."""
        rows = rows or [None] * len(targets)
        with self._updating(targets):
            for held in targets:
                if held.dropped is not None:  # an assignment took it since the push's plan
                    raise StaleEpoch(*held.dropped)
            # Every row found (or made) before anything changes. A dynamic table grows its
            # pool before it evicts (locate), so a refused growth (the memory budget) leaves
            # it as it was; a push to several of them grows every pool first (reserve: a
            # second look-up of the ids, paid only then), so none of their rows is evicted.
            tables = [(held, touched[0]) for held, touched in zip(targets, rows)
                      if touched is not None and held.dynamic is not None]
            for held, ids in tables if len(tables) > 1 else ():
                held.dynamic.reserve(ids)
                held.sync_pool()
            local = [None if touched is None else self._local_rows(held, touched[0])
                     for held, touched in zip(targets, rows)]
            for held, grad, touched, where in zip(targets, grads, rows, local):
                if held.seqlock is not None:
                    held.seqlock[VERSION] += 1  # odd: readers of the segment retry
                try:
                    if touched is None:
                        apply_update(held.spec, held.knobs, held.values, held.state, grad,
                                     read_block)
                    else:
                        held.state.steps += 1
                        apply_rows(held.spec, held.knobs, held.values, held.optimizer_slots,
                                   where, touched[1])
                finally:
                    if held.seqlock is not None:
                        held.seqlock[VERSION] += 1
                held.updates += 1

    @staticmethod
    def _local_rows(held: HeldShard, ids: np.ndarray) -> np.ndarray:
        if held.dynamic is None:
            return ids // held.shard.stride
        # Rows evicted since (or never pulled) are made from the initializer first.
        local = held.dynamic.locate(ids)
        held.sync_pool()
        return local

    def _admit(self, nbytes: int, *, capped: bool) -> Callable | None:
        """A dynamic table's pool may grow by `nbytes` only within the memory budget.
        A capped table's pool never grows past its share of the capacity (DynamicRows._grow),
        and placement charged this server's budget for all of that share: its growth is
        always admitted. An uncapped table's growth counts every capped one at that charge,
        so that it cannot take the room reserved for rows a capped table has yet to make.
        Growths of other tables run under their own shards' locks: an admitted growth holds
        its room (`_growing`) until its arrays are installed, which the returned `settle`
        does under the same lock as it gives the room back (see DynamicRows), so that two at
        once are never both admitted into room for one, nor one counted twice."""
        if not self.memory_budget or capped:
            return None
        with self._budget_lock:
            if self._budget_held() + self._growing + nbytes > self.memory_budget:
                raise ResourceExhausted(
                    f"this server's memory budget ({self.memory_budget} bytes) has no room for "
                    f"an uncapped dynamic table to grow by {nbytes} bytes beside what the "
                    "server holds and the capacity reserved for its capped tables; nothing was "
                    "applied (declare the table with a capacity, add servers or raise "
                    "--memory-budget)")
            self._growing += nbytes

        def settle(install) -> None:
            with self._budget_lock:
                if install is not None:
                    install()
                self._growing -= nbytes
        return settle

    def _budget_held(self) -> int:
        """Bytes held (as `nbytes`: a dynamic table's pool with its bookkeeping, which its
        growths ask room for), a capped dynamic table's shard counted at no less than
        placement's charge for its whole share of the capacity."""
        total = 0
        for held in self.held():
            pool = held.dynamic
            if pool is None:
                size = held.values.nbytes + sum(s.nbytes for s in held.state.slots.values())
            else:
                # The pool's own arrays: a growth replaces them before the shard is synced.
                size = pool.nbytes
                if pool.capacity:
                    size = max(size, footprint(held.spec, pool.capacity))
            total += size
        return total

    @contextlib.contextmanager
    def _updating(self, targets: list[HeldShard]):
        """Hold the locks of `targets` (in key order) while the body changes them, once a
        checkpoint being written has what it needs of them (it preserves them as they were
        at its cut, or, past its memory bound, the update waits for their turn)."""
        ordered = sorted(targets, key=lambda held: held.key)
        while True:
            for held in ordered:
                held.lock.acquire()
            try:
                capture = self._capture
                blocked = capture.preserve(ordered) if capture else None
                if blocked is None:
                    for held in ordered:
                        if held.live_reads:
                            preserve_for_reads(held)
                    yield
                    return
            finally:
                for held in ordered:
                    held.lock.release()
            capture.wait_written(blocked)  # the checkpoint's copies are at their bound

    def expire_rows(self) -> int:
        """Evict the rows of dynamic tables untouched for their ttl (requests do it too,
        on the shards they touch; this reaches the others). Returns how many."""
        evicted = 0
        for held in self.held():
            if held.dynamic is not None and held.dynamic.ttl_s:
                with self._updating([held]):
                    evicted += held.dynamic.expire()
        return evicted

    def table_stats(self) -> list[TableStats]:
        """Per embedding-table shard: rows held, evictions so far, bytes of its arrays."""
        stats = []
        for held in self.held():
            if not held.spec.is_table:
                continue
            with held.lock:
                if held.dynamic is not None:
                    stats.append(TableStats(*held.key, held.dynamic.rows_held,
                                            held.dynamic.evictions, held.dynamic.nbytes))
                else:
                    stats.append(TableStats(*held.key, held.shape[0], 0, held.values.nbytes + sum(
                        a.nbytes for a in held.state.slots.values())))
        return stats
