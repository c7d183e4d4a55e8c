"""The training runtime with real processes: ps-coordinator, ps-server, ps-worker, ps-cluster
and ps-ctl, each started as `python -m MODULE` (so PATH does not matter) on OS-chosen ports.

Faults are injected by signals: SIGKILL of a worker mid-task, SIGKILL of the coordinator,
SIGSTOP/SIGCONT of a process to pause it. Every wait is bounded and every process a test
starts is ended by the `launch` fixture, even when the test fails.

Reading the final status: a coordinator that ran a job shuts down soon after the job ends,
once every live worker and server has been told. To read the final status deterministically
the tests register an *observer* with the coordinator: a worker that never leases a task and
heartbeats only while the job runs. The coordinator waits for it as for any live worker,
and the observer releases it (one heartbeat, answered 'stop') once the test has read the
final status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from child_processes import EXIT_S, POLL_S, READY_S, Proc
from ps_server.coordinator.status_watchers import MAX_LINGER_S
from ps_worker.coordinator_client import CoordinatorClient, LeaseRevoked

pytestmark = pytest.mark.system

HEARTBEAT_S = 0.2
HEARTBEAT_TIMEOUT_S = 2.0
JOB_S = 60.0  # a job of these tests ends within this
REFUSE_S = 10.0  # a wrong address, dead coordinator or bad job is reported within this
ACCURACY = 0.95
OBSERVER = "test-observer"

# Digits in 2 tasks per epoch (22 steps each), so that a worker nearly always holds a task.
# lr 0.002 (the default): 0.005 ended below 0.95 held-out accuracy in about 1 run in 15, and
# batches of 8 (longer tasks) in about 1 in 5; with these, 0.966 to 0.975 in 18 runs.
SLOW_JOB = ["--tasks-per-epoch", "2", "--epochs", "10", "--lr", "0.002"]
SLOW_JOB_TASKS = 10 * (2 + 1)
# Workers of these jobs sleep this long in each step (ps-worker --step-delay), so that a task
# lasts about 0.25 s: without it the whole job ends in about a second, before a test can see
# a worker holding a task.
STEP_DELAY = ("--step-delay", "0.01")


# ---- processes ---------------------------------------------------------------------------

def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live processes (other than this one) with an argument that is
    `marker` or a path under it."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = next((line for line in (entry / "status").read_text().splitlines()
                          if line.startswith("State:")), "")
        except OSError:
            continue
        if any(a == marker or a.startswith(marker + "/") for a in argv) and \
                "zombie" not in state:
            found.append(f"{entry.name}: {' '.join(argv)}")
    return found


@pytest.fixture
def closed_address():
    """127.0.0.1:PORT where nothing listens: the port stays bound (not listening) by this
    fixture for the test's duration, so nothing else can take it; connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


# ---- the cluster -------------------------------------------------------------------------

class Observer:
    """Reads the coordinator's status; registered as a worker that never leases, so the
    coordinator cannot shut down before the observer has seen the end of the job."""

    def __init__(self, address: str):
        self.client = CoordinatorClient(address, give_up_after_s=5.0, rpc_timeout_s=5.0)
        self.incarnation = self.client.register_worker(OBSERVER).incarnation
        self._last_beat = time.monotonic()
        self.released = False

    def status(self) -> dict:
        status = self.client.status()
        if status["job"]["state"] == "running" and \
                time.monotonic() - self._last_beat > HEARTBEAT_TIMEOUT_S / 4:
            action = self.client.heartbeat(OBSERVER, self.incarnation)
            self._last_beat = time.monotonic()
            if action != "continue":
                # The job ended since the status call (or the observer was fenced): register
                # again, so that the coordinator waits for this observer once more.
                self.incarnation = self.client.register_worker(OBSERVER).incarnation
        return status

    def release(self) -> None:
        """Let the coordinator shut down (call once the final status has been read)."""
        if not self.released:
            self.released = True
            self.client.heartbeat(OBSERVER, self.incarnation)

    def close(self) -> None:
        self.client.close()


def workers_of(status: dict) -> dict[str, dict]:
    return {w["id"]: w for w in status["workers"] if w["id"] != OBSERVER}


