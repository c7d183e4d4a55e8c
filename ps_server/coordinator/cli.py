"""`ps-coordinator`: membership, variable placement (and, with a job, task scheduling)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Mapping

from ps_common.cli import (
    add_tls_arguments, add_token_argument, tls_of, token_of,
    add_daemon_arguments, add_metrics_argument, add_server_loss_arguments,
    add_shared_memory_argument, bind_of, die_with_parent, fail, parse_bytes, parse_seconds,
    exit_after_stop, parse_seconds_or_zero, run_until_signal,
    setup_logging, tf_config_task,
)
from ps_common.job import JobError, add_job_arguments, job_from_args
from ps_common.progress import strict_json
from ps_common.rpc import BindError
from ps_common.telemetry import MetricsBindError
from ps_common.tf_config import COORDINATOR, TF_CONFIG_ENV, Task
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.checkpointer import Interval

log = logging.getLogger("ps-coordinator")


DEFAULT_CHECKPOINT_EVERY = Interval(seconds=60)
_NOT_GIVEN = object()  # --checkpoint-every's default: 60 s, without asking for a directory


def checkpoint_interval(text: str) -> Interval | None:
    try:
        return Interval.parse_flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--checkpoint-every ")) from None


def _directory(text: str) -> Path:
    # An empty path (an unset variable in `--checkpoint-dir "$DIR"`) would be the working
    # directory, quietly.
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a directory")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-coordinator", description="Coordinate a paramserve cluster: servers register "
        "here, variables are declared and placed here. Without --host and --port, a "
        f"{TF_CONFIG_ENV} whose task is the chief gives them (and --expect-servers).")
    add_daemon_arguments(p)
    p.add_argument("--split-threshold", type=parse_bytes, default=64 * 1024 * 1024,
                   help="variables larger than this are split by rows over several servers "
                   "(default 64MiB)")
    p.add_argument("--heartbeat-interval", type=parse_seconds, default=2.0, metavar="SECONDS")
    p.add_argument("--heartbeat-timeout", type=parse_seconds, default=10.0, metavar="SECONDS")
    p.add_argument("--grace", type=parse_seconds_or_zero, default=5.0, metavar="SECONDS")
    add_server_loss_arguments(p)
    p.add_argument("--recovery-grace", type=parse_seconds_or_zero, default=3.0, metavar="SECONDS",
                   help="place no new variable this long after start, so that servers of a "
                   "previous coordinator report their shards first (default 3; 0 for a new "
                   "cluster)")
    p.add_argument("--expect-servers", type=int, metavar="N",
                   help="place no variable before N servers have registered, so that the "
                   "first variables are spread over all of them (default 1; with "
                   f"{TF_CONFIG_ENV}, the number of entries in cluster.ps)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", type=_directory, metavar="DIR",
                   help="take checkpoints of every shard here (a directory every server can "
                   "reach) and restore from the newest good one; also the job-file key "
                   "checkpoint_dir")
    g.add_argument("--checkpoint-every", type=checkpoint_interval, default=_NOT_GIVEN,
                   metavar="INTERVAL", help="seconds (30s, 5m) or steps (500steps) between "
                   "checkpoints (default 60s), or off (only ps-ctl checkpoint); one is also "
                   "taken at the end of the job and as soon as new variables are declared")
    g.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                   help="keep the newest N checkpoints (default 3)")
    g.add_argument("--state-dir", type=_directory, metavar="DIR",
                   help="where the coordinator keeps its own state (job progress) so that it "
                   "resumes after a restart (default: the checkpoint directory)")
    add_shared_memory_argument(p, "let the job's workers use shared memory with servers on "
                               "their host (the job key shared_memory: false); all use gRPC")
    p.add_argument("--keep-serving", action="store_true",
                   help="keep the coordinator and the servers up after the job ends, so the "
                   "model stays readable (workers exit when the job ends)")
    add_token_argument(p)
    add_tls_arguments(p, daemon=True)
    add_metrics_argument(p)
    add_job_arguments(p)
    return p


# Given either of these, ps-coordinator does not read TF_CONFIG.
ADDRESS_FLAGS = ("host", "port")


def config_and_task(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    environ: Mapping[str, str] | None = None
                    ) -> tuple[CoordinatorConfig, Task | None]:
    """The coordinator's config from its flags (the job from --job and the job flags), and
    from TF_CONFIG in `environ` (default: this process's environment) when neither --host nor
    --port was given; with the TF_CONFIG task it used (None: the flags alone)."""
    try:
        job = job_from_args(args)
    except JobError as error:
        fail(parser, str(error))
        raise
    if args.no_shm:
        if job is None:
            fail(parser, "--no-shm applies to the job's workers: give a job (--job or job flags)")
        job = dataclasses.replace(job, shared_memory=False)
    task = tf_config_task(parser, args, COORDINATOR, ADDRESS_FLAGS,
                          os.environ if environ is None else environ)
    host, port = bind_of(args, task)
    expected_servers = args.expect_servers if args.expect_servers is not None else (
        task.servers if task else 1)
    checkpoint_dir = args.checkpoint_dir or (Path(job.checkpoint_dir)
                                             if job and job.checkpoint_dir else None)
    every = DEFAULT_CHECKPOINT_EVERY if args.checkpoint_every is _NOT_GIVEN \
        else args.checkpoint_every
    if args.checkpoint_every not in (_NOT_GIVEN, None) and checkpoint_dir is None:
        fail(parser, "--checkpoint-every: needs --checkpoint-dir (or the job's checkpoint_dir)")
    try:
        config = CoordinatorConfig(
            job=job, keep_serving=args.keep_serving,
            host=host, port=port, heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
            split_threshold_bytes=args.split_threshold, grace_s=args.grace,
            server_timeout_s=args.server_timeout,
            reinitialize_lost_shards=args.reinitialize_lost_shards,
            recovery_grace_s=args.recovery_grace, expected_servers=expected_servers,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=every,
            keep_checkpoints=args.keep_checkpoints,
            state_dir=args.state_dir, token=token_of(parser, args),
            tls=tls_of(parser, args), metrics_port=args.metrics_port)
    except ValueError as error:
        fail(parser, str(error))
        raise
    state = config.state_path
    if state is not None and state.exists() and not state.is_file():
        # It would be ignored at start and fail every save: the progress never kept.
        fail(parser, f"{'--state-dir' if args.state_dir else '--checkpoint-dir'}: the state "
                     f"file {state} is not a file")
    # Made only once every flag is known good: a refused command line leaves nothing behind.
    for flag, directory in (("--checkpoint-dir" if args.checkpoint_dir
                             else "the job's checkpoint_dir", checkpoint_dir),
                            ("--state-dir", args.state_dir)):
        try:
            if directory is not None:
                Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as error:  # else it would surface as a failure to bind the port
            fail(parser, f"{flag} {directory}: cannot make it a directory "
                         f"({error.strerror or error})")
    return config, task


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    die_with_parent()
    setup_logging(args.log_level)
    config, task = config_and_task(parser, args)
    job = config.job
    if task is not None and task.workers and job is None:
        log.warning("%s lists %d worker(s) but no job was given (--job or job flags): "
                    "ps-worker processes will find no job to run", TF_CONFIG_ENV, task.workers)
    try:
        coordinator = Coordinator(config, on_job_over=lambda summary: print(
            f"ps-coordinator finished: {strict_json(summary)}", flush=True)).start()
    except MetricsBindError as error:
        print(f"ps-coordinator: --metrics-port: {error}", file=sys.stderr)
        return 1
    except BindError as error:
        where = f"{TF_CONFIG_ENV} (cluster.chief {task.address})" if task else "--host/--port"
        print(f"ps-coordinator: {where}: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # not the address's fault: say what failed
        print(f"ps-coordinator: cannot start: {error}", file=sys.stderr)
        return 1
    def announce():
        if coordinator.metrics is not None:  # before the ready line: there once that is
            print(f"ps-coordinator metrics on {coordinator.metrics.url}", flush=True)
        print(f"ps-coordinator listening on {coordinator.address}", flush=True)
        if job is not None:
            log.info("job: %s", job.to_json())

    code = run_until_signal(coordinator.stop, coordinator.wait, announce)
    log.info("stopped")
    if coordinator.runner.failure:
        log.error("the job failed: %s", coordinator.runner.failure)
        # A run that only found the job failed (restarted on its state) says so and exits 0:
        # the run that failed it exited 1, and a supervisor that restarts what fails
        # (restart: on-failure) would otherwise start this one again for ever.
        code = 0 if coordinator.failed_before_start else 1
    return code


def run() -> None:
    """The ps-coordinator command: `main`, and the process ends once it returns, past calls
    still running (ps_common.cli.exit_after_stop). In-process callers use `main`."""
    exit_after_stop(main())


if __name__ == "__main__":
    run()
