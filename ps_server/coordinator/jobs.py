"""The job on the coordinator: workers, tasks, epochs and metrics, as pure state.

Failure detection is a lease evaluated on read (`online_until = last heartbeat + timeout`):
every public method first reaps workers whose lease ran out, marking them dead with the time
and reason and putting their leased tasks back in the queue. Tests drive it with a FakeClock.
No grpc here.

Bounded by construction: no call scans every task or every worker the job ever had. The
pending tasks are a heap, epochs keep counters and running metric sums, and only the tasks
of the epochs not yet over are held (an epoch's tasks are dropped when it is over, and only
tasks that are done are dropped: an id that was issued and is not held is known to be done).
Leases and forgetting are heaps ordered by time, so reaping touches only members whose time
has come. What grows with the job is one EpochSummary per epoch.

An epoch is over when its training tasks are done and, if it is evaluated
(`JobSpec.evaluates`), its evaluation is done. Epochs are over in order, and reported so.
An epoch's evaluation measures exactly the parameters the epoch ended with: it is handed out
once every training task up to its epoch is done, and the next epoch starts as soon as it
has read them (`parameters_read`, from a worker evaluating a model without tables), or else
when it is done, so the other workers train on while one evaluates. An epoch that is not
evaluated does not hold up the next one: that one starts as soon as every training task of
it has been handed out, so that no worker waits for the last tasks of an epoch to finish.
Either way at most one epoch runs behind the current one: the epoch after waits for it.

Persistence: `export_state()` is the same bounded state as plain JSON values (the epochs
not over and their tasks, the tracked workers, one summary per epoch) and `restore_state()`
rebuilds it in a new process, so a restarted coordinator resumes the job instead of
restarting it.
Monotonic times do not survive a process: elapsed seconds are stored, and restored workers
start a fresh heartbeat lease (or forgetting delay) from the restoring clock's now.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from ps_common.clock import Clock
from ps_common.errors import FencedIncarnation, InvalidArgument, NotFound
from ps_common.job import JobSpec
from ps_common.progress import finite_or_none

log = logging.getLogger(__name__)

STATE_VERSION = 1  # of export_state()'s dict

# A task whose holder died this many times fails the job instead of killing more workers.
MAX_TASK_ATTEMPTS = 5


class JobState(enum.Enum):
    """NONE (no job: the coordinator only serves variables) is final.
    RUNNING -> DONE when every train and evaluation task of every epoch is done.
    RUNNING -> FAILED when a task lost MAX_TASK_ATTEMPTS holders."""

    NONE = "none"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class TaskState(enum.Enum):
    """PENDING -> LEASED (a live worker holds it) -> DONE (first completion report wins).
    LEASED -> PENDING when the holder dies or is fenced. DONE is final."""

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"


class WorkerState(enum.Enum):
    """ALIVE -> DEAD (missed heartbeats, replaced by a new incarnation, or reported that it
    cannot run the job) | DONE (told the job is over); DONE -> DEAD (reported a job error).
    A dead worker that registers again comes back ALIVE under a new incarnation. DEAD and
    DONE workers are forgotten `forget_after_s` after they stopped being ALIVE; a forgotten
    worker is unknown, and is told to re-register like any unknown one."""

    ALIVE = "alive"
    DEAD = "dead"
    DONE = "done"


@dataclass(frozen=True)
class Metrics:
    """What a task reports. `auc` is an evaluation's held-out AUC (None: the model gives no
    scores, or a training task); AUCs do not add up, so a sum of metrics has none."""

    loss_sum: float = 0.0
    examples: int = 0
    correct: int = 0
    steps: int = 0
    seconds: float = 0.0
    auc: float | None = None

    def __add__(self, other: "Metrics") -> "Metrics":
        return Metrics(self.loss_sum + other.loss_sum, self.examples + other.examples,
                       self.correct + other.correct, self.steps + other.steps,
                       self.seconds + other.seconds)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.examples if self.examples else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else float("nan")


@dataclass
class Task:
    task_id: int
    kind: str  # "train" | "evaluate"
    epoch: int  # 1-based
    index: int
    state: TaskState = TaskState.PENDING
    holder: tuple[str, int] | None = None
    attempts: int = 0
    metrics: Metrics | None = None
    # Who held it when a predecessor coordinator's state was saved (each predecessor's, over
    # several restarts): such a holder may have finished it since (its report went to the
    # predecessor), so its report is still taken.
    resumed_holders: tuple[tuple[str, int], ...] = ()
    # An evaluation: its holder has read the parameters it measures (the next epoch may
    # have started since).
    parameters_read: bool = False


@dataclass
class StepReport:
    """What the servers said about one worker incarnation's steps (ssp:K, sync); cumulative."""
    wait_s: float = 0.0
    staleness_max: int = 0
    dropped_stale: int = 0


@dataclass
class Worker:
    worker_id: str
    incarnation: int
    state: WorkerState
    last_heartbeat: float
    reason: str = ""
    died_at: float | None = None
    tasks_done: int = 0
    steps: int = 0
    leased: set[int] = field(default_factory=set)
    data_path: str = ""  # as the worker reports it: "shm", "grpc", "shm+grpc"
    wait_s: float = 0.0  # its pushes' waits for other workers (StepReport)
    last_lease: tuple[int, int] | None = None  # (lease_id, task_id) of its last task


@dataclass
class _OpenEpoch:
    """An epoch that is not over yet: its training tasks done, its evaluation's task id once
    that is handed out, and whether the evaluation is done (the epoch is then over once the
    one before it is)."""

    train_done: int = 0
    evaluation: int | None = None
    evaluated: bool = False


@dataclass(frozen=True)
class EpochSummary:
    epoch: int
    train: Metrics
    test: Metrics | None


