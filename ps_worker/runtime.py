"""The worker runtime: register, fetch the job, lease tasks, train, report; survive fencing.

A worker holds nothing that must survive: if it dies, the coordinator notices the missed
heartbeats and hands its task to another worker. Task semantics are at-least-once (a task
whose worker died after pushing some gradients is run again, as in TF's
ParameterServerStrategy); pushes within a task are exactly-once.

The step loop overlaps communication and compute: a step's push goes out in the background
(bounded window) and brings back the values of the step after next (`PSClient.push_pull`:
one call per server), which travel while the next step computes; a model's table rows are
prefetched a step ahead. Pulled bytes land in reusable host buffers (pinned on a GPU) and
move to the device asynchronously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import numpy as np

from ps_common.consistency import SYNC, parse_mode
from ps_common.errors import FENCED_INCARNATION, NON_FINITE_GRADIENT, InvalidArgument
from ps_common.job import JobSpec
from ps_common.rows import check_ids, dedup
from ps_common.rpc import READ_RETRY_CODES, RetryPolicy
from ps_common.shardmap import Component, VariableSpec
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_worker.backend import ArrayBackend, select_backend
from ps_worker.client import PSClient
from ps_worker.coordinator_client import (
    CoordinatorClient, CoordinatorUnreachable, LeasedTask, LeaseRevoked,
)
from ps_worker.data import Dataset, iter_batches, load_dataset, task_indices
from ps_worker.metrics import held_out_auc
from ps_worker.models import EmbeddingDef, build_model

log = logging.getLogger("ps-worker")


# A worker waits for a parameter server that is away for as long as it takes, with one log
# line: the coordinator decides when the job gives up on the server (--server-timeout; the
# heartbeat then answers STOP), and SIGTERM ends the wait too (both interrupt the PSClient).
# A worker's calls to servers wait out an outage, and a deadline passed: a stepped push that
# waited its longest for a straggler (ssp:K, sync) waits again, under its sequence (counted
# once), until the straggler comes or the coordinator declares it dead.
SERVER_OUTAGE_RETRY = RetryPolicy(max_attempts=None, initial_backoff_s=0.05, max_backoff_s=2.0,
                                  retry_codes=READ_RETRY_CODES)
# With nothing to run (the epoch's last tasks run elsewhere), a worker's lease waits at the
# coordinator up to this long for a task, and starts it the moment it is pending.
LEASE_WAIT_S = 1.0


class JobCannotRun(ValueError):
    """The job's data or model does not load on this worker (reported to the coordinator)."""

    def __init__(self, message: str, *, job_failed: bool):
        super().__init__(message)
        self.job_failed = job_failed


class Fenced(Exception):
    """This incarnation was declared dead; the worker registers again."""


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str
    device: str = "auto"
    # This worker's index among the workers of its host (--local-rank): `auto` and `cuda`
    # then use GPU local_rank mod the GPUs visible, so that workers spread over the GPUs.
    local_rank: int | None = None
    worker_id: str | None = None
    # How long the coordinator may stay unreachable (at start, or during training) before
    # the worker gives up with an error naming its address.
    coordinator_timeout_s: float = 30.0
    # Where `coordinator` came from (a flag, TF_CONFIG): what that error tells one to check.
    coordinator_from: str = "--coordinator"
    max_in_flight_pushes: int = 2
    # Pull and push through shared memory with servers on this host that offer it (and the
    # job allows it); False: gRPC only (--no-shm).
    shared_memory: bool = True
    # Seconds slept in every training step (--step-delay): a slow worker, for demos and tests.
    step_delay_s: float = 0.0
    # The cluster's token, on every call (ps_common.auth); kept out of the repr: a secret.
    token: str | None = dataclasses.field(default=None, repr=False)
    # Call the cluster over TLS (ps_common.tls); None: plaintext.
    tls: TLS | None = None


@dataclass
class TaskResult:
    loss_sum: float = 0.0
    examples: int = 0
    correct: int = 0
    steps: int = 0
    seconds: float = 0.0
    # Held-out ROC AUC of an evaluation, for a model that gives scores of binary labels.
    auc: float | None = None


# Test examples per evaluation batch; a model with tables pulls the rows of each batch, so
# it takes bigger batches (fewer calls; 4096 x 12 fields of 8 floats is 1.5 MiB of rows).
EVAL_BATCH = 1024
EVAL_BATCH_WITH_TABLES = 4096


def model_tables(model) -> list[EmbeddingDef]:
    """The model's embedding tables (none for a model without ``tables()``)."""
    tables = getattr(model, "tables", None)
    return list(tables()) if callable(tables) else []


