"""`ps-ctl`: look at a running cluster.

    ps-ctl --coordinator HOST:PORT status [--json] [--watch [SECONDS] [--count N]]
    ps-ctl --coordinator HOST:PORT checkpoint      # prints {"id": ..., "step": ...} as JSON
    ps-ctl --coordinator HOST:PORT plot [--out curve.png]   # needs paramserve[plot]
    ps-ctl plot --from status.json [--out curve.png]        # a saved `status --json`

`status` prints tables that fit 80 columns (`render`); `--json` prints the status as the
coordinator client returns it, whose keys scripts rely on.
    ps-ctl probe HOST:PORT                         # exit 0 when the daemon is SERVING
    ps-ctl make-certs --out DIR [--hosts 127.0.0.1,localhost]

Every command takes --token-file and the --tls-* flags of a client (ps_common.tls).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.certs import DEFAULT_HOSTS, make_certs
from ps_common.cli import (
    add_tls_arguments, add_token_argument, fail, parse_address, parse_seconds, tls_of,
    token_of,
)
from ps_common.progress import strict_json
from ps_common.rpc import make_channel
from ps_common.status import RemoteError
from ps_common.tf_config import TF_CONFIG_ENV, TFConfigError
from ps_common.tf_config import parse as parse_tf_config
from ps_common.tls import TLS
from ps_worker.coordinator_client import CoordinatorClient, CoordinatorUnreachable

WIDTH = 80  # every line render() returns fits this many columns
GAP = "  "  # between two columns of a table
ELLIPSIS = "..."  # ASCII: a terminal in the C locale prints it too
PLACEHOLDER = "-"  # a value not known (yet): aligned as the values of its column
MAX_EPOCHS_SHOWN = 12  # the newest; --json has every epoch, `plot` draws them
CLEAR_SCREEN = "\033[H\033[2J"
PLOT_INSTALL = 'pip install "paramserve[plot]"'


# ---- text layout ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """A table column. `shrink_to`: the narrowest it may be cut to (with an ellipsis) when the
    table is too wide; None: never cut. `cut`: where a value loses characters: "end" (a
    reason) or "middle" (an id, whose end often tells it apart: worker-0, worker-1)."""

    header: str
    right: bool = False
    shrink_to: int | None = None
    cut: str = "end"


def cut(text: str, width: int, where: str = "end") -> str:
    """`text` in at most `width` characters, an ellipsis standing for what was taken out."""
    if len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return text[:width]
    keep = width - len(ELLIPSIS)
    if where == "middle":
        head = (keep + 1) // 2
        return text[:head] + ELLIPSIS + text[len(text) - (keep - head):]
    return text[:keep] + ELLIPSIS


def table(columns: list[Column], rows: list[list[str]], *, width: int = WIDTH,
          indent: int = 2) -> list[str]:
    """Rows under a header, each column as wide as its widest cell; when that is wider than
    `width`, the widest shrinkable column loses a character at a time (down to its
    `shrink_to` and never below its header) until it fits."""
    widths = [max([len(c.header), *(len(row[i]) for row in rows)])
              for i, c in enumerate(columns)]
    excess = indent + sum(widths) + len(GAP) * (len(columns) - 1) - width
    while excess > 0:
        shrinkable = [i for i, c in enumerate(columns) if c.shrink_to is not None
                      and widths[i] > max(c.shrink_to, len(c.header))]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1

    def line(cells: list[str]) -> str:
        text = GAP.join(
            cut(cell, w, c.cut).rjust(w) if c.right else cut(cell, w, c.cut).ljust(w)
            for cell, w, c in zip(cells, widths, columns))
        return (" " * indent + text).rstrip()

    return [line([c.header for c in columns]), *(line(row) for row in rows)]


def fields(pairs: list[tuple[str, str]], *, width: int = WIDTH) -> list[str]:
    """`label  value` lines, values aligned; a long value wraps under itself."""
    label_width = max(len(label) for label, _ in pairs)
    out = []
    for label, value in pairs:
        lines = textwrap.wrap(value, width - label_width - len(GAP),
                              break_on_hyphens=False) or [""]
        out.append(f"{label:<{label_width}}{GAP}{lines[0]}".rstrip())
        out.extend(" " * (label_width + len(GAP)) + rest for rest in lines[1:])
    return out


def wrapped(text: str, *, indent: int = 2, width: int = WIDTH) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + 2), break_on_hyphens=False)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _fmt(value, spec: str = ".4f") -> str:
    return PLACEHOLDER if value is None else format(value, spec)


# ---- the status as text --------------------------------------------------------------------

def steps_per_s(job: dict) -> float | None:
    """The job's mean rate: its steps over its elapsed time (None before any time passed)."""
    return job["steps"] / job["elapsed_s"] if job.get("elapsed_s") else None


