"""The push socket of a real ps-server after a moment without file descriptors.

README ("Which path pulls and pushes take"): "where the socket cannot be reached or the
server serves no more sockets (256 at once), the same call goes over gRPC". A server that
once ran out of file descriptors (its `--max` open files reached for a moment: many gRPC
connections, staging files, push sockets) must go on answering shared-memory pushes once
descriptors are free again, or send them over gRPC: never leave them unanswered."""

from __future__ import annotations

import os
import resource
import socket
import struct
import time

import numpy as np
import pytest

from child_processes import POLL_S
from ps_common import shm
from ps_worker import PSClient, RetryPolicy

UNSUPPORTED = shm.supported()
pytestmark = [pytest.mark.system,
              pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")]

WAIT_S = 30.0
SGD1 = {"name": "sgd", "lr": 1.0}


def open_fds(pid: int) -> set[int]:
    return {int(n) for n in os.listdir(f"/proc/{pid}/fd")}


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(POLL_S)


def test_shared_memory_pushes_are_answered_after_the_server_briefly_ran_out_of_descriptors(
        launch):
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0",
                         "--grace", "1", "--recovery-grace", "0")
    address = coordinator.address()
    server = launch("server", "ps_server.cli", "--port", "0", "--coordinator", address,
                    "--server-id", "s0", "--grace", "1")
    server.address()
    with PSClient(address, timeout_s=10) as setup:
        setup.declare("w", shape=(8, 4), init="zeros", optimizer=SGD1)
    (socket_path,) = [p for p in shm.DIRECTORY.iterdir()
                      if p.name.startswith(f"{shm.PREFIX}{server.pid}.")
                      and p.name.endswith(".socket")]

    # For a moment the server may open a few more descriptors only.
    original = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
    baseline = len(open_fds(server.pid))
    limit = max(open_fds(server.pid)) + 4
    resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (limit, original[1]))
    raw = []
    try:
        # More connections than free descriptors: the last ones find none (EMFILE).
        for _ in range(limit - baseline + 4):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(WAIT_S)
            raw.append(sock)
            sock.connect(str(socket_path))
        wait_for(lambda: set(range(limit)) <= open_fds(server.pid),
                 "every descriptor the server may open taken by an accepted socket")
        # A round trip on the accepted socket: its thread runs, so the acceptor has gone on
        # to the second connection and met the limit.
        payload = b"not a request"
        raw[0].sendall(struct.pack("<I", len(payload)) + payload)
        (length,) = struct.unpack("<I", raw[0].recv(4, socket.MSG_WAITALL))
        assert length > 0
        raw[0].recv(length, socket.MSG_WAITALL)
    finally:
        for sock in raw:
            sock.close()
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, original)
    wait_for(lambda: len(open_fds(server.pid)) <= baseline, "the server's descriptors freed")

    # Descriptors are plentiful again: a new client's pushes land, through the socket or gRPC.
    with PSClient(address, timeout_s=3,
                  retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.05,
                                    max_backoff_s=0.2)) as ps:
        ps.push({"w": np.ones((8, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), -np.ones((8, 4), np.float32))
    assert server.returncode is None
