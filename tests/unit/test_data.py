"""Data sets, held-out splits and task slicing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ps_worker.data import Dataset, iter_batches, load_dataset, task_indices


def test_digits_has_the_real_shape_classes_and_range() -> None:
    digits = load_dataset("digits")
    assert digits.num_train + digits.num_test == 1797
    assert digits.num_test == pytest.approx(0.2 * 1797, abs=1)
    assert digits.num_features == 64 and digits.num_classes == 10
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    assert digits.x_train.shape == (digits.num_train, 64) and digits.y_test.shape == (digits.num_test,)
    for x in (digits.x_train, digits.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(digits.y_train)) == set(range(10)) == set(np.unique(digits.y_test))


def test_held_out_splits_are_deterministic_and_disjoint() -> None:
    first, second = load_dataset("digits"), load_dataset("digits", seed=9)
    np.testing.assert_array_equal(first.x_test, second.x_test)
    np.testing.assert_array_equal(first.y_train, second.y_train)
    train_rows = {row.tobytes() for row in first.x_train}
    shared = sum(row.tobytes() in train_rows for row in first.x_test)
    assert shared < 5  # a few digits are pixel-identical; a leak would share hundreds


def test_dataset_arrays_are_read_only() -> None:
    digits = load_dataset("digits")
    with pytest.raises(ValueError):
        digits.x_train[0, 0] = 1.0


@pytest.mark.parametrize("num_examples,tasks", [(1797, 7), (10, 3), (5, 8), (0, 2), (12, 1)])
def test_task_indices_partition_every_row_exactly_once_per_epoch(num_examples: int, tasks: int) -> None:
    parts = [
        task_indices(num_examples, epoch=2, task_index=i, tasks_per_epoch=tasks, seed=11) for i in range(tasks)
    ]
    combined = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(combined), np.arange(num_examples))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(part.dtype == np.int64 for part in parts)


def test_task_indices_are_deterministic_and_reshuffled_per_epoch_and_seed() -> None:
    def task(epoch: int, seed: int) -> np.ndarray:
        return task_indices(1000, epoch=epoch, task_index=1, tasks_per_epoch=4, seed=seed)

    np.testing.assert_array_equal(task(0, 1), task(0, 1))
    assert not np.array_equal(task(0, 1), task(1, 1))
    assert not np.array_equal(task(0, 1), task(0, 2))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(epoch=0, task_index=3, tasks_per_epoch=3, seed=0),
        dict(epoch=0, task_index=-1, tasks_per_epoch=3, seed=0),
        dict(epoch=0, task_index=0, tasks_per_epoch=0, seed=0),
        dict(epoch=-1, task_index=0, tasks_per_epoch=1, seed=0),
    ],
)
def test_task_indices_reject_impossible_tasks(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        task_indices(10, **kwargs)


def test_iter_batches_covers_the_indices_in_order_with_a_short_last_batch() -> None:
    dataset = load_dataset("synthetic:50")
    indices = task_indices(dataset.num_train, epoch=0, task_index=0, tasks_per_epoch=1, seed=0)
    batches = list(iter_batches(dataset, indices, 16))
    assert [len(y) for _, y in batches] == [16, 16, 8]
    np.testing.assert_array_equal(np.concatenate([x for x, _ in batches]), dataset.x_train[indices])
    np.testing.assert_array_equal(np.concatenate([y for _, y in batches]), dataset.y_train[indices])
    test_batches = list(iter_batches(dataset, np.arange(dataset.num_test), 100, split="test"))
    np.testing.assert_array_equal(test_batches[0][1], dataset.y_test)


def test_synthetic_is_deterministic_per_seed_and_sized() -> None:
    default = load_dataset("synthetic")
    assert default.num_train + default.num_test == 4096
    assert (default.num_features, default.num_classes) == (20, 4)
    np.testing.assert_array_equal(load_dataset("synthetic").x_train, default.x_train)
    assert not np.array_equal(load_dataset("synthetic", seed=1).x_train, default.x_train)
    small = load_dataset("synthetic:100", seed=3)
    assert small.num_train + small.num_test == 100


def test_synthetic_classes_are_learnable_by_nearest_class_mean() -> None:
    data = load_dataset("synthetic")
    means = np.stack([data.x_train[data.y_train == c].mean(axis=0) for c in range(data.num_classes)])
    distances = ((data.x_test[:, None, :] - means[None]) ** 2).sum(axis=2)
    accuracy = (distances.argmin(axis=1) == data.y_test).mean()
    assert 0.8 < accuracy


@pytest.mark.parametrize("spec", ["synthetic:x", "synthetic:1", "imagenet"])
def test_bad_specs_are_rejected_naming_them(spec: str) -> None:
    with pytest.raises(ValueError) as raised:
        load_dataset(spec)
    assert spec in str(raised.value)


def _save(tmp_path: Path, **arrays: np.ndarray) -> Path:
    path = tmp_path / "user.npz"
    np.savez(path, **arrays)
    return path


def test_npz_without_test_arrays_holds_out_a_fifth_deterministically(tmp_path: Path) -> None:
    x = np.arange(200, dtype=np.float64).reshape(50, 2, 2)
    y = np.arange(50) % 3
    path = _save(tmp_path, x=x, y=y)
    first, second = load_dataset(str(path)), load_dataset(str(path))
    assert isinstance(first, Dataset)
    assert (first.num_train, first.num_test, first.num_features, first.num_classes) == (40, 10, 4, 3)
    np.testing.assert_array_equal(first.x_test, second.x_test)
    rows = np.concatenate([first.x_train, first.x_test])[:, 0] // 4
    np.testing.assert_array_equal(np.sort(rows), np.arange(50))


def test_npz_with_test_arrays_uses_them(tmp_path: Path) -> None:
    path = _save(
        tmp_path,
        x=np.ones((6, 3), np.float32),
        y=np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]),
        x_test=np.zeros((2, 3)),
        y_test=np.array([[4], [0]]),
    )
    dataset = load_dataset(str(path))
    assert (dataset.num_train, dataset.num_test, dataset.num_classes) == (6, 2, 5)
    np.testing.assert_array_equal(dataset.y_test, [4, 0])
    assert dataset.y_train.dtype == np.int64


@pytest.mark.parametrize(
    "arrays",
    [
        dict(x=np.ones((4, 2))),
        dict(y=np.zeros(4, int)),
        dict(x=np.ones((4, 2)), y=np.zeros(3, int)),
        dict(x=np.ones((4, 2)), y=np.array([0.0, 1.5, 0.0, 1.0])),
        dict(x=np.ones((4, 2)), y=np.array(["a", "b", "c", "d"])),
        dict(x=np.ones((4, 2)), y=np.array([0, -1, 0, 1])),
        dict(x=np.array([[np.nan, 1.0]] * 4), y=np.zeros(4, int)),
        dict(x=np.ones((4, 2)), y=np.zeros(4, int), x_test=np.ones((2, 2))),
        dict(x=np.ones((4, 2)), y=np.zeros(4, int), x_test=np.ones((2, 3)), y_test=np.zeros(2, int)),
    ],
)
def test_invalid_npz_is_rejected_naming_the_path(tmp_path: Path, arrays: dict) -> None:
    path = _save(tmp_path, **arrays)
    with pytest.raises(ValueError) as raised:
        load_dataset(str(path))
    assert str(path) in str(raised.value)


def test_missing_or_unreadable_npz_is_rejected_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file")
    for path in (missing, garbage):
        with pytest.raises(ValueError) as raised:
            load_dataset(str(path))
        assert str(path) in str(raised.value)
