"""gRPC adapter of the coordinator: decode, call state / assigner, encode."""

from __future__ import annotations

from ps_common.errors import CheckpointFailed, InvalidArgument, ResourceExhausted
from ps_common.status import translate_errors
from ps_common.wire import shard_from_proto, shardmap_from_proto, shardmap_to_proto, spec_from_proto
from ps_proto.v1 import coordinator_pb2 as pb
from ps_proto.v1 import coordinator_pb2_grpc as pb_grpc
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.identity import ClientRegistry, Incarnations, RetiredLog
from ps_server.coordinator.jobs import JobRunner, JobState, Metrics, StepReport
from ps_server.coordinator.placement import held_bytes
from ps_server.coordinator.state import CoordinatorState, HeldReport, ServerReport
from ps_server.coordinator.status_watchers import StatusWatchers

_ACTIONS = {"continue": pb.CONTINUE, "reregister": pb.REREGISTER, "stop": pb.STOP}
# The longest a LeaseTask waits for a task, whatever its wait_ms: a worker that waits asks
# again at least this often.
MAX_LEASE_WAIT_MS = 5_000


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Thread-safe."""

    def __init__(self, state: CoordinatorState, assigner: Assigner, runner: JobRunner,
                 clients: ClientRegistry, retired: RetiredLog, incarnations: Incarnations, *,
                 token: bytes,
                 heartbeat_interval_s: float, keep_serving: bool, checkpointer=None,
                 servers_may_stop=lambda: True, save_progress=lambda: None,
                 watchers: StatusWatchers | None = None):
        self._state = state
        self._watchers = watchers
        self._assigner = assigner
        self._runner = runner
        self._clients = clients
        self._retired = retired
        self._incarnations = incarnations
        self._token = token
        self._keep_serving = keep_serving
        self._heartbeat_interval_ms = int(heartbeat_interval_s * 1000)
        self._checkpointer = checkpointer
        # Servers are told the job is over only once this says so (after its last checkpoint).
        self._servers_may_stop = servers_may_stop
        self._save_progress = save_progress

    def RegisterServer(self, request, context):
        with translate_errors(context, "RegisterServer"):
            if not request.server_id or not request.address:
                raise InvalidArgument("RegisterServer needs a server_id and an address")
            if request.memory_budget_bytes < 0:
                raise InvalidArgument("memory_budget_bytes must be >= 0")
            report = ServerReport(
                epoch=request.epoch, generation=request.generation,
                held=tuple(HeldReport(spec_from_proto(h.spec), shard_from_proto(h.shard),
                                      h.updates) for h in request.held),
                last_map=shardmap_from_proto(request.last_map))
            losses = self._state.register_server(
                request.server_id, request.address, request.memory_budget_bytes, report)
            if losses and self._state.data_loss:
                self._runner.fail(self._state.data_loss,
                                  resumable=self._state.data_loss_resumable)
            if self._state.highest_reported_generation >= self._state.generation:
                # This coordinator's clock is behind a predecessor's: keep its incarnations
                # above every one that predecessor may have handed out.
                self._incarnations.raise_floor(self._state.highest_reported_generation + 1)
            # No assignment yet: the server obeys this coordinator only once it has read this
            # reply; its first heartbeat asks for the map.
            return pb.RegisterServerReply(
                heartbeat_interval_ms=self._heartbeat_interval_ms,
                generation=self._state.generation, control_token=self._token,
                min_epoch=self._state.shard_map.epoch)

    def ServerHeartbeat(self, request, context):
        with translate_errors(context, "ServerHeartbeat"):
            known, needs_sync = self._state.server_heartbeat(
                request.server_id, request.epoch, request.generation,
                [((t.variable, t.index), (t.rows, t.evictions, t.bytes))
                 for t in request.tables])
            if needs_sync:
                self._assigner.sync_in_background()
            shutdown = (known and self._runner.over and not self._keep_serving
                        and self._servers_may_stop())
            if shutdown:
                self._state.mark_told_to_stop(request.server_id)
            retired, through = (self._retired.since(request.retired_through) if known
                                else ([], request.retired_through))
            return pb.ServerHeartbeatReply(
                epoch=self._state.shard_map.epoch, known=known, shutdown=shutdown,
                retired=[pb.RetiredClient(client_id=r.client_id, incarnation=r.incarnation)
                         for r in retired], retired_through=through)

    def Declare(self, request, context):
        """Places new variables and returns once every shard of the declared variables
        exists on its server. A declaration that changes the map waits until every live
        server has the new map (so clients never meet a server still on the old epoch); one
        that declares only known variables waits for nothing but their holders, so a slow
        server never holds up workers that start after the variables exist."""
        with translate_errors(context, "Declare"):
            if not request.variables:
                raise InvalidArgument("Declare names no variables")
            specs = [spec_from_proto(v) for v in request.variables]
            _, added = self._state.declare_new(specs)
            holders, placed_at = self._state.holders([s.name for s in specs])
            # A map with new variables goes to every live server before the call returns.
            self._assigner.sync(None if added else holders, placed_at)
            failed = self._state.creation_failures([s.name for s in specs])
            if failed:
                # A server could not allocate what placement thought fits: take the variables
                # out of the map again (this call's, and any that failed in an earlier try of
                # it), so that nothing waits on shards that do not exist.
                self._state.withdraw(set(added) | set(failed))
                self._assigner.sync_in_background()
                raise ResourceExhausted("; ".join(failed.values())
                                        + "; nothing was declared: add servers or give them "
                                        "more memory")
            return shardmap_to_proto(self._state.shard_map)

    def GetShardMap(self, request, context):
        with translate_errors(context, "GetShardMap"):
            self._state.check_no_data_loss()
            return shardmap_to_proto(self._state.shard_map)

    def RegisterClient(self, request, context):
        with translate_errors(context, "RegisterClient"):
            if not request.client_id:
                raise InvalidArgument("RegisterClient needs a client_id")
            return pb.RegisterClientReply(incarnation=self._clients.register(request.client_id))

    def ReleaseClient(self, request, context):
        with translate_errors(context, "ReleaseClient"):
            if not request.client_id or request.incarnation <= 0:
                raise InvalidArgument("ReleaseClient needs a client_id and its incarnation")
            self._clients.release(request.client_id, request.incarnation)
            return pb.ReleaseClientReply()

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
            action = self._runner.heartbeat(request.worker_id, request.incarnation,
                                            request.data_path, _step_report(request))
            return pb.WorkerHeartbeatReply(action=_ACTIONS[action])

    def LeaseTask(self, request, context):
        with translate_errors(context, "LeaseTask"):
            if request.wait_ms < 0:
                raise InvalidArgument(f"LeaseTask wait_ms {request.wait_ms} must be >= 0")
            wait_s = min(request.wait_ms, MAX_LEASE_WAIT_MS) / 1000
            # A caller that hangs up (a stopping worker) frees its thread at once; one gone
            # already (add_callback refuses a call that has ended) is not waited for at all.
            if wait_s and not context.add_callback(self._runner.wake_waiting):
                wait_s = 0.0
            outcome, task = self._runner.lease(request.worker_id, request.incarnation, wait_s,
                                               abandoned=lambda: not context.is_active(),
                                               lease_id=request.lease_id)
            if outcome == "task":
                # Saved before the worker hears it, like a completion: a restarted
                # coordinator then still takes this worker's report of it.
                self._save_progress()
                return pb.LeaseTaskReply(task=pb.Task(
                    task_id=task.task_id,
                    kind=pb.TRAIN if task.kind == "train" else pb.EVALUATE,
                    epoch=task.epoch, index=task.index,
                    tasks_per_epoch=self._runner.job.tasks_per_epoch))
            if outcome == "wait":
                return pb.LeaseTaskReply(retry_after_ms=(
                    min(200, self._heartbeat_interval_ms) if task is None else 0))
            if outcome == "done":
                return pb.LeaseTaskReply(job_done=True)
            return pb.LeaseTaskReply(reregister=True)

    def CompleteTask(self, request, context):
        with translate_errors(context, "CompleteTask"):
            m = request.metrics
            if m.examples < 0 or m.steps < 0 or m.correct < 0:
                raise InvalidArgument("task metrics must not be negative")
            auc = m.auc if m.HasField("auc") else None
            if auc is not None and not 0.0 <= auc <= 1.0:  # NaN fails this too
                raise InvalidArgument(f"task metrics: auc {auc} is not in [0, 1]")
            duplicate = self._runner.complete(
                request.worker_id, request.incarnation, request.task_id,
                Metrics(m.loss_sum, m.examples, m.correct, m.steps, m.seconds, auc),
                data_path=request.data_path, steps=_step_report(request))
            # On disk before the worker hears it: a task acknowledged as done is done for a
            # restarted coordinator too. A repeated report (a retry whose first attempt is
            # still being saved) waits for that save; with nothing new, nothing is written.
            self._save_progress()
            return pb.CompleteTaskReply(duplicate=duplicate)

    def EvaluationReadParameters(self, request, context):
        with translate_errors(context, "EvaluationReadParameters"):
            started = self._runner.parameters_read(request.worker_id, request.incarnation,
                                                   request.task_id)
            if started:
                # A restarted coordinator resumes with the next epoch under way, so that the
                # reports of its tasks are taken.
                self._save_progress()
            return pb.EvaluationReadParametersReply(next_epoch_started=started)

    def ReportJobError(self, request, context):
        with translate_errors(context, "ReportJobError"):
            failed = self._runner.report_job_error(
                request.worker_id, request.incarnation, request.message[:2000],
                diverged=request.diverged)
            return pb.ReportJobErrorReply(job_failed=failed)

    def GetStatus(self, request, context):
        with translate_errors(context, "GetStatus"):
            snap = self._runner.snapshot()
            if request.watching and self._watchers is not None:
                # Whether this reply shows the outcome: from the snapshot it is built from
                # (the job may end right after it; then this watcher is waited for still).
                self._watchers.read(context.peer(), snap["state"] in (
                    JobState.DONE, JobState.FAILED))
            shard_map = self._state.shard_map
            servers = [pb.ServerStatus(
                server_id=m.server_id, address=m.address, state=state, heartbeat_age_s=age,
                bytes=held_bytes(shard_map, m.server_id, dict(m.tables)),
                shards=len(shard_map.shards_on(m.server_id)),
                synced_epoch=m.synced_epoch, state_losses=m.state_losses,
                lost_shards=m.lost_shards, loss_action=m.loss_action)
                for m, state, age in self._state.server_states()]
            metrics = [pb.EpochMetrics(
                epoch=e.epoch, loss=e.train.mean_loss, accuracy=e.train.accuracy,
                test_loss=e.test.mean_loss if e.test else 0.0,
                test_accuracy=e.test.accuracy if e.test else 0.0,
                evaluated=e.test is not None, steps=e.train.steps, examples=e.train.examples,
                test_auc=e.test.auc if e.test else None, over=e.epoch <= snap["over_through"],
            ) for e in snap["metrics"]]
            job = self._runner.job
            return pb.ClusterStatus(
                job=pb.JobStatus(
                    state=snap["state"].value, epoch=snap["epoch"], epochs=snap["epochs"],
                    tasks_done=snap["tasks_done"], tasks_total=snap["tasks_total"],
                    steps=snap["steps"], elapsed_s=snap["elapsed_s"], metrics=metrics,
                    job_json=job.to_json() if job else "", failure=snap["failure"],
                    mode=snap["mode"], staleness_max=snap["staleness_max"],
                    dropped_stale_gradients=snap["dropped_stale_gradients"],
                    epoch_tasks=snap["epoch_tasks"], epoch_tasks_done=snap["epoch_tasks_done"]),
                workers=[pb.WorkerStatus(**w) for w in snap["workers"]],
                servers=servers,
                shard_map_epoch=shard_map.epoch,
                generation=self._state.generation,
                awaiting_servers=self._state.awaiting(),
                last_checkpoint=_checkpoint_info(
                    self._checkpointer.last if self._checkpointer else None),
                checkpoint_dir=str(self._checkpointer.catalog.root) if self._checkpointer else "",
                shards_restored=self._state.shards_restored,
                tables=_tables(shard_map, [m for m, state, _ in self._state.server_states()
                                           if state == "alive"]),
            )

    def Checkpoint(self, request, context):
        with translate_errors(context, "Checkpoint"):
            if self._checkpointer is None:
                raise CheckpointFailed("this coordinator takes no checkpoints: start it with "
                                       "--checkpoint-dir DIR")
            if not self._state.shard_map.shards:
                raise CheckpointFailed("nothing to checkpoint: no variable has been declared")
            return _checkpoint_info(self._checkpointer.take("requested"))


def _tables(shard_map, servers) -> list[pb.TableStatus]:
    """Each embedding table, with what the live servers last reported holding of it (a
    shard reported by two servers, as while it moves, counts once: the holder's report)."""
    reported = {(server.server_id, key): numbers for server in servers
                for key, numbers in server.tables}
    tables = []
    for name, spec in shard_map.variables.items():
        if not spec.is_table:
            continue
        rows = evictions = nbytes = 0
        for shard in shard_map.shards.get(name, ()):
            held, evicted, size = reported.get((shard.server_id, shard.key), (0, 0, 0))
            rows, evictions, nbytes = rows + held, evictions + evicted, nbytes + size
        tables.append(pb.TableStatus(
            name=name, dim=spec.shape[1], num_rows=spec.rows, capacity=spec.capacity,
            ttl_seconds=spec.ttl_seconds, rows_held=rows, evictions=evictions, bytes=nbytes))
    return tables


def _checkpoint_info(manifest) -> pb.CheckpointInfo | None:
    if manifest is None:
        return None
    return pb.CheckpointInfo(id=manifest.id, step=manifest.step, path=str(manifest.directory),
                             created_unix_s=manifest.created_unix_s, bytes=manifest.bytes)


def _step_report(request) -> StepReport | None:
    if not request.HasField("step_report"):
        return None
    r = request.step_report
    if not (r.wait_s >= 0 and r.staleness_max >= 0 and r.dropped_stale >= 0):  # NaN too
        raise InvalidArgument("step_report figures must be >= 0")
    return StepReport(r.wait_s, r.staleness_max, r.dropped_stale)
