"""gRPC adapter of the coordinator: decode, call state / assigner, encode."""

from __future__ import annotations

import threading

from ps_common.errors import InvalidArgument
from ps_common.status import translate_errors
from ps_common.wire import shardmap_to_proto, spec_from_proto
from ps_proto.v1 import coordinator_pb2 as pb
from ps_proto.v1 import coordinator_pb2_grpc as pb_grpc
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.jobs import JobRunner, Metrics
from ps_server.coordinator.placement import server_loads
from ps_server.coordinator.state import CoordinatorState

_ACTIONS = {"continue": pb.CONTINUE, "reregister": pb.REREGISTER, "stop": pb.STOP}


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thread-safe."""

    def __init__(self, state: CoordinatorState, assigner: Assigner, runner: JobRunner, *,
                 heartbeat_interval_s: float, keep_serving: bool):
        self._state = state
        self._assigner = assigner
        self._runner = runner
        self._keep_serving = keep_serving
        self._heartbeat_interval_ms = int(heartbeat_interval_s * 1000)
        # Declarations are serialized so each one's placement sees the previous one's.
        self._declare_lock = threading.Lock()

    def RegisterServer(self, request, context):
        with translate_errors(context, "RegisterServer"):
            if not request.server_id or not request.address:
                raise InvalidArgument("RegisterServer needs a server_id and an address")
            if request.memory_budget_bytes < 0:
                raise InvalidArgument("memory_budget_bytes must be >= 0")
            self._state.register_server(
                request.server_id, request.address, request.memory_budget_bytes)
            self._assigner.sync_in_background()
            return pb.RegisterServerReply(heartbeat_interval_ms=self._heartbeat_interval_ms)

    def ServerHeartbeat(self, request, context):
        with translate_errors(context, "ServerHeartbeat"):
            known, needs_sync = self._state.server_heartbeat(request.server_id, request.epoch)
            if needs_sync:
                self._assigner.sync_in_background()
            shutdown = known and self._runner.over and not self._keep_serving
            if shutdown:
                self._state.mark_told_to_stop(request.server_id)
            return pb.ServerHeartbeatReply(
                epoch=self._state.shard_map.epoch, known=known, shutdown=shutdown)

    def Declare(self, request, context):
        with translate_errors(context, "Declare"):
            if not request.variables:
                raise InvalidArgument("Declare names no variables")
            specs = [spec_from_proto(v) for v in request.variables]
            with self._declare_lock:
                shard_map = self._state.declare(specs)
                self._assigner.sync(shard_map)
            return shardmap_to_proto(shard_map)

    def GetShardMap(self, request, context):
        with translate_errors(context, "GetShardMap"):
            return shardmap_to_proto(self._state.shard_map)

    # ---- training runtime --------------------------------------------------------------

    def RegisterWorker(self, request, context):
        with translate_errors(context, "RegisterWorker"):
            incarnation = self._runner.register_worker(request.worker_id)
            job = self._runner.job
            return pb.RegisterWorkerReply(
                incarnation=incarnation, job_json=job.to_json() if job else "",
                heartbeat_interval_ms=self._heartbeat_interval_ms)

    def WorkerHeartbeat(self, request, context):
        with translate_errors(context, "WorkerHeartbeat"):
            action = self._runner.heartbeat(request.worker_id, request.incarnation)
            return pb.WorkerHeartbeatReply(action=_ACTIONS[action])

    def LeaseTask(self, request, context):
        with translate_errors(context, "LeaseTask"):
            outcome, task = self._runner.lease(request.worker_id, request.incarnation)
            if outcome == "task":
                return pb.LeaseTaskReply(task=pb.Task(
                    task_id=task.task_id,
                    kind=pb.TRAIN if task.kind == "train" else pb.EVALUATE,
                    epoch=task.epoch, index=task.index,
                    tasks_per_epoch=self._runner.job.tasks_per_epoch))
            if outcome == "wait":
                return pb.LeaseTaskReply(retry_after_ms=min(200, self._heartbeat_interval_ms))
            if outcome == "done":
                return pb.LeaseTaskReply(job_done=True)
            return pb.LeaseTaskReply(reregister=True)

    def CompleteTask(self, request, context):
        with translate_errors(context, "CompleteTask"):
            m = request.metrics
            if m.examples < 0 or m.steps < 0 or m.correct < 0:
                raise InvalidArgument("task metrics must not be negative")
            duplicate = self._runner.complete(
                request.worker_id, request.incarnation, request.task_id,
                Metrics(m.loss_sum, m.examples, m.correct, m.steps, m.seconds))
            return pb.CompleteTaskReply(duplicate=duplicate)

    def ReportJobError(self, request, context):
        with translate_errors(context, "ReportJobError"):
            failed = self._runner.report_job_error(
                request.worker_id, request.incarnation, request.message[:2000])
            return pb.ReportJobErrorReply(job_failed=failed)

    def GetStatus(self, request, context):
        with translate_errors(context, "GetStatus"):
            snap = self._runner.snapshot()
            shard_map = self._state.shard_map
            loads = server_loads(shard_map)
            servers = [pb.ServerStatus(
                server_id=m.server_id, address=m.address, state=state, heartbeat_age_s=age,
                bytes=loads.get(m.server_id, 0), shards=len(shard_map.shards_on(m.server_id)),
                synced_epoch=m.synced_epoch) for m, state, age in self._state.server_states()]
            metrics = [pb.EpochMetrics(
                epoch=e.epoch, loss=e.train.mean_loss, accuracy=e.train.accuracy,
                test_loss=e.test.mean_loss if e.test else 0.0,
                test_accuracy=e.test.accuracy if e.test else 0.0,
                evaluated=e.test is not None, steps=e.train.steps, examples=e.train.examples,
            ) for e in snap["metrics"]]
            job = self._runner.job
            return pb.ClusterStatus(
                job=pb.JobStatus(
                    state=snap["state"].value, epoch=snap["epoch"], epochs=snap["epochs"],
                    tasks_done=snap["tasks_done"], tasks_total=snap["tasks_total"],
                    steps=snap["steps"], elapsed_s=snap["elapsed_s"], metrics=metrics,
                    job_json=job.to_json() if job else "", failure=snap["failure"]),
                workers=[pb.WorkerStatus(**w) for w in snap["workers"]],
                servers=servers,
                shard_map_epoch=shard_map.epoch,
            )
