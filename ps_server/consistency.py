"""One server's steps in the ssp:K and sync modes (ps_common.consistency): who takes part,
how far each has got, and, in sync, the gradients of the step being combined.

The bound sits on the push: a client's push of step t returns once the client may start
step t + 1 (ssp:K: when no live member is more than K steps behind; sync: when step t's
averaged gradient has been applied). A pull after it therefore needs no call to wait on,
which keeps pulls through shared memory call-free in every mode.

Membership is per server: a client joins (JoinSteps) at the step the others are at, leaves
(LeaveSteps) when its work is done, and is removed when the coordinator retires it (dead:
missed heartbeats), so no step waits for a dead client longer than its heartbeat timeout.

A server that restarts comes back with no members. Its clients find it so (their pushes are
refused: not joined) and join again saying where they were: the step they compute next and
the members they last heard of (each stepped push's answer names them). The first of them
sets the restarted server's step, and until the others are back (or left, or retired), for
at most the bound of a step's wait, the steps wait for them: the first sync step combines
one gradient from each, as before the restart, and in ssp:K nobody runs more than K steps
ahead of the step they are assumed at. Without this the first client back would make the
first step alone, and a sync step would then pair one client's step t with another's t + 1.

In sync, a contribution is recorded in the exactly-once ledger only when the step it belongs
to is applied, together with it: a push is acknowledged only after the average that
includes it has been applied, so a server restored from a checkpoint either has both or
neither, and a retried push of a pending step is recognized by its client and not counted
twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ps_common.consistency import SYNC, Mode
from ps_common.errors import (
    FailedPrecondition, FencedIncarnation, InvalidArgument, NotReady, PSError, StepTimeout,
)

log = logging.getLogger(__name__)

# The longest a push waits for other clients before it is told which ones it waited for.
STEP_WAIT_S = 30.0
# The most client ids a restarted server keeps as awaited, or as gone, while it resumes
# (a server with no bound on its members: else that bound).
MAX_REMEMBERED = 1 << 16
MAX_INCARNATION = (1 << 63) - 1  # a leave of every incarnation
# The longest client id that takes part in steps: every stepped push's answer names every
# member, and one id of megabytes would swell all of them.
MAX_STEP_CLIENT_ID = 1024


@dataclass
class _Member:
    incarnation: int
    done: int  # ssp: steps finished (the step it computes next)


@dataclass
class Contribution:
    """A sync push waiting for its step: what the ledger records once the step is applied."""
    client_id: str
    incarnation: int
    sequence: int
    acked_through: int
    refuse_non_finite: bool = True  # its header's ask (PushHeader.refuse_non_finite)


@dataclass
class PushOutcome:
    next_step: int
    waited_s: float = 0.0
    staleness: int = 0
    stale_dropped: bool = False
    duplicate: bool = False
    members: tuple[tuple[str, int], ...] = ()  # (client_id, incarnation) of the members


@dataclass(frozen=True)
class StepStats:
    """What a server's steps look like now, for metrics (StepGate.stats)."""
    mode: str  # "" while nobody takes part
    members: int
    step: int  # sync: steps done (the step being combined), applied or refused whole
    applied: int  # sync: steps whose average was applied
    staleness_max: int
    dropped_stale: int
    waits: int  # stepped pushes answered (each after its wait, if any)
    waited_s: float  # their waits, summed


