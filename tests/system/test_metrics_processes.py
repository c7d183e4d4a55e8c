"""--metrics-port with real processes: ps-coordinator, ps-server and ps-worker each serve
Prometheus metrics on a port the OS chose (printed as "... metrics on URL" before the ready
line), and their figures move while a job trains; a taken port stops each command with an
error naming the flag. Every wait is bounded; the `launch` fixture ends every process."""

from __future__ import annotations

import socket
import time

import pytest

from child_processes import READY_S, Proc
from ps_server.testing import metric, scrape_metrics

pytestmark = pytest.mark.system

MOVE_S = 60.0  # a figure that training moves moves within this
SCRAPE_S = 0.1  # between two scrapes of a poll


def metrics_url(proc: Proc, timeout: float = READY_S) -> str:
    """The URL of the process's "... metrics on URL" line (bounded wait)."""
    return proc.last_word_of(" metrics on ", "served metrics", timeout)


def wait_above(proc: Proc, url: str, name: str, floor: float, watch: tuple[Proc, ...]) -> float:
    """Scrape until the figure `name` exceeds `floor`; its value then (bounded wait, failing
    at once if a watched process exits)."""
    deadline = time.monotonic() + MOVE_S
    while True:
        # Exits first: a process that exits once what is awaited happened is seen with it.
        exited = [p for p in watch if p.returncode is not None]
        value = metric(scrape_metrics(url), name)
        if value > floor:
            return value
        if exited or time.monotonic() > deadline:
            why = f"{exited[0].name} exited" if exited else f"{MOVE_S:g} s passed"
            pytest.fail(f"{name} of {proc.name} stayed at {value} ({why})\n"
                        + "\n".join(p.logs() for p in watch))
        time.sleep(SCRAPE_S)


def test_every_process_serves_figures_that_move_while_the_job_trains(launch):
    coordinator = launch(
        "coordinator", "ps_server.coordinator.cli", "--port", "0", "--recovery-grace", "0",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--metrics-port", "0",
        # Long enough to be scraped while it trains; the fixture ends it.
        "--epochs", "1000", "--tasks-per-epoch", "4")
    address = coordinator.address()
    server = launch("ps-0", "ps_server.cli", "--port", "0", "--server-id", "ps-0",
                    "--coordinator", address, "--heartbeat-interval", "0.2",
                    "--metrics-port", "0")
    worker = launch("worker-0", "ps_worker.cli", "--coordinator", address, "--worker-id",
                    "worker-0", "--device", "cpu", "--metrics-port", "0")
    procs = (coordinator, server, worker)
    urls = {proc.name: metrics_url(proc) for proc in procs}
    assert len(set(urls.values())) == 3
    moving = {"coordinator": "paramserve_job_steps_total",
              "ps-0": "paramserve_pushes_applied_total",
              "worker-0": "paramserve_worker_steps_total"}
    for proc in procs:  # each figure moves, and moves again: training goes on
        name = moving[proc.name]
        first = wait_above(proc, urls[proc.name], name, 0.0, procs)
        wait_above(proc, urls[proc.name], name, first, procs)

    at_coordinator = scrape_metrics(urls["coordinator"])
    assert metric(at_coordinator, "paramserve_members", role="server", state="alive") == 1
    assert metric(at_coordinator, "paramserve_members", role="worker", state="alive") == 1
    assert metric(at_coordinator, "paramserve_job_state", state="running") == 1
    assert 0 < metric(at_coordinator, "paramserve_job_progress_ratio") < 1
    assert metric(at_coordinator, "paramserve_job_steps_per_second") > 0
    # Its only worker always has the next task (or the evaluation) to run: it never waits.
    assert metric(at_coordinator, "paramserve_job_waiting_leases") == 0
    assert metric(at_coordinator, "paramserve_rpc_handled_total",
                  method="/ps.v1.Coordinator/CompleteTask", code="OK") > 0
    at_server = scrape_metrics(urls["ps-0"])
    assert metric(at_server, "paramserve_shards") > 0
    assert metric(at_server, "paramserve_process_resident_memory_bytes") > 0
    at_worker = scrape_metrics(urls["worker-0"])
    assert metric(at_worker, "paramserve_worker_pull_wait_seconds_count") > 0
    assert metric(at_worker, "paramserve_worker_push_wait_seconds_count") > 0
    assert metric(at_worker, "paramserve_worker_tasks_total", kind="train") > 0
    assert metric(at_worker, "paramserve_worker_steps_per_second") > 0
    info = [labels for (name, labels) in at_worker if name == "paramserve_worker_info"]
    assert info and dict(info[0])["worker_id"] == "worker-0"
    assert dict(info[0])["data_path"] in ("shm", "grpc", "shm+grpc")


def test_a_taken_metrics_port_stops_each_command_naming_the_flag(launch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        procs = [
            launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                   "--metrics-port", port),
            launch("ps-0", "ps_server.cli", "--port", "0", "--metrics-port", port),
            launch("worker-0", "ps_worker.cli", "--coordinator", "127.0.0.1:1",
                   "--metrics-port", port),
        ]
        for proc in procs:
            assert proc.wait() != 0, proc.logs()
            assert "--metrics-port" in proc.stderr() and port in proc.stderr(), proc.logs()
            assert " listening on " not in proc.stdout()


def test_ps_cluster_gives_every_child_a_metrics_port(launch, tmp_path):
    log_dir = tmp_path / "logs"
    proc = launch("ps-cluster", "ps_worker.cluster", "--servers", "1", "--workers", "1",
                  "--epochs", "1", "--log-dir", str(log_dir), "--metrics-port", "0")
    assert proc.wait(MOVE_S) == 0, proc.logs()
    logs = {path.stem: path.read_text() for path in log_dir.glob("*.log")}
    assert set(logs) == {"coordinator", "server-0", "worker-0"}
    for name, text in logs.items():
        assert " metrics on http://127.0.0.1:" in text, f"{name}:\n{text[-2000:]}"
