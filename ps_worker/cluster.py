"""`ps-cluster`: a whole cluster on 127.0.0.1, one command.

Starts a coordinator (with the job), S servers and W workers as child processes, shows
progress, stops every child it started on exit or Ctrl-C, and prints as its last line a JSON
object with the outcome. It starts processes by module name and reads the coordinator's
status over gRPC: it imports none of the daemons' internals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ps_common.cli import (
    DIE_WITH_ENV, add_server_loss_arguments, add_shared_memory_argument, add_tls_arguments,
    add_token_argument, parse_bytes, parse_port, parse_seconds, tls_of, token_of,
)
from ps_common.checkpoints import Interval
from ps_common.job import JobError, JobSpec, add_job_arguments, job_from_args
from ps_common.progress import epoch_line, figure, strict_json
from ps_common.status import RemoteError
from ps_common.tls import TLS
from ps_worker.backend import device_flag_problem
from ps_worker.chaos import ChaosError, ChaosMonkey
from ps_worker.chaos import plan as chaos_plan
from ps_worker.coordinator_client import CoordinatorClient, CoordinatorUnreachable

READY_TIMEOUT_S = 60.0
KILL_WAIT_S = 10.0
# Short, so that a server killed by --chaos loses little (the default job lasts seconds).
CHAOS_CHECKPOINT_EVERY = "20steps"
# Three kills and their recoveries take seconds (restarts, heartbeats, a checkpoint first),
# about as long as the whole default 10-epoch job over shared memory: a --chaos job given
# no epochs (by flag or job file) runs this many, so that it outlasts them.
CHAOS_EPOCHS = 30
# Piped progress (not a terminal): a line at least this often while an epoch runs.
PIPED_INTERVAL_S = 10.0


class ClusterError(RuntimeError):
    pass


BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_environment(workers: int) -> dict[str, str]:
    """The workers' environment: the machine's cores split between them for BLAS, unless the
    user set these already. Several processes whose BLAS threads each spin on every core slow
    each other down several times over (W1: 17 -> 60 steps/s on 2 cores with 2 workers)."""
    return _blas_environment(str(max(1, (os.cpu_count() or 1) // max(1, workers))))


def _blas_environment(threads: str) -> dict[str, str]:
    """os.environ with every BLAS thread variable set: to the user's value where the user
    set one of them (OpenBLAS reads its own variable before OMP_NUM_THREADS, so filling the
    others with `threads` would overrule a user's OMP_NUM_THREADS), else to `threads`."""
    given = next((os.environ[k] for k in BLAS_THREAD_VARIABLES if os.environ.get(k)), None)
    default = threads if given is None else given
    return {**os.environ, **{k: os.environ.get(k) or default for k in BLAS_THREAD_VARIABLES}}


def daemon_environment() -> dict[str, str]:
    """The coordinator's and the servers' environment: one BLAS thread each, unless the user
    set these already. They never multiply matrices (optimizers are elementwise), and a BLAS
    library starts a thread per core when numpy is imported: 63 idle threads per daemon on a
    64-core host, which count against the host's process limit all the same."""
    return _blas_environment("1")


class SignalFlag:
    """A flag that a signal handler sets. Not a threading.Event: a Python handler runs on
    the main thread between two bytecodes, possibly inside Event.wait's locked section or
    inside its own earlier run (a second Ctrl-C), and Event.set would then wait forever for
    that lock. Appending to a list takes none; `wait` polls."""

    def __init__(self):
        self._set: list[bool] = []

    def set(self) -> None:
        self._set.append(True)

    def is_set(self) -> bool:
        return bool(self._set)

    def wait(self, timeout: float) -> bool:
        time.sleep(timeout)  # a handler runs during it; the sleep then ends as planned
        return self.is_set()


class Child:
    """One child process with its output in `log_dir/name.log`. Start (and restart) it from
    the main thread: the child asks Linux for SIGTERM when the thread that started it ends
    (ps_common.cli.die_with_parent), and the main thread ends only with ps-cluster.

    `restart()` starts it again as a supervisor would (docker compose's `restart:
    on-failure`, a StatefulSet): the same command line and, for a daemon whose address was
    read with `wait_for_address`, the same address (its `--port 0` becomes the port it got).
    Each incarnation logs to its own file: `name.log`, then `name.restart-1.log`, ...
    `process` and `log_path` are the current incarnation's."""

    def __init__(self, name: str, argv: list[str], log_dir: Path,
                 env: dict[str, str] | None = None):
        self.name = name
        self.address: str | None = None
        self.restarts = 0
        self._argv, self._env, self._log_dir = argv, env, log_dir
        self._start()

    def _start(self) -> None:
        suffix = f".restart-{self.restarts}" if self.restarts else ""
        self.log_path = self._log_dir / f"{self.name}{suffix}.log"
        self._log = open(self.log_path, "wb")
        env = self._env if self._env is not None else os.environ
        # No preexec_fn (see die_with_parent): Python then starts the child with vfork.
        self.process = subprocess.Popen(
            self._argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**env, DIE_WITH_ENV: str(os.getpid())},
            start_new_session=True)  # Ctrl-C reaches ps-cluster only; it stops children itself

    def wait_for_address(self, deadline: float) -> str:
        """The HOST:PORT from the child's 'listening on HOST:PORT' line."""
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if " listening on " in line:
                    self.address = line.rsplit(" ", 1)[-1]
                    return self.address
            if self.process.poll() is not None:
                raise ClusterError(f"{self.name} exited with {self.process.returncode} before "
                                   f"it was ready{_last_error(self)}; see {self.log_path}")
            time.sleep(0.05)
        raise ClusterError(f"{self.name} was not ready within {READY_TIMEOUT_S:g} s; "
                           f"see {self.log_path}")

    def kill(self) -> bool:
        """SIGKILL, and reap it (a killed process exits at once; bounded all the same).
        True if the SIGKILL ended it; False if it had exited by itself (its exit status is
        its own, even when it exited between the check and the signal)."""
        if self.process.poll() is None:
            self.process.kill()
            try:
                self.process.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{self.name} (pid {self.process.pid}) did not exit within "
                                   f"{KILL_WAIT_S:g} s of SIGKILL") from None
        self._log.close()
        return self.process.returncode == -signal.SIGKILL

    def restart(self) -> None:
        """Start it again (it must have exited); a daemon is ready on its old address when
        this returns. Raises ClusterError if it is not (e.g. another process took the port)."""
        if self.process.poll() is None:
            raise ClusterError(f"{self.name} is still running; it cannot be restarted")
        self._log.close()
        previous = self.address
        if previous is not None:
            self._argv = _on_port(self._argv, previous.rsplit(":", 1)[1])
        self.restarts += 1
        self._start()
        if previous is not None:
            address = self.wait_for_address(time.monotonic() + READY_TIMEOUT_S)
            if address != previous:
                raise ClusterError(f"{self.name} came back on {address}, not on {previous}")

    def stop(self, grace_s: float, impatient: SignalFlag | None = None) -> None:
        """SIGTERM, up to `grace_s` for a clean exit (cut short by `impatient`), SIGKILL."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            impatient = impatient or SignalFlag()
            deadline = time.monotonic() + grace_s
            while self.process.poll() is None and time.monotonic() < deadline:
                if impatient.wait(0.05):
                    break
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(5.0)
        self._log.close()

    @property
    def returncode(self) -> int | None:
        return self.process.poll()


def _on_port(argv: list[str], port: str) -> list[str]:
    """`argv` with the value of its `--port` replaced by `port`."""
    i = argv.index("--port")
    return [*argv[:i + 1], port, *argv[i + 2:]]


class Progress:
    """What ps-cluster shows while the job runs, from the coordinator's status.

    On a terminal: a bar for the current epoch, redrawn in place and cut to the terminal's
    width, and a line per epoch as it is over (`epoch_line`).

    Piped (a file, a CI log): lines only, at regular points. One line per epoch as it is over,
    whose steps are the job's steps up to the end of that epoch (the sum of the epochs'
    steps, however late the status that showed it was read: consecutive lines differ by
    one epoch's steps). While no line has been printed for `interval_s`, a line with the
    job's steps so far and the rate since the previous such line, every `interval_s`.

    `clock` (monotonic seconds) is injected for tests. Not thread-safe: one thread updates.
    """

    def __init__(self, stream, epochs: int, *, clock=time.monotonic,
                 interval_s: float = PIPED_INTERVAL_S, width: int | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.epochs = epochs
        self.reported: set[int] = set()
        self._clock = clock
        self._interval_s = interval_s
        self._width = width  # None: the terminal's, read at every redraw
        now = clock()
        self._last_steps = (0, now)  # (steps, when) the rate is measured from
        self._rate = 0.0
        self._last_line_at = now

    def update(self, status: dict) -> None:
        job = status["job"]
        now = self._clock()
        through = 0  # the job's steps up to the end of each epoch
        for m in job["metrics"]:
            through += m.get("steps", 0)
            if not m["over"]:
                break  # epochs are over in order (an evaluation runs beside the next epoch)
            if m["epoch"] not in self.reported:
                self.reported.add(m["epoch"])
                self._line(epoch_line(m["epoch"], self.epochs, loss=m["loss"],
                                      accuracy=m["accuracy"], test_accuracy=m["test_accuracy"],
                                      test_auc=m.get("test_auc"), steps=through))
        if job["state"] != "running":
            return
        if self.tty:
            self._bar(status, now)
        elif now - self._last_line_at >= self._interval_s:
            steps, then = self._last_steps
            rate = max(0.0, job["steps"] - steps) / (now - then) if now > then else 0.0
            self._last_steps = (job["steps"], now)
            self._line(f"epoch {job['epoch']}/{job['epochs']}  training  tasks "
                       f"{job['tasks_done']}/{job['tasks_total']}  steps {job['steps']}  "
                       f"{rate:.0f} steps/s  workers {_alive(status)}")

    def _bar(self, status: dict, now: float) -> None:
        job = status["job"]
        steps, then = self._last_steps
        if now - then >= 0.5:
            self._rate = (job["steps"] - steps) / (now - then)
            self._last_steps = (job["steps"], now)
        per_epoch, done_in_epoch = job["epoch_tasks"], job["epoch_tasks_done"]
        width = 12
        filled = int(width * max(0, min(done_in_epoch, per_epoch)) / max(1, per_epoch))
        current = job["metrics"][-1] if job["metrics"] else None
        figures = (f"  train: loss {figure(current['loss'])} acc {figure(current['accuracy'])}"
                   if current and current["examples"] else "")
        text = (f"epoch {job['epoch']}/{job['epochs']} [{'#' * filled}{'.' * (width - filled)}]"
                f" {self._rate:.0f} steps/s  workers {_alive(status)}{figures}")
        columns = self._width or shutil.get_terminal_size((80, 24)).columns
        # One character short of the width: a full line would wrap, and \r would then
        # return to the wrapped part only. The epoch's training figures come last: the
        # epoch's line shows them when it ends.
        self.stream.write("\r\033[K" + text[:max(1, columns - 1)])
        self.stream.flush()

    def _line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last_line_at = self._clock()

    def note(self, text: str) -> None:
        self._line(text)


def _alive(status: dict) -> int:
    return sum(w["state"] == "alive" for w in status["workers"])


def with_model_directory(env: dict[str, str], directory: str) -> dict[str, str]:
    """`env` with `directory` first on PYTHONPATH: workers find a `--model module:attribute`
    whose module is in ps-cluster's working directory, whatever their own sys.path."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([directory, *(p for p in paths
                                                               if p != directory)])}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-cluster", description="Run a coordinator, S servers and W workers on "
        "127.0.0.1 and train the job (default: an MLP on the digits data set).")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu",
                   help="workers' --device (default cpu); with auto or cuda, worker i uses GPU "
                   "i mod the GPUs visible")
    p.add_argument("--heartbeat-interval", type=parse_seconds, default=0.5, metavar="SECONDS")
    p.add_argument("--heartbeat-timeout", type=parse_seconds, default=5.0, metavar="SECONDS")
    p.add_argument("--split-threshold", type=parse_bytes, default="64MiB")
    add_server_loss_arguments(p)
    p.add_argument("--keep-serving", action="store_true",
                   help="keep the coordinator and servers up after the job, until Ctrl-C, "
                   "so the model stays readable (workers exit when the job ends)")
    add_token_argument(p)
    add_tls_arguments(p, daemon=True)
    add_shared_memory_argument(p, "let workers and servers use shared memory (they share this "
                               "host); everything goes over gRPC")
    p.add_argument("--log-dir", help="where children's logs go (default: a new temp dir)")
    p.add_argument("--metrics-port", type=parse_port, metavar="BASE",
                   help="every child serves Prometheus metrics: the coordinator on port BASE, "
                   "server i on BASE+1+i, worker i on BASE+1+SERVERS+i (0: each on a free "
                   "port, printed in its log); default: no metrics")
    g = p.add_argument_group("checkpoints and chaos")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="the coordinator's --checkpoint-dir: servers write checkpoints here "
                   "and a restarted server or coordinator resumes from them (default: none; "
                   "with --chaos, LOG_DIR/checkpoints)")
    g.add_argument("--checkpoint-every", metavar="INTERVAL",
                   help="the coordinator's --checkpoint-every, e.g. 30s or 500steps (default: "
                   f"the coordinator's; with --chaos, {CHAOS_CHECKPOINT_EVERY})")
    g.add_argument("--chaos", action="store_true",
                   help="during the job, SIGKILL a random worker, then a random server, then "
                   "the coordinator, one at a time, restarting each with the same command "
                   "and waiting for the cluster to recover before the next")
    g.add_argument("--chaos-seed", type=int, metavar="N",
                   help="which worker and server --chaos kills (default: random, printed)")
    add_job_arguments(p)
    return p


