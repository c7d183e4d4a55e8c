"""The Trainer with a model that has embedding tables, against an in-memory stand-in for
PSClient: which rows are pulled and pushed (and when), the specs declared, evaluation with
AUC; and that a dense model never touches the row calls."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import numpy as np
import pytest

from ps_common.job import JobSpec
from ps_common.shardmap import OPTIMIZER_KNOBS, Component
from ps_worker.backend import NumpyBackend
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import iter_batches, load_dataset, task_indices
from ps_worker.metrics import roc_auc
from ps_worker.models import EmbeddingDef, EmbeddingMLP, VariableDef, build_model
from ps_worker.runtime import EVAL_BATCH_WITH_TABLES, Trainer, variable_specs

DATA = "synthetic_ctr:3000"


def done(value=None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class FakePS:
    """The PSClient calls the Trainer makes, in memory: dense variables and fixed tables,
    plain SGD (a table's gradients of repeated ids summed, as the servers do). Every call
    is logged as (method, name or names, ids copy or None)."""

    def __init__(self, lr: float = 0.0, seed: int = 0):
        self.lr = lr
        self.values: dict[str, np.ndarray] = {}
        self.specs = []
        self.calls: list[tuple[str, object, np.ndarray | None]] = []
        self._rng = np.random.default_rng(seed)

    def declare_many(self, specs):
        self.specs = list(specs)
        for spec in specs:
            self.values[spec.name] = self._rng.uniform(-0.1, 0.1, spec.shape).astype(np.float32)

    def pull(self, names, *, out=None, wire_dtype=None, log=True):
        if log:
            self.calls.append(("pull", tuple(names), None))
        result = {}
        for name in names:
            target = out[name] if out is not None else np.empty_like(self.values[name])
            np.copyto(target, self.values[name])
            result[name] = target
        return result

    def pull_async(self, names, *, out=None, wire_dtype=None):
        return done(self.pull(names, out=out))

    def pull_rows(self, name, ids, *, out=None, wire_dtype=None):
        assert ids.dtype == np.int64 and ids.ndim == 1
        self.calls.append(("pull_rows", name, ids.copy()))
        rows = self.values[name][ids]
        if out is None:
            return rows
        assert out.shape == rows.shape and out.flags.c_contiguous
        np.copyto(out, rows)
        return out

    def pull_rows_async(self, name, ids, *, out=None, wire_dtype=None):
        return done(self.pull_rows(name, ids, out=out))

    def push_async(self, grads, *, wire_dtype=None):
        self.calls.append(("push", tuple(sorted(grads)), None))
        self._apply(grads)
        return done()

    def _apply(self, grads):
        for name, grad in grads.items():
            assert grad.shape == self.values[name].shape
            self.values[name] -= self.lr * grad

    def push_pull_async(self, grads, names, *, out=None, wire_dtype=None):
        self.calls.append(("push_pull", tuple(sorted(grads)), None))
        self._apply(grads)
        return done(self.pull(names, out=out, log=False))

    def push_rows_async(self, name, ids, grads, *, wire_dtype=None):
        assert grads.shape == (len(ids), self.values[name].shape[1])
        self.calls.append(("push_rows", name, ids.copy()))
        np.add.at(self.values[name], ids, -self.lr * grads)
        return done()

    def flush(self, timeout=None):
        self.calls.append(("flush", None, None))

    def of(self, method: str) -> list:
        return [call for call in self.calls if call[0] == method]


def ctr_trainer(**job_fields) -> tuple[Trainer, FakePS]:
    data = load_dataset(DATA)
    job = JobSpec.from_mapping({"model": "embedding_mlp", "data": DATA, "batch_size": 64,
                                "tasks_per_epoch": 4, **job_fields})
    model = build_model(job.model, num_features=data.num_features, num_classes=2,
                        hidden=job.hidden, field_sizes=data.field_sizes)
    trainer = Trainer(job, data, model, NumpyBackend())
    ps = FakePS()
    ps.declare_many(trainer.specs)
    return trainer, ps


def task(index: int, epoch: int = 0, tasks: int = 4) -> LeasedTask:
    return LeasedTask(task_id=1, kind="train", epoch=epoch, index=index, tasks_per_epoch=tasks)


def optimizer(knobs: dict) -> Component:
    """The optimizer of a spec declared with `knobs`: every knob, those not given at their
    defaults."""
    return Component.of(knobs).with_defaults(OPTIMIZER_KNOBS)


def test_tables_are_declared_as_embedding_specs_with_their_optimizer_and_seed() -> None:
    class TwoTables:
        def variables(self):
            return [VariableDef("w", (3, 1), "glorot_uniform", seed=1)]

        def tables(self):
            return [EmbeddingDef("fixed", 4, num_rows=10, seed=5,
                                 optimizer={"name": "adagrad", "lr": 0.1}),
                    EmbeddingDef("hashed", 2, capacity=100, ttl_seconds=30.0,
                                 init={"name": "normal", "stddev": 0.01})]

    job = JobSpec(optimizer="adam", lr=0.003, seed=7)
    dense, fixed, hashed = variable_specs(TwoTables(), job)
    assert (dense.kind, dense.shape, dense.seed) == ("dense", (3, 1), 8)
    # (a spec holds every knob: the ones not given at their defaults)
    assert dense.optimizer == optimizer({"name": "adam", "lr": 0.003})
    assert (fixed.kind, fixed.shape, fixed.seed, fixed.capacity) == ("embedding", (10, 4), 12, 0)
    assert fixed.optimizer == optimizer({"name": "adagrad", "lr": 0.1})
    assert fixed.initializer == Component.of({"name": "uniform", "minval": -0.05, "maxval": 0.05})
    assert (hashed.kind, hashed.shape, hashed.capacity, hashed.ttl_seconds) == (
        "embedding", (0, 2), 100, 30.0)
    assert hashed.dynamic and hashed.optimizer == dense.optimizer  # no override: the job's
    assert hashed.initializer == Component.of({"name": "normal", "mean": 0.0, "stddev": 0.01})


def test_each_step_pulls_and_pushes_each_distinct_id_of_its_batch_once() -> None:
    """The batch's rows are gathered from its distinct ids' rows on the device, and its
    gradients summed per id there: only distinct rows cross the wire (and the host-device
    link), each with the sum of its occurrences' gradients."""
    trainer, ps = ctr_trainer()
    recorded = []
    push_rows_async = ps.push_rows_async

    def recording(name, ids, grads, *, wire_dtype=None):
        recorded.append(np.array(grads))
        return push_rows_async(name, ids, grads)

    ps.push_rows_async = recording
    result = trainer.train(ps, task(1), should_stop=lambda: False)
    indices = task_indices(trainer.dataset.num_train, epoch=0, task_index=1, tasks_per_epoch=4,
                           seed=0)
    batches = list(iter_batches(trainer.dataset, indices, 64))
    expected = [trainer.model.row_ids(batch)["embedding"] for batch in batches]
    pulled = [ids for _, name, ids in ps.of("pull_rows") if name == "embedding"]
    pushed = [ids for _, name, ids in ps.of("push_rows") if name == "embedding"]
    assert result.steps == len(batches) == len(pulled) == len(pushed)
    for want, got_pulled, got_pushed, grads in zip(expected, pulled, pushed, recorded):
        np.testing.assert_array_equal(got_pulled, np.unique(want))
        np.testing.assert_array_equal(got_pushed, np.unique(want))
        assert grads.shape == (len(np.unique(want)), trainer.tables["embedding"].dim)
    # Zipf ids repeat within a batch: fewer rows move than the batch has ids.
    assert any(len(ids) < len(want) for ids, want in zip(pushed, expected))
    # Dense variables: pulled whole every step (never the table), pushed every step; the
    # first two steps' values are pulled, the others come back with an earlier push.
    assert len(ps.of("pull")) == 2 and len(ps.of("push_pull")) == len(batches) - 2
    assert all("embedding" not in names for _, names, _ in ps.of("pull"))
    assert all("embedding" not in names and names
               for _, names, _ in ps.of("push") + ps.of("push_pull"))
    assert len(ps.of("push")) == 2
    assert ps.calls[-1][0] == "flush"  # the task ends once its pushes have landed
    assert result.examples == len(indices) and 0 <= result.correct <= result.examples


def test_the_next_batchs_rows_are_pulled_before_this_steps_gradients_are_pushed() -> None:
    trainer, ps = ctr_trainer()
    trainer.train(ps, task(0), should_stop=lambda: False)
    order = [method for method, _, _ in ps.calls if method in ("pull_rows", "push_rows")]
    steps = order.count("push_rows")
    # pull 0, pull 1, push 0, pull 2, push 1, ..., pull n-1, push n-2, push n-1
    assert order == ["pull_rows"] + ["pull_rows", "push_rows"] * (steps - 1) + ["push_rows"]


def test_row_buffers_are_reused_across_steps_and_tasks() -> None:
    trainer, ps = ctr_trainer()
    seen: list[np.ndarray] = []
    pull_rows = ps.pull_rows

    def recording(name, ids, *, out=None, wire_dtype=None):
        seen.append(out)
        return pull_rows(name, ids, out=out)

    ps.pull_rows = recording
    trainer.train(ps, task(0), should_stop=lambda: False)
    trainer.train(ps, task(1), should_stop=lambda: False)
    bases = {id(buffer.base if buffer.base is not None else buffer) for buffer in seen}
    assert len(seen) > 4 and len(bases) == 2  # two slots, alternating, the last batch too


def test_training_moves_exactly_the_rows_of_the_ids_it_saw() -> None:
    trainer, ps = ctr_trainer()
    ps.lr = 0.5
    before = ps.values["embedding"].copy()
    trainer.train(ps, task(2), should_stop=lambda: False)
    seen = np.unique(np.concatenate([ids for _, _, ids in ps.of("push_rows")]))
    changed = np.flatnonzero((ps.values["embedding"] != before).any(axis=1))
    assert set(changed) <= set(seen) and len(changed) > 0.9 * len(seen)


def test_a_stop_mid_task_leaves_no_pull_in_flight_and_flushes() -> None:
    trainer, ps = ctr_trainer()
    steps = iter(range(100))
    result = trainer.train(ps, task(0), should_stop=lambda: next(steps) >= 3)
    assert result.steps == 3 and len(ps.of("push_rows")) == 3
    assert len(ps.of("pull_rows")) == 4 and ps.calls[-1][0] == "flush"


def test_evaluation_pulls_the_rows_of_every_test_batch_and_reports_auc() -> None:
    trainer, ps = ctr_trainer()
    result = trainer.evaluate(ps)
    data, model = trainer.dataset, trainer.model
    pulled = [ids for _, _, ids in ps.of("pull_rows")]
    batches = list(iter_batches(data, np.arange(data.num_test), EVAL_BATCH_WITH_TABLES,
                                split="test"))
    assert len(pulled) == len(batches) and not ps.of("push_rows") and not ps.of("push")
    scores, loss_sum, correct = [], 0.0, 0
    for batch, ids in zip(batches, pulled):
        batch_ids = model.row_ids(batch)["embedding"]
        np.testing.assert_array_equal(ids, np.unique(batch_ids))
        params = {**ps.values, "embedding": ps.values["embedding"][batch_ids]}
        batch_loss, batch_correct, batch_scores = model.evaluate_and_scores(params, batch)
        scores.append(batch_scores)
        loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
    assert result.examples == data.num_test and result.correct == correct
    assert result.loss_sum == pytest.approx(loss_sum)
    assert result.auc == roc_auc(np.concatenate(scores), data.y_test)
    assert 0.0 <= result.auc <= 1.0


def test_a_few_epochs_through_the_trainer_learn_the_click_signal() -> None:
    data = load_dataset("synthetic_ctr:20000")
    job = JobSpec.from_mapping({"model": "embedding_mlp", "data": "synthetic_ctr:20000",
                                "batch_size": 128, "tasks_per_epoch": 1})
    model = EmbeddingMLP(data.num_features, data.field_sizes, hidden=(16,))
    trainer = Trainer(job, data, model, NumpyBackend())
    ps = FakePS(lr=0.5)
    ps.declare_many(trainer.specs)
    assert trainer.evaluate(ps).auc < 0.6
    for epoch in range(3):
        trainer.train(ps, task(0, epoch=epoch, tasks=1), should_stop=lambda: False)
    assert trainer.evaluate(ps).auc > 0.7


def digits_trainer() -> tuple[Trainer, FakePS]:
    data = load_dataset("digits")
    model = build_model("mlp", num_features=data.num_features, num_classes=data.num_classes,
                        hidden=(8,))
    trainer = Trainer(JobSpec(batch_size=64), data, model, NumpyBackend())
    ps = FakePS()
    ps.declare_many(trainer.specs)
    return trainer, ps


def test_a_dense_model_never_pulls_or_pushes_rows_and_has_no_auc() -> None:
    trainer, ps = digits_trainer()
    data = trainer.dataset
    assert all(spec.kind == "dense" for spec in trainer.specs)
    result = trainer.train(ps, task(0), should_stop=lambda: False)
    evaluation = trainer.evaluate(ps)
    assert result.steps > 0 and evaluation.examples == data.num_test
    assert evaluation.auc is None
    assert not ps.of("pull_rows") and not ps.of("push_rows")
    assert all(names == tuple(trainer.names) for _, names, _ in ps.of("pull"))


def test_a_dense_evaluation_says_it_has_its_parameters_and_measures_those() -> None:
    trainer, ps = digits_trainer()
    expected = trainer.evaluate(ps)
    reads = []

    def parameters_read():
        # The next epoch starts now: its pushes must not reach what is being measured.
        reads.append([call[0] for call in ps.calls])
        for values in ps.values.values():
            values += 1.0

    result = trainer.evaluate(ps, parameters_read)
    assert reads == [["pull", "pull"]]  # once, right after the evaluation's one pull
    assert (result.loss_sum, result.correct) == (expected.loss_sum, expected.correct)


def test_an_evaluation_with_tables_never_says_it_has_its_parameters() -> None:
    trainer, ps = ctr_trainer()
    reads = []
    result = trainer.evaluate(ps, lambda: reads.append(1))
    assert reads == [] and result.examples == trainer.dataset.num_test  # rows pulled to the end


# ---- dense values: pulled for the first steps, then back with the pushes ----------------

def dense_trainer(mode: str = "async") -> tuple[Trainer, FakePS, int]:
    data = load_dataset("digits")
    model = build_model("mlp", num_features=data.num_features, num_classes=data.num_classes,
                        hidden=(8,))
    trainer = Trainer(JobSpec(batch_size=64, mode=mode), data, model, NumpyBackend())
    ps = SteppedFakePS(lr=0.5)
    ps.declare_many(trainer.specs)
    indices = task_indices(data.num_train, epoch=0, task_index=0, tasks_per_epoch=4, seed=0)
    return trainer, ps, len(list(iter_batches(data, indices, 64)))


class SteppedFakePS(FakePS):
    """FakePS that also records which host buffers each call fills, and joins steps."""

    def __init__(self, lr: float):
        super().__init__(lr=lr)
        self.buffers: list[int] = []  # the id of the buffer set each call fills

    def pull_async(self, names, *, out=None, wire_dtype=None):
        self.buffers.append(id(out[names[0]]))
        return super().pull_async(names, out=out)

    def push_pull_async(self, grads, names, *, out=None, wire_dtype=None):
        self.buffers.append(id(out[names[0]]))
        return super().push_pull_async(grads, names, out=out)

    def join_steps(self, mode):
        self.calls.append(("join_steps", mode, None))

    def leave_steps(self):
        self.calls.append(("leave_steps", None, None))


def test_in_async_a_steps_push_brings_back_the_values_of_the_step_after_next() -> None:
    trainer, ps, steps = dense_trainer()
    seen = []
    step = trainer._step

    def recording(params, batch):
        seen.append({n: params[n].copy() for n in trainer.names})
        return step(params, batch)

    trainer._step = recording
    result = trainer.train(ps, task(0), should_stop=lambda: False)
    assert result.steps == steps > 4
    # pull 0, pull 1, then step i's push with the values of step i + 2, then plain pushes
    assert [c[0] for c in ps.calls] == (["pull"] * 2 + ["push_pull"] * (steps - 2)
                                        + ["push"] * 2 + ["flush"])
    # Step i + 2's values land in the buffers that step i read, once it is done with them.
    filled = ps.buffers
    assert filled[0] != filled[1] and filled == [filled[i % 2] for i in range(steps)]
    # Every step but the first two computes with the values after step i - 2's push.
    for i in range(2, steps):
        changed = [not np.array_equal(seen[i][n], seen[i - 1][n]) for n in trainer.names]
        assert any(changed), i
    np.testing.assert_array_equal(seen[1][trainer.names[0]], seen[0][trainer.names[0]])


def test_in_ssp_a_steps_push_brings_back_the_values_of_the_next_step() -> None:
    trainer, ps, steps = dense_trainer("ssp:1")
    trainer.train(ps, task(0), should_stop=lambda: False)
    assert [c[0] for c in ps.calls] == (["join_steps", "pull"] + ["push_pull"] * (steps - 1)
                                        + ["push", "flush", "leave_steps"])
    filled = ps.buffers
    assert filled == [filled[i % 2] for i in range(steps)] and filled[0] != filled[1]


class ArrivesWhenAwaited(Future):
    """The values of a push_pull still in flight: they arrive when the trainer asks for
    them (result) or waits for them (see the test below), never on their own."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def arrive(self) -> None:
        if not self.done():
            self.set_result(self.values)

    def result(self, timeout=None):
        self.arrive()
        return super().result(timeout)


def test_a_stop_mid_task_waits_for_the_values_still_in_flight(monkeypatch) -> None:
    """They land in the trainer's buffers: none may still be coming when train returns."""
    import ps_worker.runtime as runtime

    trainer, ps, _ = dense_trainer()
    in_flight: list[ArrivesWhenAwaited] = []
    push_pull_async = ps.push_pull_async

    def unfinished(grads, names, *, out=None, wire_dtype=None):
        in_flight.append(ArrivesWhenAwaited(push_pull_async(grads, names, out=out).result()))
        return in_flight[-1]

    waited: list[Future] = []

    def waiting(fs, *args, **kwargs):
        for future in fs:
            waited.append(future)
            future.arrive()
        return futures_wait(fs, *args, **kwargs)

    monkeypatch.setattr(ps, "push_pull_async", unfinished)
    monkeypatch.setattr(runtime, "futures_wait", waiting)
    steps = iter(range(100))
    result = trainer.train(ps, task(0), should_stop=lambda: next(steps) >= 3)
    assert result.steps == 3 and ps.calls[-1][0] == "flush"
    # Steps 0, 1 and 2 pushed with the values of steps 2, 3 and 4; 3 and 4 never ran.
    assert len(in_flight) == 3 and all(f.done() for f in in_flight)
    assert in_flight[1] in waited and in_flight[2] in waited


def test_a_failed_push_is_raised_when_its_values_are_needed_after_a_flush() -> None:
    """Flushed: no pull still writes into a buffer, and the client holds the error no more
    (PSClient.close would raise it again)."""
    trainer, ps, _ = dense_trainer()
    push_pull_async = ps.push_pull_async
    refused = RuntimeError("refused")

    def failing_second(grads, names, *, out=None, wire_dtype=None):
        finished = push_pull_async(grads, names, out=out)
        if len(ps.of("push_pull")) != 2:
            return finished
        failed: Future = Future()
        failed.set_exception(refused)
        return failed

    ps.push_pull_async = failing_second
    with pytest.raises(RuntimeError) as caught:
        trainer.train(ps, task(0), should_stop=lambda: False)
    assert caught.value is refused
    # Step 1's push failed; step 3, which needed its values, flushed and raised.
    assert [c[0] for c in ps.calls] == ["pull", "pull", "push_pull", "push_pull",
                                        "push_pull", "flush"]


def test_in_ssp_a_steps_row_gradients_land_before_the_push_that_finishes_it() -> None:
    """Row pushes carry no step: the trainer has them applied before the stepped push, so
    the others' pulls after this step (which that push lets them take) see them."""
    trainer, _ = ctr_trainer(mode="ssp:0")
    ps = SteppedFakePS(lr=0.0)
    ps.declare_many(trainer.specs)
    trainer.train(ps, task(0), should_stop=lambda: False)
    order = [method for method, _, _ in ps.calls if method in ("push_rows", "push_pull", "push")]
    steps = order.count("push_rows")
    assert steps > 1
    assert order == ["push_rows", "push_pull"] * (steps - 1) + ["push_rows", "push"]


def test_row_ids_outside_a_fixed_table_are_a_job_error_naming_the_table() -> None:
    """A model whose row_ids() go past its fixed table's rows cannot run the job: the
    trainer raises ValueError (reported to the coordinator as a job error), before any
    pull, instead of the client's OUT_OF_RANGE ending this worker alone."""
    trainer, ps = ctr_trainer()
    rows = trainer.tables["embedding"].num_rows
    real_row_ids = trainer.model.row_ids

    def past_the_table(batch):
        ids = dict(real_row_ids(batch))
        ids["embedding"] = ids["embedding"].copy()
        ids["embedding"][-1] = rows
        return ids

    trainer.model.row_ids = past_the_table
    with pytest.raises(ValueError, match=f"table 'embedding'.*rows 0:{rows}"):
        trainer.train(ps, task(1), should_stop=lambda: False)
    assert ps.of("pull_rows") == []
