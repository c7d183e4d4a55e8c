"""The Trainer's host buffers against a GPU-like backend whose copies are as late as the
ArrayBackend contract allows, and a stand-in PSClient whose calls finish as late as theirs
allow (the real backend runs in tests/gpu, on a machine with a GPU).

ArrayBackend (ps_worker/backend.py): "``to_device(host)`` may be asynchronous: ``host`` must
not be rewritten until ``synchronize()`` returns" and "``to_host(arr, out)`` may be
asynchronous: the returned host array is valid only after ``synchronize()``". PSClient:
push_async / push_pull_async: "The caller must not modify `grads` or read `out` until it is
done". The stand-ins record every breach of those rules, exactly (np.shares_memory), with
no threads and no timing: a copy is pending until synchronize(), a call until something
waits for it (or the push window needs its place).
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as real_wait

import numpy as np
import pytest

import ps_worker.runtime as runtime
from ps_common.job import JobSpec
from ps_common.rows import sum_duplicates
from ps_worker.backend import ArrayBackend, HostBufferCache
from ps_worker.coordinator_client import LeasedTask
from ps_worker.data import load_dataset
from ps_worker.models import build_model
from ps_worker.runtime import Trainer

POISON = np.float32(np.nan)


class LateCopyBackend:
    """The device is NumPy. An H2D copy reads its source until synchronize(); a D2H copy
    may write `out` at once (poison here) and lands at synchronize()."""

    name = "late-copies"
    xp = np
    device = "fake:0"

    def __init__(self):
        self._buffers = HostBufferCache(lambda shape, dtype: np.zeros(shape, dtype))
        self._reading: list[np.ndarray] = []
        self._landing: list[tuple[np.ndarray, np.ndarray]] = []

    def host_buffer(self, key, shape, dtype):
        return self._buffers.get(key, shape, dtype)

    def to_device(self, host):
        host = np.asarray(host)
        self._reading.append(host)
        return host.copy()  # what kernels queued after it see (stream order)

    def to_host(self, arr, out=None):
        value = np.array(arr, copy=True)
        out = np.empty(value.shape, value.dtype) if out is None else out
        out[...] = POISON
        self._landing.append((out, value))
        return out

    def synchronize(self):
        for out, value in self._landing:
            np.copyto(out, value)
        self._reading.clear()
        self._landing.clear()

    def sum_rows(self, grads, inverse, n_unique):
        return sum_duplicates(np.asarray(grads), inverse, n_unique)

    def being_read(self, arr) -> bool:
        return any(np.shares_memory(host, arr) for host in self._reading)

    def being_written(self, arr) -> bool:
        return any(np.shares_memory(out, arr) for out, _ in self._landing)


class Late(Future):
    """A call in flight: it finishes when waited for or asked for its result."""

    def __init__(self, finish):
        super().__init__()
        self._finish = finish

    def finish(self):
        if not self.done():
            self.set_result(self._finish())

    def result(self, timeout=None):
        self.finish()
        return super().result(timeout)


class LatePS:
    """The PSClient calls a Trainer makes. A pull writes into `out` from the moment it is
    issued (poison) until it finishes (the values); a push reads its gradients until it
    finishes (and must find them as they were when it was issued). Breaches are recorded in
    `breaches`."""

    def __init__(self, backend: LateCopyBackend, window: int, lr: float = 0.1,
                 newest_first: bool = False):
        self.backend, self.window, self.lr = backend, window, lr
        # Pushes to different servers need not finish in order: the newest may go first.
        self.newest_first = newest_first
        self.values: dict[str, np.ndarray] = {}
        self.pushes: list[Late] = []
        self.breaches: list[str] = []

    def declare_many(self, specs):
        rng = np.random.default_rng(0)
        for spec in specs:
            self.values[spec.name] = rng.uniform(-0.1, 0.1, spec.shape).astype(np.float32)

    def _writes(self, arr, what):
        if self.backend.being_read(arr):
            self.breaches.append(f"{what} writes into a host buffer of shape {arr.shape} "
                                 "that an H2D copy not yet synchronized reads")

    def _reads(self, name, grad, what):
        if self.backend.being_written(grad):
            self.breaches.append(f"{what} reads gradient {name!r} while a D2H copy not yet "
                                 "synchronized writes it")

    def _fill(self, names, out, what):
        for name in names:
            self._writes(out[name], what)
            np.copyto(out[name], self.values[name])
        return {name: out[name] for name in names}

    def _start_pull(self, names, out, what):
        for name in names:
            self._writes(out[name], what)
            out[name][...] = POISON

    def pull(self, names, *, out=None, wire_dtype=None):
        return self._fill(names, out, "pull")

    def pull_async(self, names, *, out=None, wire_dtype=None):
        self._start_pull(names, out, "pull_async")
        return Late(lambda: self._fill(names, out, "pull_async"))

    def pull_rows_async(self, name, ids, *, out=None, wire_dtype=None):
        self._writes(out, "pull_rows_async")
        out[...] = POISON
        ids = ids.copy()

        def finish():
            self._writes(out, "pull_rows_async")
            np.copyto(out, self.values[name][ids])
            return out
        return Late(finish)

    def _push(self, grads, then=None, rows=None, what="push"):
        while sum(not p.done() for p in self.pushes) >= self.window:
            pending = [p for p in self.pushes if not p.done()]
            pending[-1 if self.newest_first else 0].finish()

        sent = {name: np.array(grad, copy=True) for name, grad in grads.items()}

        def finish():
            for name, grad in grads.items():
                self._reads(name, grad, what)
                if not np.array_equal(grad, sent[name], equal_nan=True):
                    self.breaches.append(f"{what}: gradient {name!r} was rewritten while the "
                                         "push was in flight")
                if rows is None:
                    self.values[name] -= self.lr * grad
                else:
                    np.add.at(self.values[name], rows, -self.lr * grad)
            return then() if then is not None else None
        self.pushes.append(Late(finish))
        return self.pushes[-1]

    def push_async(self, grads, *, wire_dtype=None):
        return self._push(grads)

    def push_pull_async(self, grads, names, *, out=None, wire_dtype=None):
        self._start_pull(names, out, "push_pull_async")
        return self._push(grads, then=lambda: self._fill(names, out, "push_pull_async"),
                          what="push_pull_async")

    def push_rows_async(self, name, ids, grads, *, wire_dtype=None):
        return self._push({name: grads}, rows=ids.copy(), what="push_rows_async")

    def flush(self, timeout=None):
        for push in self.pushes:
            push.result()
        self.pushes.clear()

    def join_steps(self, mode):
        pass

    def leave_steps(self):
        pass


@pytest.fixture(autouse=True)
def waits_finish_calls(monkeypatch):
    """The Trainer's futures_wait finishes the Late calls it waits for."""
    def wait(fs, *args, **kwargs):
        for future in fs:
            if isinstance(future, Late):
                future.finish()
        return real_wait(fs, *args, **kwargs)
    monkeypatch.setattr(runtime, "futures_wait", wait)


