"""`ps-ctl`: look at a running cluster.

    ps-ctl --coordinator HOST:PORT status [--json]
    ps-ctl --coordinator HOST:PORT checkpoint      # prints {"id": ..., "step": ...} as JSON
    ps-ctl probe HOST:PORT                         # exit 0 when the daemon is SERVING
    ps-ctl make-certs --out DIR [--hosts 127.0.0.1,localhost]

Every command takes --token-file and the --tls-* flags of a client (ps_common.tls).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.certs import DEFAULT_HOSTS, make_certs
from ps_common.cli import (
    add_tls_arguments, add_token_argument, fail, parse_address, tls_of, token_of,
)
from ps_common.rpc import make_channel
from ps_common.tls import TLS
from ps_common.status import RemoteError
from ps_worker.coordinator_client import CoordinatorClient, CoordinatorUnreachable


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def render(status: dict) -> str:
    """The status as a human-readable report."""
    job = status["job"]
    lines = [f"job: {job['state']}  epoch {job['epoch']}/{job['epochs']}  "
             f"tasks {job['tasks_done']}/{job['tasks_total']}  steps {job['steps']}  "
             f"elapsed {job['elapsed_s']:.1f} s  shard map epoch {status['shard_map_epoch']}"]
    if job.get("failure"):
        lines.append(f"  failure: {job['failure']}")
    stepped = job.get("mode") not in (None, "", "async")
    if job.get("mode"):
        lines.append(f"  mode {job['mode']}" + (
            f"  largest gap let through {job['staleness']['max']} step(s)  "
            f"stale gradients dropped {job['dropped_stale_gradients']}" if stepped else ""))
    if job["metrics"]:
        # Held-out AUC only for models that give scores (chance: 0.5).
        with_auc = any(m.get("test_auc") is not None for m in job["metrics"])
        lines.append("  epoch   loss     accuracy  test_loss  test_accuracy  "
                     + ("test_auc  " if with_auc else "") + "steps")
        for m in job["metrics"]:
            auc = f"{_fmt(m.get('test_auc'))}    " if with_auc else ""
            lines.append(f"  {m['epoch']:>5}   {_fmt(m['loss'])}   {_fmt(m['accuracy'])}    "
                         f"{_fmt(m['test_loss'])}     {_fmt(m['test_accuracy'])}         "
                         f"{auc}{m['steps']}")
        if with_auc:
            lines.append("  (test_auc: held-out ROC AUC; chance is 0.5)")
    lines.append(f"workers ({len(status['workers'])}):")
    for w in status["workers"]:
        extra = f"  {w['reason']}" if w["reason"] else ""
        lines.append(f"  {w['id']:<24} {w['state']:<6} incarnation {w['incarnation']:<3} "
                     f"heartbeat {w['heartbeat_age_s']:.1f} s ago  tasks {w['tasks_done']}  "
                     f"steps {w['steps']}  data path {w.get('data_path') or '-'}"
                     + (f"  waited {w.get('wait_s', 0.0):.2f} s" if stepped else "") + extra)
    lines.append(f"servers ({len(status['servers'])}):")
    for s in status["servers"]:
        lines.append(f"  {s['id']:<12} {s['address']:<22} {s['state']:<6} "
                     f"{s['shards']} shard(s) {_bytes(s['bytes'])}  "
                     f"heartbeat {s['heartbeat_age_s']:.1f} s ago")
        if s.get("state_losses"):
            lines.append(f"    came back without its shards {s['state_losses']} time(s); last lost "
                         f"{', '.join(s['lost_shards'])}: {s['loss_action']}")
    if status.get("tables"):
        lines.append(f"embedding tables ({len(status['tables'])}):")
        for t in status["tables"]:
            size = (f"{t['num_rows']} rows" if t["num_rows"] else "dynamic" + (
                f", capacity {t['capacity']}" if t["capacity"] else "") + (
                f", ttl {t['ttl_seconds']:g} s" if t["ttl_seconds"] else ""))
            lines.append(f"  {t['name']:<24} dim {t['dim']}  {size}  holding {t['rows_held']} "
                         f"rows {_bytes(t['bytes'])}  evictions {t['evictions']}")
    last = status.get("last_checkpoint")
    if status.get("checkpoint_dir"):
        lines.append(f"checkpoints in {status['checkpoint_dir']}: " + (
            f"last {last['id']} at step {last['step']} ({_bytes(last['bytes'])})" if last
            else "none yet") + (f"; {status['shards_restored']} shard(s) restored from one"
                                if status.get("shards_restored") else ""))
    if status.get("awaiting_servers"):
        lines.append(f"awaiting servers (held shards before the coordinator restarted): "
                     f"{', '.join(status['awaiting_servers'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-ctl", description="Inspect a paramserve cluster.")
    p.add_argument("--coordinator", type=parse_address,
                   help="coordinator HOST:PORT (status, checkpoint)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="give up when the coordinator does not answer within this time")
    add_token_argument(p)
    add_tls_arguments(p, daemon=False)
    sub = p.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="members, shards, job progress and metrics")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                        help="as the --timeout before the command")
    checkpoint = sub.add_parser("checkpoint", help="take a checkpoint now; prints its id "
                                "and step as JSON once it is complete")
    checkpoint.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                            metavar="SECONDS", help="as the --timeout before the command "
                            "(default for checkpoint: 600)")
    probe = sub.add_parser("probe", help="ask a daemon's gRPC health service whether it "
                           "serves: exit 0 when SERVING, 1 otherwise (for container and "
                           "Kubernetes probes, over TLS where native gRPC probes cannot go)")
    probe.add_argument("address", type=parse_address, help="the daemon's HOST:PORT")
    probe.add_argument("--service", default="",
                       help="the service to ask about (default: the whole daemon)")
    probe.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                       help="as the --timeout before the command")
    certs = sub.add_parser("make-certs", help="write a throwaway CA and a server and a client "
                           "certificate with keys, for trying TLS (ca.pem, server.pem, "
                           "server-key.pem, client.pem, client-key.pem)")
    certs.add_argument("--out", required=True, metavar="DIR",
                       help="directory to write them into (created; must not hold them yet)")
    certs.add_argument("--hosts", default=",".join(DEFAULT_HOSTS),
                       help="comma-separated names and IP addresses the server certificate "
                       "is valid for: every address clients dial (default %(default)s)")
    certs.add_argument("--days", type=int, default=365,
                       help="how long the certificates are valid (default %(default)s)")
    return p


def _probe(address: str, service: str, timeout_s: float, tls: TLS | None) -> int:
    with make_channel(address, tls=tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as error:
            print(f"ps-ctl probe {address}: {RemoteError.from_rpc_error(error)}",
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-certs":
        if args.days < 1:
            fail(parser, f"--days {args.days}: must be at least 1")
        try:
            written = make_certs(args.out, args.hosts.split(","), days=args.days)
        except ValueError as error:
            fail(parser, str(error))
        print("\n".join(str(path) for path in written))
        return 0
    token = token_of(parser, args)
    tls = tls_of(parser, args)
    if args.command == "probe":
        return _probe(args.address, args.service, args.timeout, tls)
    if args.coordinator is None:
        fail(parser, f"{args.command}: needs --coordinator HOST:PORT")
    given = argv if argv is not None else sys.argv[1:]
    if args.command == "checkpoint" and not any(a.startswith("--timeout") for a in given):
        args.timeout = 600.0  # writing a large model takes a while
    try:
        with CoordinatorClient(args.coordinator, give_up_after_s=args.timeout,
                               rpc_timeout_s=args.timeout, token=token,
                               tls=tls) as coordinator:
            if args.command == "checkpoint":
                print(json.dumps(coordinator.checkpoint()))
                return 0
            status = coordinator.status()
    except CoordinatorUnreachable as error:
        print(f"ps-ctl: --coordinator {args.coordinator}: {error}", file=sys.stderr)
        return 1
    except RemoteError as error:
        print(f"ps-ctl: {error}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
