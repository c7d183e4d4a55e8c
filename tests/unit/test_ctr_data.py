"""synthetic_ctr: a generated click log with categorical fields; deterministic, the shapes
and dtypes the models rely on, Zipf ids, and a signal a linear model can learn."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker.data import Features, iter_batches, load_dataset
from ps_worker.metrics import roc_auc

SMALL = "synthetic_ctr:20000"


@pytest.fixture(scope="module")
def small():
    return load_dataset(SMALL)


def test_shapes_dtypes_and_ranges(small) -> None:
    fields = len(small.field_sizes)
    assert 8 <= fields <= 16 and small.categorical
    assert all(1000 <= size <= 100_000 for size in small.field_sizes)
    assert small.num_train + small.num_test == 20000 and small.num_test == 4000
    assert small.num_classes == 2 and small.num_features == small.x_train.shape[1] >= 1
    assert small.x_train.dtype == np.float32 and small.y_train.dtype == np.int64
    assert small.c_train.dtype == np.int64 and small.c_test.dtype == np.int64
    assert small.c_train.shape == (small.num_train, fields)
    assert small.c_test.shape == (small.num_test, fields)
    for ids in (small.c_train, small.c_test):
        assert ids.min() >= 0 and (ids.max(axis=0) < np.array(small.field_sizes)).all()
    assert set(np.unique(small.y_train)) == {0, 1} == set(np.unique(small.y_test))
    assert 0.2 <= small.y_train.mean() <= 0.3  # base click rate about 25%


def test_arrays_are_read_only(small) -> None:
    for array in (small.x_train, small.y_train, small.c_train, small.c_test):
        with pytest.raises(ValueError):
            array[0] = 0


def test_same_seed_same_data_other_seed_other_data() -> None:
    first, again, other = (load_dataset("synthetic_ctr:3000", seed=s) for s in (4, 4, 5))
    for name in ("x_train", "y_train", "c_train", "x_test", "y_test", "c_test"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.c_train, other.c_train)
    assert first.num_test == other.num_test == 600


def test_ids_are_zipf_distributed_most_frequent_first(small) -> None:
    for field, size in enumerate(small.field_sizes):
        counts = np.bincount(small.c_train[:, field], minlength=size)
        assert counts[0] == counts.max()
        assert counts[0] > counts[9] > counts[99]
        assert counts[:10].sum() > 0.2 * small.num_train  # a heavy head
    # and a long tail: most of the largest field's ids are seen twice at most, if at all
    largest = int(np.argmax(small.field_sizes))
    counts = np.bincount(small.c_train[:, largest], minlength=small.field_sizes[largest])
    assert (counts <= 2).mean() > 0.5


def test_batches_carry_the_ids_of_their_rows(small) -> None:
    rows = np.array([5, 0, 17, 3])
    [(x, y)] = list(iter_batches(small, rows, 8))
    assert isinstance(x, Features)
    np.testing.assert_array_equal(x.dense, small.x_train[rows])
    np.testing.assert_array_equal(x.ids, small.c_train[rows])
    np.testing.assert_array_equal(y, small.y_train[rows])
    [(x_test, _)] = list(iter_batches(small, np.arange(3), 8, split="test"))
    np.testing.assert_array_equal(x_test.ids, small.c_test[:3])


def test_data_sets_without_fields_are_unchanged() -> None:
    digits = load_dataset("digits")
    assert not digits.categorical and digits.field_sizes == () and digits.c_train is None
    x, _ = next(iter_batches(digits, np.arange(4), 4))
    assert isinstance(x, np.ndarray) and x.shape == (4, 64)


def one_hot_logistic_regression_auc(data, epochs: int = 2) -> float:
    """Held-out AUC of a logistic regression on the one-hot ids (a weight per id of each
    field: the form of the hidden effects) and the dense features, trained with Adagrad."""
    offsets = np.concatenate([[0], np.cumsum(data.field_sizes)[:-1]])
    columns_train, columns_test = data.c_train + offsets, data.c_test + offsets
    id_weights = np.zeros(int(sum(data.field_sizes)))
    id_squares = np.full_like(id_weights, 1e-3)
    dense_weights, bias = np.zeros(data.num_features), 0.0
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        for rows in np.array_split(rng.permutation(data.num_train), data.num_train // 256):
            columns, x, y = columns_train[rows], data.x_train[rows], data.y_train[rows]
            logits = id_weights[columns].sum(axis=1) + x @ dense_weights + bias
            error = 1 / (1 + np.exp(-logits)) - y  # d(logistic loss)/d(logit)
            grad = np.bincount(columns.ravel(), np.repeat(error, columns.shape[1]),
                               minlength=id_weights.size) + 1e-3 * id_weights
            id_squares += grad * grad
            id_weights -= 0.5 * grad / np.sqrt(id_squares)
            dense_weights -= 0.05 * x.T @ error / len(rows)
            bias -= 0.05 * error.mean()
    scores = id_weights[columns_test].sum(axis=1) + data.x_test @ dense_weights + bias
    return roc_auc(scores, data.y_test)


def test_the_signal_is_learnable_by_a_linear_model_on_one_hot_ids() -> None:
    data = load_dataset("synthetic_ctr:100000")
    auc = one_hot_logistic_regression_auc(data)
    assert auc >= 0.78, auc  # 0.80 measured; the true probabilities score 0.86
    # Dense features alone carry some signal too, far less than the ids.
    dense_only = roc_auc(data.x_test @ np.linalg.lstsq(
        data.x_train, data.y_train - data.y_train.mean(), rcond=None)[0], data.y_test)
    assert 0.55 < dense_only < auc


@pytest.mark.parametrize("spec", ["synthetic_ctr:abc", "synthetic_ctr:1", "synthetic_ctr:-5"])
def test_bad_specs_are_refused_naming_them(spec) -> None:
    with pytest.raises(ValueError) as raised:
        load_dataset(spec)
    assert spec in str(raised.value)