def _stepped(job: dict) -> bool:
    return job.get("mode") not in (None, "", "async")


def render(status: dict, *, width: int = WIDTH) -> str:
    """The status as a human-readable report whose every line fits `width` columns: the
    job, its per-epoch metrics (training and held-out apart), workers, servers, embedding
    tables."""
    job = status["job"]
    lines = fields(_job_fields(status), width=width)
    if job["metrics"]:
        lines += ["", *_metrics(job, width)]
    lines += ["", f"workers ({len(status['workers'])})"]
    if status["workers"]:
        lines += _workers(status["workers"], _stepped(job), width)
    lines += ["", f"servers ({len(status['servers'])})"]
    if status["servers"]:
        lines += _servers(status["servers"], width)
    if status.get("tables"):
        lines += ["", f"embedding tables ({len(status['tables'])})", *_tables(status["tables"],
                                                                           width)]
    # A last guard: nothing above should be wider, but a terminal must never wrap a line.
    return "\n".join(cut(line, width) for line in lines)


def _job_fields(status: dict) -> list[tuple[str, str]]:
    job = status["job"]
    if job["state"] == "none":
        pairs = [("job", "none (the coordinator only serves variables)")]
    else:
        progress = (f"{job['state']}{GAP}epoch {job['epoch']}/{job['epochs']}{GAP}"
                    f"tasks {job['tasks_done']}/{job['tasks_total']}")
        pairs = [("job", progress)]
        rate = steps_per_s(job)
        pairs.append(("steps", f"{job['steps']} in {job['elapsed_s']:.1f} s"
                      + (f" ({rate:.1f} steps/s)" if rate is not None else "")))
    if job.get("failure"):
        pairs.append(("failure", job["failure"]))
    if job.get("mode"):
        pairs.append(("mode", job["mode"] + (
            f", largest gap let through {job['staleness']['max']} step(s), stale gradients "
            f"dropped {job['dropped_stale_gradients']}" if _stepped(job) else "")))
    pairs.append(("shard map", f"epoch {status['shard_map_epoch']}"))
    if status.get("checkpoint_dir"):
        last = status.get("last_checkpoint")
        pairs.append(("checkpoints", (
            f"last {last['id']} at step {last['step']} ({_bytes(last['bytes'])})" if last
            else "none yet") + f" in {status['checkpoint_dir']}" + (
            f"; {status['shards_restored']} shard(s) restored from one"
            if status.get("shards_restored") else "")))
    if status.get("awaiting_servers"):
        awaiting = ", ".join(status["awaiting_servers"])
        pairs.append(("awaiting", f"{awaiting} (held shards before the coordinator restarted)"))
    return pairs


def _metrics(job: dict, width: int) -> list[str]:
    metrics = job["metrics"]
    with_auc = any(m.get("test_auc") is not None for m in metrics)
    columns = [Column("epoch", right=True), Column("train loss", right=True),
               Column("train acc", right=True), Column("held-out loss", right=True),
               Column("held-out acc", right=True)]
    if with_auc:  # only models that give scores have one
        columns.append(Column("held-out AUC", right=True))
    columns.append(Column("steps", right=True))
    shown = metrics[-MAX_EPOCHS_SHOWN:]
    rows = [[str(m["epoch"]), _fmt(m["loss"]), _fmt(m["accuracy"]), _fmt(m["test_loss"]),
             _fmt(m["test_accuracy"]), *([_fmt(m.get("test_auc"))] if with_auc else []),
             str(m["steps"])] for m in shown]
    lines = table(columns, rows, width=width, indent=0)
    if len(shown) < len(metrics):
        lines += wrapped(f"(epochs {metrics[0]['epoch']} to {shown[0]['epoch'] - 1} not "
                         "shown: status --json has them all, plot draws them)", indent=0,
                         width=width)
    lines += wrapped("(train: the epoch's training batches; held-out: evaluated after the "
                     "epoch, every evaluate_every-th and the last" + ("; AUC: ROC AUC, chance is 0.5)" if with_auc else ")"),
                     indent=0, width=width)
    return lines


