"""The coordinator daemon: state + assigner + servicer + daemon."""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ps_common.clock import Clock, SystemClock
from ps_common.job import JobSpec
from ps_common.progress import epoch_line, job_over_line
from ps_common.telemetry import MetricsEndpoint
from ps_common.tls import TLS
from ps_proto.v1 import coordinator_pb2_grpc
from ps_server.coordinator.assigner import Assigner
from ps_server.coordinator.checkpointer import (
    Catalog, Checkpointer, Interval, run_periodically, take_last,
)
from ps_server.coordinator.directory_lock import DirectoryLock
from ps_server.coordinator.identity import (
    ClientRegistry, Incarnations, RetiredLog, new_generation,
)
from ps_server.coordinator.jobs import EpochSummary, JobRunner, JobState
from ps_server.coordinator.persistence import StateFile
from ps_server.coordinator.servicer import CoordinatorServicer
from ps_server.coordinator.state import CoordinatorState
from ps_server.coordinator.status_watchers import MAX_LINGER_S, StatusWatchers
from ps_server.daemon import Daemon
from ps_server.telemetry import CoordinatorCollector

log = logging.getLogger(__name__)

SERVICE_NAME = "ps.v1.Coordinator"
STATE_FILE = "coordinator-state.json"
STATE_SAVE_INTERVAL_S = 0.5
# Each call in progress holds a handler thread. Workers with nothing to do wait for a task
# inside LeaseTask (so they start the moment one is pending, not when their next poll comes),
# at most MAX_WAITING_LEASES of them at once: the other threads stay free for heartbeats,
# completions and clients. Workers beyond that poll, as every worker did before.
HANDLER_THREADS = 16
MAX_WAITING_LEASES = 8
# How long stop() waits for a checkpoint being taken to end (its servers' calls are cut off
# by then) before it lets the checkpoint directory go.
CHECKPOINT_STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    split_threshold_bytes: int = 64 * 1024 * 1024
    grace_s: float = 5.0
    job: JobSpec | None = None
    # Keep servers (and this coordinator) up after the job ends, for PSClient users.
    keep_serving: bool = False
    # How long a server holding shards may stay away before its values count as lost.
    server_timeout_s: float = 60.0
    # Re-create shards a server came back without from their initializers instead of
    # failing the job (their trained values are gone either way).
    reinitialize_lost_shards: bool = False
    # New variables are placed only this long after start, so that servers still holding
    # shards from a previous coordinator have reported them first (they heartbeat every
    # second). 0 for a coordinator known to start a new cluster.
    recovery_grace_s: float = 3.0
    # New variables are placed only once this many servers have registered (once reached, it
    # no longer matters): the first variables are spread over the whole cluster, not over
    # whichever servers came first.
    expected_servers: int = 1
    # Checkpoints of every shard go here (a directory every server can reach); None: no
    # checkpoints, and a server that restarts has lost its values.
    checkpoint_dir: Path | None = None
    # None: only on request (ps-ctl checkpoint) and at the end of the job.
    checkpoint_every: Interval | None = Interval(seconds=60.0)
    keep_checkpoints: int = 3
    # The coordinator's own state (job progress) goes here; default: checkpoint_dir.
    state_dir: Path | None = None
    # Every call to the coordinator must carry it, and its calls to servers carry it
    # (ps_common.auth); None: no token. Kept out of the repr: it is a secret.
    token: str | None = field(default=None, repr=False)
    # Serve TLS only, and call servers over TLS (ps_common.tls); None: plaintext.
    tls: TLS | None = None
    # Serve Prometheus metrics on host:metrics_port (0: any free port); None: no metrics.
    metrics_port: int | None = None

    @property
    def state_path(self) -> Path | None:
        directory = self.state_dir or self.checkpoint_dir
        return directory / STATE_FILE if directory else None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not in 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} is not in 0..65535")
        for flag, seconds in (("--heartbeat-interval", self.heartbeat_interval_s),
                              ("--heartbeat-timeout", self.heartbeat_timeout_s),
                              ("--server-timeout", self.server_timeout_s)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{flag} {seconds} must be a number of seconds > 0")
        for flag, seconds in (("--grace", self.grace_s),
                              ("--recovery-grace", self.recovery_grace_s)):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{flag} {seconds} must be a number of seconds >= 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"--heartbeat-timeout {self.heartbeat_timeout_s} must exceed "
                f"--heartbeat-interval {self.heartbeat_interval_s}")
        if self.expected_servers < 1:
            raise ValueError(f"--expect-servers {self.expected_servers} must be >= 1")
        if self.split_threshold_bytes < 1:
            raise ValueError(f"--split-threshold {self.split_threshold_bytes} must be >= 1")
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints {self.keep_checkpoints} must be >= 1")
        for flag, field_name in (("--checkpoint-dir", "checkpoint_dir"),
                                 ("--state-dir", "state_dir")):
            directory = getattr(self, field_name)
            if directory is None:
                continue
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"{flag} {directory} is not a directory")
            # Servers are sent the checkpoint directory's path, and resolve a relative one
            # against their own working directory: it is made absolute here, once.
            object.__setattr__(self, field_name, Path(os.path.abspath(directory)))


