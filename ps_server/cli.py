"""`ps-server`: the parameter-server daemon."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Mapping

from ps_common.cli import (
    add_tls_arguments, add_token_argument, tls_of, token_of,
    add_daemon_arguments, add_metrics_argument, add_shared_memory_argument, bind_of, fail,
    die_with_parent, parse_address, parse_bytes, parse_seconds, parse_seconds_or_zero,
    StopSignals, exit_after_stop, run_until_signal, setup_logging, tf_config_task,
)
from ps_common.malloc import tune_malloc
from ps_common.rpc import DEFAULT_CHUNK_BYTES, DEFAULT_RECEIVE_WINDOW_BYTES, BindError
from ps_common.telemetry import MetricsBindError
from ps_common.tf_config import SERVER, TF_CONFIG_ENV, Task
from ps_server.app import ParameterServer, ServerConfig
from ps_server.snapshots import DEFAULT_STALL_TIMEOUT_S

log = logging.getLogger("ps-server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-server", description="Hold shards of variables in CPU memory and apply the "
        "optimizer to pushed gradients. Without --host, --port, --advertise-address and "
        f"--coordinator, a {TF_CONFIG_ENV} whose task is a 'ps' gives them (and --server-id "
        "ps-INDEX).")
    add_daemon_arguments(p)
    p.add_argument("--advertise-address", type=parse_address, metavar="HOST:PORT",
                   help="address others use to reach this server (default: the bound address, "
                   f"or HOSTNAME:PORT when --host is 0.0.0.0; with {TF_CONFIG_ENV}, its entry "
                   "in cluster.ps)")
    p.add_argument("--server-id", help="stable id of this server (default: its address; with "
                   f"{TF_CONFIG_ENV}, ps-INDEX); a restarted server must keep its id")
    p.add_argument("--coordinator", type=parse_address, help="coordinator HOST:PORT to register with")
    p.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="bytes of values + optimizer slots this server may hold (default: 70%% "
                   "of the machine's or container's memory; 0 = no limit)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=DEFAULT_CHUNK_BYTES,
                   help="size of streamed tensor chunks (default 2MiB)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="accept NaN/Inf in gradients instead of refusing the push, from "
                   "clients that accept them too (PSClient(allow_non_finite=True))")
    p.add_argument("--heartbeat-interval", type=parse_seconds, default=1.0, metavar="SECONDS")
    p.add_argument("--max-streams", type=int, default=128, metavar="N",
                   help="Pull and Push streams served at once; more are refused with "
                   "RESOURCE_EXHAUSTED with a retry delay; also the most clients taking part "
                   "in ssp/sync steps (default 128)")
    p.add_argument("--stream-idle-timeout", type=parse_seconds, default=30.0, metavar="SECONDS",
                   help="cancel a stream whose peer sends (push) or takes (pull) nothing for "
                   "this long, freeing its slot and thread (default 30)")
    p.add_argument("--checkpoint-memory", type=parse_bytes, default=None,
                   help="memory a checkpoint may use for copies of shards that pushes change "
                   "while it writes; past it those pushes wait for the writer (default: 15%% "
                   "of the machine's or container's memory, at least 256MiB, at most the 30%% the "
                   "default --memory-budget leaves)")
    p.add_argument("--checkpoint-stall-timeout", type=parse_seconds_or_zero,
                   default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="give up a checkpoint whose writing makes no progress for this long "
                   "(a hung disk under --checkpoint-dir): the pushes it held go on and the "
                   "checkpoint fails (default %(default)g; 0: never)")
    p.add_argument("--push-memory", type=parse_bytes, default=None,
                   help="memory streamed pushes may wait in until all of each has arrived "
                   "(pushes are applied all or nothing); a push past it waits in a file in "
                   "--spill-dir instead (default: a quarter of the bytes this server holds, "
                   "at least 16MiB)")
    p.add_argument("--receive-window", type=parse_bytes, default=DEFAULT_RECEIVE_WINDOW_BYTES,
                   metavar="SIZE",
                   help="HTTP/2 receive window per call: how much of a push a client may send "
                   "ahead of the server, buffered beside the values (default 1MiB; raise it "
                   "to the link's bandwidth x round-trip time where that is larger; 0: gRPC "
                   "sizes it from what it measures, at least 4MiB)")
    p.add_argument("--spill-dir", default=None, metavar="DIR",
                   help="where pushes past --push-memory wait (default: the system's "
                   "temporary directory, $TMPDIR or /tmp)")
    add_shared_memory_argument(p, "offer clients on this host the shared-memory data path; "
                               "with it, every client uses gRPC")
    p.add_argument("--grace", type=parse_seconds_or_zero, default=5.0, metavar="SECONDS",
                   help="how long RPCs in flight may finish after SIGTERM")
    add_token_argument(p)
    add_tls_arguments(p, daemon=True)
    add_metrics_argument(p)
    return p


# Given any of these, ps-server does not read TF_CONFIG.
ADDRESS_FLAGS = ("host", "port", "advertise_address", "coordinator")


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The server's config from its flags, and from TF_CONFIG in `environ` (default: this
    process's environment) when no address flag was given."""
    return config_and_task(parser, args, environ)[0]


