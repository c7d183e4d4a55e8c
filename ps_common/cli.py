"""Command-line helpers shared by every ps-* entry point: sizes, addresses, logging, and
running a daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import ctypes
import decimal
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import thread as futures_thread
from typing import Mapping, NoReturn

from ps_common.auth import TOKEN_FILE_ENV, token_from
from ps_common.tf_config import TF_CONFIG_ENV, Task, TFConfigError, split_address, task_for
from ps_common.tls import TLS

DEFAULT_HOST = "127.0.0.1"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str) -> int:
    """'64MiB', '1.5GB', '4096' -> bytes (argparse type)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64MiB or 2GB")
    unit = (match.group(2) or "").lower().rstrip("b")
    return int(decimal.Decimal(match.group(1)) * _UNITS[unit])


def parse_seconds(text: str) -> float:
    """A finite number of seconds > 0 (argparse type): NaN and inf are refused too, which
    float() takes and every comparison lets through."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def parse_seconds_or_zero(text: str) -> float:
    """A finite number of seconds >= 0 (argparse type)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
    return value


def parse_address(text: str) -> str:
    """HOST:PORT, an IPv6 host in brackets (argparse type)."""
    try:
        split_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    """--host, --port and --log-level: what every ps-* daemon takes. --host and --port
    default to None, so that a command can tell whether they were given (bind_of)."""
    parser.add_argument("--host", help=f"interface to bind (default {DEFAULT_HOST}, or what "
                        f"{TF_CONFIG_ENV} says; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, help=f"port to bind; 0 = any free port (default "
                        f"0, or the port of this task's entry in {TF_CONFIG_ENV})")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def parse_port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535 (argparse type)."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return int(text)


def add_metrics_argument(parser: argparse.ArgumentParser, host: str = "--host") -> None:
    """--metrics-port: Prometheus metrics over HTTP, on every daemon and worker."""
    parser.add_argument("--metrics-port", type=parse_port, metavar="PORT",
                        help="serve Prometheus metrics (paramserve_*) at "
                        f"http://HOST:PORT/metrics, HOST being {host}; 0 = any free port "
                        "(its URL is printed at start); default: no metrics")


def add_shared_memory_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--no-shm: the same flag on every command that moves tensors or starts what does."""
    parser.add_argument("--no-shm", action="store_true", help=f"do not {what}")


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    """--token-file: the cluster's shared token (ps_common.auth), on every command."""
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the cluster's shared token: daemons refuse calls "
                        "without it (UNAUTHENTICATED), clients send it on every call "
                        f"(default: the file named by {TOKEN_FILE_ENV}, if set; else none)")


def token_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The token --token-file (or PARAMSERVE_TOKEN_FILE) gives; a bad file is a usage error
    naming the flag or variable."""
    try:
        return token_from(args.token_file)
    except ValueError as error:
        fail(parser, str(error))
        raise


def add_tls_arguments(parser: argparse.ArgumentParser, *, daemon: bool) -> None:
    """--tls-*: TLS (ps_common.tls), on every command. A daemon serves with its certificate
    and calls other daemons with it; a client presents one only for mutual TLS."""
    parser.add_argument("--tls-ca", metavar="FILE",
                        help="PEM file of the CA that signed the daemons' certificates: calls "
                        "go over TLS and check them against it")
    own = ("this daemon's certificate chain (PEM): it serves TLS only, and presents it when "
           "calling other daemons" if daemon else
           "this client's certificate (PEM), for daemons that require one (mutual TLS)")
    parser.add_argument("--tls-cert", metavar="FILE", help=own)
    parser.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    if daemon:
        parser.add_argument("--tls-client-ca", metavar="FILE",
                            help="mutual TLS: refuse callers without a certificate signed by "
                            "this CA (PEM)")


def tls_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TLS | None:
    """The TLS settings --tls-* give (None: plaintext); a bad file or combination is a usage
    error naming the flag."""
    try:
        tls = TLS.from_files(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                             client_ca=getattr(args, "tls_client_ca", None))
        if tls is not None and hasattr(args, "tls_client_ca"):
            tls.check_daemon()
        return tls
    except ValueError as error:
        fail(parser, str(error))
        raise


def tf_config_task(parser: argparse.ArgumentParser, args: argparse.Namespace, command: str,
                   address_flags: tuple[str, ...],
                   environ: Mapping[str, str]) -> Task | None:
    """What TF_CONFIG (ps_common.tf_config) in `environ` gives `command`, or None: when it is
    unset or empty, or when any of `address_flags` (attribute names of `args`) was given.
    Flags win, and then TF_CONFIG is not read at all. A malformed TF_CONFIG, or one whose
    task is another command's, is a usage error naming TF_CONFIG."""
    text = environ.get(TF_CONFIG_ENV, "")
    if not text.strip():
        return None
    log = logging.getLogger(parser.prog)
    given = [f"--{name.replace('_', '-')}" for name in address_flags
             if getattr(args, name) is not None]
    if given:
        log.info("%s is set, but %s given: the flags say where this process is, and %s is not "
                 "read", TF_CONFIG_ENV, ", ".join(given), TF_CONFIG_ENV)
        return None
    try:
        task = task_for(command, text)
    except TFConfigError as error:
        fail(parser, str(error))
        raise
    log.info("%s", task.describe())
    return task