def wait_for(observer: Observer, predicate, what: str, *, timeout: float = JOB_S,
             watch: tuple[Proc, ...] = ()) -> dict:
    """Poll status until `predicate(status)`; fail (bounded) with the last status and the
    logs of `watch`, and at once if a watched process exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        # Exits are looked at before the status is read: a worker that exits because what is
        # awaited happened (the job ended) is then seen with the status that shows it.
        exited = [p for p in watch if p.returncode is not None]
        status = observer.status()
        if predicate(status):
            return status
        if exited or time.monotonic() > deadline:
            why = (f"{', '.join(p.name for p in exited)} exited" if exited
                   else f"{timeout:g} s passed")
            pytest.fail(f"{why} while waiting for {what}; status:\n"
                        f"{json.dumps(status, indent=1)}\n" + "\n".join(p.logs() for p in watch))
        time.sleep(POLL_S)


def job_over(status: dict) -> bool:
    return status["job"]["state"] in ("done", "failed")


class Cluster:
    def __init__(self, launch, job_args: list[str], *, servers: int = 2,
                 coordinator_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = ()):
        self.launch = launch
        self.worker_args = worker_args  # given to every worker start_worker starts
        self.coordinator = launch(
            "coordinator", "ps_server.coordinator.cli", "--port", "0", "--recovery-grace", "0",
            "--heartbeat-interval", str(HEARTBEAT_S),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), *coordinator_args, *job_args)
        self.address = self.coordinator.address()
        self.observer = Observer(self.address)
        self.servers = [launch(
            f"ps-{i}", "ps_server.cli", "--port", "0", "--server-id", f"ps-{i}",
            "--coordinator", self.address, "--heartbeat-interval", str(HEARTBEAT_S))
            for i in range(servers)]
        self.server_addresses = {f"ps-{i}": s.address() for i, s in enumerate(self.servers)}
        wait_for(self.observer, lambda s: sum(v["state"] == "alive" for v in s["servers"])
                 == servers, "the servers to register", timeout=READY_S,
                 watch=(self.coordinator, *self.servers))
        self.workers: dict[str, Proc] = {}

    def start_worker(self, worker_id: str, *args: str) -> Proc:
        proc = self.launch(worker_id, "ps_worker.cli", "--coordinator", self.address,
                           "--worker-id", worker_id, "--device", "cpu", *self.worker_args,
                           *args)
        self.workers[worker_id] = proc
        return proc

    @property
    def daemons(self) -> tuple[Proc, ...]:
        return (self.coordinator, *self.servers)

    def wait_until_over(self, *, watch: tuple[Proc, ...] = ()) -> dict:
        """The final status (the job done or failed), read before the coordinator exits."""
        return wait_for(self.observer, job_over, "the job to end",
                        watch=(*self.daemons, *watch))

    def finish(self) -> None:
        self.observer.release()
        self.observer.close()


@pytest.fixture
def cluster(launch):
    """`cluster(job_args, ...)` -> a started Cluster (coordinator + servers, no workers)."""
    made: list[Cluster] = []

    def make(job_args: list[str], **kwargs) -> Cluster:
        c = Cluster(launch, job_args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.observer.close()


def coordinator_summary(coordinator: Proc) -> dict:
    """The outcome ps-coordinator prints as it exits (after every live worker was told to
    stop or declared dead)."""
    prefix = "ps-coordinator finished: "
    lines = [line for line in coordinator.stdout().splitlines() if line.startswith(prefix)]
    assert lines, coordinator.logs()
    return json.loads(lines[-1][len(prefix):])


def assert_exit_0(procs, timeout: float = EXIT_S) -> None:
    deadline = time.monotonic() + timeout
    codes = {p.name: p.wait(max(0.1, deadline - time.monotonic())) for p in procs}
    bad = [p for p in procs if codes[p.name] != 0]
    assert not bad, f"exit codes {codes}\n" + "\n".join(p.logs() for p in bad)


# ---- a. ps-cluster -----------------------------------------------------------------------

def start_ps_cluster(launch, tmp_path, *args: str) -> tuple[Proc, str, Path]:
    log_dir = tmp_path / "cluster-logs"
    proc = launch("ps-cluster", "ps_worker.cluster", "--servers", "2", "--workers", "2",
                  "--log-dir", str(log_dir), *args)
    # The first line names the coordinator: "coordinator on HOST:PORT; logs in DIR".
    deadline = time.monotonic() + READY_S
    while not (lines := proc.stdout().splitlines()):
        if proc.returncode is not None or time.monotonic() > deadline:
            pytest.fail(f"ps-cluster did not start its coordinator\n{proc.logs()}")
        time.sleep(POLL_S)
    address = lines[0].split(" on ", 1)[1].split(";", 1)[0]
    return proc, address, log_dir


def test_ps_cluster_trains_digits_and_every_process_exits_0(launch, tmp_path):
    """The default job: the README's main-job command, exactly."""
    proc, address, log_dir = start_ps_cluster(launch, tmp_path)
    assert proc.wait(JOB_S) == 0, proc.logs()
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert {"state", "epochs", "steps", "loss", "accuracy", "elapsed_s"} <= outcome.keys()
    assert outcome["state"] == "done"
    assert outcome["epochs"] == 10
    assert outcome["steps"] > 0 and outcome["loss"] > 0 and outcome["elapsed_s"] > 0
    assert outcome["accuracy"] >= ACCURACY, outcome
    assert outcome["exit_codes"] == {"coordinator": 0, "server-0": 0, "server-1": 0,
                                     "worker-0": 0, "worker-1": 0}
    assert outcome["workers_dead"] == []
    assert processes_mentioning(address) == []
    assert processes_mentioning(str(log_dir)) == []