class Coordinator:
    """A running ps-coordinator. Start with `start()` (or `with`); `stop()` is graceful.

    With `config.metrics_port`, `metrics` serves its figures at `metrics.url`
    (ps_server.telemetry); else it is None. The constructor raises OSError when the port
    cannot be bound, MetricsBindError (an OSError) when the metrics port cannot."""

    def __init__(self, config: CoordinatorConfig, *, clock: Clock | None = None, interceptors=(),
                 on_job_over=lambda summary: None):
        self.config = config
        # Called with the job's summary (JobRunner.summary) just before the coordinator
        # shuts down at the end of a job.
        self.on_job_over = on_job_over
        self._clock = clock or SystemClock()
        self._directory_locks = _lock_directories(config)
        try:
            self._set_up(config, interceptors)
        except BaseException:
            self._release_directories()
            raise

    def _set_up(self, config: CoordinatorConfig, interceptors) -> None:
        # Fencing: a new generation (above every predecessor's) and a random token that only
        # servers receive; servers obey assignments carrying both.
        self.generation = new_generation()
        token = os.urandom(16)
        self.state = CoordinatorState(
            self._clock, heartbeat_timeout_s=config.heartbeat_timeout_s,
            split_threshold_bytes=config.split_threshold_bytes, generation=self.generation,
            server_timeout_s=config.server_timeout_s,
            reinitialize_lost=config.reinitialize_lost_shards,
            recovery_grace_s=config.recovery_grace_s, expected_servers=config.expected_servers)
        self._assigner = Assigner(self.state, token, cluster_token=config.token,
                                  cluster_tls=config.tls)
        incarnations = Incarnations(self.generation)
        retired = self._retired = RetiredLog()
        # The job had failed in an earlier run, found so by this one (exit 0: see cli.main).
        self.failed_before_start = False
        self.runner = JobRunner(config.job, self._clock,
                                heartbeat_timeout_s=config.heartbeat_timeout_s,
                                incarnations=incarnations, on_worker_gone=retired.append,
                                on_epoch_done=self._log_epoch,
                                max_waiting_leases=MAX_WAITING_LEASES)
        self.checkpointer: Checkpointer | None = None
        if config.checkpoint_dir is not None:
            catalog = Catalog(config.checkpoint_dir)
            self.state.use_checkpoints(catalog)
            self.checkpointer = Checkpointer(
                catalog, self.state, self._assigner.sync, self._assigner.save_checkpoint,
                self._progress, keep=config.keep_checkpoints)
        else:
            log.warning("no --checkpoint-dir: a parameter server that restarts or is lost "
                        "takes its values with it (the job fails)")
        self._state_file = None
        self._saving = threading.Lock()
        self._saved_progress = None
        if config.state_path is not None:
            self._state_file = StateFile(config.state_path)
            self._resume_job()
        # Servers are told the job is over only after its last checkpoint.
        self._servers_may_stop = threading.Event()
        self.clients = ClientRegistry(incarnations, retired)
        self.watchers = StatusWatchers(self._clock)
        servicer = CoordinatorServicer(
            self.state, self._assigner, self.runner, self.clients,
            retired, incarnations, token=token, heartbeat_interval_s=config.heartbeat_interval_s,
            keep_serving=config.keep_serving, checkpointer=self.checkpointer,
            servers_may_stop=self._servers_may_stop.is_set, save_progress=self._save_state,
            watchers=self.watchers)
        self.metrics = (None if config.metrics_port is None else MetricsEndpoint(
            config.host, config.metrics_port, name="ps-coordinator"))
        try:
            self._daemon = Daemon(
                host=config.host, port=config.port, service_names=[SERVICE_NAME],
                add_servicers=lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
                    servicer, s),
                interceptors=interceptors, token=config.token, tls=config.tls,
                metrics=self.metrics, max_workers=HANDLER_THREADS,
            )
        except BaseException:  # e.g. the port is taken: free the metrics port too
            if self.metrics is not None:
                self.metrics.stop()
            raise
        if self.metrics is not None:
            self.metrics.register(CoordinatorCollector(self))
        self.address, self.port = self._daemon.address, self._daemon.port
        self._stopping = threading.Event()
        self._finisher: threading.Thread | None = None

    def _log_epoch(self, summary: EpochSummary, steps: int) -> None:
        """Log an epoch that is over as ps-cluster shows it (a coordinator started by hand
        shows the job's progress too)."""
        test = summary.test
        if test is not None and not test.examples:
            test = None  # a model without evaluate: no held-out figures, shown as none
        log.info("%s", epoch_line(
            summary.epoch, self.runner.job.epochs, loss=summary.train.mean_loss,
            accuracy=summary.train.accuracy, test_accuracy=test.accuracy if test else None,
            test_auc=test.auc if test else None, steps=steps))

    def _progress(self) -> tuple[int, dict | None]:
        if self.runner.job is None:
            return 0, None
        progress = self.runner.export_state()
        return int(progress.get("steps", 0)), progress

    def _resume_job(self) -> None:
        """Take the job up where a predecessor left it: from the state file, else from the
        progress recorded in the newest checkpoint."""
        if self.runner.job is None:
            return
        saved = self._state_file.load()
        candidates = []
        if saved and saved.get("job") is not None:
            candidates.append((saved["job"], f"{self._state_file.path}"))
        manifest = self.checkpointer.catalog.current() if self.checkpointer else None
        if manifest is not None and manifest.job is not None:
            candidates.append((manifest.job, f"checkpoint {manifest.directory}"))
        for progress, source in candidates:
            try:
                self.runner.restore_state(progress)  # unchanged when it raises
                break
            except ValueError as error:  # another job's, say: the next one may be this job's
                log.warning("not resuming from %s: %s", source, error)
        else:
            if candidates:
                log.warning("starting the job afresh")
            return
        snap = self.runner.snapshot()
        self.failed_before_start = snap["state"] is JobState.FAILED
        # The servers may not have read these retirements before the predecessor stopped
        # (it logs them only in memory): a dead worker left among a server's step members
        # would hold every sync step there for good. Retiring one twice changes nothing.
        for worker in snap["workers"]:
            if worker["state"] != "alive":
                self._retired.append(worker["worker_id"], worker["incarnation"])
        log.info("resumed the job from %s: %s, epoch %d/%d, %d of %d task(s) done, %d step(s)",
                 source, snap["state"].value, snap["epoch"], snap["epochs"], snap["tasks_done"],
                 snap["tasks_total"], snap["steps"])

    def _save_state(self) -> None:
        if self._state_file is None or self.runner.job is None:
            return
        with self._saving:  # export and write together: an older export never lands last
            self._save_state_locked()

    def _save_state_locked(self) -> None:
        progress = self.runner.export_state()
        # Elapsed time alone changes on every read: not worth a write (it is saved with the
        # next real change, and a restart loses at most that much of it).
        changed = {k: v for k, v in progress.items() if k != "elapsed_s"}
        if changed != self._saved_progress:
            try:
                self._state_file.save({"job": progress})
                self._saved_progress = changed
            except OSError as error:
                log.error("cannot save the coordinator's state to %s: %s",
                          self._state_file.path, error)

    def _keep_state_saved(self) -> None:
        while not self._stopping.wait(STATE_SAVE_INTERVAL_S):
            self._save_state()

    def start(self) -> "Coordinator":
        self._daemon.start()
        if self._state_file is not None and self.runner.job is not None:
            threading.Thread(target=self._keep_state_saved, name="ps-coordinator-state",
                             daemon=True).start()
        if self.checkpointer is not None:  # (with --checkpoint-every off: new variables only)
            threading.Thread(target=run_periodically, name="ps-coordinator-checkpoints",
                             args=(self.checkpointer, self.config.checkpoint_every,
                                   lambda: self.runner.snapshot()["steps"], self._stopping,
                                   self._nothing_to_checkpoint), daemon=True).start()
        self._watcher = threading.Thread(target=self._watch_servers,
                                         name="ps-coordinator-server-watch", daemon=True)
        self._watcher.start()
        if self.config.job is not None:
            self._finisher = threading.Thread(
                target=self._finish_when_job_over, name="ps-coordinator-finisher", daemon=True)
            self._finisher.start()
        return self

    def _watch_servers(self) -> None:
        """Log a server's loss the moment its lease runs out (not when someone asks), and
        fail the job when one holding shards stays away past --server-timeout."""
        interval = min(1.0, self.config.heartbeat_interval_s)
        while not self._stopping.wait(interval):
            for event in self.state.watch():
                shards = ", ".join(event.shards) or "no shards"
                if event.kind == "down":
                    log.warning("lost contact with parameter server %s (%s, holding %s): no "
                                "heartbeat for %g s; waiting up to %g s (--server-timeout) for "
                                "it to come back", event.server_id, event.address, shards,
                                self.config.heartbeat_timeout_s, self.config.server_timeout_s)
                elif event.kind == "back":
                    log.info("parameter server %s (%s) is back", event.server_id, event.address)
                elif event.kind == "moved":
                    log.warning("parameter server %s (%s) has been gone for more than %g s "
                                "(--server-timeout): its shards move to live servers from "
                                "checkpoint %s: %s; updates applied after that checkpoint are "
                                "lost", event.server_id, event.address,
                                self.config.server_timeout_s, event.checkpoint, shards)
                else:
                    log.error("%s", self.state.data_loss)
            # Whatever found it (a timeout, a server back empty, a checkpoint that could
            # not be read), a data loss ends the job.
            if self.state.data_loss and self.runner.fail(
                    self.state.data_loss, resumable=self.state.data_loss_resumable):
                log.error("the job failed: %s", self.state.data_loss)

    def _nothing_to_checkpoint(self) -> bool:
        return (self.runner.over or not self.state.shard_map.shards
                or bool(self.state.data_loss))

    def _finish_when_job_over(self) -> None:
        """After the job ends, take its last checkpoint, then (unless told to keep serving)
        wait until every live member has been told (or a heartbeat timeout has passed) and
        shut down: the process exits 0."""
        while not self._stopping.wait(0.1):
            if self.runner.over:
                break
        else:
            return
        summary = self.runner.summary()
        log.log(logging.INFO if summary["state"] == JobState.DONE.value else logging.ERROR,
                "%s", job_over_line(summary))
        if (self.checkpointer is not None and self.runner.state is JobState.DONE
                and self.state.shard_map.shards):
            take_last(self.checkpointer, "end of the job",
                      give_up_after_s=self.config.server_timeout_s, stopping=self._stopping)
        self._save_state()
        self._servers_may_stop.set()
        if self.config.keep_serving:
            self._job_over(summary)  # told now: this coordinator does not exit
            return  # servers and this coordinator stay up for PSClient users
        log.info("job %s; telling workers and servers to exit", self.runner.state.value)
        deadline = self._clock.monotonic() + self.config.heartbeat_timeout_s + 2.0
        while not self._stopping.wait(0.1) and self._clock.monotonic() < deadline:
            servers_left = [m for m in self.state.live_servers() if not m.told_to_stop]
            if not servers_left and self.runner.live_workers() == 0:
                break
        # ps-ctl status --watch and the like: each reads the outcome before this exits.
        deadline = self._clock.monotonic() + MAX_LINGER_S
        while (self.watchers.waiting() and self._clock.monotonic() < deadline
               and not self._stopping.wait(0.1)):
            pass
        try:
            self._job_over(self.runner.summary())
        finally:  # whatever telling failed with, the process exits
            threading.Thread(target=self.stop, name="ps-coordinator-stop", daemon=True).start()

    def _job_over(self, summary: dict) -> None:
        # A failure to tell (its output is a full disk or a closed pipe, say) must not keep
        # the coordinator from going on: logged, not raised.
        try:
            self.on_job_over(summary)
        except Exception:  # noqa: BLE001
            log.exception("could not report the job's outcome")

    def stop(self, grace_s: float | None = None) -> None:
        self._stopping.set()
        self.runner.stop_waiting()  # before the drain, which would wait for them
        if self.checkpointer is not None:
            self.checkpointer.close()
        self._daemon.stop(self.config.grace_s if grace_s is None else grace_s)
        self._assigner.close()
        # The directories go to whoever locks them next only once no checkpoint of this
        # coordinator writes, removes or prunes there any more.
        if self.checkpointer is not None and not self.checkpointer.wait_idle(
                CHECKPOINT_STOP_WAIT_S):
            log.warning("a checkpoint was still being taken %g s after the stop began; "
                        "letting the checkpoint directory go all the same",
                        CHECKPOINT_STOP_WAIT_S)
        self._release_directories()

    def _release_directories(self) -> None:
        for lock in self._directory_locks:
            lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        return self._daemon.wait(timeout)

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _lock_directories(config: CoordinatorConfig) -> list[DirectoryLock]:
    """Lock the checkpoint and state directories this coordinator writes (made if need
    be; ps_server.coordinator.directory_lock): raises DirectoryInUse, an OSError, when
    another coordinator holds one, with every lock taken here released."""
    wanted = {}
    for flag, directory in (("--checkpoint-dir", config.checkpoint_dir),
                            ("--state-dir", config.state_dir)):
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            wanted.setdefault(directory.resolve(), (flag, directory))
    locks: list[DirectoryLock] = []
    try:
        for flag, directory in wanted.values():
            lock = DirectoryLock(directory, flag)
            lock.acquire()
            locks.append(lock)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks

