"""The Trainer holds a model's `row_ids(batch)` to PSClient's rule for ids
(ps_common.rows.check_ids): 1-D int64. Ids of another dtype (float, whose rounding errors
would truncate to the wrong rows) are refused with a ValueError before any row is pulled or
pushed, never converted."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models import build_model
from ps_worker.runtime import Trainer

DATA = "synthetic_ctr:3000"


def done(value=None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class RecordingPS:
    """The PSClient calls the Trainer makes, in memory; records the ids of row calls."""

    def __init__(self, specs):
        rng = np.random.default_rng(0)
        self.values = {s.name: rng.uniform(-0.1, 0.1, s.shape).astype(np.float32)
                       for s in specs}
        self.row_ids: list[np.ndarray] = []

    def pull(self, names, *, out=None, wire_dtype=None):
        for name in names:
            np.copyto(out[name], self.values[name])
        return out

    def pull_async(self, names, *, out=None, wire_dtype=None):
        return done(self.pull(names, out=out))

    def pull_rows_async(self, name, ids, *, out=None, wire_dtype=None):
        self.row_ids.append(np.array(ids))
        np.copyto(out, self.values[name][ids])
        return done(out)

    def push_async(self, grads, *, wire_dtype=None):
        return done()

    def push_pull_async(self, grads, names, *, out=None, wire_dtype=None):
        return done(self.pull(names, out=out))

    def push_rows_async(self, name, ids, grads, *, wire_dtype=None):
        self.row_ids.append(np.array(ids))
        return done()

    def flush(self, timeout=None):
        pass


def test_float_row_ids_from_a_model_are_refused_not_truncated():
    data = load_dataset(DATA)
    job = JobSpec.from_mapping({"model": "embedding_mlp", "data": DATA, "batch_size": 64,
                                "tasks_per_epoch": 4})
    model = build_model(job.model, num_features=data.num_features, num_classes=2,
                        hidden=job.hidden, field_sizes=data.field_sizes)
    int_row_ids = model.row_ids
    # A model that keeps its categorical ids in a float feature matrix, as many do, with
    # one off by a rounding error: 2.9999998 is meant as id 3.
    model.row_ids = lambda batch: {name: ids.astype(np.float64) - 2e-7
                                   for name, ids in int_row_ids(batch).items()}
    trainer = Trainer(job, data, model, NumpyBackend())
    ps = RecordingPS(trainer.specs)
    task = LeasedTask(task_id=1, kind="train", epoch=0, index=0, tasks_per_epoch=4)
    with pytest.raises(Exception, match="int64"):
        trainer.train(ps, task, should_stop=lambda: False)
    assert ps.row_ids == []  # no row of a truncated id pulled or pushed