def test_ps_cluster_evaluating_every_other_epoch_shows_every_epoch_in_order(launch, tmp_path):
    proc, _, _ = start_ps_cluster(launch, tmp_path, "--epochs", "3", "--evaluate-every", "2")
    assert proc.wait(JOB_S) == 0, proc.logs()
    lines = [line for line in proc.stdout().splitlines() if line.startswith("epoch ")
             and "  steps " in line and "training" not in line]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], proc.stdout()
    assert ["held-out: not evaluated" in line for line in lines] == [True, False, False]
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert outcome["state"] == "done" and outcome["accuracy"] is not None, outcome


def test_ps_cluster_with_no_workers_says_how_to_start_one(launch, tmp_path):
    proc, address, _ = start_ps_cluster(launch, tmp_path, "--workers", "0")
    deadline = time.monotonic() + READY_S
    while "--workers 0" not in proc.stdout():
        if proc.returncode is not None or time.monotonic() > deadline:
            pytest.fail(f"ps-cluster --workers 0 said nothing of its workers\n{proc.logs()}")
        time.sleep(POLL_S)
    assert f"ps-worker --coordinator {address}" in proc.stdout()


def test_ps_cluster_shows_why_every_worker_exited(launch, tmp_path):
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: --device cuda:0 can work here")
    proc, _, _ = start_ps_cluster(launch, tmp_path, "--device", "cuda:0", "--epochs", "1")
    assert proc.wait(JOB_S) == 1, proc.logs()
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert outcome["state"] == "failed"
    # The worker's own error, not only where its log is.
    assert "every worker exited" in outcome["error"], outcome
    assert "--device cuda:0" in outcome["error"] and "CuPy" in outcome["error"], outcome


def test_ps_cluster_reports_the_outcome_even_if_it_missed_the_end(launch, tmp_path):
    """ps-cluster paused (SIGSTOP: e.g. descheduled on a busy machine) across the end of the
    job still reports it: the job is done and every child exits 0."""
    proc, address, log_dir = start_ps_cluster(launch, tmp_path, "--epochs", "2", "--lr", "0.002")
    observer = Observer(address)
    try:
        wait_for(observer, lambda s: len(workers_of(s)) == 2, "ps-cluster's workers",
                 timeout=READY_S, watch=(proc,))
        proc.signal(signal.SIGSTOP)
        wait_for(observer, job_over, "the job to end")
        observer.release()
    finally:
        observer.close()
    # Until the coordinator has exited (a zombie: its parent, ps-cluster, is paused). It
    # waits for ps-cluster, which watches the status, to read the outcome: at most
    # MAX_LINGER_S, and then exits all the same.
    job_file = str(log_dir / "job.json")
    deadline = time.monotonic() + EXIT_S + MAX_LINGER_S
    while processes_mentioning(job_file):
        assert time.monotonic() < deadline, processes_mentioning(job_file)
        time.sleep(POLL_S)
    proc.signal(signal.SIGCONT)
    code = proc.wait(JOB_S)
    outcome = json.loads(proc.stdout().splitlines()[-1])
    assert outcome["state"] == "done", outcome
    assert outcome["epochs"] == 2 and outcome["accuracy"] is not None
    assert set(outcome["exit_codes"].values()) == {0}, outcome
    assert code == 0


# ---- b. a worker killed mid-task ---------------------------------------------------------