def variable_specs(model, job: JobSpec) -> list[VariableSpec]:
    """The model's variables as the servers hold them, with the job's optimizer; then its
    embedding tables, each with its own optimizer if it names one, else the job's."""
    optimizer = Component.of({"name": job.optimizer, "lr": job.lr})
    specs = [
        VariableSpec(name=v.name, shape=tuple(v.shape), dtype="float32",
                     initializer=Component.of(v.init_spec()), optimizer=optimizer,
                     seed=job.seed + v.seed)
        for v in model.variables()
    ]
    for table in model_tables(model):
        override = table.optimizer_spec()
        specs.append(VariableSpec(
            name=table.name, shape=table.shape, dtype="float32",
            initializer=Component.of(table.init_spec()),
            optimizer=optimizer if override is None else Component.of(override),
            seed=job.seed + table.seed, kind="embedding", capacity=table.capacity,
            ttl_seconds=float(table.ttl_seconds)))
    return specs


class _RowPull:
    """The rows of one batch being pulled: per table, its distinct ids, where each of the
    batch's ids is among them (`inverse`), and the future of their rows (on the host)."""

    def __init__(self, ids: dict[str, np.ndarray], inverse: dict[str, np.ndarray],
                 futures: dict[str, Future]):
        self.ids = ids
        self.inverse = inverse
        self.futures = futures

    def result(self) -> dict[str, np.ndarray]:
        return {name: future.result() for name, future in self.futures.items()}

    def wait(self) -> None:
        """Until no pull writes into a buffer any more (errors are moot here)."""
        futures_wait(list(self.futures.values()))


_NO_ROWS = _RowPull({}, {}, {})


def _fenced(error: RemoteError) -> bool:
    """Whether a server refused this incarnation (the coordinator declared it gone, or a
    newer one of this worker replaced it). A server names that reason; one from before
    reasons says FAILED_PRECONDITION with the incarnation in its message."""
    if error.target == "client":
        return False  # the client's own refusal is no server's fence
    if error.reason:
        return error.reason == FENCED_INCARNATION
    return error.code().name == "FAILED_PRECONDITION" and "incarnation" in error.details()


def _pause(seconds: float, should_stop) -> None:
    """Sleep `seconds`, or less once `should_stop()` (a SIGTERM, say) says so: it is asked
    every 50 ms."""
    end = time.monotonic() + seconds
    while not should_stop():
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


