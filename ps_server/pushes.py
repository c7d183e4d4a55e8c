"""Receiving one push: the exactly-once, all-or-nothing sequence of steps, without grpc.

The servicer decodes the header and hands over the stream of data pieces; this module
checks the dedup ledger (before the epoch: a retry of an applied push is a duplicate even
after the map moved on), validates the header against the shards, assembles the bytes where
they wait (ps_server.push_staging: pooled buffers, or a file past the memory bound), checks
the gradients, and applies them under the ledger's exactly-once guard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ps_common.consistency import SYNC
from ps_common.errors import FencedIncarnation, InvalidArgument, NonFiniteGradient, PSError
from ps_common.tensors import (
    StreamAssembler, TensorMeta, all_finite, finite_in_both, wire_raw_dtype,
)
from ps_server.consistency import Contribution, PushOutcome, StepGate
from ps_server.ledger import PushLedger
from ps_server.push_staging import PushStaging
from ps_server.store import ShardStore
from ps_server.wire_gradients import ConvertingReader, raw_gradient, whole_gradient


@dataclass(frozen=True)
class PushHeader:
    client_id: str
    incarnation: int
    sequence: int
    acked_through: int
    epoch: int
    refs: list[tuple[str, int]]
    metas: list[TensorMeta]
    # Per ref: the ids of an embedding table's rows the tensor is for; None: the whole shard.
    row_ids: list[np.ndarray | None] | None = None
    # The step it belongs to, from a client that joined this server's steps (else None).
    step: int | None = None
    # The client refuses non-finite gradients, whatever the server accepts.
    refuse_non_finite: bool = False


class PushReceiver:
    """Thread-safe (the store, ledger, staging and step gate are). `steps`: the server's
    consistency steps (ps_server.consistency), which pushes with a step go through."""

    def __init__(self, store: ShardStore, ledger: PushLedger, staging: PushStaging, *,
                 max_step_clients: int | None = None):
        self._store = store
        self._ledger = ledger
        self._staging = staging
        self.steps = StepGate(self._apply_average, check_live=ledger.check_live,
                              max_members=max_step_clients)

    def receive(self, header: PushHeader, first_data, more_data: Iterable) -> PushOutcome:
        """Apply the push exactly once; the outcome says whether it had been applied
        already (`duplicate`) and, for a push with a step, what the step gate said.

        `more_data` yields the data of the following chunks (it raises for a malformed
        stream); everything is validated before anything is applied.
        """
        _check_identity(header)
        if self._ledger.applied(header.client_id, header.incarnation, header.sequence):
            for _ in more_data:  # drain: the sender is still streaming
                pass
            return self._duplicate(header)
        targets = self._store.plan_push(header.epoch, header.refs, header.metas, header.row_ids)
        arrival = FiniteOnArrival(header.metas, [held.spec.dtype for held in targets]) \
            if self._store.refuses_non_finite(header.refuse_non_finite) else None
        with self._staging.stage([meta.nbytes for meta in header.metas]) as staged:
            assembler = StreamAssembler(staged.destinations, what="push", on_write=arrival)
            assembler.write(first_data)
            for data in more_data:
                assembler.write(data)
            assembler.finish()
            staged.finish()
            grads = [raw_gradient(data, meta) for data, meta in zip(staged.data, header.metas)]
            try:
                return self._apply(header, targets, grads, staged.reader,
                                   arrival.finite() if arrival else frozenset())
            finally:
                # No view of a staged file may outlive the push, or the file is not reused.
                del grads
                if staged.reader is not None:
                    staged.reader.finish()

    def receive_whole(self, header: PushHeader, data: memoryview) -> PushOutcome:
        """The same for a push whose tensors all came in one message (`data`): read in place
        from it, no copy (the update copies each block it works on; see apply_update)."""
        total = sum(meta.nbytes for meta in header.metas)
        if len(data) != total:
            raise InvalidArgument(f"push: its message carries {len(data)} bytes of tensors, its "
                                  f"header announces {total}")
        return self.receive_shared(header, data)

    def receive_shared(self, header: PushHeader, data: memoryview, reader=None, *,
                       checked_in_slot: bool = False) -> PushOutcome:
        """The same for a push whose tensors lie back to back at the start of `data` (a
        client's push slot in shared memory): read in place, no copy. `reader` (a
        ps_common.shm.BlockReader of a large slot) reads each block from the slot's file
        instead, so that the slot does not become resident in this process; it is finished
        however the push ends.

        `checked_in_slot`: the client checked the slot for non-finite values after writing
        it (PushHeader.finite_checked, taken from PushShared alone: a push over gRPC is
        always checked here). The slot lies in memory that the client's user can write, as
        it can every segment of this server, so that check stands for the server's, which
        would read the slot once more. Where a finite value of the wire dtype may overflow
        the stored one, the server checks anyway."""
        try:
            _check_identity(header)
            if self._ledger.applied(header.client_id, header.incarnation, header.sequence):
                return self._duplicate(header)
            targets = self._store.plan_push(header.epoch, header.refs, header.metas,
                                            header.row_ids)
            total = sum(meta.nbytes for meta in header.metas)
            if total > len(data):
                raise InvalidArgument(f"push names {total} bytes of tensors but its "
                                      f"shared-memory slot holds {len(data)}")
            grads, offset = [], 0
            for meta in header.metas:
                grads.append(raw_gradient(data[offset:offset + meta.nbytes], meta))
                offset += meta.nbytes
            finite = frozenset(
                i for i, (meta, held) in enumerate(zip(header.metas, targets))
                if finite_in_both(meta.dtype, held.spec.dtype)) if checked_in_slot \
                else frozenset()
            return self._apply(header, targets, grads, reader, finite)
        finally:
            if reader is not None:
                reader.finish()

    def _apply(self, header: PushHeader, targets, grads, read_block=None,
               finite: frozenset[int] = frozenset()) -> PushOutcome:
        """`grads`: raw_gradient views, in their wire dtypes; `read_block` reads a block of
        one (ps_common.shm.BlockReader), if given. `finite`: the positions of gradients
        found finite already (FiniteOnArrival)."""
        kind = (self.steps.check_member(header.client_id, header.incarnation)
                if header.step is not None else None)
        stored = [held.spec.dtype for held in targets]
        converting = ConvertingReader(grads, header.metas, stored, read_block)
        self._store.check_gradients(targets, grads, converting.for_finiteness(), finite,
                                    client_refuses=header.refuse_non_finite)
        read_block = converting.for_update()  # converts a block at a time
        sync = kind == SYNC
        if sync or header.row_ids is not None:
            # A sync step's sum and a row push's sum of repeated ids take their gradients
            # whole.
            row_ids = header.row_ids or [None] * len(grads)
            grads = [whole_gradient(grad, meta, dtype) if sync or ids is not None else grad
                     for grad, meta, dtype, ids in zip(grads, header.metas, stored, row_ids)]
        rows = self._store.sum_rows(targets, grads, header.row_ids,
                                    client_refuses=header.refuse_non_finite)
        if sync:
            if any(r is not None for r in rows or ()):
                raise InvalidArgument(
                    "a row push (push_rows) in the sync mode: sync combines whole-variable "
                    "gradients only; train embedding tables in async or ssp:K")
            # The step's sum holds a copy: a slot read through its mapping is dropped from
            # this process before the wait for the other clients, not after it.
            contribution = Contribution(header.client_id, header.incarnation, header.sequence,
                                        header.acked_through, header.refuse_non_finite)
            return self.steps.contribute(contribution, header.step, targets, grads,
                                         copied=getattr(read_block, "finish", None))
        # Shared with other pushes, exclusive of a checkpoint's cut: a push is in a
        # checkpoint with its ledger entry, or not at all.
        with self._store.gate.shared(), self._ledger.exactly_once(
                header.client_id, header.incarnation, header.sequence,
                header.acked_through) as duplicate:
            if not duplicate:
                self._store.apply(targets, grads, read_block, rows)
        return self._stepped(header, duplicate)

    def _duplicate(self, header: PushHeader) -> PushOutcome:
        if header.step is not None and self.steps.kind_of(header.client_id) == SYNC:
            return PushOutcome(next_step=self.steps.current_step(), duplicate=True,
                               members=tuple(self.steps.members()))
        return self._stepped(header, True)

    def _stepped(self, header: PushHeader, duplicate: bool) -> PushOutcome:
        """After an applied (or duplicate) push: the ssp bound's wait, for a push with a step."""
        if header.step is None:
            return PushOutcome(next_step=0, duplicate=duplicate)
        outcome = self.steps.finish_step(header.client_id, header.incarnation, header.step)
        outcome.duplicate = duplicate
        return outcome

    def _apply_average(self, contributions: list[Contribution], targets, grads
                       ) -> dict[tuple[str, int], PSError]:
        """One sync step: the averaged gradients applied, and every contribution recorded
        in the ledger with them (in client order: the ledger's locks are per client).

        A contribution whose incarnation the coordinator retired while it waited is fenced
        in the ledger: it cannot be recorded, and its push is answered with the fence's
        error, while the others' step is applied. Its gradients stay in the average, as a
        push of a client that left while it waited does: they were computed from the
        step's values, and the step's sum holds them (one array per shard whatever the
        number of clients, rather than a copy of every push to leave one out). Returns
        those unrecorded, {(client_id, incarnation, sequence): the fence's error}. Of a
        client whose new incarnation took part in the step beside its replaced one, only the
        newest is recorded (the ledger holds one record per client); the older ones are
        answered as fenced, their gradients in the average as a retired one's are."""
        # The ledger holds one lock per client: each client's first push is recorded with
        # the update, its others (pushes of the same step) right after; all of it under the
        # gate, so that no checkpoint cuts between the update and any of its records. Once
        # a client's lock is held, no retirement can fence it before the update.
        self._refuse_non_finite_average(contributions, targets, grads)
        newest: dict[str, int] = {}
        for c in contributions:
            newest[c.client_id] = max(newest.get(c.client_id, c.incarnation), c.incarnation)
        unrecorded: dict[tuple[str, int, int], PSError] = {
            (c.client_id, c.incarnation, c.sequence): FencedIncarnation(
                f"client {c.client_id!r} pushed with incarnation {c.incarnation}, but "
                f"incarnation {newest[c.client_id]} took part in the same step: this client "
                "was replaced; register again")
            for c in contributions if c.incarnation < newest[c.client_id]}
        ordered = sorted((c for c in contributions if c.incarnation == newest[c.client_id]),
                         key=lambda c: (c.client_id, c.sequence))
        first = {c.client_id: c for c in reversed(ordered)}
        with self._store.gate.shared():
            with contextlib.ExitStack() as ledger:
                for c in (first[client_id] for client_id in sorted(first)):
                    try:
                        ledger.enter_context(self._ledger.exactly_once(
                            c.client_id, c.incarnation, c.sequence, c.acked_through))
                    except FencedIncarnation as error:
                        unrecorded.update({(o.client_id, o.incarnation, o.sequence): error
                                           for o in ordered if o.client_id == c.client_id})
                self._store.apply(targets, grads)
            for c in ordered:
                if first[c.client_id] is not c \
                        and (c.client_id, c.incarnation, c.sequence) not in unrecorded:
                    # Retired since its first push was recorded: its fence refuses any
                    # retry of this one too, so there is nothing left to record.
                    with contextlib.suppress(FencedIncarnation), self._ledger.exactly_once(
                            c.client_id, c.incarnation, c.sequence, c.acked_through):
                        pass
        return unrecorded

    def _refuse_non_finite_average(self, contributions: list[Contribution], targets,
                                   averages) -> None:
        """Every gradient of the step was finite (each was checked as it came), and their
        sum is kept from overflowing (ps_server.consistency.StepSum): a non-finite average
        would take a rounding at the very edge of the dtype's range. Such a step is refused
        whole, as a non-finite push is, rather than applied."""
        if not self._store.refuses_non_finite(any(c.refuse_non_finite for c in contributions)):
            return
        lenient = [c.client_id for c in contributions if not c.refuse_non_finite]
        for held, average in zip(targets, averages):
            if average.size and not all_finite(average):
                why = (f"a client that allows NaN and Inf ({', '.join(sorted(lenient))}) may "
                       "have sent them" if lenient else
                       "each was finite: lower the learning rate or clip the gradients")
                raise NonFiniteGradient(
                    f"variable {held.spec.name!r} shard {held.shard.index}: the average of this "
                    f"sync step's {len(contributions)} gradients is not finite in "
                    f"{held.spec.dtype}; nothing of the step was applied here ({why})")


