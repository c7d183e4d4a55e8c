"""A job whose data or user model does not load is reported
to the coordinator (which fails the job) instead of killing the worker with a traceback,
and a model's row_ids() (model code, called every step) counts as time in the model for
--stall-timeout.

Real in-process daemons on OS-chosen ports; every wait is bounded (a bound a sound build
never reaches); every worker and daemon started here is ended."""

from __future__ import annotations

import struct
import sys
import threading
import types
import zipfile
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_server.coordinator.jobs import JobState
from ps_worker import PSClient
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models import EmbeddingDef, VariableDef
from ps_worker.runtime import JobCannotRun, Trainer
from worker_threads import WAIT_S, Cluster, RunningWorker

SHARED_MEMORY = False
MODULE = "jobs_that_cannot_load_models"

# ---- a job whose data or model does not load ------------------------------------------------

Variable = namedtuple("Variable", "name shape")


class NamedTupleVariables:
    """variables() returns named things that are not VariableDefs (no init_spec, no seed)."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        self.shape = (num_features, num_classes)

    def variables(self):
        return [Variable("w", self.shape)]

    def loss_and_grads(self, params, batch):
        return 0.0, {"w": np.zeros(self.shape, np.float32)}


class VariablesRaise:
    """variables() fails with a TypeError (a bug in the user's model)."""

    def variables(self):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    def loss_and_grads(self, params, batch):
        return 0.0, {}


def _corrupt_npz(directory: Path) -> str:
    """A savez_compressed file whose zip directory is intact and whose 'x.npy' deflate
    stream starts with a block of the reserved type (first byte 0xFF)."""
    path = directory / "corrupt.npz"
    rng = np.random.default_rng(0)
    np.savez_compressed(path, x=rng.normal(size=(64, 4)).astype(np.float32),
                        y=rng.integers(0, 3, 64))
    with zipfile.ZipFile(path) as archive:
        offset = archive.getinfo("x.npy").header_offset
    raw = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", raw, offset + 26)
    raw[offset + 30 + name_length + extra_length] = 0xFF
    path.write_bytes(bytes(raw))
    return str(path)


@pytest.mark.parametrize("case", ["corrupt-npz", "variables-not-VariableDefs",
                                  "variables-raises"])
def test_a_job_whose_data_or_model_does_not_load_fails_instead_of_killing_workers(
        case, tmp_path, monkeypatch):
    """A job nobody can run fails as soon as a worker reports it, with that worker's message;
    the worker ends with JobCannotRun. A damaged .npz (zlib.error), a model whose variables()
    are not VariableDefs (AttributeError when the trainer was built) and a variables() that
    raises TypeError each killed the worker with a traceback, told nobody, and left the job
    running with no worker able to run it."""
    module = types.ModuleType(MODULE)
    module.NamedTupleVariables = NamedTupleVariables
    module.VariablesRaise = VariablesRaise
    monkeypatch.setitem(sys.modules, MODULE, module)
    if case == "corrupt-npz":
        job = JobSpec(model="logreg", data=_corrupt_npz(tmp_path), epochs=1, tasks_per_epoch=1)
        named = "corrupt.npz"
    else:
        attribute = "NamedTupleVariables" if case == "variables-not-VariableDefs" \
            else "VariablesRaise"
        job = JobSpec(model=f"{MODULE}:{attribute}", data="synthetic:64", epochs=1,
                      tasks_per_epoch=1)
        named = attribute
    cluster = Cluster(job, heartbeat_timeout_s=30.0)
    worker = None
    try:
        worker = RunningWorker(cluster.coordinator.address, "w0")
        outcome = worker.join()
        assert outcome, "the worker did not end"
        snap = cluster.coordinator.runner.snapshot()
        assert snap["state"] is JobState.FAILED, (
            f"job {snap['state'].value} after its only worker ended with {outcome!r}: "
            "nobody told the coordinator that the job cannot run")
        assert named in snap["failure"], snap["failure"]
        assert isinstance(outcome.get("error"), JobCannotRun), outcome
    finally:
        if worker is not None:
            worker.end()
        cluster.stop()


# ---- row_ids() and the stall clock ----------------------------------------------------------

class HeldRowIds:
    """A dense bias and a table of one row per class; row_ids() of the training's second
    batch (its second call) waits until `release` is set, as a hung one would."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def variables(self):
        return [VariableDef("bias", (self.num_classes,))]

    def tables(self):
        return [EmbeddingDef("label_rows", dim=2, num_rows=self.num_classes)]

    def row_ids(self, batch):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.release.wait(WAIT_S)
        return {"label_rows": np.asarray(batch[1], np.int64)}

    def loss_and_grads(self, params, batch):
        rows = params["label_rows"]
        return (float((rows ** 2).sum() / len(rows)),
                {"label_rows": (2 * rows / len(rows)).astype(np.float32),
                 "bias": np.zeros(self.num_classes, np.float32)})


def test_a_row_ids_call_that_hangs_counts_as_time_in_the_model(cluster):
    """--stall-timeout counts the model's own code, and row_ids() is the model's code, called
    for every batch. It was called outside the stall clock: a row_ids() that never returned
    showed 0 s in the model, and the worker held its task for ever."""
    data = load_dataset("synthetic:400")
    model = HeldRowIds(data.num_classes)
    job = JobSpec(model=f"{MODULE}:HeldRowIds", data="synthetic:400", batch_size=32,
                  tasks_per_epoch=1)
    trainer = Trainer(job, data, model, NumpyBackend())
    task = LeasedTask(task_id=1, kind="train", epoch=0, index=0, tasks_per_epoch=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        results: list = []
        training = threading.Thread(
            target=lambda: results.append(trainer.train(ps, task, lambda: False)), daemon=True)
        training.start()
        try:
            assert model.entered.wait(WAIT_S), "row_ids() of the second batch was not called"
            stalled = trainer.in_model_s()
        finally:
            model.release.set()
            training.join(WAIT_S)
        assert not training.is_alive() and results and results[0].steps > 1
        assert stalled > 0, ("the trainer was inside the model's row_ids() and in_model_s() "
                             "said 0: a hung row_ids() never trips --stall-timeout")
