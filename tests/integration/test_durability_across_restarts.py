"""Durability across restarts: a server that came back empty stays owed its shards when the
coordinator restarts before they reach it, and a relative --checkpoint-dir means the
coordinator's directory to every server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_common.checkpoints import MANIFEST, checkpoint_ids
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
# Bounded: a pull that keeps getting UNAVAILABLE ends with it instead of hanging the test.
BOUNDED = RetryPolicy(max_attempts=100, initial_backoff_s=0.01, max_backoff_s=0.1)
REPO = Path(__file__).resolve().parents[2]


def _index_of(cluster, server_id: str) -> int:
    return next(i for i, s in enumerate(cluster.servers) if s.server_id == server_id)


def _two_variables_on_two_servers(ps: PSClient) -> dict[str, str]:
    ps.declare("a", shape=(4,), init="zeros", optimizer=SGD1)
    ps.declare("b", shape=(4,), init="zeros", optimizer=SGD1)
    holders = {name: ps.shard_map.shards_of(name)[0].server_id for name in ("a", "b")}
    assert holders["a"] != holders["b"], holders
    return holders


class RefuseAssignments(grpc.ServerInterceptor):
    """Answers AssignShards with UNAVAILABLE while `refusing` is set (a server whose
    assignment has not reached it yet), counting the refusals."""

    def __init__(self):
        self.refusing = threading.Event()
        self.refusing.set()
        self.refused = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith("/AssignShards"):
            return handler
        assign = handler.unary_unary

        def wrapped(request, context):
            if self.refusing.is_set():
                self.refused += 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected: assignment not arrived")
            return assign(request, context)

        return handler._replace(unary_unary=wrapped)


# ---- a server that came back empty, then the coordinator restarted -----------------------

def test_a_restore_pending_when_the_coordinator_restarts_still_restores_the_checkpoint(
        make_cluster, tmp_path):
    """Server X crashes and comes back (same id); it registers with coordinator C1, which
    finds X's shards lost and has to restore them from the checkpoint. Before that restore
    reaches X, C1 restarts (crash, kill -9, chaos). C2 rebuilds the map from the other
    server's report, which still places `a` on X, and X reports holding nothing: C2 too
    restores `a` from the checkpoint (-1: one step of lr 1 before it), never creating it
    empty (X reports itself as a new process until an assignment has reached it whole)."""
    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        holders = _two_variables_on_two_servers(ps)
        ps.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
        cluster.checkpoint()
        ps.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})  # lost with X

    index = _index_of(cluster, holders["a"])
    old = cluster.servers[index]
    old.stop(grace_s=0.5)
    gate = RefuseAssignments()
    config = ServerConfig(server_id=old.server_id, port=old.port,
                          coordinator=cluster.coordinator_address, **cluster._server_kwargs)
    cluster.servers[index] = ParameterServer(config, interceptors=[gate]).start()
    # C1 has found the loss and tried to deliver the restore (refused: not arrived yet).
    wait_until(lambda: gate.refused >= 1, "the first coordinator sends the restore")
    assert cluster.coordinator.state.restore_sources() == {checkpoint_ids(tmp_path)[-1]}

    cluster.restart_coordinator()
    gate.refusing.clear()
    cluster.wait_until_synced()
    with PSClient(cluster.coordinator_address, retry=BOUNDED) as ps:
        np.testing.assert_array_equal(ps.pull("b"), np.full(4, -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull("a"), np.full(4, -1.0, np.float32))


def test_a_data_loss_is_not_forgotten_when_the_coordinator_restarts(make_cluster):
    """Without checkpoints: X comes back empty and C1 reports DATA_LOSS (README: "the job
    fails naming the server and the variables (DATA_LOSS for PSClient users), unless
    --reinitialize-lost-shards"). Restarting the coordinator does not turn that into
    silently re-initialized values."""
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address, retry=PATIENT) as ps:
        holders = _two_variables_on_two_servers(ps)
        ps.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})
    cluster.restart_server(_index_of(cluster, holders["a"]))
    wait_until(lambda: cluster.coordinator.state.data_loss, "the first coordinator's DATA_LOSS")
    with PSClient(cluster.coordinator_address, retry=BOUNDED) as ps:
        with pytest.raises(RemoteError) as lost:
            ps.pull("a")
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS

    cluster.restart_coordinator()
    with PSClient(cluster.coordinator_address, retry=BOUNDED) as ps:
        with pytest.raises(RemoteError) as lost:
            ps.pull("a")
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS


# ---- a relative --checkpoint-dir -------------------------------------------------------------

class _ServerProcess:
    """`python -m ps_server.cli` in `cwd`, in a process group of its own."""

    def __init__(self, cwd: Path, coordinator: str, out: Path):
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")]))}
        self.out = out
        with open(out, "wb") as stdout:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "ps_server.cli", "--port", "0", "--server-id", "ps-0",
                 "--coordinator", coordinator, "--no-shm", "--heartbeat-interval", "0.2"],
                cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True)

    def wait_listening(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while " listening on " not in self.out.read_text(errors="replace"):
            assert self.popen.poll() is None, self.out.read_text(errors="replace")
            assert time.monotonic() < deadline, self.out.read_text(errors="replace")
            time.sleep(0.05)

    def end(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15.0)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5.0)


def test_a_relative_checkpoint_dir_is_where_the_coordinator_runs_not_where_servers_run(
        tmp_path, monkeypatch):
    """`ps-coordinator --checkpoint-dir ckpt` (a relative path, as the CLI accepts it) run
    in directory A, and `ps-server` run in directory B (another terminal, another unit):
    the checkpoint lands in A/ckpt with the server's files in it (the coordinator sends
    servers the absolute path, not one each would resolve against its own directory)."""
    here, there = tmp_path / "coordinator-cwd", tmp_path / "server-cwd"
    here.mkdir()
    there.mkdir()
    monkeypatch.chdir(here)
    coordinator = Coordinator(CoordinatorConfig(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, recovery_grace_s=0.0,
        checkpoint_dir=Path("ckpt"), checkpoint_every=None)).start()
    server = None
    try:
        server = _ServerProcess(there, coordinator.address, tmp_path / "server.out")
        server.wait_listening()
        with PSClient(coordinator.address, retry=PATIENT) as ps:
            ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
            ps.push({"w": np.ones(4, np.float32)})
        manifest = coordinator.checkpointer.take("requested")
        assert (here / "ckpt" / manifest.id / MANIFEST).is_file()
        assert (here / "ckpt" / manifest.id / "ps-0.safetensors").is_file()
    finally:
        if server is not None:
            server.end()
        coordinator.stop(grace_s=0.5)