def make(model: str, data: str, window: int = 2, mode: str = "async",
         newest_first: bool = False):
    dataset = load_dataset(data)
    job = JobSpec.from_mapping({"model": model, "data": data, "batch_size": 64,
                                "tasks_per_epoch": 2, "mode": mode, "hidden": [8]})
    built = build_model(job.model, num_features=dataset.num_features,
                        num_classes=dataset.num_classes, hidden=job.hidden,
                        field_sizes=dataset.field_sizes)
    backend = LateCopyBackend()
    assert isinstance(backend, ArrayBackend)
    trainer = Trainer(job, dataset, built, backend, push_window=window)
    ps = LatePS(backend, window, newest_first=newest_first)
    ps.declare_many(trainer.specs)
    return trainer, ps


def task(index: int, epoch: int = 0) -> LeasedTask:
    return LeasedTask(task_id=1, kind="train", epoch=epoch, index=index, tasks_per_epoch=2)


@pytest.mark.parametrize("newest_first", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("mode", ["async", "ssp:1"])
@pytest.mark.parametrize(("model", "data"), [("mlp", "digits"),
                                             ("embedding_mlp", "synthetic_ctr:3000")])
def test_training_steps_keep_every_copy_and_call_apart(model, data, mode, window,
                                                       newest_first) -> None:
    """The step loop, its values double buffer (ahead=2 in async) and its ring of gradient
    slots breach nothing, across tasks and a stop mid-task, with pushes finishing in order or
    not. (A ring as long as the window, or no synchronize() before the pushes, fails here:
    the Trainer was changed so once, to see that it does.)"""
    trainer, ps = make(model, data, window=window, mode=mode, newest_first=newest_first)
    for index in range(2):
        result = trainer.train(ps, task(index), should_stop=lambda: False)
        assert np.isfinite(result.loss_sum) and result.steps > 3
    steps = iter(range(100))
    trainer.train(ps, task(0, epoch=1), should_stop=lambda: next(steps) >= 3)
    assert ps.breaches == []


def test_an_evaluation_leaves_no_h2d_copy_reading_the_buffers_the_next_task_pulls_into() -> None:
    """Trainer.evaluate copies the pulled dense values to the device from host buffer set 0
    and, for a model without tables or scores (mlp, logreg, a user model), never calls
    synchronize(); the next training task's first pull_async writes into that same set 0.
    With the shipped CupyBackend the model's float(loss) happens to wait for that copy, so
    this is a breach of the ArrayBackend contract rather than wrong values on CuPy."""
    trainer, ps = make("mlp", "digits")
    result = trainer.evaluate(ps)
    assert result.examples == trainer.dataset.num_test
    trainer.train(ps, task(0), should_stop=lambda: False)
    assert ps.breaches == []