class JobRunner:
    """Thread-safe: every public method holds one lock, and none of them scans all the tasks
    or all the workers the job ever had (see the module docstring). `job=None` means no job:
    workers are told there is nothing to run.

    `incarnations()` returns the next incarnation to hand out; it must increase strictly from
    call to call, since servers fence a worker's pushes by it. It is called with the lock held
    and must not call back into the runner. When None, incarnations count up from
    `first_incarnation` or else from the wall clock in ms.

    `on_worker_gone(worker_id, incarnation)` is called exactly once for every incarnation that
    stops being live: declared dead (missed heartbeats), replaced by a new incarnation,
    reported a job error, or told that the job is over (DONE). It is called after the lock is
    released (calls are collected under the lock), on the thread of whichever public method
    made the change, which may be a call from another worker or a status read (any call
    reaps); calls made by different threads are not ordered among themselves. It may call
    back into the runner. An exception it raises is logged and swallowed: the change is
    already made, and the caller that happened to trigger it must not fail for it.

    `on_epoch_done(summary, steps)` is called once for each epoch as it is over (never for
    epochs that were over before `restore_state`), with the epoch's EpochSummary (`test`
    None when it is not evaluated) and the job's training steps up to the end of that epoch
    (the sum of the epochs' steps; the next epoch may be under way: see the module
    docstring), in epoch order. Like on_worker_gone, it is called after the lock is released
    on the reporting thread, may call back into the runner, and an exception it raises is
    logged and swallowed.

    Dead and done workers are forgotten `forget_after_s` (default max(60, 6 x
    heartbeat_timeout_s)) after they stopped being live.

    A lease may wait for a task (`lease(..., wait_s=)`): at most `max_waiting_leases` at
    once, since each holds the caller's thread (an RPC handler's); past that, and after
    `stop_waiting()`, leases answer at once.
    """

    def __init__(self, job: JobSpec | None, clock: Clock, *, heartbeat_timeout_s: float,
                 first_incarnation: int | None = None,
                 incarnations: Callable[[], int] | None = None,
                 on_worker_gone: Callable[[str, int], None] | None = None,
                 forget_after_s: float | None = None,
                 on_epoch_done: Callable[[EpochSummary, int], None] | None = None,
                 max_waiting_leases: int = 0):
        if incarnations is not None and first_incarnation is not None:
            raise ValueError("give JobRunner either incarnations or first_incarnation, not both")
        if forget_after_s is None:
            forget_after_s = max(60.0, 6 * heartbeat_timeout_s)
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s {forget_after_s} must be > 0")
        self.job = job
        self._clock = clock
        self._timeout = heartbeat_timeout_s
        self._forget_after = forget_after_s
        self._on_worker_gone = on_worker_gone
        self._on_epoch_done = on_epoch_done
        self._lock = threading.Lock()
        # Waiting leases sleep on it, woken (_wake_leases) by what may end a wait: a task
        # pending, the job over, a worker gone. Not by every call: a waiting lease's own
        # look would wake the others, whose looks would wake it again.
        self._changed = threading.Condition(self._lock)
        self._max_waiting = max_waiting_leases
        self._waiting = 0
        self._waits_stopped = False
        self._changes = 0  # counts the _wake_leases calls
        self._workers: dict[str, Worker] = {}
        self._alive = 0
        # (deadline, sequence, worker) heaps; `sequence` breaks ties so that Workers are never
        # compared. `_expiries` holds one entry per live worker, its deadline as of when the
        # entry was pushed; a popped entry whose worker has sent a heartbeat since is pushed
        # again with the new deadline (lazy deletion: a heartbeat costs no heap operation).
        # `_forgets` holds one entry per incarnation that stopped being live.
        self._expiries: list[tuple[float, int, Worker]] = []
        self._forgets: list[tuple[float, int, Worker]] = []
        self._sequence = itertools.count()
        # (worker_id, incarnation) gone since the lock was taken; run once it is released.
        self._gone: list[tuple[str, int]] = []
        # (summary, steps) of epochs over since the lock was taken; likewise.
        self._epochs_over: list[tuple[EpochSummary, int]] = []
        # The tasks of the epochs not over yet (at most the current one and the one before);
        # `_issued` is the highest task id ever handed out.
        self._tasks: dict[int, Task] = {}
        self._issued = 0
        self._open: dict[int, _OpenEpoch] = {}  # the epochs not over yet, by number
        # The training steps of the epochs that are over.
        self._steps_through = 0
        # The current epoch's training tasks not handed out (PENDING).
        self._unleased = 0
        # The current epoch's evaluation has read its parameters or is done: the next epoch
        # may start (once the epoch before it is over).
        self._epoch_released = False
        # Every PENDING task exactly once, as (not an evaluation, task_id): evaluations first
        # (they measure an epoch that has just ended), then the oldest task.
        self._pending: list[tuple[bool, int]] = []
        self._tasks_done = 0
        self._steps = 0
        self._summaries: list[EpochSummary] = []
        # (worker_id, incarnation) -> its newest StepReport (kept after it dies: the job's
        # staleness and drops count every incarnation).
        self._step_reports: dict[tuple[str, int], StepReport] = {}
        if incarnations is None:
            # Servers fence a worker's pushes by incarnation, and they outlive a coordinator
            # restart: incarnations start from the wall clock (ms) so that a restarted
            # coordinator never hands out one lower than a server has already seen.
            counter = itertools.count(first_incarnation if first_incarnation is not None
                                      else time.time_ns() // 1_000_000)
            incarnations = counter.__next__
        self._incarnations = incarnations
        self._started_at = clock.monotonic()
        self._finished_at: float | None = None
        self.failure = ""
        # Whether a restart resumes the failed job (fail(resumable=True)): a failure that
        # servers added or a budget raised cures, unlike a model's error or lost values.
        self.resumable = False
        self.state = JobState.RUNNING if job else JobState.NONE
        self._epoch = 0
        if job:
            with self._lock:  # as everything that adds a task
                self._start_epoch(1)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock and reap first; on the way out (a raise included) release it, then
        make the on_worker_gone and on_epoch_done calls collected meanwhile."""
        gone: list[tuple[str, int]] = []
        over: list[tuple[EpochSummary, int]] = []
        try:
            with self._lock:
                try:
                    self._reap()
                    yield
                finally:
                    gone, self._gone = self._gone, []
                    over, self._epochs_over = self._epochs_over, []
        finally:
            for worker_id, incarnation in gone:
                self._notify_gone(worker_id, incarnation)
            for summary, steps in over:
                self._notify_epoch_done(summary, steps)

    def _notify_gone(self, worker_id: str, incarnation: int) -> None:
        if self._on_worker_gone is None:
            return
        try:
            self._on_worker_gone(worker_id, incarnation)
        except Exception:  # the change is made; see the class docstring
            log.exception("on_worker_gone(%r, %d) failed", worker_id, incarnation)

    def _notify_epoch_done(self, summary: EpochSummary, steps: int) -> None:
        if self._on_epoch_done is None:
            return
        try:
            self._on_epoch_done(summary, steps)
        except Exception:  # the change is made; see the class docstring
            log.exception("on_epoch_done(epoch %d) failed", summary.epoch)

    # ---- epochs and tasks (expect the lock held) --------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        # What is held of earlier epochs is what is not done of the one not over yet.
        self._tasks = {i: t for i, t in self._tasks.items() if t.state is not TaskState.DONE}
        self._epoch = epoch
        self._epoch_released = False
        self._open[epoch] = _OpenEpoch()
        self._unleased = self.job.tasks_per_epoch
        self._summaries.append(EpochSummary(epoch, Metrics(), None))
        for index in range(self.job.tasks_per_epoch):
            self._add_task("train", epoch, index)

    def _add_task(self, kind: str, epoch: int, index: int) -> int:
        self._issued += 1
        task_id = self._issued
        self._tasks[task_id] = Task(task_id, kind, epoch, index)
        heapq.heappush(self._pending, (kind != "evaluate", task_id))
        self._wake_leases()
        return task_id

    def _wake_leases(self) -> None:
        """Waiting leases look again: a task may be pending, the job over, or one of them
        fenced."""
        self._changes += 1
        self._changed.notify_all()

    def _record(self, task: Task, metrics: Metrics) -> None:
        """A task is done: count it and add its metrics to its epoch."""
        self._tasks_done += 1
        index = task.epoch - 1
        summary = self._summaries[index]
        if task.kind == "train":
            self._open[task.epoch].train_done += 1
            self._steps += metrics.steps
            self._summaries[index] = EpochSummary(summary.epoch, summary.train + metrics,
                                                  summary.test)
        else:
            self._open[task.epoch].evaluated = True
            self._summaries[index] = EpochSummary(summary.epoch, summary.train, metrics)

    def _advance(self) -> None:
        """After a task is done: the evaluations that are due are handed out, the epochs
        that are over end (in order: reported, their tasks dropped), and the next epoch
        starts or the job ends, as `_next_epoch` says. A job that is no longer running does
        not advance."""
        if self.state is not JobState.RUNNING:
            return
        per_epoch = self.job.tasks_per_epoch
        for epoch in sorted(self._open):  # at most two
            progress = self._open[epoch]
            if progress.train_done < per_epoch:
                break  # an evaluation waits for every training step up to its epoch
            if self.job.evaluates(epoch) and progress.evaluation is None \
                    and not progress.evaluated:
                progress.evaluation = self._add_task("evaluate", epoch, 0)
        for epoch in sorted(self._open):
            progress = self._open[epoch]
            if progress.train_done < per_epoch or (
                    self.job.evaluates(epoch) and not progress.evaluated):
                break
            del self._open[epoch]
            self._tasks = {i: t for i, t in self._tasks.items()
                           if t.epoch > epoch or t.state is not TaskState.DONE}
            summary = self._summaries[epoch - 1]
            self._steps_through += summary.train.steps
            self._epochs_over.append((summary, self._steps_through))
        self._next_epoch()

    def _next_epoch(self) -> None:
        """Start the next epoch once the current one lets it (its evaluation has read its
        parameters or is done; not evaluated: every training task of it is handed out) and
        the epoch before it is over; after the last epoch, end the job once every epoch is
        over."""
        if self._epoch in self._open:
            if len(self._open) > 1:
                return  # the epoch before is not over: at most one runs behind
            released = (self._epoch_released if self.job.evaluates(self._epoch)
                        else self._unleased == 0)
            if not released:
                return
        if self._epoch < self.job.epochs:
            self._start_epoch(self._epoch + 1)
        elif not self._open:
            self._finish(JobState.DONE)

    def _release(self, task: Task, reason: str = "") -> None:
        """The task back to the queue, its holder gone (for `reason`, if one was given):
        the job fails once it has lost MAX_TASK_ATTEMPTS holders, saying why the last went."""
        if task.kind == "train" and task.epoch == self._epoch:
            self._unleased += 1
        if task.kind == "evaluate" and task.parameters_read:
            if task.epoch < self._epoch:
                log.warning("the evaluation of epoch %d lost its worker after the next epoch "
                            "had started; it runs again, on the parameters of that moment "
                            "rather than those epoch %d ended with", task.epoch, task.epoch)
            else:  # the next epoch has not started: it waits for the next holder's read
                task.parameters_read = False
                self._epoch_released = False
        task.state, task.holder = TaskState.PENDING, None
        heapq.heappush(self._pending, (task.kind != "evaluate", task.task_id))
        self._wake_leases()
        if task.attempts >= MAX_TASK_ATTEMPTS and self.state is JobState.RUNNING:
            last = f"; the last one: {reason}" if reason else ""
            self._finish(JobState.FAILED, f"task {task.task_id} ({task.kind}, epoch {task.epoch})"
                                          f" lost {task.attempts} workers; giving up{last}")

    def _finish(self, state: JobState, failure: str = "") -> None:
        self.state, self.failure = state, failure
        self._finished_at = self._clock.monotonic()
        self._wake_leases()

    # ---- liveness (expect the lock held) ---------------------------------------------

    def _reap(self) -> None:
        """Declare dead the live workers whose lease ran out and forget the gone workers
        whose time has come. Only heap entries that are due are touched: each live worker
        is looked at about once per heartbeat timeout, each gone incarnation once."""
        now = self._clock.monotonic()
        while self._expiries and self._expiries[0][0] < now:
            _, _, worker = heapq.heappop(self._expiries)
            if worker.state is not WorkerState.ALIVE:
                continue  # gone meanwhile; its forgetting has its own entry
            deadline = worker.last_heartbeat + self._timeout
            if now > deadline:
                self._leave(worker, WorkerState.DEAD, now, f"no heartbeat for {self._timeout:g} s")
            else:
                self._schedule(self._expiries, deadline, worker)
        while self._forgets and self._forgets[0][0] < now:
            _, _, worker = heapq.heappop(self._forgets)
            # Only that incarnation: the id may have registered again since.
            if self._workers.get(worker.worker_id) is worker:
                del self._workers[worker.worker_id]

    def _schedule(self, heap: list, when: float, worker: Worker) -> None:
        heapq.heappush(heap, (when, next(self._sequence), worker))

    def _leave(self, worker: Worker, state: WorkerState, now: float, reason: str = "") -> None:
        """The worker becomes DEAD (releasing its tasks) or DONE. If it was live, this is
        the one moment its incarnation is gone: on_worker_gone is queued and its
        forgetting scheduled."""
        was_alive = worker.state is WorkerState.ALIVE
        worker.state = state
        self._wake_leases()  # it may be waiting for a task itself
        if state is WorkerState.DEAD:
            worker.reason, worker.died_at = reason, now
            for task_id in sorted(worker.leased):
                self._release(self._tasks[task_id], reason)
            worker.leased.clear()
        if was_alive:
            self._alive -= 1
            self._gone.append((worker.worker_id, worker.incarnation))
            self._schedule(self._forgets, now + self._forget_after, worker)

    def _current(self, worker_id: str, incarnation: int) -> Worker | None:
        """The worker if (worker_id, incarnation) is its live incarnation, else None."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.incarnation != incarnation or worker.state is WorkerState.DEAD:
            return None
        if worker.state is WorkerState.DONE and self.state is JobState.RUNNING:
            # It left, or was told the job was over before a resumed job ran again: it has
            # no heartbeat lease, so a task it took would be held for good. It registers anew.
            return None
        return worker

    @property
    def over(self) -> bool:
        return self.state in (JobState.DONE, JobState.FAILED)

    # ---- worker API --------------------------------------------------------------------

    def register_worker(self, worker_id: str) -> int:
        """A new incarnation for `worker_id`; an older live one is fenced (its tasks requeued)."""
        if not worker_id:
            raise InvalidArgument("RegisterWorker needs a worker_id")
        now = self._clock.monotonic()
        with self._locked():
            old = self._workers.get(worker_id)
            if old is not None and old.state is WorkerState.ALIVE:
                self._leave(old, WorkerState.DEAD, now,
                            f"replaced by a new incarnation of {worker_id}")
            incarnation = self._incarnations()
            worker = Worker(worker_id, incarnation, WorkerState.ALIVE, now)
            self._workers[worker_id] = worker
            self._alive += 1
            self._schedule(self._expiries, now + self._timeout, worker)
            return incarnation

    def heartbeat(self, worker_id: str, incarnation: int, data_path: str = "",
                  steps: StepReport | None = None) -> str:
        """'continue', 'reregister' (fenced, unknown or forgotten) or 'stop' (job over).
        `data_path`: how the worker's pulls and pushes travel; `steps`: what the servers
        said of its steps so far; both for status."""
        now = self._clock.monotonic()
        with self._locked():
            worker = self._current(worker_id, incarnation)
            if worker is None:
                return "reregister"
            worker.last_heartbeat = now
            if data_path:
                worker.data_path = data_path
            self._note_steps(worker, steps)
            if self.over or self.state is JobState.NONE:
                self._leave(worker, WorkerState.DONE, now)
                return "stop"
            return "continue"

    def lease(self, worker_id: str, incarnation: int, wait_s: float = 0.0, *,
              abandoned: Callable[[], bool] = lambda: False,
              lease_id: int = 0) -> tuple[str, Task | float | None]:
        """('task', task) | ('wait', None) | ('wait', 0.0) | ('done', None) |
        ('reregister', None).

        When no task is pending, the call waits up to `wait_s` seconds (real time, whatever
        the runner's clock) for one, for the job to end or for this incarnation to be
        fenced, and answers as it would then, except that a task pending after a wait is
        answered ('wait', 0.0): ask again at once (and get it, unless another worker was
        faster). ('wait', 0.0) also when the wait ran out; ('wait', None): it did not wait
        (`wait_s` 0, too many leases waiting already, or `stop_waiting()`), so the caller
        should pause first.
        A wait also ends, with ('wait', None), once `abandoned()` says the caller is gone
        (checked whenever the wait is woken: see `wake_waiting`).
        `lease_id` (0: none): the caller's number for this ask, the same on its retries. A
        retry of the ask that got this worker its last task gets that task again while it
        holds it: the answer was lost, and a second task would sit leased to a worker that
        never heard of it, alive and heartbeating, for good.
        """
        give_up_at = time.monotonic() + wait_s
        waited = False
        while True:
            with self._locked():
                now = self._clock.monotonic()
                worker = self._current(worker_id, incarnation)
                if worker is None:
                    return "reregister", None
                worker.last_heartbeat = now
                if self.state is not JobState.RUNNING:
                    self._leave(worker, WorkerState.DONE, now)
                    return "done", None
                if waited and abandoned():
                    return "wait", None
                if lease_id and worker.last_lease and worker.last_lease[0] == lease_id:
                    task = self._tasks.get(worker.last_lease[1])
                    if task is not None and task.state is TaskState.LEASED \
                            and task.holder == (worker_id, incarnation):
                        return "task", task
                # A resumed task its old holder reported done stays in the heap (and may
                # even have been dropped with its epoch since): skipped.
                while self._pending and getattr(self._tasks.get(self._pending[0][1]), "state",
                                                None) is not TaskState.PENDING:
                    heapq.heappop(self._pending)
                if self._pending and waited:
                    # Asked to ask again at once rather than given the task: a caller that
                    # stalled while its call waited (stopped, swapping, dying) must not hold
                    # the task for a heartbeat timeout; its next call shows it is alive.
                    return "wait", 0.0
                if self._pending:
                    _, task_id = heapq.heappop(self._pending)
                    task = self._tasks[task_id]
                    task.state, task.holder = TaskState.LEASED, (worker_id, incarnation)
                    task.attempts += 1
                    worker.leased.add(task_id)
                    worker.last_lease = (lease_id, task_id) if lease_id else None
                    if task.kind == "train" and task.epoch == self._epoch:
                        self._unleased -= 1
                        self._next_epoch()  # an epoch not evaluated is now all handed out
                    return "task", task
                if self._waits_stopped or (not waited and self._waiting >= self._max_waiting):
                    return "wait", None
                if give_up_at - time.monotonic() <= 0:
                    return "wait", (0.0 if waited else None)
                waited = True
                self._waiting += 1
                seen = self._changes  # a change from now on, even before the wait, ends it
            # The wait holds the bare lock, outside _locked(): the calls to on_worker_gone
            # and on_epoch_done that this lease's own reaping collected are made as it
            # lets go of the lock above, not when the wait ends.
            with self._lock:
                try:
                    while (self._changes == seen and not self._waits_stopped
                           and not abandoned()):
                        remaining = give_up_at - time.monotonic()
                        if remaining <= 0:
                            break
                        self._changed.wait(remaining)
                finally:
                    self._waiting -= 1

    @property
    def waiting_leases(self) -> int:
        """How many leases are waiting for a task now."""
        with self._lock:
            return self._waiting

    def wake_waiting(self) -> None:
        """Have every waiting lease look again (e.g. whether its caller is gone)."""
        with self._lock:
            self._changed.notify_all()

    def stop_waiting(self) -> None:
        """Wake every waiting lease (each answers as if its wait had run out) and answer
        every later lease at once: the coordinator is stopping."""
        with self._lock:
            self._waits_stopped = True
            self._changed.notify_all()

    def complete(self, worker_id: str, incarnation: int, task_id: int, metrics: Metrics,
                 data_path: str = "", steps: StepReport | None = None) -> bool:
        """Record a finished task; returns True for a duplicate report (nothing changes),
        including the report of a task of an epoch that has ended (its tasks are dropped).
        `data_path` as for heartbeat().

        Raises NotFound for a task id never issued and FencedIncarnation when
        the reporter no longer holds the task's lease (it was declared dead meanwhile).
        """
        with self._locked():
            task = self._tasks.get(task_id)
            if task is None:
                if 1 <= task_id <= self._issued:
                    return True  # dropped with its epoch, which ended: it was done
                raise NotFound(f"task {task_id} does not exist")
            if task.state is TaskState.DONE:
                return True
            if task.holder != (worker_id, incarnation) and (
                    worker_id, incarnation) in task.resumed_holders:
                # Held since before the coordinator restarted, and done: the first report
                # wins over a lease handed out again since.
                if task.holder is not None:
                    other = self._workers.get(task.holder[0])
                    if other is not None and other.incarnation == task.holder[1]:
                        other.leased.discard(task_id)
                task.holder = (worker_id, incarnation)
            if task.holder != (worker_id, incarnation):
                raise FencedIncarnation(
                    f"worker {worker_id!r} incarnation {incarnation} does not hold task "
                    f"{task_id} (its lease was revoked); register again")
            # The holder is that incarnation; after the job ended it may have been told so
            # and forgotten since, which loses only its own counters.
            worker = self._workers.get(worker_id)
            if worker is not None and worker.incarnation == incarnation:
                worker.leased.discard(task_id)
                worker.tasks_done += 1
                worker.steps += metrics.steps
                if data_path:
                    worker.data_path = data_path
                self._note_steps(worker, steps)
            if task.state is TaskState.PENDING and task.kind == "train" \
                    and task.epoch == self._epoch:
                self._unleased -= 1  # reported by its holder from before a restart
            task.state, task.holder, task.metrics = TaskState.DONE, None, metrics
            self._record(task, metrics)
            self._advance()
            return False

    def parameters_read(self, worker_id: str, incarnation: int, task_id: int) -> bool:
        """The holder of an evaluation has read the parameters it measures: the next epoch
        may start while it computes (see `_next_epoch`). Returns True if this call started
        it; False when it did not: a repeat, an evaluation done and dropped, the last epoch's,
        one that waits for an earlier evaluation (the epoch starts when that one is done), or
        one of an epoch that is over already (run again after its first holder was lost, it
        measures the parameters of its own time).

        Raises NotFound for a task id never issued, InvalidArgument for a training task and
        FencedIncarnation when the caller does not hold the evaluation (as `complete`)."""
        with self._locked():
            task = self._tasks.get(task_id)
            if task is None:
                if 1 <= task_id <= self._issued:
                    return False  # done, and dropped with its epoch
                raise NotFound(f"task {task_id} does not exist")
            if task.kind != "evaluate":
                raise InvalidArgument(f"task {task_id} is a training task: only an evaluation "
                                      "reads an epoch's parameters")
            if task.state is TaskState.DONE:
                return False
            if (worker_id, incarnation) not in (task.holder, *task.resumed_holders):
                raise FencedIncarnation(
                    f"worker {worker_id!r} incarnation {incarnation} does not hold task "
                    f"{task_id} (its lease was revoked); register again")
            if task.holder != (worker_id, incarnation):
                # Its holder from before the coordinator restarted: it gets the task back
                # unless another worker holds it now, whose own read then counts.
                worker = self._current(worker_id, incarnation)
                if task.state is not TaskState.PENDING or worker is None:
                    return False
                task.state, task.holder = TaskState.LEASED, (worker_id, incarnation)
                worker.leased.add(task_id)
            task.parameters_read = True
            if task.epoch != self._epoch or self._epoch_released \
                    or self.state is not JobState.RUNNING:
                return False
            self._epoch_released = True
            epoch = self._epoch
            self._next_epoch()
            return self._epoch != epoch

    def _note_steps(self, worker: Worker, steps: StepReport | None) -> None:
        """Keep the newest report of each incarnation (under the lock): the job's figures
        are the largest gap and the sum of drops over every incarnation that ever ran."""
        if steps is None:
            return
        worker.wait_s = steps.wait_s
        self._step_reports[(worker.worker_id, worker.incarnation)] = steps

    def report_job_error(self, worker_id: str, incarnation: int, message: str, *,
                         diverged: bool = False) -> bool:
        """A worker cannot run the job (data or model does not load). It is marked dead with
        the message as reason and its tasks go back. If no task has been done yet and no
        live worker is left, nobody has shown the job can run: it fails (one worker with a
        broken mount among healthy ones does not fail the job). `diverged`: the model's
        gradients are not finite, as every worker's would be from the same values: the job
        fails whatever its progress. Returns True if it failed."""
        now = self._clock.monotonic()
        with self._locked():
            worker = self._current(worker_id, incarnation)
            if worker is not None:
                self._leave(worker, WorkerState.DEAD, now, f"cannot run the job: {message}")
            if self.state is not JobState.RUNNING:
                return False
            if diverged:
                self._finish(JobState.FAILED, f"the model diverged on worker {worker_id}: "
                             f"{message}")
                return True
            if self._tasks_done == 0 and self._alive == 0:
                self._finish(JobState.FAILED, f"worker {worker_id} cannot run the job: {message}")
                return True
            return False

    def fail(self, message: str, *, resumable: bool = False) -> bool:
        """Fail a RUNNING job with `message` as its failure. Returns True if this call
        changed the state, False if the job was not running (no job, done or failed
        already). Workers learn it from their next lease or heartbeat. `resumable`: a
        coordinator restarted on this job's state resumes it (restore_state)."""
        with self._locked():
            if self.state is not JobState.RUNNING:
                return False
            self._finish(JobState.FAILED, message)
            self.resumable = resumable
            return True

    # ---- reads -------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """A consistent copy of everything status shows (plain values). Costs one row per
        tracked worker and one EpochSummary per epoch, whatever the number of tasks."""
        now = self._clock.monotonic()
        with self._locked():
            end = self._finished_at if self._finished_at is not None else now
            return {
                "state": self.state,
                "epoch": self._epoch,
                "epochs": self.job.epochs if self.job else 0,
                "tasks_done": self._tasks_done,
                "tasks_total": (self.job.epochs * self.job.tasks_per_epoch
                                + self.job.evaluations()) if self.job else 0,
                **self._current_epoch_tasks(),
                # Epochs are over in order: every one before the first not over is.
                "over_through": min(self._open) - 1 if self._open else self._epoch,
                "steps": self._steps,
                "elapsed_s": end - self._started_at,
                "metrics": list(self._summaries),
                "failure": self.failure,
                "mode": self.job.mode if self.job else "",
                "staleness_max": max((r.staleness_max for r in self._step_reports.values()),
                                     default=0),
                "dropped_stale_gradients": sum(r.dropped_stale
                                               for r in self._step_reports.values()),
                "workers": [
                    {**{k: getattr(w, k) for k in ("worker_id", "incarnation", "reason",
                                                   "tasks_done", "steps", "data_path",
                                                   "wait_s")},
                     "state": w.state.value, "heartbeat_age_s": now - w.last_heartbeat,
                     "died_at_s": (w.died_at - self._started_at) if w.died_at is not None else 0.0,
                     "leased_tasks": sorted(w.leased)}
                    for w in self._workers.values()
                ],
            }

    def _current_epoch_tasks(self) -> dict:
        """The current epoch's tasks (its training tasks and its evaluation, if any) and how
        many of them are done: what the progress bar shows."""
        if not self.job:
            return {"epoch_tasks": 0, "epoch_tasks_done": 0}
        total = self.job.tasks_per_epoch + self.job.evaluates(self._epoch)
        progress = self._open.get(self._epoch)
        if progress is None:  # over
            return {"epoch_tasks": total, "epoch_tasks_done": total}
        return {"epoch_tasks": total,
                "epoch_tasks_done": progress.train_done + progress.evaluated}

    def live_workers(self) -> int:
        with self._locked():
            return self._alive

    def tracked_tasks(self) -> int:
        """How many tasks the runner holds in memory (those of the epochs not over: at most
        the current one's and what is left of the one before)."""
        with self._locked():
            return len(self._tasks)

    def tracked_workers(self) -> int:
        """How many workers the runner holds in memory: the live ones and those gone less
        than `forget_after_s` ago."""
        with self._locked():
            return len(self._workers)

    def summary(self) -> dict:
        """The job's outcome as plain JSON-ready values (printed when the coordinator ends)."""
        snap = self.snapshot()
        last = snap["metrics"][-1] if snap["metrics"] else None

        # NaN (no examples, or a loss that overflowed) and infinities are not JSON: null.
        number = finite_or_none

        return {
            "state": snap["state"].value,
            "epochs": snap["epoch"],
            "steps": snap["steps"],
            "loss": number(last.train.mean_loss) if last else None,
            "accuracy": number(last.test.accuracy) if last and last.test else None,
            "test_loss": number(last.test.mean_loss) if last and last.test else None,
            "auc": number(last.test.auc) if last and last.test else None,
            "train_accuracy": number(last.train.accuracy) if last else None,
            "job_elapsed_s": round(snap["elapsed_s"], 3),
            "steps_per_s": round(snap["steps"] / snap["elapsed_s"], 1) if snap["elapsed_s"] else None,
            "workers_dead": [w["worker_id"] for w in snap["workers"] if w["state"] == "dead"],
            "data_paths": {w["worker_id"]: w["data_path"] for w in snap["workers"]
                           if w["data_path"]},
            "mode": snap["mode"],
            "staleness_max": snap["staleness_max"],
            "dropped_stale_gradients": snap["dropped_stale_gradients"],
            **({"failure": snap["failure"]} if snap["failure"] else {}),
        }

    # ---- persistence -------------------------------------------------------------------

    def export_state(self) -> dict:
        """Everything needed to resume the job, as plain JSON-ready values, taken under the
        lock (one consistent cut). Costs one row per current-epoch task, tracked worker and
        epoch. Times are seconds since the job started: monotonic clocks do not survive a
        restart."""
        with self._locked():
            now = self._clock.monotonic()
            end = self._finished_at if self._finished_at is not None else now
            return {
                "version": STATE_VERSION,
                "job": self.job.to_json() if self.job else None,
                "state": self.state.value,
                "failure": self.failure,
                "resumable": self.resumable,
                "epoch": self._epoch,
                "issued": self._issued,
                "open_epochs": [{"epoch": epoch, "train_done": p.train_done,
                                 "evaluation": p.evaluation, "evaluated": p.evaluated}
                                for epoch, p in sorted(self._open.items())],
                "epoch_released": self._epoch_released,
                "tasks_done": self._tasks_done,
                "steps": self._steps,
                "elapsed_s": end - self._started_at,
                "finished": self._finished_at is not None,
                "tasks": [{"task_id": t.task_id, "kind": t.kind, "epoch": t.epoch,
                           "index": t.index, "state": t.state.value,
                           "holder": list(t.holder) if t.holder else None,
                           # A coordinator restarted again still takes that holder's report.
                           "resumed_holders": [list(h) for h in t.resumed_holders],
                           "attempts": t.attempts,
                           "metrics": asdict(t.metrics) if t.metrics else None,
                           "parameters_read": t.parameters_read}
                          for t in self._tasks.values()],
                "summaries": [{"epoch": s.epoch, "train": asdict(s.train),
                               "test": asdict(s.test) if s.test else None}
                              for s in self._summaries],
                # Every incarnation's, the gone ones' too: the job's staleness and drops.
                "step_reports": [{"worker_id": worker_id, "incarnation": incarnation,
                                  **asdict(report)}
                                 for (worker_id, incarnation), report
                                 in self._step_reports.items()],
                "workers": [{"worker_id": w.worker_id, "incarnation": w.incarnation,
                             "state": w.state.value, "reason": w.reason,
                             "died_at_s": (w.died_at - self._started_at
                                           if w.died_at is not None else None),
                             "tasks_done": w.tasks_done, "steps": w.steps,
                             "leased": sorted(w.leased),
                             "last_lease": list(w.last_lease) if w.last_lease else None,
                             "data_path": w.data_path, "wait_s": w.wait_s}
                            for w in self._workers.values()],
            }

    def restore_state(self, state: dict) -> None:
        """Rebuild the job from `export_state()`'s dict (JSON round-tripped or not). Call it on
        a fresh runner built with the same JobSpec, before any worker talks to it.

        Live workers get a full heartbeat lease from now, so one that never comes back is
        declared dead after the timeout and its tasks go back to the queue; dead and done
        workers are forgotten `forget_after_s` from now. Incarnations are not restored: the
        `incarnations` source must already hand out numbers above the restored ones (the
        coordinator's are generation-based). Raises ValueError for another version or job
        or a malformed state (the runner is then unchanged), and RuntimeError on a runner
        that has already been used."""
        if not isinstance(state, dict):  # ValueError: callers treat any bad state alike
            raise ValueError(  # noqa: TRY004
                f"malformed job state: a {type(state).__name__}, not a dict")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"job state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}: cannot restore it")
        if state.get("job") != (self.job.to_json() if self.job else None):
            raise ValueError("the saved job state is for a different job than this "
                             "coordinator's: " + str(state.get("job")))
        try:  # parse everything before changing anything
            tasks = {t["task_id"]: Task(t["task_id"], t["kind"], t["epoch"], t["index"],
                                        TaskState(t["state"]),
                                        tuple(t["holder"]) if t["holder"] else None,
                                        t["attempts"],
                                        Metrics(**t["metrics"]) if t["metrics"] else None,
                                        resumed_holders=tuple(
                                            tuple(h) for h in t.get("resumed_holders", ())),
                                        parameters_read=bool(t.get("parameters_read", False)))
                     for t in state["tasks"]}
            summaries = [EpochSummary(s["epoch"], Metrics(**s["train"]),
                                      Metrics(**s["test"]) if s["test"] else None)
                         for s in state["summaries"]]
            workers = [(Worker(w["worker_id"], w["incarnation"], WorkerState(w["state"]), 0.0,
                               w["reason"], None, w["tasks_done"], w["steps"], set(w["leased"]),
                               last_lease=(tuple(w["last_lease"]) if w.get("last_lease")
                                           else None),
                               data_path=str(w.get("data_path", "")),
                               wait_s=float(w.get("wait_s", 0.0))),
                        w["died_at_s"]) for w in state["workers"]]
            # (a state saved before they were kept has none: live workers report again)
            step_reports = {(r["worker_id"], int(r["incarnation"])): StepReport(
                                float(r["wait_s"]), int(r["staleness_max"]),
                                int(r["dropped_stale"]))
                            for r in state.get("step_reports", [])}
            job_state, failure = JobState(state["state"]), state["failure"]
            resuming = job_state is JobState.FAILED and bool(state.get("resumable", False))
            counters = [state[k] for k in ("epoch", "issued", "tasks_done", "steps")]
            if "open_epochs" in state:
                open_epochs = {o["epoch"]: _OpenEpoch(o["train_done"], o["evaluation"],
                                                      bool(o["evaluated"]))
                               for o in state["open_epochs"]}
            else:
                open_epochs = self._open_epochs_of_old_state(state, tasks, summaries)
            for progress in open_epochs.values():
                if progress.evaluation is not None and not progress.evaluated \
                        and progress.evaluation not in tasks:
                    raise ValueError(f"evaluation task {progress.evaluation} is not held")
            elapsed, finished = float(state["elapsed_s"]), bool(state["finished"])
            # Saved before evaluations ran beside the next epoch: the epoch waited for them.
            released = bool(state.get("epoch_released", False))
            for worker, _ in workers:  # a release would look these tasks up
                if any(tasks[i].holder != (worker.worker_id, worker.incarnation)
                       for i in worker.leased):
                    raise ValueError(f"worker {worker.worker_id} leases a task it does not hold")
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed job state: {type(error).__name__}: {error}") from error
        with self._locked():
            if self._workers or self._tasks_done:
                raise RuntimeError("restore_state needs a runner no worker has talked to")
            now = self._clock.monotonic()
            self.state, self.failure = job_state, failure
            if resuming:
                # A failure a restart answers (servers added, a budget raised): the job
                # goes on, each task's holders counted afresh.
                log.warning("resuming the job, which had failed: %s", failure)
                self.state, self.failure, finished = JobState.RUNNING, "", False
                for task in tasks.values():
                    task.attempts = 0
            self._epoch, self._issued, self._tasks_done, self._steps = counters
            self._epoch_released = released
            self._open = open_epochs
            # Epochs over before the restart are not reported again.
            self._steps_through = sum(s.train.steps for s in summaries
                                      if s.epoch not in open_epochs)
            # Elapsed time goes on from where it was (and stays put for a finished job).
            self._started_at = now - elapsed
            self._finished_at = now if finished else None
            self._summaries, self._tasks = summaries, tasks
            self._step_reports = step_reports
            # A lease is not resumed: its holder may have finished the task with the
            # predecessor (the state saved lags a little) and will never report it again,
            # so it is handed out again; a late report from that holder still counts.
            for task in tasks.values():
                if task.kind == "evaluate" and task.state is not TaskState.DONE \
                        and task.parameters_read:
                    if task.epoch < self._epoch:
                        log.warning(
                            "the evaluation of epoch %d is handed out again after the "
                            "restart; unless its worker reports it first, it measures the "
                            "parameters of that moment rather than those epoch %d ended "
                            "with", task.epoch, task.epoch)
                    else:  # the next epoch has not started: it waits for a read again
                        task.parameters_read = False
                        self._epoch_released = False
                if task.state is TaskState.LEASED:
                    if task.holder not in task.resumed_holders:
                        task.resumed_holders += (task.holder,)
                    task.state, task.holder = TaskState.PENDING, None
                    # The restart ended this lease, not a lost worker: it is no attempt
                    # of the MAX_TASK_ATTEMPTS (the next lease counts as one again).
                    task.attempts = max(0, task.attempts - 1)
            for worker, _ in workers:
                worker.leased = set()
            self._pending = [(t.kind != "evaluate", t.task_id) for t in tasks.values()
                             if t.state is TaskState.PENDING]
            heapq.heapify(self._pending)
            self._unleased = sum(t.kind == "train" and t.epoch == self._epoch
                                 and t.state is TaskState.PENDING for t in tasks.values())
            self._expiries, self._forgets, self._workers = [], [], {}
            for worker, died_at_s in workers:
                worker.last_heartbeat = now
                worker.died_at = self._started_at + died_at_s if died_at_s is not None else None
                self._workers[worker.worker_id] = worker
                if worker.state is WorkerState.ALIVE:
                    self._schedule(self._expiries, now + self._timeout, worker)
                else:
                    self._schedule(self._forgets, now + self._forget_after, worker)
            self._alive = sum(w.state is WorkerState.ALIVE for w in self._workers.values())
            if resuming:
                # Completions reported after the failure did not advance the job: an epoch
                # they finished ends now.
                self._advance()

    def _open_epochs_of_old_state(self, state: dict, tasks: dict[int, Task],
                                  summaries: list[EpochSummary]) -> dict[int, _OpenEpoch]:
        """The epochs not over in a state saved before epochs could run behind one another
        (every epoch evaluated): those from the first epoch not evaluated yet on, each
        evaluated epoch among them done but held back behind it. The current epoch's
        training tasks done were a count of their own; an earlier one's were all done."""
        first = next((s.epoch for s in summaries if s.test is None), None)
        if first is None:
            return {}
        evaluations = {t.epoch: t.task_id for t in tasks.values() if t.kind == "evaluate"}
        current = state["epoch"]
        return {epoch: _OpenEpoch(
                    int(state["train_done"]) if epoch == current else self.job.tasks_per_epoch,
                    evaluations.get(epoch), summaries[epoch - 1].test is not None)
                for epoch in range(first, current + 1)}
