"""A model's row_ids() of a narrower integer dtype (int32, uint32: every value fits int64
exactly) trains the rows it names: the trainer widens them, and refuses only conversions
that could change an id (floats, uint64, 2-D arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_worker import PSClient
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models import build_model
from ps_worker.runtime import Trainer

DATA = "synthetic_ctr:2000"


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_narrow_integer_row_ids_train_their_rows(cluster, dtype):
    data = load_dataset(DATA)
    job = JobSpec.from_mapping({"model": "embedding_mlp", "data": DATA, "batch_size": 64,
                                "tasks_per_epoch": 8})
    model = build_model(job.model, num_features=data.num_features, num_classes=2,
                        hidden=job.hidden, field_sizes=data.field_sizes)
    int64_row_ids = model.row_ids
    model.row_ids = lambda batch: {name: ids.astype(dtype)
                                   for name, ids in int64_row_ids(batch).items()}
    trainer = Trainer(job, data, model, NumpyBackend())
    task = LeasedTask(task_id=1, kind="train", epoch=0, index=0, tasks_per_epoch=8)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_many(trainer.specs)
        table = trainer.specs[-1].name
        before = ps.pull_rows(table, np.arange(10, dtype=np.int64)).copy()
        result = trainer.train(ps, task, lambda: False)
        after = ps.pull_rows(table, np.arange(10, dtype=np.int64))
    assert result.steps > 0
    assert not np.array_equal(before, after)  # the rows the batches named were trained