def bind_of(args: argparse.Namespace, task: Task | None) -> tuple[str, int]:
    """(host, port) a daemon binds: the flags, else its TF_CONFIG entry, else the defaults."""
    host = args.host if args.host is not None else (task.bind_host if task else DEFAULT_HOST)
    port = args.port if args.port is not None else (task.port if task else 0)
    return host, port


def add_server_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """--server-timeout and --reinitialize-lost-shards: what the coordinator does about a
    parameter server that is gone or came back without its shards (ps-coordinator, and
    ps-cluster, which passes them on)."""
    parser.add_argument("--server-timeout", type=parse_seconds, default=60.0, metavar="SECONDS",
                        help="how long a parameter server holding shards may stay unreachable "
                        "before the job fails naming it (default 60)")
    parser.add_argument("--reinitialize-lost-shards", action="store_true",
                        help="when a server comes back without the shards it held, re-create "
                        "them from their initializers and go on (default: the job fails: "
                        "DATA_LOSS)")


# Set by ps-cluster in its children's environment: its pid (see `die_with_parent`).
DIE_WITH_ENV = "PARAMSERVE_DIE_WITH"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """In a child of ps-cluster (DIE_WITH_ENV names its pid): have Linux send this process
    SIGTERM when ps-cluster dies, even by SIGKILL (PR_SET_PDEATHSIG), so that no child
    outlives it; each then stops gracefully, bounded by its own --grace. If ps-cluster is
    gone already, exit at once: nobody would signal this process.

    The child sets it itself, first thing, rather than ps-cluster in a `preexec_fn`
    between fork and exec: a `preexec_fn` makes Python fork() instead of vfork(), and a
    fork while gRPC's threads run in ps-cluster (its status client's) may crash the child
    before it execs (gRPC restarts its poller in the child, on an epoll descriptor that
    closing the inherited descriptors then closes). The variable is removed from the
    environment, so that processes this one starts do not take ps-cluster for their parent.
    Elsewhere than Linux there is no such signal: children may be orphaned."""
    parent = os.environ.pop(DIE_WITH_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if str(os.getppid()) != parent:  # gone before the line above: no signal will come
        sys.exit(f"{DIE_WITH_ENV}: ps-cluster (pid {parent}) is gone; not starting")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class StopSignals:
    """SIGTERM and SIGINT recorded in `requested` instead of ending the process, from its
    making until `restore()`. A daemon makes it first thing, so that a signal during its
    startup is served by the graceful stop (which removes what startup made, e.g. a server's
    shared-memory segments) instead of killing it half-built."""

    def __init__(self):
        # A plain list, not an Event: the handler must take no lock. A Python handler can
        # run again, nested, while its first run holds a lock (Event.set's), and deadlock on
        # it: a second SIGTERM comes soon enough, e.g. PR_SET_PDEATHSIG is sent once for
        # each thread of a multi-threaded parent that dies (ps-cluster's children).
        self.requested: list[int] = []
        self._previous = {s: signal.signal(s, self._on_signal)
                          for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum, frame) -> None:
        self.requested.append(signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def run_until_signal(stop, wait, announce, signals: StopSignals | None = None) -> int:
    """Call `announce()` (print the ready line), then block until SIGTERM or SIGINT (then
    call `stop()` for a graceful shutdown) or until `wait(timeout)` reports the daemon ended
    by itself. Handlers are installed before the announcement (or earlier: `signals`, made
    before startup), so a signal sent as soon as the ready line appears is still graceful.
    Returns the exit status, 0."""
    signals = signals or StopSignals()
    announce()
    try:
        while not signals.requested:
            if wait(0.2):
                return 0
    finally:
        signals.restore()
    stop()
    return 0


# After a graceful stop, how long threads still running (handlers past --grace) may take to
# end before the process ends without them.
LINGER_S = 0.2


def _joined_at_exit() -> list[threading.Thread]:
    """Threads the interpreter waits for at exit: non-daemon ones, and thread-pool workers
    (concurrent.futures joins those at exit whatever their daemon flag; gRPC's handlers
    are such workers)."""
    pool_workers = set(getattr(futures_thread, "_threads_queues", {}))
    return [t for t in threading.enumerate() if t is not threading.current_thread()
            and t.is_alive() and (not t.daemon or t in pool_workers)]


def exit_after_stop(code: int) -> NoReturn:
    """End a daemon's process with `code` once its graceful stop is over: calls still running
    get LINGER_S more, then are abandoned (a checkpoint write to a slow disk, a call to an
    unreachable peer must not keep a stopped process alive), and the interpreter's own
    teardown is skipped, logs and output flushed first: it would join such threads, and
    grpcio objects torn down while one of its daemon threads holds their lock hang it."""
    deadline = time.monotonic() + LINGER_S
    for thread in _joined_at_exit():
        thread.join(max(0.0, deadline - time.monotonic()))
    if _joined_at_exit():
        logging.getLogger(__name__).warning(
            "calls still running after the stop are abandoned; exiting")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 with `message` in argparse's format (it names the flag at fault)."""
    parser.error(message)