class Trainer:
    """Runs tasks of one job against one PSClient. Not thread-safe: one per worker.

    A model with embedding tables (``ps_worker.models.base``) has, each step, its dense
    variables pulled whole and the rows its batch needs pulled by id, into reusable host
    buffers ahead of time (see `_train`). Dense gradients go out with ``push_pull_async``
    (``push_async`` near a task's end), each table's with ``push_rows_async`` (the same
    in-flight window); ``flush`` ends a task once all of them have landed. Evaluation
    pulls the rows of each test batch.

    `observer` (None: nothing is measured) is told after every training step how long the
    step waited for its pulled values and for its pushes: `observer.step(pull_wait_s,
    push_wait_s)` (ps_worker.telemetry).
    """

    def __init__(self, job: JobSpec, dataset: Dataset, model, backend: ArrayBackend,
                 push_window: int = 2, step_delay_s: float = 0.0, observer=None):
        self.job = job
        self.observer = observer
        self.push_window = push_window
        self.step_delay_s = step_delay_s
        self.dataset = dataset
        self.model = model
        self.backend = backend
        self.specs = variable_specs(model, job)
        self.tables = {t.name: t for t in model_tables(model)}
        # What a step pulls whole: every variable but the tables.
        self.dense_specs = [s for s in self.specs if s.name not in self.tables]
        self.names = [s.name for s in self.dense_specs]
        self._row_capacity: dict[str, int] = {}
        # GPU gradient buffers: the pushes that read each ring slot (see _reuse_slot).
        self._slot_pushes: dict[int, list[Future]] = {}
        # When the trainer entered the model's or the device's code (None: it is not in
        # it): read by another thread (in_model_s) to tell a hung step.
        self._in_model_since: float | None = None

    @contextlib.contextmanager
    def _in_model(self):
        """The code inside runs the model or the device, whose time paramserve does not
        bound (its own calls have deadlines and retries that do)."""
        self._in_model_since = time.monotonic()
        try:
            yield
        finally:
            self._in_model_since = None

    def in_model_s(self) -> float:
        """How long the trainer has been in the model's or the device's code without a
        break (0 when it is not): a training step that hung shows here. Thread-safe."""
        since = self._in_model_since
        return 0.0 if since is None else time.monotonic() - since

    def _buffers(self, slot: int) -> dict[str, np.ndarray]:
        return {s.name: self.backend.host_buffer(f"{s.name}#{slot}", s.shape, np.float32)
                for s in self.dense_specs}

    def _row_buffer(self, table: str, slot: int, rows: int, kind: str = "rows") -> np.ndarray:
        """A reusable host buffer for `rows` rows of `table` (its rows, or with kind "grad"
        their gradients): the first rows of one that only grows, so that a task's shorter
        last batch (and a batch with fewer distinct ids) reuses it too."""
        capacity = max(rows, self._row_capacity.get(table, 0))
        self._row_capacity[table] = capacity
        buffer = self.backend.host_buffer(f"{table}/{kind}#{slot}",
                                          (capacity, self.tables[table].dim), np.float32)
        return buffer[:rows]

    def _pull_rows_async(self, ps: PSClient, batch, slot: int) -> _RowPull:
        if not self.tables:
            return _NO_ROWS
        with self._in_model():  # the model's code: counted toward --stall-timeout
            ids = self.model.row_ids(batch)
        if set(ids) != set(self.tables):
            raise ValueError(f"row_ids() gave ids of {sorted(ids)}, the model's tables are "
                             f"{sorted(self.tables)}")
        # Each distinct id's row crosses the wire and the host-device link once: the batch's
        # rows are gathered from them on the device, and its gradients summed there.
        unique, inverse = {}, {}
        for name, table_ids in ids.items():
            # PSClient's rule for ids, after narrower integers are widened (exactly):
            # converting anything else here would truncate float ids, wrap uint64 ones and
            # flatten 2-D ones, training the wrong rows without a word.
            dtype = getattr(table_ids, "dtype", None)
            if dtype is not None and (dtype.kind == "i" or dtype.kind == "u"
                                      and dtype.itemsize < 8):
                table_ids = np.asarray(table_ids, np.int64)  # exact: every value fits
            try:
                table_ids = check_ids(table_ids, what=f"the model's row_ids(), table {name!r}")
            except InvalidArgument as error:
                raise ValueError(str(error)) from None
            rows = self.tables[name].num_rows
            if rows is not None and len(table_ids) and not (
                    0 <= int(table_ids.min()) and int(table_ids.max()) < rows):
                # The model's data does not fit its table: a job error, as a bad gradient is
                # (the client's OUT_OF_RANGE would end this worker and no other).
                raise ValueError(f"the model's row_ids(), table {name!r}: ids "
                                 f"{int(table_ids.min())}..{int(table_ids.max())} are not all "
                                 f"in its rows 0:{rows}")
            unique[name], inverse[name] = dedup(table_ids)
        # Buffers sized by the batch's ids, an upper bound of the distinct ones: reused.
        return _RowPull(unique, inverse, {
            name: ps.pull_rows_async(name, table_ids, out=self._row_buffer(
                name, slot, len(inverse[name]))[:len(table_ids)])
            for name, table_ids in unique.items()})

    def _on_device(self, host: dict[str, np.ndarray]) -> dict:
        return {n: self.backend.to_device(a) for n, a in host.items()}

    def _rows_on_device(self, pulled: _RowPull) -> tuple[dict, dict]:
        """The batch's rows of each table on the device, in the order of its ids (gathered
        there from the distinct ids' rows), and the device copies of `inverse`."""
        rows, inverse = {}, {}
        for name, host_rows in pulled.result().items():
            inverse[name] = self.backend.to_device(pulled.inverse[name])
            rows[name] = self.backend.xp.take(self.backend.to_device(host_rows), inverse[name],
                                              axis=0)
        return rows, inverse

    def train(self, ps: PSClient, task: LeasedTask, should_stop) -> TaskResult:
        started = time.monotonic()
        indices = task_indices(self.dataset.num_train, epoch=task.epoch, task_index=task.index,
                               tasks_per_epoch=task.tasks_per_epoch, seed=self.job.seed)
        batches = list(iter_batches(self.dataset, indices, self.job.batch_size))
        result = TaskResult()
        mode = parse_mode(self.job.mode)
        stepped = mode.stepped
        if mode.kind == SYNC and self.tables:
            # (JobSpec refuses it for the built-in models; a user's model shows it here.)
            raise ValueError(f"model {self.job.model!r} has embedding tables "
                             f"({', '.join(sorted(self.tables))}): sync averages whole "
                             "variables only; train it in async or ssp:K")
        if stepped:
            # ssp:K and sync: this worker's pushes wait for the others while it trains this
            # task; it leaves the steps once the task is over, so that nobody waits for a
            # worker that is between tasks.
            ps.join_steps(self.job.mode)
        try:
            return self._train(ps, batches, result, started, stepped, should_stop)
        finally:
            if stepped:
                try:
                    ps.leave_steps()
                except RemoteError as error:  # a push's own error was raised by _train
                    log.info("leaving the steps after a task: %s", error)

    def _train(self, ps: PSClient, batches, result: "TaskResult", started: float,
               stepped: bool, should_stop) -> "TaskResult":
        # The dense values of step i land in host buffer set i % 2. The first steps pull
        # them; after that, the push of step i brings back the values of step i + `ahead`
        # (push_pull: one call per server, not a pull and a push). In async, ahead = 2: they
        # travel while step i + 1 computes, as a prefetched pull would, and are read after
        # step i's gradient was applied. In ssp:K and sync, ahead = 1: the push returns when
        # the mode lets the next step start, and its values are the ones that step is
        # allowed to see.
        ahead = 1 if stepped else 2
        values = {i: ps.pull_async(self.names, out=self._buffers(i))
                  for i in range(min(ahead, len(batches)))}
        upcoming_rows = self._pull_rows_async(ps, batches[0], 0) if batches else _NO_ROWS
        observer = self.observer
        for step, (x, y) in enumerate(batches):
            if should_stop():
                # No pull may still be writing into a buffer when we return.
                futures_wait(list(values.values()))
                upcoming_rows.wait()
                break
            waiting = time.monotonic() if observer is not None else 0.0
            try:
                host = values.pop(step).result()
            except BaseException:
                # The push that was to bring these values failed: leave no pull writing into
                # a buffer, and raise as flush does (which also settles the push's error).
                futures_wait(list(values.values()))
                upcoming_rows.wait()
                ps.flush()
                raise
            pulled = upcoming_rows
            if observer is not None:
                pulled.wait()
                pull_wait = time.monotonic() - waiting
            if step + 1 < len(batches) and not stepped:
                upcoming_rows = self._pull_rows_async(ps, batches[step + 1], (step + 1) % 2)
            pulled.wait()  # (a paramserve wait, bounded by its own deadlines)
            with self._in_model():
                rows, inverse = self._rows_on_device(pulled)
                params = {**self._on_device(host), **rows}
                loss, grads, correct = self._step(params, (x, y))
                if step == 0:  # once a task: a model's gradients keep their names and shapes
                    self._check_grads(grads, pulled)
                result.correct += correct
                for name in self.tables:
                    grads[name] = self.backend.sum_rows(grads[name], inverse[name],
                                                        len(pulled.ids[name]))
            self._reuse_slot(step)
            with self._in_model():
                host_grads = self.grads_to_host(grads, step)
                self.backend.synchronize()  # also: no copy still reads this step's buffers
            dense_grads = {n: g for n, g in host_grads.items() if n not in self.tables}
            waiting = time.monotonic() if observer is not None else 0.0
            later = step + ahead
            # push_async and push_pull_async wait while the window of pushes is full.
            row_pushes = [ps.push_rows_async(name, pulled.ids[name], host_grads[name])
                          for name in self.tables]
            pushes = list(row_pushes)
            if stepped and row_pushes:
                # Row pushes carry no step: they land before the push that finishes this
                # step, so that the others' pulls after it see them as the mode promises.
                # A model of tables alone finishes its step with a push of no gradients.
                futures_wait(row_pushes)
                for push in row_pushes:
                    push.result()
            if dense_grads or (stepped and row_pushes):
                if later < len(batches) and dense_grads:
                    values[later] = ps.push_pull_async(dense_grads, self.names,
                                                       out=self._buffers(later % 2))
                    pushes.append(values[later])
                else:
                    pushes.append(ps.push_async(dense_grads))
            self._track_slot(step, pushes)
            if stepped:
                futures_wait(pushes)
                for push in pushes:
                    push.result()  # raises what the push raised
            if observer is not None:
                observer.step(pull_wait, time.monotonic() - waiting)
            if later < len(batches) and later not in values:  # no dense gradient came back
                values[later] = ps.pull_async(self.names, out=self._buffers(later % 2))
            if stepped and step + 1 < len(batches):
                upcoming_rows = self._pull_rows_async(ps, batches[step + 1], (step + 1) % 2)
            result.loss_sum += float(loss) * len(y)
            result.examples += len(y)
            result.steps += 1
            if self.step_delay_s:  # a deliberately slow worker (--step-delay)
                _pause(self.step_delay_s, should_stop)
        ps.flush()  # the task counts as done only once its updates have landed
        result.seconds = time.monotonic() - started
        return result

    def _reuse_slot(self, step: int) -> None:
        """Before gradients are copied into a GPU ring slot: wait for the pushes that read
        it last. The ring is one longer than the push window, so with pushes completing in
        order they have always finished already; pushes to different servers may not."""
        for future in self._slot_pushes.pop(step % (self.push_window + 1), ()):
            futures_wait([future])

    def _track_slot(self, step: int, pushes: list[Future]) -> None:
        if self.backend.name != "numpy":  # NumPy gradients are never reused
            self._slot_pushes[step % (self.push_window + 1)] = pushes

    def grads_to_host(self, grads: dict, step: int) -> dict[str, np.ndarray]:
        """Gradients as host arrays for the push. On a GPU they land in reusable pinned
        buffers: a ring one longer than the push window, so a buffer is reused only after
        the push that read it has finished (push_async blocks while the window is full).
        NumPy gradients already are host arrays: no copy."""
        if self.backend.name == "numpy":
            return {n: np.asarray(g) for n, g in grads.items()}
        slot = step % (self.push_window + 1)
        return {n: self.backend.to_host(g, out=(
                    self._row_buffer(n, slot, g.shape[0], "grad") if n in self.tables
                    else self.backend.host_buffer(f"{n}/grad#{slot}", g.shape, g.dtype)))
                for n, g in grads.items()}

    def _step(self, params: dict, batch) -> tuple[float, dict, int]:
        """(loss, grads, rows classified right): in one pass where the model offers it,
        else with a second forward pass through `evaluate`, else without accuracy (0)."""
        if hasattr(self.model, "loss_grads_and_correct"):
            return self.model.loss_grads_and_correct(params, batch)
        loss, grads = self.model.loss_and_grads(params, batch)
        correct = self.model.evaluate(params, batch)[1] if hasattr(self.model, "evaluate") else 0
        return loss, grads, int(correct)

    def _check_grads(self, grads, pulled: _RowPull) -> None:
        """ValueError naming the model and the variable unless `grads` has a float32
        gradient of the right shape for every variable and table, and no other: a missing
        one would leave its variable untrained, a misnamed one fail at the servers."""
        method = ("loss_grads_and_correct" if hasattr(self.model, "loss_grads_and_correct")
                  else "loss_and_grads")
        where = f"model {self.job.model!r}: {method}"
        if not isinstance(grads, dict):
            raise ValueError(f"{where} returned {type(grads).__name__} gradients, not a dict "
                             f"of variable name to array")
        # A table's gradient has a row per id occurrence of the batch (ps_worker.models.base).
        expected = {s.name: tuple(s.shape) for s in self.dense_specs}
        expected.update({name: (len(pulled.inverse[name]), table.dim)
                         for name, table in self.tables.items()})
        # An undeclared name first: a misspelt one is missing its declared name too, and
        # this message names both.
        for name in grads:
            if name not in expected:
                raise ValueError(f"{where} returned a gradient for {name!r}, which the model "
                                 f"does not declare (its variables and tables: "
                                 f"{sorted(expected)})")
        for name in expected:
            if name not in grads:
                raise ValueError(f"{where} returned no gradient for {name!r}")
        for name, grad in grads.items():
            shape, dtype = getattr(grad, "shape", None), getattr(grad, "dtype", None)
            if shape is None or dtype is None:
                raise ValueError(f"{where} returned a {type(grad).__name__} for {name!r}, not "
                                 f"an array")
            if tuple(shape) != expected[name]:
                raise ValueError(f"{where} returned a gradient of shape {tuple(shape)} for "
                                 f"{name!r}, whose shape is {expected[name]}")
            if np.dtype(dtype) != np.float32:
                raise ValueError(f"{where} returned a {np.dtype(dtype)} gradient for {name!r}; "
                                 f"gradients are float32, as the parameters are")

    def evaluate(self, ps: PSClient, parameters_read: Callable[[], None] | None = None
                 ) -> TaskResult:
        """Loss and accuracy on the held-out set, and its AUC for a model that gives scores
        of binary labels. A model with tables has the rows of each test batch pulled (the
        next batch's while this one is computed). `parameters_read` is called once every
        value the evaluation measures has been pulled, before it computes: for a model
        without tables, right after the one pull of its variables.

        A model with no way to evaluate (`evaluate` is optional) reports no figures: no
        examples, which the coordinator shows as it does an epoch it does not evaluate."""
        started = time.monotonic()
        scoring = callable(getattr(self.model, "scores", None)) and \
            self.dataset.num_classes == 2
        if not (callable(getattr(self.model, "evaluate", None)) or scoring and callable(
                getattr(self.model, "evaluate_and_scores", None))):
            # Nothing to measure, so nothing to pull; completing the task frees the epoch.
            return TaskResult(seconds=time.monotonic() - started)
        params = self._on_device(ps.pull(self.names, out=self._buffers(0)))
        if parameters_read is not None and not self.tables:
            parameters_read()
        result = TaskResult()
        indices = np.arange(self.dataset.num_test)
        batch_size = EVAL_BATCH_WITH_TABLES if self.tables else EVAL_BATCH
        batches = iter_batches(self.dataset, indices, batch_size, split="test")
        scores = []
        batch = next(batches, None)
        upcoming_rows = self._pull_rows_async(ps, batch, 0) if batch is not None else _NO_ROWS
        slot = 0
        while batch is not None:
            x, y = batch
            upcoming_rows.wait()
            with self._in_model():
                rows, _ = self._rows_on_device(upcoming_rows)
            batch, slot = next(batches, None), 1 - slot
            if batch is not None:
                upcoming_rows = self._pull_rows_async(ps, batch, slot)
            with self._in_model():
                batch_params = {**params, **rows} if rows else params
                if scoring:
                    loss_sum, correct, batch_scores = self._evaluate_and_score(batch_params,
                                                                               (x, y))
                    scores.append(self.backend.to_host(batch_scores))
                else:
                    loss_sum, correct = self.model.evaluate(batch_params, (x, y))
                if rows or scores:
                    self.backend.synchronize()  # rows' buffer is pulled into next; scores copied
                result.loss_sum += float(loss_sum)  # (a device scalar waits for its kernel)
                result.correct += int(correct)
            result.examples += len(y)
        # The parameters' host buffers (set 0) are the next task's to pull into: no copy to
        # the device may still read them (the backend's contract; CuPy's waits anyway).
        with self._in_model():
            self.backend.synchronize()
        if scores:
            result.auc = held_out_auc(np.concatenate(scores), self.dataset.y_test)
        result.seconds = time.monotonic() - started
        return result

    def _evaluate_and_score(self, params: dict, batch) -> tuple[float, int, object]:
        if hasattr(self.model, "evaluate_and_scores"):
            return self.model.evaluate_and_scores(params, batch)
        loss_sum, correct = self.model.evaluate(params, batch)
        return loss_sum, correct, self.model.scores(params, batch)


class Worker:
    """One ps-worker process's life: returns its exit status from `run()`.

    `request_stop()` (thread-safe; SIGTERM) ends every wait at once: the coordinator calls
    retrying and the current PSClient (`interrupt()`), so that `run()` returns promptly
    whatever it was waiting for. A STOP or REREGISTER heartbeat answer interrupts the
    PSClient the same way: its task is abandoned, to run again (tasks are at-least-once).

    `observer` (None: nothing is measured) is the Trainer's (see there), and is told of
    every task the coordinator accepted: `observer.task_done(kind, steps, seconds)`.
    """

    def __init__(self, config: WorkerConfig, observer=None):
        self.config = config
        self.observer = observer
        self.worker_id = config.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._stop = threading.Event()
        self._trainer: Trainer | None = None  # once the job is known
        self._fenced = threading.Event()
        self._job_over = threading.Event()
        self._coordinator = CoordinatorClient(
            config.coordinator, give_up_after_s=config.coordinator_timeout_s, stop=self._stop,
            token=config.token, tls=config.tls, address_from=config.coordinator_from)
        self._client: PSClient | None = None  # the incarnation's PSClient, to interrupt
        self._client_lock = threading.Lock()
        self._incarnation = 0
        self._incarnation_lock = threading.Lock()  # the incarnation and its fence together
        self.lost_coordinator: Exception | None = None

    def request_stop(self) -> None:
        self._stop.set()
        self._interrupt_client()
        self._coordinator.interrupt_waits()

    def _watch_client(self, ps: PSClient) -> None:
        """Make `ps` the client that a stop, a fence or the job's end interrupts (at once if
        one came already: whichever of this and `_interrupt_client` runs second sees the
        other's write)."""
        with self._client_lock:
            self._client = ps
        if self._interrupted():
            ps.interrupt()

    def _interrupt_client(self) -> None:
        with self._client_lock:
            ps = self._client
        if ps is not None:
            ps.interrupt()

    def _exit_status(self) -> int:
        return 1 if self.lost_coordinator else 0

    def run(self) -> int:
        heartbeat = None
        try:
            # The device first: a worker that cannot use it must not join (and hold tasks).
            backend = select_backend(self.config.device, log=log.info,
                                     local_rank=self.config.local_rank)
            registration = self._coordinator.register_worker(self.worker_id)
            if registration.job is None:
                log.error("the coordinator at %s has no job to run (start it with job flags "
                          "or --job FILE)", self.config.coordinator)
                return 1
            job = registration.job
            self._incarnation = registration.incarnation
            try:
                dataset = load_dataset(job.data, seed=job.seed)
                model = build_model(job.model, num_features=dataset.num_features,
                                    num_classes=dataset.num_classes, hidden=job.hidden,
                                    field_sizes=dataset.field_sizes)
                trainer = Trainer(
                    job, dataset, model, backend, push_window=self.config.max_in_flight_pushes,
                    step_delay_s=self.config.step_delay_s, observer=self.observer)
            except ValueError as error:
                failed = self._coordinator.report_job_error(self.worker_id, self._incarnation,
                                                            str(error))
                raise JobCannotRun(str(error), job_failed=failed) from None
            self._trainer = trainer
            log.info("worker %s (incarnation %d) runs %s on %s, %d training examples",
                     self.worker_id, self._incarnation, job.model, job.data, dataset.num_train)
            heartbeat = threading.Thread(
                target=self._heartbeat_loop, args=(registration.heartbeat_interval_s,),
                name=f"ps-worker-{self.worker_id}-heartbeat", daemon=True)
            heartbeat.start()
            while True:
                try:
                    self._serve_incarnation(trainer)
                    return self._exit_status()
                except Fenced:
                    pass
                except RemoteError:
                    # Once this worker is told to stop, to re-register or that the job is
                    # over, what its client raises (CANCELLED by interrupt(), a fenced push)
                    # is moot: the task is abandoned and runs again (at-least-once).
                    if not self._interrupted():
                        raise
                    if self._stop.is_set() or self._job_over.is_set():
                        return self._exit_status()
                incarnation = self._coordinator.register_worker(self.worker_id).incarnation
                with self._incarnation_lock:  # see _heartbeat_loop
                    self._incarnation = incarnation
                    self._fenced.clear()
                log.warning("the coordinator no longer knows this worker's incarnation (it "
                            "was declared dead, or the coordinator lost it); re-registered as "
                            "incarnation %d", self._incarnation)
        except RemoteError:
            # A coordinator call cut short by request_stop() (CANCELLED) is no failure.
            # (An except clause runs before `finally` below sets _stop.)
            if not self._stop.is_set():
                raise
            return self._exit_status()
        finally:
            self._stop.set()
            if heartbeat is not None:
                heartbeat.join(timeout=5.0)
            self._coordinator.close()

    def _serve_incarnation(self, trainer: Trainer) -> None:
        """Lease and run tasks until the job is over; raises Fenced to re-register."""
        with PSClient(self.config.coordinator, client_id=self.worker_id,
                      incarnation=self._incarnation, retry=SERVER_OUTAGE_RETRY,
                      max_in_flight_pushes=self.config.max_in_flight_pushes,
                      shared_memory=self.config.shared_memory
                      and trainer.job.shared_memory, token=self.config.token,
                      tls=self.config.tls) as ps:
            self._watch_client(ps)
            try:
                ps.declare_many(trainer.specs)
            except RemoteError as error:
                # The servers refuse the model's variables as declared (a knob the update's
                # dtype cannot hold, say): nobody can run this job.
                if error.code().name != "INVALID_ARGUMENT" or self._interrupted():
                    raise
                self._cannot_run(None, error)
            while True:
                if self._stop.is_set() or self._job_over.is_set():
                    return
                if self._fenced.is_set():
                    raise Fenced()
                outcome, task = self._coordinator.lease(self.worker_id, self._incarnation,
                                                        wait_s=LEASE_WAIT_S)
                if outcome == "done":
                    log.info("the job is over")
                    return
                if outcome == "reregister":
                    raise Fenced()
                if outcome == "wait":
                    self._stop.wait(task)
                    continue
                try:
                    result = (trainer.train(ps, task, self._interrupted)
                              if task.kind == "train" else
                              trainer.evaluate(ps, lambda task=task: self._parameters_read(task)))
                except RemoteError as error:
                    if _fenced(error):
                        # Servers refuse pushes of an incarnation the coordinator declared
                        # gone (or that a newer one of this worker replaced).
                        log.warning("a server refused this incarnation's push (%s): it was "
                                    "declared gone", error.target)
                        raise Fenced() from None
                    if self._interrupted():
                        raise
                    if error.reason == NON_FINITE_GRADIENT:
                        # The model diverged (or its data holds NaN): every worker computes
                        # from the same values, so the job fails, saying why.
                        self._cannot_run(task, error, diverged=True)
                    if (error.code().name == "FAILED_PRECONDITION"
                            and error.target != "client"):
                        # A server cannot take this job's steps (its --max-streams clients
                        # take part, or others in another mode): the job cannot run here.
                        self._cannot_run(task, error)
                    raise
                except ValueError as error:
                    if self._interrupted():
                        raise
                    # The model broke its contract (Trainer checks its gradients and row
                    # ids) or raised ValueError: the job cannot run here, as when it does
                    # not load, and the coordinator hears why (it fails the job if no
                    # worker has shown that it can run) instead of waiting for the task.
                    self._cannot_run(task, error)
                if self._interrupted():
                    continue
                try:
                    self._coordinator.complete(
                        self.worker_id, self._incarnation, task.task_id,
                        loss_sum=result.loss_sum, examples=result.examples,
                        correct=result.correct, steps=result.steps, seconds=result.seconds,
                        data_path=self._data_path(), auc=result.auc,
                        step_stats=self._step_stats())
                except LeaseRevoked as revoked:
                    log.warning("task %d was taken back: %s", task.task_id, revoked)
                    raise Fenced() from None
                if self.observer is not None:
                    self.observer.task_done(task.kind, result.steps, result.seconds)
                log.info("task %d (%s, epoch %d) done: %d steps, loss %.4f%s in %.2f s",
                         task.task_id, task.kind, task.epoch, result.steps,
                         result.loss_sum / max(1, result.examples),
                         "" if result.auc is None else f", auc {result.auc:.4f}",
                         result.seconds)

    def _cannot_run(self, task: LeasedTask | None, error: Exception, *,
                    diverged: bool = False):
        """Report that this worker cannot run the job (the coordinator fails it when nobody
        has shown it can run, or when the model diverged), and raise JobCannotRun. `task`:
        the one it was running (None: declaring the model's variables)."""
        message = (f"{task.kind} task of epoch {task.epoch}: {error}" if task is not None
                   else f"declaring the model's variables: {error}")
        failed = self._coordinator.report_job_error(self.worker_id, self._incarnation,
                                                    message, diverged=diverged)
        raise JobCannotRun(message, job_failed=failed) from None

    def _parameters_read(self, task: LeasedTask) -> None:
        """The evaluation `task` has its parameters: the coordinator may start the next
        epoch while it computes."""
        try:
            self._coordinator.evaluation_read_parameters(self.worker_id, self._incarnation,
                                                         task.task_id)
        except LeaseRevoked as revoked:
            log.warning("task %d was taken back: %s", task.task_id, revoked)
            raise Fenced() from None

    def _step_stats(self):
        """The client's StepStats (None before it exists, or in the async mode)."""
        with self._client_lock:
            ps = self._client
        if ps is None or ps.mode == "async" and not ps.step_stats.wait_s:
            return None
        return dataclasses.replace(ps.step_stats)

    @property
    def data_path(self) -> str:
        """How this worker's pulls and pushes travel: "shm", "grpc", "shm+grpc", or ""
        before it used a server. Thread-safe."""
        return self._data_path()

    def _data_path(self) -> str:
        """How this worker's pulls and pushes travel (for ps-ctl status): "shm", "grpc",
        "shm+grpc", or "" before it used a server."""
        with self._client_lock:
            ps = self._client
        paths = set(ps.data_paths.values()) if ps is not None else set()
        return "+".join(sorted(paths, reverse=True))

    def in_model_s(self) -> float:
        """How long the current task has been in the model's or the device's code without
        a break (Trainer.in_model_s; 0 before the job is known). Thread-safe."""
        trainer = self._trainer
        return 0.0 if trainer is None else trainer.in_model_s()

    def _interrupted(self) -> bool:
        return self._stop.is_set() or self._fenced.is_set() or self._job_over.is_set()

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            incarnation = self._incarnation
            try:
                action = self._coordinator.heartbeat(self.worker_id, incarnation,
                                                     self._data_path(), self._step_stats())
            except CoordinatorUnreachable as error:
                log.error("%s", error)
                self.lost_coordinator = error
                self.request_stop()
                return
            except RemoteError as error:
                if self._stop.is_set():  # cut short by request_stop() (CANCELLED)
                    return
                # One refused heartbeat (INTERNAL, RESOURCE_EXHAUSTED...) is no reason to send
                # no more: the coordinator would declare this worker dead while it trains.
                log.warning("heartbeat to the coordinator failed (%s: %s); trying again in "
                            "%g s", error.code().name, error.details(), interval_s)
                continue
            if action == "reregister":
                # About the incarnation the heartbeat carried: one the worker has replaced
                # while the call was in flight is no news about the live one.
                with self._incarnation_lock:
                    if incarnation != self._incarnation:
                        continue
                    self._fenced.set()
                    # The fenced incarnation's client, read with the check: once the lock is
                    # released the main thread may register anew and watch a new client,
                    # which this fence must not interrupt (interrupt() is for good).
                    with self._client_lock:
                        fenced = self._client
                if fenced is not None:
                    fenced.interrupt()
            elif action == "stop":
                self._job_over.set()
                self._interrupt_client()
