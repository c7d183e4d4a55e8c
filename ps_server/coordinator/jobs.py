"""The job on the coordinator: workers, tasks, epochs and metrics, as pure state.

Failure detection is a lease evaluated on read (`online_until = last heartbeat + timeout`):
every public method first reaps workers whose lease ran out, marking them dead with the time
and reason and putting their leased tasks back in the queue. Tests drive it with a FakeClock.
No grpc here.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from ps_common.clock import Clock
from ps_common.errors import FencedIncarnation, InvalidArgument, NotFound
from ps_common.job import JobSpec

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
    """ALIVE -> DEAD (missed heartbeats) | DONE (told the job is over). A dead worker that
    registers again comes back ALIVE under a new incarnation."""

    ALIVE = "alive"
    DEAD = "dead"
    DONE = "done"


@dataclass(frozen=True)
class Metrics:
    loss_sum: float = 0.0
    examples: int = 0
    correct: int = 0
    steps: int = 0
    seconds: float = 0.0

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


@dataclass(frozen=True)
class EpochSummary:
    epoch: int
    train: Metrics
    test: Metrics | None


class JobRunner:
    """Thread-safe. `job=None` means no job: workers are told there is nothing to run."""

    def __init__(self, job: JobSpec | None, clock: Clock, *, heartbeat_timeout_s: float,
                 first_incarnation: int | None = None):
        self.job = job
        self._clock = clock
        self._timeout = heartbeat_timeout_s
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}
        self._tasks: dict[int, Task] = {}
        # Servers fence a worker's pushes by incarnation, and they outlive a coordinator
        # restart: incarnations start from the wall clock (ms) so that a restarted
        # coordinator never hands out one lower than a server has already seen.
        self._next_incarnation = (first_incarnation if first_incarnation is not None
                                  else time.time_ns() // 1_000_000)
        self._started_at = clock.monotonic()
        self._finished_at: float | None = None
        self.failure = ""
        self.state = JobState.RUNNING if job else JobState.NONE
        self._epoch = 0
        if job:
            self._start_epoch(1)

    # ---- epochs and tasks (expect the lock held) --------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        for index in range(self.job.tasks_per_epoch):
            self._add_task("train", epoch, index)

    def _add_task(self, kind: str, epoch: int, index: int) -> None:
        task_id = len(self._tasks) + 1
        self._tasks[task_id] = Task(task_id, kind, epoch, index)

    def _epoch_tasks(self, epoch: int, kind: str) -> list[Task]:
        return [t for t in self._tasks.values() if t.epoch == epoch and t.kind == kind]

    def _advance(self) -> None:
        """After an epoch's last training task: its evaluation task. After that evaluation:
        the next epoch, or the end of the job. The next epoch waits for the evaluation so
        that it measures exactly the parameters the epoch ended with (evaluating the small
        held-out set takes far less than a training task)."""
        evaluations = self._epoch_tasks(self._epoch, "evaluate")
        if not evaluations:
            if all(t.state is TaskState.DONE for t in self._epoch_tasks(self._epoch, "train")):
                self._add_task("evaluate", self._epoch, 0)
        elif evaluations[0].state is TaskState.DONE:
            if self._epoch < self.job.epochs:
                self._start_epoch(self._epoch + 1)
            else:
                self.state = JobState.DONE
                self._finished_at = self._clock.monotonic()

    def _release(self, task: Task) -> None:
        task.state, task.holder = TaskState.PENDING, None
        if task.attempts >= MAX_TASK_ATTEMPTS and self.state is JobState.RUNNING:
            self.state = JobState.FAILED
            self._finished_at = self._clock.monotonic()
            self.failure = (f"task {task.task_id} ({task.kind}, epoch {task.epoch}) lost "
                            f"{task.attempts} workers; giving up")

    # ---- liveness ----------------------------------------------------------------------

    def _reap(self) -> None:
        now = self._clock.monotonic()
        for worker in self._workers.values():
            if worker.state is WorkerState.ALIVE and now > worker.last_heartbeat + self._timeout:
                self._mark_dead(worker, now, f"no heartbeat for {self._timeout:g} s")

    def _mark_dead(self, worker: Worker, now: float, reason: str) -> None:
        worker.state, worker.reason, worker.died_at = WorkerState.DEAD, reason, now
        for task_id in sorted(worker.leased):
            self._release(self._tasks[task_id])
        worker.leased.clear()

    def _current(self, worker_id: str, incarnation: int) -> Worker | None:
        """The worker if (worker_id, incarnation) is its live incarnation, else None."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.incarnation != incarnation or worker.state is WorkerState.DEAD:
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
        with self._lock:
            self._reap()
            old = self._workers.get(worker_id)
            if old is not None and old.state is WorkerState.ALIVE:
                self._mark_dead(old, now, f"replaced by a new incarnation of {worker_id}")
            incarnation = self._next_incarnation
            self._next_incarnation += 1
            self._workers[worker_id] = Worker(worker_id, incarnation, WorkerState.ALIVE, now)
            return incarnation

    def heartbeat(self, worker_id: str, incarnation: int) -> str:
        """'continue', 'reregister' (fenced or unknown) or 'stop' (job over)."""
        now = self._clock.monotonic()
        with self._lock:
            self._reap()
            worker = self._current(worker_id, incarnation)
            if worker is None:
                return "reregister"
            worker.last_heartbeat = now
            if self.over or self.state is JobState.NONE:
                worker.state = WorkerState.DONE
                return "stop"
            return "continue"

    def lease(self, worker_id: str, incarnation: int) -> tuple[str, Task | None]:
        """('task', task) | ('wait', None) | ('done', None) | ('reregister', None)."""
        now = self._clock.monotonic()
        with self._lock:
            self._reap()
            worker = self._current(worker_id, incarnation)
            if worker is None:
                return "reregister", None
            worker.last_heartbeat = now
            if self.state is not JobState.RUNNING:
                worker.state = WorkerState.DONE
                return "done", None
            pending = [t for t in self._tasks.values() if t.state is TaskState.PENDING]
            if not pending:
                return "wait", None
            # Evaluations first: they measure an epoch that has just ended.
            task = min(pending, key=lambda t: (t.kind != "evaluate", t.task_id))
            task.state, task.holder = TaskState.LEASED, (worker_id, incarnation)
            task.attempts += 1
            worker.leased.add(task.task_id)
            return "task", task

    def complete(self, worker_id: str, incarnation: int, task_id: int, metrics: Metrics) -> bool:
        """Record a finished task; returns True for a duplicate report (nothing changes).

        Raises NotFound for an unknown task and FencedIncarnation when
        the reporter no longer holds the task's lease (it was declared dead meanwhile).
        """
        with self._lock:
            self._reap()
            task = self._tasks.get(task_id)
            if task is None:
                raise NotFound(f"task {task_id} does not exist")
            if task.state is TaskState.DONE:
                return True
            if task.holder != (worker_id, incarnation):
                raise FencedIncarnation(
                    f"worker {worker_id!r} incarnation {incarnation} does not hold task "
                    f"{task_id} (its lease was revoked); register again")
            worker = self._workers[worker_id]
            worker.leased.discard(task_id)
            worker.tasks_done += 1
            worker.steps += metrics.steps
            task.state, task.holder, task.metrics = TaskState.DONE, None, metrics
            self._advance()
            return False

    def report_job_error(self, worker_id: str, incarnation: int, message: str) -> bool:
        """A worker cannot run the job (data or model does not load). It is marked dead with
        the message as reason and its tasks go back. If no task has been done yet and no
        live worker is left, nobody has shown the job can run: it fails (one worker with a
        broken mount among healthy ones does not fail the job). Returns True if it failed."""
        now = self._clock.monotonic()
        with self._lock:
            self._reap()
            worker = self._current(worker_id, incarnation)
            if worker is not None:
                self._mark_dead(worker, now, f"cannot run the job: {message}")
            progressed = any(t.state is TaskState.DONE for t in self._tasks.values())
            others = any(w.state is WorkerState.ALIVE for w in self._workers.values())
            if self.state is JobState.RUNNING and not progressed and not others:
                self.state = JobState.FAILED
                self._finished_at = now
                self.failure = f"worker {worker_id} cannot run the job: {message}"
                return True
            return False

    # ---- reads -------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """A consistent copy of everything status shows (plain values)."""
        now = self._clock.monotonic()
        with self._lock:
            self._reap()
            done = [t for t in self._tasks.values() if t.state is TaskState.DONE]
            epochs = []
            for epoch in range(1, self._epoch + 1):
                train = [t.metrics for t in self._epoch_tasks(epoch, "train") if t.metrics]
                test = [t.metrics for t in self._epoch_tasks(epoch, "evaluate") if t.metrics]
                epochs.append(EpochSummary(epoch, sum(train, Metrics()),
                                           test[0] if test else None))
            end = self._finished_at if self._finished_at is not None else now
            return {
                "state": self.state,
                "epoch": self._epoch,
                "epochs": self.job.epochs if self.job else 0,
                "tasks_done": len(done),
                "tasks_total": self.job.epochs * (self.job.tasks_per_epoch + 1) if self.job else 0,
                "steps": sum(t.metrics.steps for t in done if t.kind == "train"),
                "elapsed_s": end - self._started_at,
                "metrics": epochs,
                "failure": self.failure,
                "workers": [
                    {**{k: getattr(w, k) for k in ("worker_id", "incarnation", "reason",
                                                   "tasks_done", "steps")},
                     "state": w.state.value, "heartbeat_age_s": now - w.last_heartbeat,
                     "died_at_s": (w.died_at - self._started_at) if w.died_at is not None else 0.0,
                     "leased_tasks": sorted(w.leased)}
                    for w in self._workers.values()
                ],
            }

    def live_workers(self) -> int:
        with self._lock:
            self._reap()
            return sum(w.state is WorkerState.ALIVE for w in self._workers.values())

    def summary(self) -> dict:
        """The job's outcome as plain JSON-ready values (printed when the coordinator ends)."""
        snap = self.snapshot()
        last = snap["metrics"][-1] if snap["metrics"] else None

        def number(value):
            return None if value is None or value != value else value  # NaN -> None

        return {
            "state": snap["state"].value,
            "epochs": snap["epoch"],
            "steps": snap["steps"],
            "loss": number(last.train.mean_loss) if last else None,
            "accuracy": number(last.test.accuracy) if last and last.test else None,
            "test_loss": number(last.test.mean_loss) if last and last.test else None,
            "train_accuracy": number(last.train.accuracy) if last else None,
            "job_elapsed_s": round(snap["elapsed_s"], 3),
            "steps_per_s": round(snap["steps"] / snap["elapsed_s"], 1) if snap["elapsed_s"] else None,
            "workers_dead": [w["worker_id"] for w in snap["workers"] if w["state"] == "dead"],
            **({"failure": snap["failure"]} if snap["failure"] else {}),
        }
