"""A client that only pulls through shared memory from a server that was SIGKILLed and does
not come back follows the server's shards once they move, as a client over gRPC does (real
processes on OS-chosen ports, each ended by the launch fixture)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from ps_common import shm
from ps_server.shared_memory import clear_dead
from ps_worker import PSClient, RetryPolicy

pytestmark = pytest.mark.system
SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.mark.skipif(shm.supported() is not None, reason=shm.supported() or "")
def test_a_shared_memory_reader_follows_the_shards_of_a_killed_server_once_they_move(launch,
                                                                                     tmp_path):
    """README, "A server dies and does not come back": after --server-timeout its shards move
    to the live servers from the newest checkpoint and "clients follow the new map". A
    client that only pulls, through shared memory, from the server that was SIGKILLed (an
    evaluator, say) makes no call that would tell it: it reads the values of the moment of
    the kill while the server is down, and once the coordinator's map has placed the shards
    anew (it asks at most once a second while the server's lock is free), follows it, as a
    gRPC reader with the same stale map does on its first pull."""
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
            # SIGKILL, as the OOM killer does (nothing of the server's cleanup runs), and
            # not coming back: w moves to the other server.
            servers[holder].signal(signal.SIGKILL)
            servers[holder].wait()
            moved_and_read(address, holder, reader, grpc_reader)
        finally:
            clear_dead()  # the segments the killed server left
    finally:
        reader.interrupt()
        reader.close()
        grpc_reader.interrupt()
        grpc_reader.close()


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