class FiniteOnArrival:
    """The finiteness check of a streamed push's gradients, made on each piece as it
    arrives (a StreamAssembler's `on_write`), while the piece is still in the CPU's caches:
    the check no longer reads the whole push back from memory, or from its staging file,
    before the update reads it once more. A tensor whose pieces cannot be checked that way
    (a wire dtype numpy cannot test, a piece that splits an element) or that holds a
    non-finite value is left out of `finite()`, for the full check to decide and report.
    So is a tensor whose finite values may overflow its variable's dtype (bfloat16 into a
    float16 variable: ps_common.tensors.finite_in_both)."""

    def __init__(self, metas: list[TensorMeta], stored_dtypes: list[str]):
        self._dtypes = [wire_raw_dtype(meta.dtype) if finite_in_both(meta.dtype, stored) else None
                        for meta, stored in zip(metas, stored_dtypes)]
        self._unchecked = {i for i, dtype in enumerate(self._dtypes) if dtype is None}

    def __call__(self, tensor: int, offset: int, data: memoryview) -> None:
        if tensor in self._unchecked:
            return
        itemsize = self._dtypes[tensor].itemsize
        if offset % itemsize or len(data) % itemsize:
            self._unchecked.add(tensor)
        elif len(data) and not all_finite(np.frombuffer(data, self._dtypes[tensor])):
            self._unchecked.add(tensor)

    def finite(self) -> frozenset[int]:
        return frozenset(range(len(self._dtypes))) - self._unchecked


def _check_identity(header: PushHeader) -> None:
    if not header.client_id or header.sequence < 1:
        raise InvalidArgument(
            "push header needs a client_id and a sequence >= 1 (exactly-once identity)")
    if not header.refs and header.step is None:
        # An empty push only carries a client's step to a server it has no gradients for
        # this step (ssp: the step finished; sync: a contribution of none).
        raise InvalidArgument("push names no shards (only a push with a step may be empty)")