def _workers(workers: list[dict], stepped: bool, width: int) -> list[str]:
    """A row per worker; why a worker is dead goes under its row (up to 3 lines)."""
    columns = [Column("worker", shrink_to=12, cut="middle"), Column("state"),
               Column("heartbeat", right=True), Column("tasks", right=True),
               Column("steps", right=True), Column("data path")]
    if stepped:  # seconds its pushes waited for other workers (ssp:K, sync)
        columns.append(Column("waited", right=True))
    rows = [[w["id"], w["state"], f"{w['heartbeat_age_s']:.1f} s ago", str(w["tasks_done"]),
             str(w["steps"]), w.get("data_path") or PLACEHOLDER,
             *([f"{w.get('wait_s', 0.0):.2f} s"] if stepped else [])] for w in workers]
    header, *lines = table(columns, rows, width=width)
    out = [header]
    for w, line in zip(workers, lines):
        out.append(line)
        if w["reason"]:
            out += _at_most(wrapped(f"reason: {w['reason']}", indent=4, width=width), 3,
                            width)
    return out


def _at_most(lines: list[str], n: int, width: int) -> list[str]:
    """The first `n` lines, the last of them ending in an ellipsis if any were left out."""
    if len(lines) <= n:
        return lines
    return [*lines[:n - 1], cut(f"{lines[n - 1]} {ELLIPSIS}", width)]


def _servers(servers: list[dict], width: int) -> list[str]:
    columns = [Column("server", shrink_to=12, cut="middle"),
               Column("address", shrink_to=15, cut="middle"), Column("state"),
               Column("shards", right=True), Column("bytes", right=True),
               Column("heartbeat", right=True)]
    rows = [[s["id"], s["address"], s["state"], str(s["shards"]), _bytes(s["bytes"]),
             f"{s['heartbeat_age_s']:.1f} s ago"] for s in servers]
    lines = table(columns, rows, width=width)
    for s in servers:
        if s.get("state_losses"):
            lines += wrapped(f"{s['id']} came back without its shards {s['state_losses']} "
                             f"time(s); last lost {', '.join(s['lost_shards'])}: "
                             f"{s['loss_action']}", width=width)
    return lines


def _tables(tables: list[dict], width: int) -> list[str]:
    columns = [Column("table", shrink_to=12, cut="middle"), Column("dim", right=True),
               Column("rows", right=True), Column("capacity", right=True),
               Column("ttl", right=True), Column("holding", right=True),
               Column("bytes", right=True), Column("evictions", right=True)]
    rows = [[t["name"], str(t["dim"]), str(t["num_rows"]) if t["num_rows"] else "dynamic",
             str(t["capacity"]) if t["capacity"] else PLACEHOLDER,
             f"{t['ttl_seconds']:g} s" if t["ttl_seconds"] else PLACEHOLDER,
             str(t["rows_held"]), _bytes(t["bytes"]), str(t["evictions"])] for t in tables]
    return table(columns, rows, width=width)


# ---- watch ---------------------------------------------------------------------------------

def watch(read_status, *, interval_s: float, out=None, as_json: bool = False,
          count: int | None = None, sleep=time.sleep) -> int:
    """Show the status every `interval_s` until the job is over (0 when it is done, 1 when it
    failed) or after `count` refreshes (0). On a terminal each refresh clears the screen;
    otherwise refreshes are separated by a line of dashes. `--json`: one JSON object per
    line. `read_status` raising ends the watch with its exception."""
    out = out or sys.stdout
    tty = out.isatty()
    shown = 0
    while True:
        status = read_status()
        if as_json:
            out.write(strict_json(status) + "\n")
        else:
            if tty:
                out.write(CLEAR_SCREEN)
            elif shown:
                out.write("-" * WIDTH + "\n")
            out.write(render(status) + "\n")
        out.flush()
        shown += 1
        state = status["job"]["state"]
        if state in ("done", "failed"):
            return 0 if state == "done" else 1
        if count is not None and shown >= count:
            return 0
        sleep(interval_s)


# ---- plot ----------------------------------------------------------------------------------

class PlotUnavailable(RuntimeError):
    pass