def test_worker_killed_mid_task_its_task_is_rerun_and_the_job_completes(cluster):
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY)
    w0, w1 = c.start_worker("w0"), c.start_worker("w1")
    # w0 mid-job and mid-task: it has finished a task and holds another.
    status = wait_for(c.observer, lambda s: workers_of(s).get("w0", {}).get("tasks_done", 0) >= 1
                      and workers_of(s)["w0"]["leased_tasks"], "w0 to hold a task",
                      watch=(*c.daemons, w0, w1))
    killed_task = workers_of(status)["w0"]["leased_tasks"][0]
    w0_done = workers_of(status)["w0"]["tasks_done"]
    w0.signal(signal.SIGKILL)
    assert w0.wait(EXIT_S) == -signal.SIGKILL

    status = c.wait_until_over(watch=(w1,))
    job, workers = status["job"], workers_of(status)
    assert job["state"] == "done", job
    assert job["tasks_done"] == job["tasks_total"] == SLOW_JOB_TASKS
    # If w0 finished its task just before the kill landed, w1 may end the job before w0's
    # heartbeat timeout: w0 is then still 'alive' here, and declared dead before the
    # coordinator exits (checked on its summary below).
    assert workers["w0"]["state"] in ("dead", "alive")
    if workers["w0"]["state"] == "dead":
        assert workers["w0"]["reason"]
        assert workers["w0"]["died_at_s"] is not None and workers["w0"]["died_at_s"] > 0
    assert workers["w0"]["leased_tasks"] == []
    # Every task was completed once, and w0 completed none after it was killed: the task it
    # held (killed_task, or one it took just before the kill landed) was run by w1.
    assert workers["w0"]["tasks_done"] + workers["w1"]["tasks_done"] == job["tasks_total"]
    assert workers["w0"]["tasks_done"] in (w0_done, w0_done + 1)  # + task it just finished?
    assert workers["w1"]["tasks_done"] > 0, f"task {killed_task} was never re-run"
    assert [m["epoch"] for m in job["metrics"]] == list(range(1, 11))
    assert all(m["test_accuracy"] is not None for m in job["metrics"])
    assert job["metrics"][-1]["test_accuracy"] >= ACCURACY, job["metrics"]
    c.finish()
    assert_exit_0((w1, *c.daemons))
    assert coordinator_summary(c.coordinator)["workers_dead"] == ["w0"]


# ---- c. a late worker --------------------------------------------------------------------

def test_late_worker_joins_and_gets_tasks(cluster):
    c = cluster(["--tasks-per-epoch", "4", "--batch-size", "8", "--epochs", "5", "--lr", "0.002"])
    first = c.start_worker("first")
    status = wait_for(c.observer, lambda s: bool(s["job"]["metrics"]) and
                      s["job"]["metrics"][0]["test_accuracy"] is not None,
                      "epoch 1's evaluation", watch=(*c.daemons, first))
    assert status["job"]["state"] == "running"
    paused_as = workers_of(status)["first"]["incarnation"]
    # The first worker is paused until the late one has done a task: otherwise it could
    # finish the job while the late one is still starting (its heartbeats stop meanwhile; a
    # task it holds for longer than the heartbeat timeout goes to the late worker).
    os.kill(first.pid, signal.SIGSTOP)
    try:
        late = c.start_worker("late")
        wait_for(c.observer, lambda s: workers_of(s).get("late", {}).get("tasks_done", 0) > 0,
                 "a task done by the late worker", watch=(*c.daemons, late))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    status = c.wait_until_over(watch=(first,))
    assert status["job"]["state"] == "done"
    workers = workers_of(status)
    assert workers["late"]["tasks_done"] > 0, workers
    assert workers["late"]["steps"] > 0
    done_by_both = workers["first"]["tasks_done"] + workers["late"]["tasks_done"]
    if workers["first"]["incarnation"] == paused_as:
        assert done_by_both == status["job"]["tasks_total"]
    else:
        # Paused past the heartbeat timeout (the late worker had to wait for a task it held):
        # declared dead, it registered again on waking, and counts only what it did since.
        assert done_by_both < status["job"]["tasks_total"]
    assert status["job"]["tasks_done"] == status["job"]["tasks_total"]
    c.finish()
    assert_exit_0((first, late, *c.daemons))


# ---- d. wrong addresses, dead coordinators, bad jobs -------------------------------------

