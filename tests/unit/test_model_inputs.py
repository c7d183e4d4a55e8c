"""What the built-in models do with labels, and the data sets' edges.

The dense built-ins check that the labels are a vector of the batch (ps_worker/models/dense.py
``MLP._inputs``: "batch shapes x=..., y=... do not fit a model"), but neither they nor
embedding_mlp check what the labels are; a label the loss cannot use must be an error that
names it, never a loss, gradients and an accuracy computed from something else."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker.data import Features, load_dataset
from ps_worker.models import MLP, EmbeddingMLP, LogisticRegression

FIELD_SIZES = (5, 4)


def _embedding_model_and_params(batch_size: int):
    model = EmbeddingMLP(2, FIELD_SIZES, dim=2, hidden=(3,))
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, n, batch_size) for n in FIELD_SIZES], axis=1)
    x = Features(rng.normal(size=(batch_size, 2)), ids)
    params = {v.name: rng.normal(0.0, 0.7, v.shape) for v in model.variables()}
    for name, table_ids in model.row_ids((x, None)).items():
        params[name] = rng.normal(0.0, 0.7, (len(table_ids), model.dim))
    return model, params, x


def test_embedding_mlp_refuses_a_column_of_labels_instead_of_counting_b_squared_pairs():
    """A (B, 1) label column broadcasts against the (B,) logits: evaluate returns the loss
    summed over B*B pairs and more examples 'classified right' than the batch has."""
    model, params, x = _embedding_model_and_params(4)
    column = np.array([[0], [1], [1], [0]])
    outcome = None
    try:
        outcome = model.evaluate(params, (x, column))
    except ValueError as error:
        assert "(4, 1)" in str(error), error
    assert outcome is None, (
        f"evaluate of 4 examples with labels of shape (4, 1) returned (loss_sum, correct) = "
        f"{outcome}: correct > 4 examples")
    with pytest.raises(ValueError, match=r"\(4, 1\)"):
        model.loss_and_grads(params, (x, column))


def test_embedding_mlp_refuses_labels_that_are_not_0_or_1():
    """The model's docstring: 'the loss is the logistic loss of binary labels (y in {0, 1})'.
    -1/+1 labels (libsvm style) give a loss and gradients that push every logit down."""
    model, params, x = _embedding_model_and_params(4)
    signs = np.array([-1, 1, 1, -1])
    outcome = None
    try:
        outcome = model.loss_and_grads(params, (x, signs))[0]
    except ValueError as error:
        assert "label" in str(error).lower(), error
    assert outcome is None, f"labels -1/+1 were trained on: loss {outcome}"


def test_dense_models_refuse_negative_labels():
    """A label of -1 (a -1/+1 labelling) indexes the last class (numpy's negative indexing):
    the loss and gradients are those of other labels than the batch's, silently."""
    model = LogisticRegression(3, 2)
    rng = np.random.default_rng(1)
    params = {v.name: rng.normal(size=v.shape) for v in model.variables()}
    x = rng.normal(size=(4, 3))
    outcome = None
    try:
        outcome = model.loss_and_grads(params, (x, np.array([-1, 1, 1, -1])))[0]
    except (ValueError, IndexError) as error:
        assert "label" in str(error).lower(), f"an error that does not name the labels: {error!r}"
    assert outcome is None, f"labels [-1, 1, 1, -1] gave a loss of {outcome}"


def test_dense_models_take_bool_labels_as_0_and_1_or_refuse_them():
    """A bool label vector is taken as a mask in ``shifted[rows, labels]``: with labels
    [True, True] row 0's loss is that of class 0, while ``evaluate``'s accuracy compares
    argmax with 1 (the loader and roc_auc take bool labels as 0/1)."""
    model = LogisticRegression(3, 2)
    rng = np.random.default_rng(1)
    params = {v.name: rng.normal(size=v.shape) for v in model.variables()}
    x = rng.normal(size=(2, 3))
    expected, _ = model.loss_and_grads(params, (x, np.array([1, 1])))
    try:
        loss, _ = model.loss_and_grads(params, (x, np.array([True, True])))
    except ValueError as error:
        assert "label" in str(error).lower(), error
        return
    assert loss == pytest.approx(expected), (
        f"labels [True, True] gave loss {loss}; labels [1, 1] give {expected}")


def test_mlp_takes_numpy_integer_sizes_as_embedding_mlp_does():
    """``MLP(x.shape[1], y.max() + 1)``: y.max() + 1 is np.int64, and the error says that
    10 'must be a positive integer'."""
    model = MLP(np.int64(64), np.int64(10), hidden=(np.int64(8),))
    assert [v.shape for v in model.variables()][0] == (64, 8)


def test_an_npz_of_one_example_is_refused_or_holds_one_out(tmp_path):
    """data._held_out_split: 'TEST_FRACTION of the rows, at least one each'; 'synthetic:1' is
    refused ('needs at least 2 examples to hold some out'). An .npz of one example without
    x_test loads with no held-out row: every evaluation then measures nothing."""
    path = tmp_path / "one.npz"
    np.savez(path, x=np.ones((1, 3)), y=np.array([0]))
    try:
        data = load_dataset(str(path))
    except ValueError as error:
        assert "one.npz" in str(error)
        return
    assert data.num_train >= 1 and data.num_test >= 1, (
        f"{data.num_train} training and {data.num_test} held-out examples")


# ---- float labels of whole values, as a data set's loader takes them

def _model_params_batch():
    model = EmbeddingMLP(2, FIELD_SIZES, dim=2, hidden=(3,))
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, n, 4) for n in FIELD_SIZES], axis=1)
    x = Features(rng.normal(size=(4, 2)), ids)
    params = {v.name: rng.normal(0.0, 0.7, v.shape) for v in model.variables()}
    for name, table_ids in model.row_ids((x, None)).items():
        params[name] = rng.normal(0.0, 0.7, (len(table_ids), model.dim))
    return model, params, x


def test_embedding_mlp_takes_float_0_1_labels_as_it_did():
    model, params, x = _model_params_batch()
    ints = np.array([0, 1, 1, 0])
    expected = model.loss_and_grads(params, (x, ints))[0]
    loss = model.loss_and_grads(params, (x, ints.astype(np.float32)))[0]
    assert loss == expected
    assert model.evaluate(params, (x, ints.astype(np.float64))) == model.evaluate(
        params, (x, ints))