def metrics_ports(base: int, servers: int, workers: int) -> str:
    """Which child serves metrics on which port, for --metrics-port BASE."""
    def span(first: int, count: int) -> str:
        return f"{first}" if count == 1 else f"{first}-{first + count - 1}"

    parts = [f"coordinator {base}", f"server(s) {span(base + 1, servers)}"]
    if workers:
        parts.append(f"worker(s) {span(base + 1 + servers, workers)}")
    return ", ".join(parts)


def worker_command(coordinator: str, index: int, device: str, flags: list[str]) -> list[str]:
    """The command of worker `index`: local rank `index`, so that with `--device auto` or
    `cuda` the workers spread over the host's GPUs instead of all computing on GPU 0."""
    return _python("ps_worker.cli", "--coordinator", coordinator, "--worker-id",
                   f"worker-{index}", "--device", device, "--local-rank", str(index), *flags)


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _names_epochs(job_file: str) -> bool:
    """Whether the job file sets `epochs` (job_from_args has read and checked it already)."""
    values = yaml.safe_load(Path(job_file).read_text())
    return isinstance(values, dict) and "epochs" in values


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.servers < 1:
        parser.error(f"--servers {args.servers}: need at least 1")
    if args.workers < 0:
        parser.error(f"--workers {args.workers}: must be >= 0")
    if args.chaos_seed is not None and not args.chaos:
        parser.error("--chaos-seed is for --chaos")
    if args.metrics_port and args.metrics_port + args.servers + args.workers > 65535:
        parser.error(f"--metrics-port {args.metrics_port}: its {1 + args.servers + args.workers} "
                     "ports must end at 65535 or below")
    _check_children_flags(parser, args)
    token = token_of(parser, args)  # checked here; children read the same file
    tls = tls_of(parser, args)  # the same: the files are passed on
    # `--model mymodule:Model` may name a module in this directory: found here (the job is
    # checked below) and by the workers (PYTHONPATH), as PYTHONPATH=. would.
    from ps_worker.models.registry import find_models_in

    model_directory = os.getcwd()
    find_models_in(model_directory)
    try:
        job = job_from_args(args) or JobSpec()
        if args.chaos and args.epochs is None and not (args.job and _names_epochs(args.job)):
            job = dataclasses.replace(job, epochs=CHAOS_EPOCHS)
        _check_job_runs_here(job)
    except JobError as error:
        parser.error(str(error))
    except ValueError as error:
        parser.error(f"the job cannot run: {error}")

    if args.checkpoint_every is not None and not (args.checkpoint_dir or job.checkpoint_dir
                                                  or args.chaos):
        parser.error(f"--checkpoint-every {args.checkpoint_every}: needs --checkpoint-dir")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ps-cluster-")).resolve()
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--log-dir {args.log_dir}: cannot make it a directory "
                     f"({error.strerror or error})")
    checkpoint_dir = _checkpoint_dir(args, job, log_dir)
    checkpoint_every = args.checkpoint_every or (CHAOS_CHECKPOINT_EVERY if args.chaos else None)
    chaos_seed = args.chaos_seed if args.chaos_seed is not None else \
        random.SystemRandom().randrange(2**31)
    job_file = log_dir / "job.json"
    job_file.write_text(job.to_json())
    progress = Progress(sys.stdout, job.epochs)
    children: list[Child] = []
    interrupted = False
    served = False  # a --keep-serving run ended by Ctrl-C after its job
    seen: dict = {}  # what the monitor saw (_monitor)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    outcome = {"state": "failed"}
    chaos: ChaosMonkey | None = None
    def metrics(index: int) -> list[str]:
        """The --metrics-port of the index-th child (coordinator, servers, workers)."""
        if args.metrics_port is None:
            return []
        return ["--metrics-port", str(args.metrics_port and args.metrics_port + index)]

    try:
        hb = ["--heartbeat-interval", str(args.heartbeat_interval)]
        passed_on = ["--no-shm"] if args.no_shm else []  # flags every child gets
        # Children inherit PARAMSERVE_TOKEN_FILE; a --token-file is passed on.
        passed_on += ["--token-file", args.token_file] if args.token_file else []
        # Every child gets the daemons' TLS settings: workers present the daemons'
        # certificate (valid as a client's too) where --tls-client-ca asks for one.
        tls_flags = [(flag, os.path.abspath(path)) for flag, path in (
            ("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
            ("--tls-key", args.tls_key)) if path]
        passed_on += [part for pair in tls_flags for part in pair]
        client_ca = (["--tls-client-ca", os.path.abspath(args.tls_client_ca)]
                     if args.tls_client_ca else [])
        coordinator = Child("coordinator", _python(
            "ps_server.coordinator.cli", "--port", "0", "--job", str(job_file), *hb,
            "--heartbeat-timeout", str(args.heartbeat_timeout),
            "--split-threshold", str(args.split_threshold),
            # A new cluster: no predecessor's servers to wait for. Safe for the coordinator
            # --chaos restarts too: the first server back reports the whole shard map, and
            # nothing is placed while a server named in it is not back.
            "--recovery-grace", "0", "--server-timeout", str(args.server_timeout),
            # The first variables are spread over every server it starts.
            "--expect-servers", str(args.servers),
            *(["--reinitialize-lost-shards"] if args.reinitialize_lost_shards else []),
            *(["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else []),
            *(["--checkpoint-every", checkpoint_every] if checkpoint_every else []),
            *(["--keep-serving"] if args.keep_serving else []), *metrics(0), *passed_on,
            *client_ca),
            log_dir, env=daemon_environment())
        children.append(coordinator)
        address = coordinator.wait_for_address(time.monotonic() + READY_TIMEOUT_S)
        progress.note(f"coordinator on {address}; logs in {log_dir}")
        servers, workers = [], []
        for i in range(args.servers):  # each child is owned (stopped at exit) once it exists
            servers.append(Child(f"server-{i}", _python(
                "ps_server.cli", "--port", "0", "--server-id", f"ps-{i}", "--coordinator",
                address, *hb, *metrics(1 + i), *passed_on, *client_ca), log_dir,
                env=daemon_environment()))
            children.append(servers[-1])
        for server in servers:
            server.wait_for_address(time.monotonic() + READY_TIMEOUT_S)
        for i in range(args.workers):
            workers.append(Child(f"worker-{i}", worker_command(
                address, i, args.device, [*metrics(1 + args.servers + i), *passed_on]),
                log_dir,
                env=with_model_directory(worker_environment(args.workers), model_directory)))
            children.append(workers[-1])
        if not args.workers:
            progress.note(f"--workers 0: the job waits for workers you start yourself: "
                          f"ps-worker --coordinator {address}")
        if args.metrics_port:
            progress.note(f"metrics at http://127.0.0.1:PORT/metrics: "
                          f"{metrics_ports(args.metrics_port, args.servers, args.workers)}")
        progress.note(f"{args.servers} server(s), {args.workers} worker(s): training "
                      f"{job.model} on {job.data} for {job.epochs} epoch(s)")
        if args.chaos:
            progress.note(f"chaos: seed {chaos_seed}; checkpoints in {checkpoint_dir} every "
                          f"{checkpoint_every}")
            targets = chaos_plan(
                chaos_seed, workers={w.name: w.name for w in workers},
                servers={s.name: f"ps-{i}" for i, s in enumerate(servers)})
            chaos = ChaosMonkey(chaos_seed, targets, {c.name: c for c in children},
                                clock=time.monotonic, note=progress.note)
        outcome = _monitor(address, coordinator, workers, progress, args.keep_serving, chaos,
                           token, tls, seen)
        # The monitor missed the last status: the last epoch's line, from the outcome. Only
        # for a job that is done: a failed job's `epochs` is the one it stopped in, never over.
        if outcome.get("state") == "done" and outcome.get("epochs") \
                and outcome["epochs"] not in progress.reported \
                and outcome.get("loss") is not None:
            progress.note(epoch_line(outcome["epochs"], job.epochs, loss=outcome["loss"],
                                     accuracy=outcome["train_accuracy"],
                                     test_accuracy=outcome["accuracy"],
                                     test_auc=outcome.get("auc"), steps=outcome["steps"]))
    except KeyboardInterrupt:
        # With --keep-serving, Ctrl-C is how a run whose job is over ends: its outcome stands.
        summary = None
        if args.keep_serving and children:
            summary = _final_summary(children[0]) or (
                _outcome_of(seen["over"]) if "over" in seen else None)
        if summary is not None:
            outcome, served = summary, True
        else:
            interrupted = True
            outcome = {"state": "interrupted"}
    except (ClusterError, ChaosError, CoordinatorUnreachable) as error:
        progress.note(f"ps-cluster: {error}")
        outcome = {"state": "failed", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - the JSON line is printed whatever happens
        progress.note(f"ps-cluster: unexpected {type(error).__name__}: {error}")
        outcome = {"state": "failed", "error": f"{type(error).__name__}: {error}"}
    finally:
        # A further Ctrl-C / SIGTERM while children are being stopped must not abandon them
        # (they run in their own process groups): it only makes the stopping impatient (SIGKILL).
        impatient = SignalFlag()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: impatient.set())
        # After a job that ended on the coordinator, children exit by themselves: give them
        # time to. After an interrupt or an error, stop them at once.
        ended_normally = (outcome.get("state") in ("done", "failed") and "error" not in outcome
                          and not served)
        # With --keep-serving, the daemons serve until now, but the workers left when the
        # job was over: one still on its way out is let finish, not signalled mid-exit.
        finishing = (children if ended_normally else
                     [c for c in children if c.name.startswith("worker-")]
                     if served and outcome.get("state") == "done" else [])
        exits = _stop_all(children, args.heartbeat_timeout + 10.0 if finishing else 0.0,
                          impatient, finishing)
    outcome.update({"elapsed_s": round(time.monotonic() - started, 3), "exit_codes": exits,
                    "log_dir": str(log_dir)})
    if chaos is not None:
        outcome["chaos"] = chaos.report()
        if outcome["state"] == "done" and not chaos.complete:
            # A chaos run that could not do what it was asked proves less than it claims.
            progress.note(f"ps-cluster: the job ended before chaos was over: "
                          f"{chaos.recoveries} of {len(chaos.targets)} kill(s) done and "
                          "recovered from")
    # Strict JSON: a loss that overflowed is null there (the coordinator's summary maps it
    # so already; this covers whatever else the outcome gathered).
    print(strict_json(outcome), flush=True)
    if interrupted:
        return 130
    clean = all(code == 0 for code in exits.values())
    chaos_done = chaos is None or chaos.complete
    return 0 if outcome["state"] == "done" and clean and chaos_done else 1


def _check_children_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (exit 2) a value that ps-cluster passes on and a child would refuse, before
    anything starts: the child's refusal would come after the others had started."""
    device_problem = device_flag_problem(args.device)
    if device_problem:
        parser.error(device_problem)
    if args.heartbeat_timeout <= args.heartbeat_interval:
        parser.error(f"--heartbeat-interval {args.heartbeat_interval:g} must be below "
                     f"--heartbeat-timeout {args.heartbeat_timeout:g}")
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        parser.error("--checkpoint-dir: an empty path; name a directory")
    if args.split_threshold < 1:
        parser.error(f"--split-threshold {args.split_threshold}: must be at least 1 byte")
    if args.checkpoint_every is not None:
        try:
            Interval.parse_flag(args.checkpoint_every)
        except ValueError as error:
            parser.error(str(error))


def _checkpoint_dir(args: argparse.Namespace, job: JobSpec, log_dir: Path) -> Path | None:
    """Where checkpoints go, as an absolute path (the children's working directory is not
    part of their command): --checkpoint-dir, else the job's checkpoint_dir, else (for
    --chaos, which restarts servers) LOG_DIR/checkpoints."""
    chosen = args.checkpoint_dir or job.checkpoint_dir or (
        str(log_dir / "checkpoints") if args.chaos else None)
    return Path(chosen).resolve() if chosen else None


def _check_job_runs_here(job: JobSpec) -> None:
    """Load the data and build the model once, so a bad job fails before anything starts."""
    from ps_worker.data import load_dataset
    from ps_worker.models import build_model

    dataset = load_dataset(job.data, seed=job.seed)
    build_model(job.model, num_features=dataset.num_features,
                num_classes=dataset.num_classes, hidden=job.hidden,
                field_sizes=dataset.field_sizes)


FINISHED_PREFIX = "ps-coordinator finished: "


def _final_summary(coordinator: Child) -> dict | None:
    """The outcome the coordinator printed as it ended (the single source of truth: the
    monitor may have missed the last status while the coordinator was shutting down)."""
    try:
        text = coordinator.log_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(FINISHED_PREFIX):
            try:
                return json.loads(line[len(FINISHED_PREFIX):])
            except ValueError:  # cut short (a full --log-dir): the caller falls back
                return None
    return None


def _monitor(address: str, coordinator: Child, workers: list[Child], progress: Progress,
             keep_serving: bool, chaos: ChaosMonkey | None = None,
             token: str | None = None, tls: TLS | None = None,
             seen: dict | None = None) -> dict:
    """The job's outcome once the coordinator has ended it. `seen["over"]` gets the status
    that said the job was over (for a --keep-serving run that Ctrl-C ends)."""
    seen = {} if seen is None else seen
    noted: set[str] = set()  # workers whose early exit was shown
    last_over: dict | None = None  # the status that said the job was over
    with CoordinatorClient(address, give_up_after_s=2.0, rpc_timeout_s=2.0,
                           token=token, tls=tls) as client:
        while True:
            if coordinator.returncode is not None:
                # The coordinator's own outcome, done or failed (a failed job exits 1 too):
                # its figures and its reason are the job's.
                summary = _final_summary(coordinator)
                if summary is not None:
                    return summary
                if last_over is not None:
                    # Its outcome line never reached the log (a full --log-dir, say): the
                    # status read as the job ended says it instead.
                    return _outcome_of(last_over)
                raise ClusterError(f"the coordinator exited with {coordinator.returncode} "
                                   f"before the job ended; see {coordinator.log_path}")
            # Taken before the status, never after: a status read just before this process
            # was descheduled must not meet workers that have since finished the job and exited.
            workers_gone = bool(workers) and all(w.returncode is not None for w in workers)
            try:
                # Watching: the coordinator, its job over, waits for this read of the outcome
                # before it exits, so every epoch's line is shown even of a job that ends
                # between two reads.
                status = client.status(watching=True)
            except (CoordinatorUnreachable, RemoteError):
                # The coordinator is exiting (its summary is read at the top of the loop),
                # restarting (chaos) or briefly busy; a persistent problem ends when the
                # process does.
                if chaos is not None:
                    chaos.observe(None)  # bounds the wait for a restarted coordinator
                time.sleep(0.1)
                continue
            progress.update(status)
            if chaos is not None:
                chaos.observe(status)  # may kill and restart a child (this main thread)
            state = status["job"]["state"]
            if state in ("done", "failed"):
                last_over = seen["over"] = status
            if state == "running" and chaos is None:
                # A worker gone while the job runs (its metrics port taken, say): the job
                # goes on with the others, and the user is told which and why.
                for worker in workers:
                    if worker.returncode not in (None, 0) and worker.name not in noted:
                        noted.add(worker.name)
                        progress.note(f"ps-cluster: {worker.name} exited with "
                                      f"{worker.returncode}{_last_error(worker)}")
            if keep_serving and state in ("done", "failed"):
                progress.note(f"job {state}; servers keep serving on {address} (Ctrl-C to stop)")
                while coordinator.returncode is None:
                    time.sleep(0.5)
                continue
            if state == "running" and workers_gone:
                raise ClusterError("every worker exited before the job ended"
                                   f"{_last_error(workers[0])}; see {workers[0].log_path}")
            time.sleep(0.25)


def _outcome_of(status: dict) -> dict:
    """The job's outcome as the coordinator prints it (JobRunner.summary), from a status that
    says the job is over: its state, figures of the last epoch, and failure."""
    job = status["job"]
    last = job["metrics"][-1] if job["metrics"] else {}
    workers = status.get("workers", [])
    return {"state": job["state"], "epochs": job["epoch"], "steps": job["steps"],
            "loss": last.get("loss"), "accuracy": last.get("test_accuracy"),
            "test_loss": last.get("test_loss"), "auc": last.get("test_auc"),
            "train_accuracy": last.get("accuracy"), "job_elapsed_s": job["elapsed_s"],
            "steps_per_s": (round(job["steps"] / job["elapsed_s"], 1) if job["elapsed_s"]
                            else None),
            "workers_dead": [w["id"] for w in workers if w["state"] == "dead"],
            "data_paths": {w["id"]: w["data_path"] for w in workers if w["data_path"]},
            "mode": job["mode"], "staleness_max": job["staleness"]["max"],
            "dropped_stale_gradients": job["dropped_stale_gradients"],
            **({"failure": job["failure"]} if job["failure"] else {})}


def _last_error(child: Child) -> str:
    """': <the last error line of its log>' (what a user needs, without opening the log),
    or '' when it logged none."""
    try:
        lines = child.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if " ERROR " in line or line.startswith(
        ("ps-worker:", "ps-server:", "ps-coordinator:", "Traceback")) or "Error:" in line]
    return f": {child.name}: {errors[-1].strip()}" if errors else ""


def _stop_all(children: list[Child], wait_s: float, impatient: SignalFlag,
              finishing: list[Child] | None = None) -> dict[str, int | None]:
    """Let `finishing` children (default: all) exit by themselves (bounded by `wait_s`),
    then stop the rest: workers first, then servers, then the coordinator. Once `impatient`
    is set, whatever is left is killed at once."""
    finishing = children if finishing is None else finishing
    deadline = time.monotonic() + wait_s
    while any(c.returncode is None for c in finishing) and time.monotonic() < deadline:
        if impatient.wait(0.1):
            break
    for child in reversed(children):
        child.stop(grace_s=0.0 if impatient.is_set() else 5.0, impatient=impatient)
    return {c.name: c.returncode for c in children}


if __name__ == "__main__":
    sys.exit(main())