def test_wrong_addresses_and_bad_jobs_are_refused_naming_what_is_wrong(
        launch, tmp_path, closed_address):
    unknown_key = tmp_path / "unknown-key.yaml"
    unknown_key.write_text("epochs: 2\nlearning_rate: 0.1\n")
    bad_value = tmp_path / "bad-value.yaml"
    bad_value.write_text("epochs: 2\nbatch_size: 0\n")
    missing = tmp_path / "missing.yaml"
    cases = {  # name: (module, args, what stderr must name)
        "ctl-closed-port": ("ps_worker.ctl", ["--coordinator", closed_address,
                                              "--timeout", "1", "status"], closed_address),
        "worker-closed-port": ("ps_worker.cli", ["--coordinator", closed_address,
                                                 "--coordinator-timeout", "1",
                                                 "--device", "cpu"], closed_address),
        "cluster-epochs-0": ("ps_worker.cluster", ["--epochs", "0"], "--epochs"),
        "coordinator-missing-job": ("ps_server.coordinator.cli",
                                    ["--port", "0", "--job", str(missing)], str(missing)),
        "coordinator-unknown-key": ("ps_server.coordinator.cli",
                                    ["--port", "0", "--job", str(unknown_key)], "learning_rate"),
        "coordinator-bad-value": ("ps_server.coordinator.cli",
                                  ["--port", "0", "--job", str(bad_value)], "batch_size"),
        "coordinator-bad-flag": ("ps_server.coordinator.cli",
                                 ["--port", "0", "--batch-size", "-1"], "--batch-size"),
        "cluster-unknown-key": ("ps_worker.cluster", ["--job", str(unknown_key)],
                                "learning_rate"),
    }
    started = time.monotonic()
    procs = {name: launch(name, module, *args) for name, (module, args, _) in cases.items()}
    for name, proc in procs.items():
        code = proc.wait(max(0.1, started + REFUSE_S - time.monotonic()))
        assert code != 0, proc.logs()
        assert cases[name][2] in proc.stderr(), proc.logs()
        assert " listening on " not in proc.stdout(), proc.logs()


def test_worker_gives_up_on_a_dead_coordinator_naming_its_address(cluster):
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY)
    worker = c.start_worker("w0", "--coordinator-timeout", "2")
    wait_for(c.observer, lambda s: bool(workers_of(s).get("w0", {}).get("leased_tasks")),
             "w0 to hold a task", watch=(*c.daemons, worker))
    c.coordinator.signal(signal.SIGKILL)
    assert worker.wait(REFUSE_S) != 0
    assert c.address in worker.stderr(), worker.logs()


def test_worker_gives_up_on_a_hung_coordinator_within_its_timeout(cluster):
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY)
    timeout_s = 2.0
    worker = c.start_worker("w0", "--coordinator-timeout", str(timeout_s))
    wait_for(c.observer, lambda s: bool(workers_of(s).get("w0", {}).get("leased_tasks")),
             "w0 to hold a task", watch=(*c.daemons, worker))
    c.coordinator.signal(signal.SIGSTOP)  # the fault: it hangs, connections stay open
    # It gives up (rather than waiting for good) after its timeout: the worker's own log says
    # how long it waited; how soon the process then exits depends on the machine's load.
    code = worker.wait()
    assert code != 0
    assert c.address in worker.stderr(), worker.logs()
    assert f"gave up after about {timeout_s:g} s" in worker.stderr(), worker.logs()


# ---- e. ps-ctl ---------------------------------------------------------------------------

def test_ps_ctl_status_shows_every_worker_and_server(cluster, launch):
    c = cluster(["--epochs", "1", "--tasks-per-epoch", "2"], coordinator_args=("--keep-serving",))
    workers = [c.start_worker(w) for w in ("alpha-worker", "beta-worker")]
    wait_for(c.observer, lambda s: s["job"]["state"] == "done" and all(
        w["state"] == "done" for w in workers_of(s).values()) and len(workers_of(s)) == 2,
        "the job to end", watch=c.daemons)
    assert_exit_0(workers)
    text = launch("ctl-text", "ps_worker.ctl", "--coordinator", c.address, "status")
    as_json = launch("ctl-json", "ps_worker.ctl", "--coordinator", c.address, "status", "--json")
    assert text.wait(REFUSE_S) == 0, text.logs()
    assert as_json.wait(REFUSE_S) == 0, as_json.logs()
    report = text.stdout()
    for name in ("alpha-worker", "beta-worker", "ps-0", "ps-1", *c.server_addresses.values()):
        assert name in report, report
    status = json.loads(as_json.stdout())
    assert set(workers_of(status)) == {"alpha-worker", "beta-worker"}
    assert {s["id"]: s["address"] for s in status["servers"]} == c.server_addresses
    assert status["job"]["state"] == "done"
    # --keep-serving: the daemons stay up after the job and stop gracefully on SIGTERM.
    assert all(p.returncode is None for p in c.daemons)
    c.finish()
    for proc in c.daemons:
        proc.signal(signal.SIGTERM)
    assert_exit_0(c.daemons)