def config_and_task(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    environ: Mapping[str, str] | None = None
                    ) -> tuple[ServerConfig, Task | None]:
    """`config_from_args`, with the TF_CONFIG task it used (None: the flags alone)."""
    task = tf_config_task(parser, args, SERVER, ADDRESS_FLAGS,
                          os.environ if environ is None else environ)
    host, port = bind_of(args, task)
    try:
        return ServerConfig(
            host=host, port=port, server_id=args.server_id or (task.name if task else None),
            advertise_address=args.advertise_address or (task.address if task else None),
            coordinator=args.coordinator or (task.coordinator if task else None),
            memory_budget_bytes=args.memory_budget,
            chunk_bytes=args.chunk_bytes, allow_non_finite=args.allow_non_finite,
            grace_s=args.grace, heartbeat_interval_s=args.heartbeat_interval,
            max_streams=args.max_streams, stream_idle_timeout_s=args.stream_idle_timeout,
            checkpoint_memory_bytes=args.checkpoint_memory,
            checkpoint_stall_timeout_s=args.checkpoint_stall_timeout,
            push_memory_bytes=args.push_memory, spill_dir=args.spill_dir,
            receive_window_bytes=args.receive_window,
            shared_memory=not args.no_shm, token=token_of(parser, args),
            tls=tls_of(parser, args), metrics_port=args.metrics_port), task
    except ValueError as error:
        fail(parser, str(error))
        raise


def server_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    die_with_parent()
    setup_logging(args.log_level)
    config, task = config_and_task(parser, args)
    tune_malloc(one_arena=True)
    signals = StopSignals()  # from here on a signal stops the server gracefully
    try:
        server = ParameterServer(config).start()
    except BaseException as error:
        signals.restore()  # no server to stop: a signal ends the process again
        if isinstance(error, MetricsBindError):
            print(f"ps-server: --metrics-port: {error}", file=sys.stderr)
            return 1
        if isinstance(error, BindError):
            where = (f"{TF_CONFIG_ENV} (cluster.ps[{task.index}] {task.address})" if task
                     else "--host/--port")
            print(f"ps-server: {where}: {error}", file=sys.stderr)
            return 1
        if isinstance(error, OSError):  # not the address's fault: say what failed
            print(f"ps-server: cannot start: {error}", file=sys.stderr)
            return 1
        raise
    def announce():
        if server.metrics is not None:  # before the ready line: there once that is
            print(f"ps-server {server.server_id} metrics on {server.metrics.url}", flush=True)
        print(f"ps-server {server.server_id} listening on {server.bound_address}", flush=True)
        if server.address != server.bound_address:
            log.info("advertising %s to the coordinator", server.address)

    code = run_until_signal(server.stop, server.wait, announce, signals)
    log.info("stopped")
    return code


def run() -> None:
    """The ps-server command: `server_main`, and the process ends once it returns, past
    calls still running (ps_common.cli.exit_after_stop). In-process callers use
    `server_main`, which returns."""
    exit_after_stop(server_main())


if __name__ == "__main__":
    run()
