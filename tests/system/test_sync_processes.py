"""sync with real processes: two PSClient processes (tests/system/sync_replica.py, the
README's example) train one variable on a ps-coordinator and a ps-server; after N steps both
hold the values of a single-process NumPy run that applies the average of the two gradients
each step, and no gradient was stale or dropped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sync_replica import batch, gradient

pytestmark = pytest.mark.system

STEPS = 20
RUN_S = 120.0  # a bound on the wait, never reached when the code is right


def test_two_processes_in_sync_equal_the_averaged_numpy_run(launch, tmp_path):
    coordinator = launch("coordinator", "ps_server.coordinator.cli", "--port", "0")
    address = coordinator.address()
    server = launch("ps-0", "ps_server.cli", "--port", "0", "--server-id", "ps-0",
                    "--coordinator", address, "--heartbeat-interval", "0.2")
    server.address()
    script = Path(__file__).with_name("sync_replica.py")
    outs = [tmp_path / f"w{rank}.npy" for rank in (0, 1)]
    replicas = [subprocess.Popen([sys.executable, str(script), address, str(rank), str(STEPS),
                                  str(outs[rank])], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [r.communicate(timeout=RUN_S) for r in replicas]
    finally:
        for r in replicas:
            if r.poll() is None:
                r.kill()
                r.wait(10)
    for r, (out, err) in zip(replicas, results):
        assert r.returncode == 0, err
        assert out.strip() == "staleness_max 0 dropped 0", out

    w = np.zeros(8, np.float32)
    batches = [batch(rank) for rank in (0, 1)]
    for _ in range(STEPS):
        w = w - np.float32(0.1) * (gradient(w, *batches[0]) + gradient(w, *batches[1])) / 2
    for out in outs:
        np.testing.assert_allclose(np.load(out), w, rtol=1e-5, atol=1e-5)
    assert not np.allclose(w, 0)  # it trained
