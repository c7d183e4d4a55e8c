"""A data file's arrays are checked (finite features, labels 0..C-1) on what training uses:
the float32 features and int64 labels they become, not the arrays as stored: features beyond
float32's range and labels beyond int64's are refused, naming the file and the array."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker.data import load_dataset


def _save(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return str(path)


def test_features_that_overflow_float32_are_refused_naming_the_file_and_array(tmp_path):
    x = np.ones((10, 3))
    x[4, 1] = 1e300  # finite as stored (float64), inf as the float32 the model trains on
    path = _save(tmp_path, x=x, y=np.arange(10) % 2)
    with pytest.raises(ValueError) as refused:
        dataset = load_dataset(path)
        # what it loads instead:
        assert np.isfinite(dataset.x_train).all() and np.isfinite(dataset.x_test).all()
    assert path in str(refused.value) and "'x'" in str(refused.value)


@pytest.mark.parametrize("labels", [
    np.array([0, 1] * 4 + [2**63 + 1] * 2, np.uint64),
    np.array([0.0, 1.0] * 4 + [1e19] * 2),
], ids=["uint64", "float"])
def test_labels_beyond_int64_are_refused_not_wrapped_to_negative(tmp_path, labels):
    path = _save(tmp_path, x=np.ones((10, 3)), y=labels)
    with pytest.raises(ValueError) as refused:
        dataset = load_dataset(path)
        # what it loads instead: negative labels, which NumPy indexing wraps silently
        assert dataset.y_train.min() >= 0 and dataset.y_test.min() >= 0
    assert path in str(refused.value) and "'y'" in str(refused.value)
