"""`ps-worker`: a generic training worker. It needs only the coordinator's address (--coordinator,
or a TF_CONFIG whose task is a worker): the job (model, data, optimizer, epochs, ...) comes
from the coordinator when it registers."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Mapping

from ps_common.cli import (
    add_metrics_argument, add_shared_memory_argument, add_tls_arguments, add_token_argument,
    die_with_parent, parse_address, parse_seconds, parse_seconds_or_zero, setup_logging,
    tf_config_task, tls_of, token_of,
)
from ps_common.job import JobError
from ps_common.malloc import tune_malloc
from ps_common.status import RemoteError
from ps_common.telemetry import MetricsBindError, MetricsEndpoint
from ps_common.tf_config import TF_CONFIG_ENV, WORKER
from ps_worker.backend import BackendUnavailable, device_flag_problem
from ps_worker.coordinator_client import CoordinatorUnreachable
from ps_worker.models.registry import find_models_in
from ps_worker.runtime import Worker, WorkerConfig
from ps_worker.telemetry import WorkerMetrics

log = logging.getLogger("ps-worker")


# A training step hung (--stall-timeout): its exit status, and the default bound. Ten
# minutes is far beyond any step of a model that fits a worker, and short enough that a
# sync job held by a hung worker goes on the same hour.
EXIT_STALLED = 3
STALL_TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-worker", description="Train on a paramserve cluster.")
    p.add_argument("--coordinator", type=parse_address,
                   help=f"coordinator HOST:PORT (default: cluster.chief of {TF_CONFIG_ENV}, "
                   "whose task must then be a worker)")
    p.add_argument("--device", default="auto",
                   help="auto (CuPy on a GPU if present, else NumPy) | cpu | cuda | cuda:N")
    p.add_argument("--local-rank", type=_parse_local_rank, metavar="N",
                   help="this worker's index among the workers of its host: --device auto "
                   "and cuda use GPU N mod the GPUs visible (default: GPU 0); ps-cluster "
                   "gives worker i rank i")
    p.add_argument("--worker-id", help="stable worker name (default: HOSTNAME-PID; with "
                   f"{TF_CONFIG_ENV}, worker-INDEX)")
    p.add_argument("--coordinator-timeout", type=parse_seconds, default=30.0, metavar="SECONDS",
                   help="give up when the coordinator is unreachable this long (default 30)")
    add_shared_memory_argument(p, "pull and push through shared memory with servers on this "
                               "host; with it, everything goes over gRPC")
    p.add_argument("--grace", type=parse_seconds_or_zero, default=5.0, metavar="SECONDS",
                   help="how long SIGTERM may take to end the worker cleanly before it exits "
                   "at once (default 5); it holds nothing that must survive")
    p.add_argument("--step-delay", type=parse_seconds_or_zero, default=0.0, metavar="SECONDS",
                   help="sleep this long in every training step: a slow worker (a straggler) "
                   "for demos and tests (default 0)")
    p.add_argument("--stall-timeout", type=parse_seconds_or_zero, default=STALL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="exit (status 3) once a training step or an evaluation has spent this "
                   "long in the model's or the device's code without a break: a hung step "
                   "(a kernel, a deadlock in the model that never returns) would otherwise hold "
                   "its task, and in sync every other worker, while the heartbeats go on. The "
                   "coordinator then hands the task to another worker; a supervisor "
                   "(restart: on-failure, a Job) starts this one again. Time in paramserve's "
                   f"own calls does not count (they have deadlines). 0: never (default "
                   f"{STALL_TIMEOUT_S:g})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_token_argument(p)
    add_tls_arguments(p, daemon=False)
    add_metrics_argument(p, host="--metrics-host")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="interface the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 for "
                   "all), with --metrics-port")
    return p


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """The worker's config from its flags, and from TF_CONFIG in `environ` (default: this
    process's environment) when --coordinator was not given."""
    device_problem = device_flag_problem(args.device)
    if device_problem:
        parser.error(device_problem)
    if not args.grace >= 0:
        parser.error(f"--grace {args.grace}: must be >= 0")
    if not 0 <= args.step_delay < float("inf"):
        parser.error(f"--step-delay {args.step_delay}: must be a number of seconds >= 0")
    task = tf_config_task(parser, args, WORKER, ("coordinator",),
                          os.environ if environ is None else environ)
    if args.coordinator is None and task is None:
        parser.error(f"--coordinator is required (or a {TF_CONFIG_ENV} naming the coordinator "
                     "as cluster.chief, whose task is a worker)")
    return WorkerConfig(coordinator=args.coordinator or task.coordinator, device=args.device,
                        local_rank=args.local_rank,
                        worker_id=args.worker_id or (task.name if task else None),
                        coordinator_timeout_s=args.coordinator_timeout,
                        shared_memory=not args.no_shm, step_delay_s=args.step_delay,
                        token=token_of(parser, args), tls=tls_of(parser, args),
                        coordinator_from=_coordinator_from(args))


