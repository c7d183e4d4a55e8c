"""The worker's and ps-ctl's view of the coordinator's control plane, as plain values.

Every call has a deadline; UNAVAILABLE is retried with backoff for a bounded time, after
which `CoordinatorUnreachable` names the address.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass

import grpc

from ps_common.job import JobSpec
from ps_common.rpc import READ_RETRY_CODES, RetryPolicy, call_with_retry, make_channel
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_proto.v1 import coordinator_pb2 as pb
from ps_proto.v1 import coordinator_pb2_grpc as pb_grpc


class CoordinatorUnreachable(ConnectionError):
    def __init__(self, address: str, seconds: float, cause: RemoteError, *,
                 address_from: str = "--coordinator"):
        # A connection that failed for a reason of TLS says what to check; the rest of
        # gRPC's message names nothing the user does not know.
        # The hint of gRPC's own message: the cause's message leads with it already, and
        # its words would read as another failure's to connection_hint.
        # `address_from`: the flag or variable the address came from, the one to check.
        hint = cause.connection_hint
        hint = f": {hint}" if hint else ""
        super().__init__(
            f"cannot reach the coordinator at {address} (gave up after about {seconds:g} s: "
            f"{cause.code().name}{hint}); check {address_from} and that ps-coordinator is "
            "running")
        self.address = address


class NotACoordinator(CoordinatorUnreachable):
    """What answers at the address is not a ps-coordinator (a ps-server's port, another
    gRPC service), or one too old to have the method called."""

    def __init__(self, address: str, method: str, *, address_from: str = "--coordinator"):
        ConnectionError.__init__(
            self, f"no ps-coordinator answers at {address}: the gRPC service there has no "
            f"Coordinator.{method} (UNIMPLEMENTED: another daemon's port, or a ps-coordinator "
            f"older than this client); check {address_from}")
        self.address = address


class LeaseRevoked(Exception):
    """The coordinator no longer counts this worker as the task's holder (it was declared
    dead meanwhile, or the coordinator forgot the task): register again."""


@dataclass(frozen=True)
class LeasedTask:
    task_id: int
    kind: str  # "train" | "evaluate"
    epoch: int
    index: int
    tasks_per_epoch: int


@dataclass(frozen=True)
class Registration:
    incarnation: int
    job: JobSpec | None
    heartbeat_interval_s: float


def _figure(value: float, measured: bool) -> float | None:
    """A figure where something was measured: as it is, NaN or inf included (a model's loss
    that overflowed, shown as such; `ps_common.progress.strict_json` prints it as null).
    None where nothing was (the coordinator sends NaN for that: a mean of no examples)."""
    return value if measured else None


def _held_out(metrics: pb.EpochMetrics) -> bool:
    """Whether the epoch has held-out figures: evaluated, on some examples."""
    return metrics.evaluated and not math.isnan(metrics.test_accuracy)


_ACTIONS = {pb.CONTINUE: "continue", pb.REREGISTER: "reregister", pb.STOP: "stop"}


class CoordinatorClient:
    """Thread-safe (one channel, stateless calls).

    `stop`: once set, a call that is retrying gives up at once with RemoteError CANCELLED
    (e.g. a worker on SIGTERM does not wait out `give_up_after_s` of an absent coordinator),
    and so does a lease waiting for a task once `interrupt_waits()` is called.
    `address_from`: where `address` came from, named by CoordinatorUnreachable.
    """

    def __init__(self, address: str, *, give_up_after_s: float = 30.0, rpc_timeout_s: float = 10.0,
                 stop: threading.Event | None = None, token: str | None = None,
                 tls: TLS | None = None, address_from: str = "--coordinator"):
        self.address = address
        self._address_from = address_from
        self._stop = stop
        self._give_up_after_s = give_up_after_s
        self._timeout = rpc_timeout_s
        self._channel = make_channel(address, token, tls)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        # ~give_up_after_s of jittered backoff capped at 1 s per try, for a coordinator away
        # (UNAVAILABLE) or one that let a call's deadline pass (paused, swapping): every call
        # is safe to repeat (heartbeats, leases under their lease_id, deduplicated reports).
        self._retry = RetryPolicy(max_attempts=max(2, int(give_up_after_s / 0.75) + 1),
                                  initial_backoff_s=0.1, max_backoff_s=1.0,
                                  retry_codes=READ_RETRY_CODES)
        self._waits_lock = threading.Lock()
        self._waits: set[grpc.Future] = set()
        self._lease_ids = itertools.count(1)  # LeaseTaskRequest.lease_id

    def _call(self, method: str, request, *, wait_s: float = 0.0, newer: bool = False):
        """`wait_s`: the coordinator may hold the call this long before it answers (a lease
        waiting for a task): added to its deadline, and the call is one that
        `interrupt_waits` cancels. `newer`: a method older coordinators lack, whose
        UNIMPLEMENTED the caller handles (else it raises NotACoordinator)."""
        rpc = getattr(self._stub, method)
        give_up_at = time.monotonic() + self._give_up_after_s + wait_s

        def attempt():
            # A hung coordinator must not hold a call past give_up_after_s either.
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                raise RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED, "gave up", target=self.address)
            timeout = min(self._timeout + wait_s, remaining)
            return rpc(request, timeout=timeout) if not wait_s else self._waiting(
                rpc.future(request, timeout=timeout))

        def on_retry(attempts: int, error: RemoteError) -> None:
            if time.monotonic() >= give_up_at:
                raise error  # not one retry past give_up_after_s

        try:
            return call_with_retry(attempt, target=self.address, policy=self._retry,
                                   stop=self._stop, on_retry=on_retry)
        except RemoteError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CoordinatorUnreachable(self.address, self._give_up_after_s, error,
                                             address_from=self._address_from) from None
            if error.code() is grpc.StatusCode.UNIMPLEMENTED and not newer:
                raise NotACoordinator(self.address, method,
                                      address_from=self._address_from) from None
            raise

    def _waiting(self, future: grpc.Future):
        with self._waits_lock:
            self._waits.add(future)
        try:
            if self._stop is not None and self._stop.is_set():
                future.cancel()  # a stop that came before the call was registered
            return future.result()
        except grpc.FutureCancelledError:
            raise RemoteError(grpc.StatusCode.CANCELLED, "stopped while waiting for a task",
                              target=self.address) from None
        finally:
            with self._waits_lock:
                self._waits.discard(future)

    def interrupt_waits(self) -> None:
        """Cancel the calls waiting for the coordinator (a lease waiting for a task): they
        raise RemoteError CANCELLED. Other calls run on, bounded by their deadlines."""
        with self._waits_lock:
            waits = list(self._waits)
        for future in waits:
            future.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register_worker(self, worker_id: str) -> Registration:
        reply = self._call("RegisterWorker", pb.RegisterWorkerRequest(worker_id=worker_id))
        job = JobSpec.from_json(reply.job_json) if reply.job_json else None
        return Registration(reply.incarnation, job, reply.heartbeat_interval_ms / 1000.0)

    def heartbeat(self, worker_id: str, incarnation: int, data_path: str = "",
                  step_stats=None) -> str:
        """'continue' | 'reregister' | 'stop'. `step_stats`: the PSClient's StepStats."""
        reply = self._call("WorkerHeartbeat", pb.WorkerHeartbeatRequest(
            worker_id=worker_id, incarnation=incarnation, data_path=data_path,
            step_report=_step_report(step_stats)))
        return _ACTIONS.get(reply.action, "continue")

    def lease(self, worker_id: str, incarnation: int, *, wait_s: float = 0.0):
        """('task', LeasedTask) | ('wait', seconds) | ('done', None) | ('reregister', None).

        `wait_s`: when no task is pending, the coordinator may hold the call up to this long
        (it bounds it too) and answer as soon as one is: a task is started the moment it is
        pending, not at the next poll. ('wait', 0.0) then means ask again at once."""
        # One lease_id per ask, kept by its retries (a lost answer gets the same task).
        reply = self._call("LeaseTask", pb.LeaseTaskRequest(
            worker_id=worker_id, incarnation=incarnation, wait_ms=round(wait_s * 1000),
            lease_id=next(self._lease_ids)), wait_s=wait_s)
        if reply.reregister:
            return "reregister", None
        outcome = reply.WhichOneof("outcome")
        if outcome == "task":
            t = reply.task
            kind = "train" if t.kind == pb.TRAIN else "evaluate"
            return "task", LeasedTask(t.task_id, kind, t.epoch, t.index, t.tasks_per_epoch)
        if outcome == "job_done":
            return "done", None
        return "wait", reply.retry_after_ms / 1000.0

    def complete(self, worker_id: str, incarnation: int, task_id: int, *, loss_sum: float,
                 examples: int, correct: int, steps: int, seconds: float,
                 data_path: str = "", auc: float | None = None, step_stats=None) -> bool:
        """Report a task done; True if it had been reported already. Raises LeaseRevoked when
        this incarnation no longer holds the task. `auc`: an evaluation's held-out AUC, or
        None when it has none."""
        try:
            reply = self._call("CompleteTask", pb.CompleteTaskRequest(
                worker_id=worker_id, incarnation=incarnation, task_id=task_id,
                metrics=pb.TaskMetrics(loss_sum=loss_sum, examples=examples, correct=correct,
                                       steps=steps, seconds=seconds, auc=auc),
                data_path=data_path, step_report=_step_report(step_stats)))
        except RemoteError as error:
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise LeaseRevoked(error.details()) from None
            raise
        return reply.duplicate

    def evaluation_read_parameters(self, worker_id: str, incarnation: int,
                                   task_id: int) -> bool:
        """Tell the coordinator that this evaluation has read the parameters it measures, so
        that the next epoch may start while it computes; True if that started it. Raises
        LeaseRevoked when this incarnation no longer holds the task."""
        try:
            reply = self._call("EvaluationReadParameters", pb.EvaluationReadParametersRequest(
                worker_id=worker_id, incarnation=incarnation, task_id=task_id), newer=True)
        except RemoteError as error:
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise LeaseRevoked(error.details()) from None
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False  # an older coordinator: its next epoch waits for the report
            raise
        return reply.next_epoch_started

    def report_job_error(self, worker_id: str, incarnation: int, message: str, *,
                         diverged: bool = False) -> bool:
        """Tell the coordinator this worker cannot run the job (`diverged`: its model's
        gradients are not finite); True if that failed the job."""
        reply = self._call("ReportJobError", pb.ReportJobErrorRequest(
            worker_id=worker_id, incarnation=incarnation, message=message, diverged=diverged))
        return reply.job_failed

    def status(self, *, watching: bool = False) -> dict:
        """The cluster status as plain data (what `ps-ctl status --json` prints). A training
        or held-out figure is None where nothing was measured, and NaN or inf where a
        model's loss overflowed: print it with `ps_common.progress.strict_json` (null).
        `watching`: this client reads it until the job is over (GetStatusRequest.watching)."""
        s = self._call("GetStatus", pb.GetStatusRequest(watching=watching))
        job = s.job
        return {
            "job": {
                "state": job.state, "epoch": job.epoch, "epochs": job.epochs,
                "tasks_done": job.tasks_done, "tasks_total": job.tasks_total,
                "steps": job.steps, "elapsed_s": round(job.elapsed_s, 3),
                "failure": job.failure,
                "mode": job.mode,
                "staleness": {"max": job.staleness_max},
                "dropped_stale_gradients": job.dropped_stale_gradients,
                "epoch_tasks": job.epoch_tasks, "epoch_tasks_done": job.epoch_tasks_done,
                "spec": JobSpec.from_json(job.job_json).__dict__ if job.job_json else None,
                "metrics": [
                    {"epoch": m.epoch, "loss": _figure(m.loss, m.examples > 0),
                     "accuracy": _figure(m.accuracy, m.examples > 0),
                     # An evaluation of no examples (a model without evaluate) has no
                     # figures: its accuracy, a count over a count, is NaN for that only.
                     "test_loss": _figure(m.test_loss, _held_out(m)),
                     "test_accuracy": _figure(m.test_accuracy, _held_out(m)),
                     "test_auc": m.test_auc if m.HasField("test_auc") else None,
                     "steps": m.steps, "examples": m.examples,
                     # (a coordinator that predates `over` evaluates every epoch, and
                     # sets no epoch_tasks)
                     "over": m.over if job.epoch_tasks else m.evaluated}
                    for m in job.metrics
                ],
            },
            "workers": [
                {"id": w.worker_id, "incarnation": w.incarnation, "state": w.state,
                 "heartbeat_age_s": round(w.heartbeat_age_s, 3), "reason": w.reason,
                 "died_at_s": round(w.died_at_s, 3) if w.state == "dead" else None,
                 "tasks_done": w.tasks_done, "steps": w.steps,
                 "leased_tasks": list(w.leased_tasks), "data_path": w.data_path,
                 "wait_s": round(w.wait_s, 3)}
                for w in s.workers
            ],
            "servers": [
                {"id": v.server_id, "address": v.address, "state": v.state,
                 "heartbeat_age_s": round(v.heartbeat_age_s, 3), "bytes": v.bytes,
                 "shards": v.shards, "synced_epoch": v.synced_epoch,
                 "state_losses": v.state_losses, "lost_shards": list(v.lost_shards),
                 "loss_action": v.loss_action}
                for v in s.servers
            ],
            "shard_map_epoch": s.shard_map_epoch,
            "generation": s.generation,
            "awaiting_servers": list(s.awaiting_servers),
            "checkpoint_dir": s.checkpoint_dir or None,
            "last_checkpoint": (_checkpoint(s.last_checkpoint)
                                if s.HasField("last_checkpoint") else None),
            "shards_restored": s.shards_restored,
            "tables": [
                {"name": t.name, "dim": t.dim, "num_rows": t.num_rows or None,
                 "capacity": t.capacity or None, "ttl_seconds": t.ttl_seconds or None,
                 "rows_held": t.rows_held, "evictions": t.evictions, "bytes": t.bytes}
                for t in s.tables
            ],
        }

    def checkpoint(self) -> dict:
        """Take a checkpoint now; returns once it is complete: {id, step, path, ...}."""
        return _checkpoint(self._call("Checkpoint", pb.CheckpointRequest()))


def _checkpoint(info) -> dict:
    return {"id": info.id, "step": info.step, "path": info.path,
            "created_unix_s": round(info.created_unix_s, 3), "bytes": info.bytes}


def _step_report(stats) -> pb.StepReport | None:
    if stats is None:
        return None
    return pb.StepReport(wait_s=stats.wait_s, staleness_max=stats.staleness_max,
                         dropped_stale=stats.dropped_stale)