# ---- fencing -----------------------------------------------------------------------------

def test_workers_fenced_mid_task_register_again_and_finish_the_job(cluster):
    """Each worker's incarnation is replaced while it holds a task (what a coordinator does
    when it declares a worker dead, and what a duplicate process of the same worker id
    does): the worker is refused when it reports the task, must register again under a new
    incarnation, and the job must complete."""
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY)
    workers = {w: c.start_worker(w) for w in ("w0", "w1")}
    status = wait_for(c.observer, lambda s: len(workers_of(s)) == 2 and all(
        w["leased_tasks"] for w in workers_of(s).values()), "both workers to hold a task",
        watch=(*c.daemons, *workers.values()))
    first = {w: row["incarnation"] for w, row in workers_of(status).items()}
    with CoordinatorClient(c.address) as impostor:  # the fault: the incarnations are fenced
        for worker_id in workers:
            impostor.register_worker(worker_id)
    status = c.wait_until_over(watch=tuple(workers.values()))
    assert status["job"]["state"] == "done"
    rows = workers_of(status)
    assert all(rows[w]["incarnation"] > first[w] for w in workers), rows
    assert status["job"]["metrics"][-1]["test_accuracy"] >= ACCURACY
    c.finish()
    assert_exit_0((*workers.values(), *c.daemons))


def test_duplicate_reports_change_nothing_and_fenced_incarnations_must_reregister(launch):
    """The worker protocol over the wire, with this test as the worker (no servers needed:
    it reports tasks without running them)."""
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-timeout",
                         str(HEARTBEAT_TIMEOUT_S), "--epochs", "1", "--tasks-per-epoch", "2")
    address = coordinator.address()
    metrics = dict(loss_sum=4.0, examples=8, correct=6, steps=2, seconds=0.1)
    with CoordinatorClient(address, give_up_after_s=5.0, rpc_timeout_s=5.0) as client:
        first = client.register_worker("solo")
        assert first.job is not None and first.job.tasks_per_epoch == 2
        outcome, task = client.lease("solo", first.incarnation)
        assert (outcome, task.kind, task.epoch) == ("task", "train", 1)
        assert client.complete("solo", first.incarnation, task.task_id, **metrics) is False
        before = client.status()["job"]
        assert client.complete("solo", first.incarnation, task.task_id,
                               **{**metrics, "steps": 99, "examples": 1}) is True
        after = client.status()["job"]
        assert (before["tasks_done"], before["steps"]) == (1, 2)
        assert (after["tasks_done"], after["steps"], after["metrics"]) == (
            before["tasks_done"], before["steps"], before["metrics"])

        outcome, held = client.lease("solo", first.incarnation)
        assert outcome == "task"
        second = client.register_worker("solo")  # the same id again fences the first
        assert second.incarnation > first.incarnation
        assert client.heartbeat("solo", first.incarnation) == "reregister"
        assert client.lease("solo", first.incarnation) == ("reregister", None)
        with pytest.raises(LeaseRevoked):
            client.complete("solo", first.incarnation, held.task_id, **metrics)
        assert client.status()["job"]["tasks_done"] == 1
        assert client.heartbeat("solo", second.incarnation) == "continue"
        outcome, again = client.lease("solo", second.incarnation)
        assert (outcome, again.task_id) == ("task", held.task_id)
        assert client.complete("solo", second.incarnation, again.task_id, **metrics) is False
        status = client.status()
        assert status["job"]["tasks_done"] == 2
        assert workers_of(status)["solo"]["incarnation"] == second.incarnation
        # The job finishes with its evaluation; the coordinator then tells us and exits.
        outcome, evaluation = client.lease("solo", second.incarnation)
        assert (outcome, evaluation.kind) == ("task", "evaluate")
        client.complete("solo", second.incarnation, evaluation.task_id,
                        **{**metrics, "steps": 0})
        assert client.status()["job"]["state"] == "done"
        assert client.lease("solo", second.incarnation) == ("done", None)
    assert_exit_0((coordinator,))