def plot(status: dict, out: Path) -> int:
    """Draw the per-epoch training and held-out loss, accuracy (and held-out AUC where there
    is one) against the epoch into `out` (its suffix picks the format: .png, .svg, .pdf).
    Uses matplotlib's Agg canvas directly: no display, no global pyplot state. Returns the
    number of epochs drawn. Raises PlotUnavailable without matplotlib, ValueError when no
    epoch has metrics yet."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotUnavailable(f"ps-ctl plot needs matplotlib: {PLOT_INSTALL}") from error
    metrics = [m for m in status["job"]["metrics"] if m["examples"] or
               m["test_accuracy"] is not None]
    if not metrics:
        raise ValueError("no epoch has metrics yet")

    def series(key: str, over: list[dict]) -> list[float]:
        return [math.nan if m.get(key) is None else m[key] for m in over]

    # The held-out figures are drawn over the evaluated epochs only (the job may evaluate
    # every N-th epoch), so that their line joins them.
    evaluated = [m for m in metrics if m["test_accuracy"] is not None]
    epochs = [m["epoch"] for m in metrics]
    evaluated_epochs = [m["epoch"] for m in evaluated]
    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    loss, accuracy = figure.subplots(1, 2)
    marker = "o" if len(epochs) <= 30 else None
    loss.plot(epochs, series("loss", metrics), marker=marker, label="training loss")
    loss.plot(evaluated_epochs, series("test_loss", evaluated), marker=marker,
              label="held-out loss")
    accuracy.plot(epochs, series("accuracy", metrics), marker=marker, label="training accuracy")
    accuracy.plot(evaluated_epochs, series("test_accuracy", evaluated), marker=marker,
                  label="held-out accuracy")
    with_auc = any(m.get("test_auc") is not None for m in metrics)
    if with_auc:
        accuracy.plot(evaluated_epochs, series("test_auc", evaluated), marker=marker,
                      label="held-out AUC")
    for axes, name in ((loss, "loss"), (accuracy, "accuracy, AUC" if with_auc else "accuracy")):
        axes.set_xlabel("epoch")
        axes.set_ylabel(name)
        axes.grid(True, alpha=0.3)
        axes.legend()
        axes.xaxis.get_major_locator().set_params(integer=True)
    spec = status["job"].get("spec") or {}
    if spec:
        figure.suptitle(f"{spec.get('model')} on {spec.get('data')}, "
                        f"{status['job']['state']} ({len(epochs)}/{status['job']['epochs']} "
                        "epochs)")
    figure.savefig(out)
    return len(epochs)


# What `plot` reads of `ps-ctl status --json`: the job's fields, and each epoch's.
_PLOTTED_JOB_FIELDS = {"state", "epochs", "metrics"}
_PLOTTED_EPOCH_FIELDS = {"epoch", "examples", "loss", "accuracy", "test_loss", "test_accuracy"}


def _status_from(source: str) -> dict:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    status = json.loads(text)
    job = status.get("job") if isinstance(status, dict) else None
    if not (isinstance(job, dict) and _PLOTTED_JOB_FIELDS <= job.keys()
            and isinstance(job["metrics"], list)
            and all(isinstance(m, dict) and _PLOTTED_EPOCH_FIELDS <= m.keys()
                    for m in job["metrics"])):
        raise ValueError("not the output of ps-ctl status --json")
    return status


# ---- the command ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-ctl", description="Inspect a paramserve cluster.")
    p.add_argument("--coordinator", type=parse_address, help="coordinator HOST:PORT "
                   "(status, checkpoint, plot without --from); default: TF_CONFIG's "
                   "cluster.chief, where TF_CONFIG is set")
    p.add_argument("--timeout", type=parse_seconds, metavar="SECONDS",
                   help="give up when the coordinator does not answer within this time "
                   "(default 5; 600 for checkpoint: writing a large model takes a while)")
    add_token_argument(p)
    add_tls_arguments(p, daemon=False)
    sub = p.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="members, shards, job progress and metrics")
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.add_argument("--watch", type=parse_seconds, nargs="?", const=2.0, metavar="SECONDS",
                        help="show it again every SECONDS (default 2) until the job is over "
                        "(exit 0 when done, 1 when failed) or Ctrl-C; with --json, one "
                        "object per line")
    status.add_argument("--count", type=int, metavar="N",
                        help="with --watch: stop after N refreshes (exit 0)")
    status.add_argument("--timeout", type=parse_seconds, default=argparse.SUPPRESS,
                        metavar="SECONDS", help="as the --timeout before the command")
    checkpoint = sub.add_parser("checkpoint", help="take a checkpoint now; prints its id "
                                "and step as JSON once it is complete")
    checkpoint.add_argument("--timeout", type=parse_seconds, default=argparse.SUPPRESS,
                            metavar="SECONDS", help="as the --timeout before the command "
                            "(default for checkpoint: 600)")
    drawing = sub.add_parser("plot", help="draw the per-epoch loss and accuracy (training "
                             f"and held-out) into an image; needs {PLOT_INSTALL}")
    drawing.add_argument("--out", type=Path, default=Path("curve.png"), metavar="FILE",
                         help="the image to write: .png (default curve.png), .svg or .pdf")
    drawing.add_argument("--from", dest="source", metavar="FILE",
                         help="read the status from FILE (what `ps-ctl status --json` printed; "
                         "- for stdin) instead of asking the coordinator")
    drawing.add_argument("--timeout", type=parse_seconds, default=argparse.SUPPRESS,
                         metavar="SECONDS", help="as the --timeout before the command")
    probe = sub.add_parser("probe", help="ask a daemon's gRPC health service whether it "
                           "serves: exit 0 when SERVING, 1 otherwise (for container and "
                           "Kubernetes probes, over TLS where native gRPC probes cannot go)")
    probe.add_argument("address", type=parse_address, help="the daemon's HOST:PORT")
    probe.add_argument("--service", default="",
                       help="the service to ask about (default: the whole daemon)")
    probe.add_argument("--timeout", type=parse_seconds, default=argparse.SUPPRESS,
                       metavar="SECONDS", help="as the --timeout before the command")
    for flag in ("--tls-ca", "--tls-cert", "--tls-key"):  # also after `probe`, as probes write
        probe.add_argument(flag, metavar="FILE", default=argparse.SUPPRESS,
                           help=f"as the {flag} before the command")
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
    if args.timeout is None:  # given neither before nor after the command
        args.timeout = 600.0 if args.command == "checkpoint" else 5.0
    if args.command == "probe":
        return _probe(args.address, args.service, args.timeout, tls)
    if args.command == "status":
        if args.watch is not None and not args.watch > 0:
            parser.error(f"--watch {args.watch}: must be a number of seconds > 0")
        if args.count is not None and (args.watch is None or args.count < 1):
            parser.error(f"--count {args.count}: needs --watch and N >= 1")
    local = args.command == "plot" and args.source is not None
    # Where the address came from, for errors: the flag at fault, as ps-worker names it.
    where = "--coordinator" if args.coordinator is not None else f"{TF_CONFIG_ENV} cluster.chief"
    if args.coordinator is None and not local and os.environ.get(TF_CONFIG_ENV, "").strip():
        # Inside a TFJob's pod (`kubectl exec ... ps-ctl status`): the chief is the coordinator.
        try:
            args.coordinator = parse_tf_config(os.environ[TF_CONFIG_ENV]).chief
        except TFConfigError as error:
            fail(parser, f"no --coordinator, and {error}")
    if args.coordinator is None and not local:
        fail(parser, f"{args.command}: needs --coordinator HOST:PORT")
    if local:
        try:
            status = _status_from(args.source)
        except (OSError, ValueError) as error:  # unreadable, or not a status
            print(f"ps-ctl plot: --from {args.source}: {error}", file=sys.stderr)
            return 1
    else:
        try:
            with CoordinatorClient(args.coordinator, give_up_after_s=args.timeout,
                                   rpc_timeout_s=args.timeout, token=token,
                                   tls=tls, address_from=where) as coordinator:
                if args.command == "checkpoint":
                    print(json.dumps(coordinator.checkpoint()))
                    return 0
                if args.command == "status" and args.watch is not None:
                    return watch(lambda: coordinator.status(watching=True),
                                 interval_s=args.watch,
                                 as_json=args.json, count=args.count)
                status = coordinator.status()
        except KeyboardInterrupt:  # Ctrl-C, e.g. ending --watch
            return 130
        except CoordinatorUnreachable as error:
            print(f"ps-ctl: {where} {args.coordinator}: {error}", file=sys.stderr)
            return 1
        except RemoteError as error:
            print(f"ps-ctl: {error}", file=sys.stderr)
            return 1
    if args.command == "plot":
        try:
            epochs = plot(status, args.out)
        except PlotUnavailable as error:
            print(f"ps-ctl: {error}", file=sys.stderr)
            return 1
        except (OSError, ValueError) as error:
            print(f"ps-ctl plot: {error}", file=sys.stderr)
            return 1
        print(f"ps-ctl: wrote {args.out} ({epochs} epoch(s))")
        return 0
    print(strict_json(status, indent=2) if args.json else render(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
