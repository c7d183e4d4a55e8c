"""The data path while the cluster changes under it, each test with the promise (README) it
checks: exactly-once beside a moved part, errors while a restarted coordinator knows nothing
yet, and shared-memory readers of a server that was killed.

In-process clusters come from the `make_cluster` fixture (tests/conftest.py); the test that
needs a server killed with SIGKILL starts real `python -m ...` processes on OS-chosen ports
and ends every one of them, whatever happens. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ps_common import shm
from ps_common.status import RemoteError
from ps_server.coordinator.app import Coordinator
from ps_server.shared_memory import clear_dead
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


# ---- a push whose server never moved is applied once, whatever moved beside it ----------------

def test_a_part_applied_by_a_server_that_never_moved_is_not_applied_again_beside_a_moved_part(
        make_cluster, tmp_path):
    """README, "What survives what": exactly-once holds for a server that stays put; only a
    part re-sent to a shard's *new* server may be applied twice. Here `x` never leaves
    ps-keep. The push {x, y} reaches ps-keep, which applies x, and its answer is lost (and
    the retries of its bounded policy find the server unreachable); meanwhile y's server is
    lost and y moves, from the checkpoint, to ps-keep. The client re-sends the failed parts
    with the new map: x as it went before (same shards, same sequence: ps-keep answers
    'duplicate'), and y in a call of its own, never x and y under one new sequence, which
    ps-keep could not tell from a new push."""
    cluster = make_cluster(servers=2, shared_memory=False, checkpoint_dir=tmp_path,
                           server_timeout_s=0.5)
    bounded = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    with PSClient(cluster.coordinator_address, shared_memory=False, retry=bounded) as ps:
        ps.declare("x", shape=(4,), init="zeros", optimizer=SGD1)
        ps.declare("y", shape=(4,), init="zeros", optimizer=SGD1)
        keep_id = ps.shard_map.shards_of("x")[0].server_id
        lost_id = ps.shard_map.shards_of("y")[0].server_id
        assert keep_id != lost_id
        keep = next(s for s in cluster.servers if s.server_id == keep_id)
        lost = next(s for s in cluster.servers if s.server_id == lost_id)
        cluster.checkpoint()  # y can move from here
        lost.stop(grace_s=0.2)
        state = cluster.coordinator.state

        def y_moves_to_keep_while_the_answer_is_lost():
            wait_until(lambda: state.shard_map.shards["y"][0].server_id == keep_id,
                       "y moved to the surviving server", WAIT_S)
            wait_until(lambda: keep.store.epoch >= state.shard_map.epoch,
                       "the surviving server holds the new map", WAIT_S)
            # The two retries of the bounded policy find the server unreachable too.
            cluster.faults.fail_next("Push", bounded.max_attempts - 1)

        # The first Push any server sees is x's on ps-keep (y's server is stopped).
        cluster.faults.drop_response_next("Push", 1,
                                          then=y_moves_to_keep_while_the_answer_is_lost)
        ps.push({"x": np.ones(4, np.float32), "y": np.ones(4, np.float32)})

        assert {s.server_id for s in ps.shard_map.shards_of("y")} == {keep_id}
        np.testing.assert_array_equal(ps.pull("y"), -np.ones(4, np.float32))
        # x was pushed once: SGD lr 1 from zeros gives -1, not -2.
        np.testing.assert_array_equal(ps.pull("x"), -np.ones(4, np.float32))


# ---- errors are RemoteError, also while a restarted coordinator knows nothing yet -------------

def test_a_push_whose_server_is_away_while_the_coordinator_restarts_raises_remote_error(
        make_cluster):
    """README, "Errors": errors are ps_worker.RemoteError with .code() a grpc.StatusCode.
    The coordinator and the server holding `w` go down together (one machine); the
    coordinator comes back first, before any server has registered with it again, so its
    map is empty (at an epoch higher than any before). A push of `w` finds its server
    unreachable and asks the coordinator whether the map moved: a map that places none of
    its variables is no move (the server's UNAVAILABLE stands), never a re-route through it
    that would raise a server-side catalogue error out of `push`."""
    cluster = make_cluster(servers=1, shared_memory=False)
    bounded = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)
    with PSClient(cluster.coordinator_address, shared_memory=False, retry=bounded) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})

        (server,) = cluster.servers
        port = cluster.coordinator.port
        cluster.coordinator.stop(grace_s=0.2)
        server.stop(grace_s=0.2)
        cluster.servers = []  # stopped: nothing for the fixture to stop
        cluster.coordinator = Coordinator(replace(
            cluster._coordinator_config, port=port, recovery_grace_s=3.0)).start()

        try:
            ps.push({"w": np.ones(4, np.float32)})
        except RemoteError:
            pass  # UNAVAILABLE (it waits for the map to be rebuilt) or NOT_FOUND: an API error
        except Exception as error:  # noqa: BLE001 - what the test is about
            pytest.fail(f"push raised {type(error).__module__}.{type(error).__name__} "
                        f"({error}), not RemoteError")
        else:
            pytest.fail("the push of a variable whose only server is away returned")


# ---- a shared-memory reader follows a server's shards once they move ---------------------------

class _Proc:
    """`python -m module args` in a process group of its own, output in files; `end()`
    kills the group and reaps it."""

    def __init__(self, name: str, module: str, args: list[str], directory: Path):
        self.name = name
        self.out = directory / f"{name}.out"
        self.err = directory / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def address(self) -> str:
        deadline = time.monotonic() + WAIT_S
        while True:
            for line in self.out.read_text(errors="replace").splitlines():
                if " listening on " in line:
                    return line.rsplit(" ", 1)[-1]
            if self.popen.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.name} never listened:\n"
                            f"{self.err.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as the OOM killer does: nothing of the server's cleanup runs."""
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(WAIT_S)

    def end(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(WAIT_S)


@pytest.mark.skipif(shm.supported() is not None, reason=shm.supported() or "")
def test_a_shared_memory_reader_follows_the_shards_of_a_killed_server_once_they_move(tmp_path):
    """README, "A server dies and does not come back": after --server-timeout its shards move
    to the live servers from the newest checkpoint and "clients follow the new map". A
    client that only pulls, through shared memory, from the server that was SIGKILLed (an
    evaluator, say) makes no call that would tell it: it reads the values of the moment of
    the kill while the server is down, and once the coordinator's map has placed the shards
    anew (it asks at most once a second while the server's lock is free), follows it, as a
    gRPC reader with the same stale map does on its first pull."""
    procs: list[_Proc] = []

    def launch(name: str, module: str, *args: str) -> _Proc:
        procs.append(_Proc(name, module, list(args), tmp_path))
        return procs[-1]

    try:
        coordinator = launch(
            "coordinator", "ps_server.coordinator.cli", "--port", "0", "--grace", "1",
            "--recovery-grace", "0", "--expect-servers", "2", "--heartbeat-interval", "0.2",
            "--heartbeat-timeout", "1", "--server-timeout", "0.5",
            "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "3600s")
        address = coordinator.address()
        servers = {}
        for server_id in ("s0", "s1"):
            servers[server_id] = launch(server_id, "ps_server.cli", "--port", "0",
                                        "--server-id", server_id, "--coordinator", address,
                                        "--heartbeat-interval", "0.2", "--grace", "1")
            servers[server_id].address()
        with PSClient(address) as writer_setup:
            writer_setup.declare("w", shape=(64,), init="zeros", optimizer=SGD1)
            holder = writer_setup.shard_map.shards_of("w")[0].server_id
            holder_address = writer_setup.shard_map.servers[holder]

        reader = PSClient(address, timeout_s=10)
        grpc_reader = PSClient(address, shared_memory=False, timeout_s=10,
                               retry=RetryPolicy(max_attempts=100, initial_backoff_s=0.05,
                                                 max_backoff_s=0.2))
        try:
            np.testing.assert_array_equal(reader.pull("w"), np.zeros(64, np.float32))
            assert reader.data_paths == {holder_address: "shm"}
            np.testing.assert_array_equal(grpc_reader.pull("w"), np.zeros(64, np.float32))

            taken = subprocess.run([sys.executable, "-m", "ps_worker.ctl", "--coordinator",
                                    address, "checkpoint"], check=False, capture_output=True,
                                   text=True, timeout=60)
            assert taken.returncode == 0, taken.stderr
            assert json.loads(taken.stdout)["id"]

            try:
                servers[holder].kill()  # not coming back: w moves to the other server
                moved_and_read(address, holder, reader, grpc_reader)
            finally:
                servers[holder].end()
                clear_dead()  # the segments the killed server left
        finally:
            reader.interrupt()
            reader.close()
            grpc_reader.interrupt()
            grpc_reader.close()
    finally:
        for proc in reversed(procs):
            proc.end()


def moved_and_read(address: str, holder: str, reader: PSClient,
                   grpc_reader: PSClient) -> None:
    """After `holder` was killed: a trainer's push lands on w's new server; both readers,
    whose maps predate the move, must then read it."""
    # A trainer pushes to w: it waits until w has moved, then lands there once.
    patient = RetryPolicy(max_attempts=200, initial_backoff_s=0.05, max_backoff_s=0.1)
    with PSClient(address, shared_memory=False, retry=patient) as trainer:
        trainer.push({"w": np.ones(64, np.float32)})
        assert trainer.shard_map.shards_of("w")[0].server_id != holder
        np.testing.assert_array_equal(trainer.pull("w"), -np.ones(64, np.float32))

    # Over gRPC, a reader whose map predates the move follows it at once.
    np.testing.assert_array_equal(grpc_reader.pull("w"), -np.ones(64, np.float32))
    # Through shared memory, it must too.
    np.testing.assert_array_equal(reader.pull("w"), -np.ones(64, np.float32))