# ---- a coordinator that dies mid-job ------------------------------------------------------

SETTLED_S = 0.5  # values unchanged this long: the stopped workers' last pushes are in


def settled_values(ps, names: list[str]) -> dict:
    """The values once the pushes the workers had sent before they were stopped are applied:
    a stopped process may have handed a push to its socket, which a server applies a moment
    later, and no event marks that moment. Pulls until the values stay unchanged for
    SETTLED_S (bounded)."""
    import numpy as np

    deadline = time.monotonic() + JOB_S
    last, since = ps.pull(names), time.monotonic()
    while time.monotonic() - since < SETTLED_S:
        assert time.monotonic() < deadline, "the values never settled"
        time.sleep(POLL_S)
        now = ps.pull(names)
        if not all(np.array_equal(now[n], last[n]) for n in names):
            last, since = now, time.monotonic()
    return last


def test_coordinator_sigkilled_mid_job_loses_no_trained_value_and_the_job_finishes(launch):
    import numpy as np

    from ps_worker import PSClient, RetryPolicy

    patient = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.25)
    # Long and slow enough that the job still runs when its workers are stopped below.
    job = ["--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-timeout",
           str(HEARTBEAT_TIMEOUT_S), "--epochs", "10", "--tasks-per-epoch", "2"]
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--recovery-grace", "0", *job)
    address = coordinator.address()
    servers = [launch(f"ps-{i}", "ps_server.cli", "--port", "0", "--server-id", f"ps-{i}",
                      "--coordinator", address, "--heartbeat-interval", str(HEARTBEAT_S))
               for i in range(2)]
    for server in servers:
        server.address()
    observer = Observer(address)
    with PSClient(address, retry=patient) as ps:
        # A training loop of the user's own, beside the job: declared in one order, trained.
        ps.declare("x", shape=(7, 3), init="uniform", optimizer={"name": "sgd", "lr": 1.0})
        ps.declare("y", shape=(300,), init="normal", optimizer={"name": "sgd", "lr": 1.0})
        ps.push({"x": np.ones((7, 3), np.float32), "y": np.ones(300, np.float32)})
        workers = [launch(f"w{i}", "ps_worker.cli", "--coordinator", address, "--worker-id",
                          f"w{i}", "--device", "cpu", *STEP_DELAY) for i in range(2)]
        wait_for(observer, lambda s: s["job"]["tasks_done"] >= 2, "the job to make progress",
                 watch=(coordinator, *servers, *workers))
        observer.close()
        for worker in workers:  # no push in flight while the values are compared
            worker.signal(signal.SIGSTOP)
        shard_map = ps.refresh()
        names = list(shard_map.variables)
        before = settled_values(ps, names)

        coordinator.signal(signal.SIGKILL)
        assert coordinator.wait(EXIT_S) == -signal.SIGKILL
        restarted = launch("coordinator-2", "ps_server.coordinator.cli",
                           "--port", address.rsplit(":", 1)[1], *job)
        assert restarted.address() == address
        # Declared again, in the reverse order: nothing is moved or re-created.
        ps.declare_many([shard_map.variables[n] for n in reversed(names)])
        assert ps.shard_map.epoch > shard_map.epoch
        after = ps.pull(names)
        for name in names:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        ps.push({"x": np.ones((7, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("x"), before["x"] - 1)
        for worker in workers:
            worker.signal(signal.SIGCONT)

    observer = Observer(address)
    try:
        status = wait_for(observer, job_over, "the job to end",
                          watch=(restarted, *servers))
        assert status["job"]["state"] == "done", status
        assert all(s["state_losses"] == 0 for s in status["servers"])
    finally:
        observer.release()
        observer.close()
    assert_exit_0([restarted, *servers, *workers], timeout=JOB_S)


def test_a_server_that_never_comes_back_fails_the_job_naming_it(cluster):
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY, coordinator_args=("--server-timeout", "3"))
    worker = c.start_worker("w0")
    wait_for(c.observer, lambda s: s["job"]["steps"] > 0, "training to start",
             watch=(*c.daemons, worker))
    c.servers[1].signal(signal.SIGKILL)
    lost = wait_for(c.observer, lambda s: any(v["id"] == "ps-1" and v["state"] != "alive"
                                              for v in s["servers"]),
                    "the coordinator to notice", watch=(c.coordinator,))
    assert lost["job"]["state"] == "running"  # it waits --server-timeout first
    status = wait_for(c.observer, job_over, "the job to fail", watch=(c.coordinator,))
    assert status["job"]["state"] == "failed"
    assert "ps-1" in status["job"]["failure"]
    assert {s["id"]: s["state"] for s in status["servers"]}["ps-1"] == "lost"
    c.finish()
    assert c.coordinator.wait(EXIT_S) == 1
    log = c.coordinator.stderr()
    assert "lost contact with parameter server ps-1" in log
    worker.wait(EXIT_S)
    assert "Traceback" not in worker.stderr()


def test_a_server_back_without_its_values_fails_the_job_naming_it_and_what_was_lost(
        cluster, launch):
    """No checkpoint directory and no --reinitialize-lost-shards: a server SIGKILLed mid-job
    and started again on its port (empty) must stop the job, never let it train on from the
    initializers."""
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY)
    worker = c.start_worker("w0")
    wait_for(c.observer, lambda s: s["job"]["steps"] > 0, "training to start",
             watch=(*c.daemons, worker))
    c.servers[1].signal(signal.SIGKILL)
    assert c.servers[1].wait(EXIT_S) == -signal.SIGKILL
    port = c.server_addresses["ps-1"].rsplit(":", 1)[1]
    again = launch("ps-1-again", "ps_server.cli", "--port", port, "--server-id", "ps-1",
                   "--coordinator", c.address, "--heartbeat-interval", str(HEARTBEAT_S))
    assert again.address() == c.server_addresses["ps-1"]

    status = wait_for(c.observer, job_over, "the job to fail",
                      watch=(c.coordinator, again))
    assert status["job"]["state"] == "failed", status["job"]
    assert "ps-1" in status["job"]["failure"]
    server = {s["id"]: s for s in status["servers"]}["ps-1"]
    assert server["state_losses"] == 1
    assert server["lost_shards"] and server["loss_action"] == "failed the job"
    c.finish()
    assert c.coordinator.wait(EXIT_S) == 1
    assert "came back without the trained values" in c.coordinator.stderr()
    worker.wait(EXIT_S)
    assert "Traceback" not in worker.stderr()


def test_coordinator_sigkilled_with_a_checkpoint_dir_resumes_the_job_where_it_was(
        cluster, tmp_path):
    """Job progress is kept in the checkpoint directory: the restarted coordinator (same
    command, same port) carries on from the tasks already done, and the job ends with a
    checkpoint of its final values."""
    checkpoints = tmp_path / "checkpoints"
    ckpt_args = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1s")
    c = cluster(SLOW_JOB, worker_args=STEP_DELAY, coordinator_args=ckpt_args)
    workers = [c.start_worker(f"w{i}") for i in range(2)]
    progress = wait_for(c.observer, lambda s: s["job"]["tasks_done"] >= 6
                        and s["last_checkpoint"] is not None, "progress and a checkpoint",
                        watch=(*c.daemons, *workers))
    c.observer.close()
    c.coordinator.signal(signal.SIGKILL)
    assert c.coordinator.wait(EXIT_S) == -signal.SIGKILL
    port = c.address.rsplit(":", 1)[1]
    restarted = c.launch(
        "coordinator-2", "ps_server.coordinator.cli", "--port", port, "--recovery-grace", "0",
        "--heartbeat-interval", str(HEARTBEAT_S), "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT_S), *ckpt_args, *SLOW_JOB)
    assert restarted.address() == c.address
    observer = Observer(c.address)
    try:
        resumed = observer.status()
        # Not started over: at least what was done before the kill, less what was in the
        # last half second that the state file had not caught yet.
        assert resumed["job"]["tasks_done"] >= progress["job"]["tasks_done"] - 2, resumed
        status = wait_for(observer, job_over, "the job to end",
                          watch=(restarted, *c.servers, *workers))
        assert status["job"]["state"] == "done", status
        assert status["job"]["tasks_done"] == SLOW_JOB_TASKS
        assert all(s["state_losses"] == 0 for s in status["servers"])
    finally:
        observer.release()
        observer.close()
    assert_exit_0([restarted, *c.servers, *workers], timeout=JOB_S)
    assert "resumed the job from" in restarted.stderr()
    final = json.loads(sorted(checkpoints.glob("ckpt-*/manifest.json"))[-1].read_text())
    assert final["job"]["state"] == "done"