def _parse_local_rank(text: str) -> int:
    if not (text.strip().isascii() and text.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (0, 1, 2, ...)")
    return int(text)


def _coordinator_from(args: argparse.Namespace) -> str:
    """Where the coordinator's address came from: what its errors tell the user to check."""
    return "--coordinator" if args.coordinator else f"{TF_CONFIG_ENV} cluster.chief"


def worker_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    die_with_parent()
    setup_logging(args.log_level)
    config = config_from_args(parser, args)
    tune_malloc()
    # A job's `--model mymodule:Model` may name a module in the directory the worker was
    # started from, as it would with `python -m` or PYTHONPATH=. (before any thread starts).
    find_models_in(os.getcwd())
    metrics = observer = None
    if args.metrics_port is not None:
        try:
            metrics = MetricsEndpoint(args.metrics_host, args.metrics_port, name="ps-worker")
        except MetricsBindError as error:
            print(f"ps-worker: --metrics-port: {error}", file=sys.stderr)
            return 1
        observer = WorkerMetrics(metrics.registry)
    worker = Worker(config, observer=observer)
    if metrics is not None:
        observer.watch(worker)
        metrics.start()
        print(f"ps-worker {worker.worker_id} metrics on {metrics.url}", flush=True)
    try:
        return _until_done(worker, args, config)
    finally:
        if metrics is not None:
            metrics.stop()


def _until_done(worker: Worker, args: argparse.Namespace, config: WorkerConfig) -> int:
    # The worker runs on its own thread and the main thread only handles signals: a Python
    # signal handler runs on the main thread between two bytecodes, and one that set an event
    # the main thread was inside the wait of (or started a thread while it held threading's
    # locks) could deadlock. Here the main thread holds no lock the handler needs.
    stop_requested: list[float] = []  # when SIGTERM/SIGINT first came (no lock: see above)

    def on_signal(signum, frame):
        if not stop_requested:
            stop_requested.append(time.monotonic())
            worker.request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    outcome: dict = {}

    def run():
        try:
            outcome["code"] = _run(worker, args, config)
        except BaseException as error:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = error

    runner = threading.Thread(target=run, name="ps-worker-main", daemon=True)
    runner.start()
    while runner.is_alive():
        runner.join(0.1)
        if stop_requested and time.monotonic() - stop_requested[0] > args.grace:
            # Whatever it is stuck in (an RPC to a hung peer, a kernel), the worker holds
            # nothing that must survive it: the coordinator re-runs its task.
            log.error("not stopped within --grace %g s of SIGTERM: exiting now", args.grace)
            os._exit(1)
        stalled = worker.in_model_s()
        if args.stall_timeout and stalled > args.stall_timeout:
            # A thread stuck in a kernel or in C code cannot be interrupted: only the
            # process's end frees the task (its heartbeats stop) and the GPU.
            log.error("the current task has been in the model's or the device's code for "
                      "%.0f s without a break, past --stall-timeout %g s: a hung step. "
                      "Exiting (status %d): the coordinator hands the task to another worker "
                      "once this one's heartbeats stop", stalled, args.stall_timeout,
                      EXIT_STALLED)
            os._exit(EXIT_STALLED)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["code"]


def _run(worker: Worker, args: argparse.Namespace, config: WorkerConfig) -> int:
    try:
        return worker.run()
    except BackendUnavailable as error:
        print(f"ps-worker: --device {args.device}: {error}", file=sys.stderr)
    except CoordinatorUnreachable as error:
        print(f"ps-worker: {config.coordinator_from} {config.coordinator}: {error}",
              file=sys.stderr)
    except (JobError, ValueError) as error:
        print(f"ps-worker: the job cannot run here: {error}", file=sys.stderr)
    except RemoteError as error:
        print(f"ps-worker: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(worker_main())