class StepSum:
    """One shard's sum of a sync step's gradients, and their count, kept from overflowing.

    The average of finite gradients is finite, but their sum may not be (two of 3e38 in
    float32, two of 40,000 in float16): a server that refused such a step would refuse only
    its own shards while the variable's other servers applied theirs. So the sum is held as
    `total * 2**scale`: `scale` stays 0 (the plain sum, bit for bit) while a bound on
    `total`'s magnitude stays within half the dtype's range (the other half a margin for
    the adds' rounding), and grows, halving `total` (exact but for subnormals), before an
    add could overflow. The bound adds up each gradient's largest magnitude, or its
    Euclidean norm (one BLAS pass, at least as large) where that is finite, in the units of
    `total`. A non-finite gradient (a server and client that allow them) is summed plainly:
    no scale keeps it finite."""

    def __init__(self, held, grad: np.ndarray):
        self.held = held
        self.total = np.array(grad, copy=True)
        self.count = 1
        self.scale = 0
        self._limit = float(np.finfo(self.total.dtype).max) / 2
        self._bound = _magnitude_bound(self.total)

    def add(self, grad: np.ndarray) -> None:
        more = _magnitude_bound(grad) * 0.5 ** self.scale
        if not (np.isfinite(more) and np.isfinite(self._bound)):
            self._bound = float("inf")  # non-finite values: nothing to keep finite
            more = 0.0
        # Each term is at most the dtype's largest value: halving both ends the loop.
        while np.isfinite(self._bound) and self._bound + more > self._limit:
            self.total *= 0.5
            self.scale += 1
            self._bound *= 0.5
            more *= 0.5
        self._bound += more
        if self.scale:
            self.total += np.ldexp(grad, -self.scale).astype(self.total.dtype, copy=False)
        else:
            self.total += grad
        self.count += 1

    def average(self) -> np.ndarray:
        average = self.total / np.asarray(self.count, self.total.dtype)
        if self.scale:
            with np.errstate(over="ignore"):  # not for an average of finite values
                average = np.ldexp(average, self.scale).astype(self.total.dtype, copy=False)
        return average


def _magnitude_bound(grad: np.ndarray) -> float:
    """A bound on the largest magnitude in `grad` (finite values), as a Python float."""
    flat = grad.reshape(-1)
    if not flat.size:
        return 0.0
    if flat.dtype in (np.float32, np.float64):
        with np.errstate(over="ignore"):
            norm = float(np.sqrt(np.dot(flat, flat)))
        if np.isfinite(norm):
            return norm
    return max(abs(float(flat.max())), abs(float(flat.min())))


@dataclass
class _Step:
    """The sync step being combined: per shard, the sum of its gradients and their count."""
    # (client_id, incarnation, sequence) -> its push: a client's pushes of one step all
    # count (each shard averages the gradients it got); a retry, under the same sequence,
    # counts once. A client's new incarnation numbers its pushes from 1 again: its first
    # push is no retry of its predecessor's.
    contributions: dict[tuple[str, int, int], Contribution] = field(default_factory=dict)

    # Summed as they come, one array per shard whatever the number of clients (an empty
    # push, a client's step with nothing for this server, adds to none).
    sums: dict[tuple[str, int], "StepSum"] = field(default_factory=dict)

    @property
    def clients(self) -> set[tuple[str, int]]:
        """(client_id, incarnation) of every contributor."""
        return {(client_id, incarnation) for client_id, incarnation, _ in self.contributions}


class StepGate:
    """Thread-safe. `apply_average(contributions, targets, grads)` applies one averaged
    gradient per shard and records every contribution in the ledger, atomically with it;
    it may leave contributions unrecorded (see PushReceiver._apply_average) and returns
    them, {(client_id, sequence): the error its push raises}, or None when there are none.
    `check_live(client_id, incarnation)` raises for an incarnation the exactly-once
    ledger refuses (retired by the coordinator), which may not join."""

    def __init__(self, apply_average: Callable, *, clock=time.monotonic,
                 wait_s: float = STEP_WAIT_S, check_live: Callable | None = None,
                 max_members: int | None = None):
        self._apply_average = apply_average
        self._check_live = check_live
        # At most this many clients take part (None: any number): each push waiting for
        # its step holds one of the server's handler threads (the server's --max-streams).
        self._max_members = max_members
        self._clock = clock
        self._wait_s = wait_s
        self._changed = threading.Condition()
        self._closed = False  # the server is stopping (close)
        self._mode: Mode | None = None
        self._members: dict[str, _Member] = {}
        self._replicas = 1
        self._started = False  # sync: its first step has been applied
        self._joined_before_start: set[str] = set()  # sync: for `replicas`
        self._high = 0  # ssp: the most steps any member has finished
        self._step = 0  # sync: steps done, applied or refused whole
        self._applied = 0  # sync: steps whose average was applied
        self._pending = _Step()
        self._failed: dict[int, PSError] = {}  # sync: steps whose update failed (recent)
        # sync: the contributions (client, incarnation, sequence) of each of those steps: a
        # retry of one, whose answer was lost, gets the step's error again, not 'dropped'.
        self._failed_keys: dict[int, frozenset] = {}
        # sync: per recent step, the contributions its update left unrecorded, with the
        # errors their pushes raise.
        self._left_out: dict[int, dict[tuple[str, int], PSError]] = {}
        self.staleness_max = 0
        self.dropped_stale = 0
        self._waits = 0
        self._waited_s = 0.0
        # Resuming after a restart (see the module's docstring). `_window_until`: the end of
        # the restart window, which opens with the first join since the server started and
        # lasts the bound of a step's wait (None: not open yet); within it, the resume of a
        # client that is no member is honoured, and after it, an awaited one's. A server
        # running for longer has not restarted lately: it ignores resumes. `_resumed`: one
        # has been, and the wait for its peers lasts until `_awaited_until`. `_awaited`:
        # members from before the restart not back yet (id -> incarnation); `_gone`: ids that
        # left or were retired meanwhile (id -> the newest incarnation gone, oldest first),
        # which a later client's peers may still name; `_resume_floor` (ssp): the step the
        # awaited members are taken to be at.
        self._window_until: float | None = None
        self._resumed = False
        self._counted_from_resume = False  # the steps' count is the first resumer's
        self._awaited: dict[str, int] = {}
        self._awaited_until = 0.0
        self._gone: dict[str, int] = {}
        self._resume_floor: int | None = None
        # A step has run since the server started (sync: applied; ssp: finished): until
        # then resumes are honoured whenever they come (a restore may outlast the window).
        self._stepped_yet = False
        # Ids remembered as awaited or gone: no more than the steps take members (every
        # stepped answer names the awaited ones).
        self._remembered_max = max_members or MAX_REMEMBERED

    # ---- membership -----------------------------------------------------------------------

    def join(self, client_id: str, incarnation: int, mode: Mode, replicas: int = 1, *,
             resume_step: int | None = None, peers=()) -> int:
        """The step `client_id` computes first. Raises FailedPrecondition when other
        clients take part in another mode. `resume_step` and `peers`: the client took part
        in this server's steps before it restarted (the step it computes next, the other
        members it last heard of): see the module's docstring."""
        if not mode.stepped:
            raise FailedPrecondition("JoinSteps: the async mode has no steps to join")
        if replicas < 1:
            raise FailedPrecondition(f"JoinSteps: replicas {replicas} must be >= 1")
        longest = max(len(c) for c in (client_id, *(p for p, _ in peers)))
        if longest > MAX_STEP_CLIENT_ID:
            raise InvalidArgument(f"JoinSteps: a client id of {longest} characters; ids that "
                                  f"take part in steps have at most {MAX_STEP_CLIENT_ID}")
        with self._changed:
            self._check_open()
            self._expire_awaited()  # (no push may have come since the wait's bound)
            if self._check_live is not None:
                # Under the lock: a retirement that the ledger records after this check
                # removes the member (leave) only once it has joined.
                self._check_live(client_id, incarnation)
            others = {c: m for c, m in self._members.items() if c != client_id}
            # Members awaited after a restart hold their places: they were in before.
            awaited_elsewhere = sum(1 for c in self._awaited if c != client_id and c not in others)
            self._check_room(len(others) + awaited_elsewhere, mode, replicas)
            if others and mode != self._mode:
                raise FailedPrecondition(
                    f"this server's steps run in {self._mode} (clients "
                    f"{', '.join(sorted(others))}); a client cannot join them in {mode}")
            if not others:
                self._mode = mode
                if not self._members:
                    # Every client of the steps before left: a new run, whose first sync
                    # step waits for its own `replicas`.
                    self._started = False
                    self._joined_before_start = set()
                if mode.kind == SYNC and not self._started:
                    self._replicas = replicas
            current = self._members.get(client_id)
            if current is not None and current.incarnation > incarnation:
                raise FencedIncarnation(
                    f"client {client_id!r} incarnation {incarnation} was replaced by "
                    f"incarnation {current.incarnation}: register again")
            # Honoured for a client this server does not count (it forgot it: it restarted),
            # within the restart window, and after it for a member it awaits.
            if self._window_until is None:
                self._window_until = self._clock() + self._wait_s
            awaited = self._awaited.get(client_id)
            resuming = resume_step is not None and resume_step >= 0 and current is None and (
                self._in_window() or not self._stepped_yet or awaited is not None)
            if awaited is not None and incarnation >= awaited:
                del self._awaited[client_id]
                self._awaited_changed()
            if resuming:
                self._resume(client_id, mode, resume_step, peers, alone=not others)
            if mode.kind == SYNC:
                start = self._step
            else:
                if resuming and self._counted_from_resume:  # ssp: where it was
                    start = resume_step
                else:  # ssp: at the slowest member's step (it then holds nobody back)
                    start = min((m.done for m in others.values()), default=self._high)
                if self._awaited:  # they are taken to be at the lowest step back
                    self._resume_floor = start if self._resume_floor is None \
                        else min(self._resume_floor, start)
            self._members[client_id] = _Member(incarnation, start)
            if not self._started:
                self._joined_before_start.add(client_id)
            self._changed.notify_all()
            return start

    def _resume(self, client_id: str, mode: Mode, step: int, peers, *, alone: bool) -> None:
        """A client back after this server restarted, at `step` there with `peers` (expects
        the lock held). Alone, it sets the steps' count; beside clients that joined since
        the restart, the count they joined at stands."""
        if not self._resumed:
            self._resumed = True
            self._awaited_until = self._clock() + self._wait_s
        if alone:
            self._counted_from_resume = True
            if mode.kind == SYNC:
                self._step = max(self._step, step)
                self._started, self._replicas = True, 1  # its peers are awaited instead
            else:
                self._high = max(self._high, step)
        if self._clock() >= self._awaited_until:
            return
        for peer, incarnation in peers:
            member = self._members.get(peer)
            if peer == client_id or (member is not None and member.incarnation >= incarnation) \
                    or self._gone.get(peer, -1) >= incarnation:
                continue
            if peer not in self._awaited and len(self._awaited) >= self._remembered_max:
                break
            self._awaited[peer] = max(self._awaited.get(peer, incarnation), incarnation)

    def _expire_awaited(self) -> None:
        """Stop waiting for members from before a restart once the wait's bound is past
        (expects the lock held)."""
        if self._awaited and self._clock() >= self._awaited_until:
            log.warning("this server's steps go on without %s: they took part before it "
                        "restarted and have not joined again within %g s",
                        ", ".join(sorted(self._awaited)), self._wait_s)
            self._awaited.clear()
            self._awaited_changed()
        if not self._resume_open():
            self._gone.clear()

    def _awaited_changed(self) -> None:
        """Once nobody is awaited, the next wait's floor is taken afresh (expects the lock
        held)."""
        if not self._awaited:
            self._resume_floor = None

    def _in_window(self) -> bool:
        """Within the restart window (expects the lock held)."""
        return self._window_until is None or self._clock() < self._window_until

    def _resume_open(self) -> bool:
        """Whether a resume may still come, or its peers be awaited (expects the lock
        held)."""
        return self._in_window() or not self._stepped_yet or (
            self._resumed and self._clock() < self._awaited_until)

    def members(self) -> list[tuple[str, int]]:
        """(client_id, incarnation) of the clients taking part in the steps, and of those
        awaited after a restart."""
        with self._changed:
            return list(self._member_ids())

    def leave(self, client_id: str, incarnation: int | None = None) -> None:
        """`client_id` takes part no more (left, or retired by the coordinator): nobody
        waits for it. `incarnation`: only that one or an older one."""
        if len(client_id) > MAX_STEP_CLIENT_ID:
            return  # never a member (join refuses it), and not worth remembering as gone
        with self._changed:
            gone = incarnation if incarnation is not None else MAX_INCARNATION
            if self._resume_open():
                # Newest last: a restarted server reads the coordinator's retirements oldest
                # first, and the newest are those a peers list may still name.
                gone = max(self._gone.pop(client_id, gone), gone)
                if len(self._gone) >= self._remembered_max:
                    del self._gone[next(iter(self._gone))]
                self._gone[client_id] = gone
            if self._awaited.get(client_id, MAX_INCARNATION + 1) <= gone:
                del self._awaited[client_id]
                self._awaited_changed()
                self._maybe_apply()
                self._changed.notify_all()
            member = self._members.get(client_id)
            if member is None or (incarnation is not None and member.incarnation > incarnation):
                return
            del self._members[client_id]
            self._maybe_apply()
            self._changed.notify_all()

    def _check_room(self, others: int, mode: Mode, replicas: int) -> None:
        limit = self._max_members
        if limit is None:
            return
        why = ("a push waiting for its step holds one of the server's handler threads: "
               "raise --max-streams on every server")
        if others >= limit:
            raise FailedPrecondition(
                f"JoinSteps: {others} clients take part in this server's steps already, the "
                f"most it takes ({limit}, its --max-streams); {why}")
        if mode.kind == SYNC and replicas > limit:
            raise FailedPrecondition(
                f"JoinSteps: replicas {replicas} is more clients than this server takes in "
                f"its steps ({limit}, its --max-streams); {why}")

    def close(self) -> None:
        """The server is stopping: every push waiting here, and every call after this,
        raises UNAVAILABLE, so that its client retries against the server that comes back
        (the pending sync step is dropped: none of its pushes was recorded or answered)."""
        with self._changed:
            self._closed = True
            self._pending = _Step()
            self._changed.notify_all()

    def mode(self) -> str:
        with self._changed:
            return str(self._mode) if self._mode is not None and self._members else ""

    def kind_of(self, client_id: str) -> str | None:
        """The mode kind `client_id` takes part in (None: it has not joined)."""
        with self._changed:
            if client_id not in self._members or self._mode is None:
                return None
            return self._mode.kind

    def check_member(self, client_id: str, incarnation: int) -> str:
        """Raises FailedPrecondition unless `client_id` takes part in the steps (before a
        stepped push is applied: it is refused whole, never applied and then refused).
        Returns the mode kind it takes part in, read with its membership: a LeaveSteps
        right after must not turn a sync push into an async one."""
        with self._changed:
            self._check_open()
            self._member(client_id, incarnation)
            return self._mode.kind

    def current_step(self) -> int:
        with self._changed:
            return self._step

    def stats(self) -> StepStats:
        with self._changed:
            return StepStats(
                mode=str(self._mode) if self._mode is not None and self._members else "",
                members=len(self._members), step=self._step, applied=self._applied,
                staleness_max=self.staleness_max, dropped_stale=self.dropped_stale,
                waits=self._waits, waited_s=self._waited_s)

    def _waited(self, started: float) -> float:
        """The wait of a stepped push answered now, counted (expects the lock held)."""
        waited = self._clock() - started
        self._waits += 1
        self._waited_s += waited
        return waited

    # ---- ssp -----------------------------------------------------------------------------

    def finish_step(self, client_id: str, incarnation: int, step: int) -> PushOutcome:
        """ssp: `client_id` has applied its push of `step`: wait until it may start the next
        one (no live member more than K steps behind it)."""
        started = self._clock()
        with self._changed:
            self._check_open()
            member = self._members.get(client_id)
            if member is None or member.incarnation != incarnation:
                # It left (or was retired) after its push was admitted and applied: nothing
                # to wait for, and refusing it now would say a push applied was not. (No
                # members named: it takes no part in these steps.)
                return PushOutcome(next_step=step + 1, waited_s=self._waited(started))
            member.done = max(member.done, step + 1)
            self._high = max(self._high, member.done)
            self._stepped_yet = True
            self._changed.notify_all()
            bound = self._mode.bound if self._mode is not None else 0
            deadline = started + self._wait_s
            while True:
                member = self._members.get(client_id)
                if member is None:  # left or retired meanwhile: nothing to wait for
                    return PushOutcome(next_step=step + 1, waited_s=self._waited(started),
                                       members=self._member_ids())
                self._expire_awaited()
                slowest = min(m.done for m in self._members.values())
                if self._awaited and self._resume_floor is not None:
                    slowest = min(slowest, self._resume_floor)
                if member.done <= slowest + bound:
                    break
                self._check_open()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    behind = [c for c, m in self._members.items() if member.done > m.done + bound]
                    raise self._timeout(step, behind + sorted(self._awaited.keys()))
                self._changed.wait(self._until_awaited_expire(remaining))
            staleness = member.done - slowest
            self.staleness_max = max(self.staleness_max, staleness)
            return PushOutcome(next_step=member.done, waited_s=self._waited(started),
                               staleness=staleness, members=self._member_ids())

    # ---- sync ----------------------------------------------------------------------------

    def contribute(self, contribution: Contribution, step: int, targets: list,
                   grads: list[np.ndarray], copied=None) -> PushOutcome:
        """sync: add a push's gradients (copied) to `step`, and wait until the step's
        average has been applied. A gradient for a step already applied is dropped.
        `copied()`, if given, is called once `grads` are no longer needed, before the wait."""
        started = self._clock()
        client_id = contribution.client_id
        with self._changed:
            self._check_open()
            self._member(client_id, contribution.incarnation)
            key = (client_id, contribution.incarnation, contribution.sequence)
            if step < self._step:
                # A retry of a push whose step was refused whole, or left out of it (its
                # answer lost): the same error again, never a 'dropped as late' success.
                if key in self._failed_keys.get(step, ()):
                    raise self._failed[step]
                left_out = self._left_out.get(step, {}).get(key)
                if left_out is not None:
                    raise left_out
                self.dropped_stale += 1
                return PushOutcome(next_step=self._step, stale_dropped=True,
                                   members=self._member_ids())
            if step > self._step:
                raise FailedPrecondition(
                    f"push of step {step}, but this server is at step {self._step}: a client "
                    "computes the step JoinSteps and its last push's answer gave it")
            if key not in self._pending.contributions:  # else a retry: counted once
                self._pending.contributions[key] = contribution
                for held, grad in zip(targets, grads):
                    total = self._pending.sums.get(held.key)
                    if total is None:
                        self._pending.sums[held.key] = StepSum(held, grad)
                    else:
                        total.add(grad)
            if copied is not None:
                copied()
            self._maybe_apply()
            deadline = started + self._wait_s
            while self._step <= step:
                self._check_open()
                if self._awaited:  # members from before a restart: the wait may be over
                    self._expire_awaited()
                    self._maybe_apply()
                if self._step > step:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._timeout(step, sorted(
                        {c for c, m in self._members.items()
                         if (c, m.incarnation) not in self._pending.clients}
                        | self._awaited.keys()))
                self._changed.wait(self._until_awaited_expire(remaining))
            waited = self._waited(started)
            if step in self._failed:
                raise self._failed[step]
            left_out = self._left_out.get(step, {}).get(key)
            if left_out is not None:
                raise left_out
            return PushOutcome(next_step=self._step, waited_s=waited, members=self._member_ids())

    def _maybe_apply(self) -> None:
        """Apply the pending step once every member has contributed (and, for the first
        step, once `replicas` have joined). Called under the lock."""
        if self._mode is None or self._mode.kind != SYNC or not self._pending.contributions \
                or self._closed:
            return
        # Every member's current incarnation: a retired one's gradient stands for no one.
        if not {(c, m.incarnation) for c, m in self._members.items()} <= self._pending.clients:
            return
        self._expire_awaited()
        if self._awaited:
            return  # members from before a restart: not back yet
        if not self._started and len(self._joined_before_start) < self._replicas \
                and self._members:
            return  # the first step: `replicas` clients have not all joined yet
        pending, self._pending = self._pending, _Step()
        targets = [total.held for total in pending.sums.values()]
        averages = [total.average() for total in pending.sums.values()]
        try:
            left_out = self._apply_average(list(pending.contributions.values()), targets,
                                           averages)
            self._applied += 1
            if left_out:
                self._left_out[self._step] = left_out
        except PSError as error:
            # Nothing of the step was applied: every contributor's push raises the error.
            self._failed[self._step] = error
            self._failed_keys[self._step] = frozenset(pending.contributions)
        except Exception as error:  # noqa: BLE001 - reported to the contributors, not lost
            log.exception("the averaged update of step %d failed", self._step)
            self._failed_keys[self._step] = frozenset(pending.contributions)
            self._failed[self._step] = PSError(f"the update of step {self._step} failed: "
                                               f"{type(error).__name__}; see the server log")
        for old in [s for s in self._failed if s < self._step - 64]:
            del self._failed[old]
            self._failed_keys.pop(old, None)
        for old in [s for s in self._left_out if s < self._step - 64]:
            del self._left_out[old]
        self._step += 1
        self._started = True
        self._stepped_yet = True
        self._changed.notify_all()

    # ---- shared ---------------------------------------------------------------------------

    def _member_ids(self) -> tuple[tuple[str, int], ...]:
        """members() with the lock held."""
        self._expire_awaited()
        return tuple(sorted({**self._awaited, **{c: m.incarnation
                                                 for c, m in self._members.items()}}.items()))

    def _until_awaited_expire(self, remaining: float) -> float:
        """How long a wait may last (expects the lock held): at most `remaining`, and no
        later than the end of the wait for members from before a restart (when it may let
        the steps go on)."""
        if self._awaited:
            return max(0.0, min(remaining, self._awaited_until - self._clock()))
        return remaining

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady("the server is stopping: retry against the server that comes back")

    def _member(self, client_id: str, incarnation: int) -> _Member:
        member = self._members.get(client_id)
        if member is None or member.incarnation != incarnation:
            raise FencedIncarnation(
                f"client {client_id!r} incarnation {incarnation} has not joined this "
                "server's steps (or left them, or was declared dead): JoinSteps first")
        return member

    def _timeout(self, step: int, waiting_for: list[str]) -> StepTimeout:
        # What became of the push that waited: a caller who sends it again as a new push
        # (not a retry under its sequence) must know it would count twice.
        kept = (f"this push stays in step {step} and counts when the step is applied"
                if self._mode is not None and self._mode.kind == SYNC else "this push was applied")
        return StepTimeout(
            f"waited {self._wait_s:g} s after step {step} ({self._mode}) for "
            f"{', '.join(sorted(waiting_for)) or 'other clients'} to catch up: a client that "
            "stopped without LeaveSteps is waited for until the coordinator declares it dead. "
            f"{kept.capitalize()}: pushed again, it would count twice")
