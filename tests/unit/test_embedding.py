"""EmbeddingDef validation and the built-in click-through model embedding_mlp: gradients
against finite differences (dense layers and table rows, repeated ids included), its
contract with the trainer (row_ids, one gradient row per id occurrence), and build_model."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest

from ps_worker.data import Features, load_dataset
from ps_worker.models import (
    EmbeddingDef,
    EmbeddingMLP,
    EmbeddingModel,
    ScoringModel,
    VariableDef,
    build_model,
)

FIELD_SIZES = (5, 4, 3)
NUM_DENSE = 2


def small_model(**options) -> EmbeddingMLP:
    return EmbeddingMLP(NUM_DENSE, FIELD_SIZES, dim=2, hidden=(4,), **options)


def small_batch(rng: np.random.Generator, size: int = 6) -> tuple[Features, np.ndarray]:
    ids = np.stack([rng.integers(0, n, size) for n in FIELD_SIZES], axis=1)
    ids[1] = ids[0]  # a repeated example: every id of it occurs twice
    ids[2, 0] = ids[0, 0]
    labels = rng.integers(0, 2, size)
    labels[:2] = [0, 1]
    return Features(rng.normal(size=(size, NUM_DENSE)), ids), labels


def whole_tables(model: EmbeddingMLP, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every variable and every table whole, as float64 (what the servers would hold)."""
    values = {v.name: rng.normal(0.0, 0.7, v.shape) for v in model.variables()}
    values.update({t.name: rng.normal(0.0, 0.7, t.shape) for t in model.tables()})
    return values


def gathered(model: EmbeddingMLP, values: dict, batch) -> dict:
    """What the trainer hands the model: dense variables whole, table rows of row_ids."""
    ids = model.row_ids(batch)
    return {name: (value[ids[name]] if name in ids else value) for name, value in values.items()}


def loss_of(model: EmbeddingMLP, values: dict, batch) -> float:
    return model.loss_and_grads(gathered(model, values, batch), batch)[0]


@pytest.mark.parametrize("per_field", [False, True], ids=["shared-table", "table-per-field"])
def test_gradients_match_central_finite_differences_of_the_whole_tables(per_field: bool) -> None:
    """The model gives one gradient row per id occurrence; summed per id (what the system
    does before the optimizer) they are the gradient of the loss with respect to the table."""
    model = small_model(table_per_field=per_field)
    rng = np.random.default_rng(7)
    values = whole_tables(model, rng)
    batch = small_batch(rng)
    ids = model.row_ids(batch)
    loss, grads = model.loss_and_grads(gathered(model, values, batch), batch)
    assert loss == pytest.approx(loss_of(model, values, batch))
    assert set(grads) == set(values)
    summed = dict(grads)
    for name, table_ids in ids.items():
        assert grads[name].shape == (len(table_ids), model.dim)
        summed[name] = np.zeros_like(values[name])
        np.add.at(summed[name], table_ids, grads[name])
    eps = 1e-6
    for name, value in values.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            original = value[index]
            value[index] = original + eps
            plus = loss_of(model, values, batch)
            value[index] = original - eps
            minus = loss_of(model, values, batch)
            value[index] = original
            numeric[index] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(summed[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_row_ids_are_example_major_with_per_field_offsets() -> None:
    model = small_model()
    x = Features(np.zeros((2, NUM_DENSE)), np.array([[0, 3, 2], [4, 0, 0]]))
    ids = model.row_ids((x, np.array([0, 1])))
    assert list(ids) == ["embedding"]
    np.testing.assert_array_equal(ids["embedding"], [0, 5 + 3, 9 + 2, 4, 5 + 0, 9 + 0])
    assert ids["embedding"].dtype == np.int64
    assert [(t.name, t.num_rows, t.dim) for t in model.tables()] == [("embedding", 12, 2)]


def test_a_table_per_field_has_each_fields_ids_as_they_are() -> None:
    model = small_model(table_per_field=True)
    x = Features(np.zeros((2, NUM_DENSE)), np.array([[0, 3, 2], [4, 0, 0]]))
    ids = model.row_ids((x, np.array([0, 1])))
    assert {name: list(v) for name, v in ids.items()} == {
        "embedding/field0": [0, 4], "embedding/field1": [3, 0], "embedding/field2": [2, 0]}
    assert [t.num_rows for t in model.tables()] == list(FIELD_SIZES)


def test_float32_params_give_float32_grads_of_the_gathered_shapes() -> None:
    model = small_model()
    rng = np.random.default_rng(0)
    values = {k: v.astype(np.float32) for k, v in whole_tables(model, rng).items()}
    batch = small_batch(rng)
    _, grads = model.loss_and_grads(gathered(model, values, batch), batch)
    for v in model.variables():
        assert grads[v.name].dtype == np.float32 and grads[v.name].shape == v.shape
    assert grads["embedding"].dtype == np.float32
    assert grads["embedding"].shape == (6 * len(FIELD_SIZES), 2)
    assert grads["embedding"].flags.c_contiguous


def test_loss_grads_and_correct_agrees_with_evaluate_and_scores() -> None:
    model = small_model()
    rng = np.random.default_rng(1)
    values = whole_tables(model, rng)
    batch = small_batch(rng)
    params = gathered(model, values, batch)
    loss, _, correct = model.loss_grads_and_correct(params, batch)
    loss_sum, evaluated_correct = model.evaluate(params, batch)
    scores = model.scores(params, batch)
    assert loss == pytest.approx(loss_sum / 6)
    assert correct == evaluated_correct == int(((scores > 0.5) == (batch[1] == 1)).sum())
    assert scores.shape == (6,) and ((scores > 0) & (scores < 1)).all()
    labels = batch[1]
    manual = -np.mean(labels * np.log(scores) + (1 - labels) * np.log(1 - scores))
    assert loss == pytest.approx(manual)


def test_huge_logits_are_finite_without_overflow_warnings() -> None:
    model = small_model()
    rng = np.random.default_rng(2)
    values = {k: v.astype(np.float32) for k, v in whole_tables(model, rng).items()}
    values["dense1/bias"][:] = 1e4  # every logit about +1e4
    batch = small_batch(rng)
    params = gathered(model, values, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, grads = model.loss_and_grads(params, batch)
        loss_sum, _ = model.evaluate(params, batch)
        scores = model.scores(params, batch)
    negatives = int((batch[1] == 0).sum())
    assert loss == pytest.approx(1e4 * negatives / 6, rel=1e-3)
    assert loss_sum == pytest.approx(1e4 * negatives, rel=1e-3)
    assert all(np.isfinite(g).all() for g in grads.values()) and (scores == 1).all()


def test_batches_that_do_not_fit_are_refused() -> None:
    model = small_model()
    rng = np.random.default_rng(3)
    values = whole_tables(model, rng)
    x, y = small_batch(rng)
    params = gathered(model, values, (x, y))
    with pytest.raises(ValueError):
        model.row_ids((x.dense, y))  # no ids
    with pytest.raises(ValueError):
        model.row_ids((Features(x.dense, x.ids[:, :2]), y))  # a field short
    with pytest.raises(ValueError):
        model.row_ids((Features(x.dense, x.ids + np.array([0, 4, 0])), y))  # field 1 too big
    with pytest.raises(ValueError):
        model.row_ids((Features(x.dense, x.ids - 5), y))  # negative
    with pytest.raises(ValueError):
        model.loss_and_grads({**params, "embedding": params["embedding"][:-1]}, (x, y))
    with pytest.raises(ValueError):
        model.loss_and_grads(params, (Features(x.dense[:, :1], x.ids), y))


@pytest.mark.parametrize("options", [
    dict(num_features=2, field_sizes=()),
    dict(num_features=2, field_sizes=(3, 0)),
    dict(num_features=-1, field_sizes=(3,)),
    dict(num_features=2, field_sizes=(3,), dim=0),
    dict(num_features=2, field_sizes=(3,), hidden=(0,)),
])
def test_bad_shapes_are_refused(options) -> None:
    with pytest.raises(ValueError):
        EmbeddingMLP(**options)


def test_a_few_steps_on_synthetic_ctr_lower_the_loss() -> None:
    data = load_dataset("synthetic_ctr:4000")
    model = EmbeddingMLP(data.num_features, data.field_sizes, hidden=(16,))
    rng = np.random.default_rng(0)
    values = {v.name: rng.uniform(-0.3, 0.3, v.shape).astype(np.float32) for v in model.variables()}
    table = rng.uniform(-0.05, 0.05, (model.num_rows, model.dim)).astype(np.float32)
    batch = (Features(data.x_train[:1024], data.c_train[:1024]), data.y_train[:1024])
    ids = model.row_ids(batch)["embedding"]
    first = None
    for _ in range(40):
        loss, grads = model.loss_and_grads({**values, "embedding": table[ids]}, batch)
        first = loss if first is None else first
        for name in values:
            values[name] -= 0.5 * grads[name]
        np.add.at(table, ids, -0.5 * grads["embedding"])
    assert loss < 0.8 * first


# ---- EmbeddingDef ------------------------------------------------------------------------

def test_embedding_def_shapes_and_defaults() -> None:
    fixed = EmbeddingDef("t", dim=8, num_rows=100)
    assert (fixed.shape, fixed.dynamic, fixed.optimizer_spec()) == ((100, 8), False, None)
    assert fixed.init_spec() == {"name": "uniform", "minval": -0.05, "maxval": 0.05}
    assert EmbeddingDef("g", dim=8, num_rows=100, init="glorot_uniform").shape == (100, 8)
    dynamic = EmbeddingDef("d", dim=4, capacity=1000, ttl_seconds=60.0,
                           optimizer={"name": "adagrad", "lr": 0.1}, seed=3)
    assert (dynamic.shape, dynamic.dynamic) == ((0, 4), True)
    assert dynamic.optimizer_spec() == {"name": "adagrad", "lr": 0.1}


@pytest.mark.parametrize("bad", [
    dict(name="", dim=2),
    dict(name="t", dim=0),
    dict(name="t", dim=2.5),
    dict(name="t", dim=True),
    dict(name="t", dim=2, num_rows=0),
    dict(name="t", dim=2, num_rows=-3),
    dict(name="t", dim=2, init="orthogonal"),
    dict(name="t", dim=2, init={"name": "normal", "scale": 2}),
    dict(name="t", dim=2, init={"name": "uniform", "minval": 1, "maxval": 0}),
    dict(name="t", dim=2, init="glorot_uniform"),  # dynamic: no row count to scale by
    dict(name="t", dim=2, seed=-1),
    dict(name="t", dim=2, optimizer={"name": "rmsprop"}),
    dict(name="t", dim=2, optimizer={"lr": 0.1}),
    dict(name="t", dim=2, optimizer={"name": "sgd", "lr": "fast"}),
    dict(name="t", dim=2, optimizer={"name": "sgd", "lr": float("nan")}),
    dict(name="t", dim=2, optimizer="adagrad"),
    dict(name="t", dim=2, capacity=-1),
    dict(name="t", dim=2, ttl_seconds=-1.0),
    dict(name="t", dim=2, ttl_seconds=float("inf")),
    dict(name="t", dim=2, num_rows=10, capacity=5),  # capacity bounds dynamic tables only
    dict(name="t", dim=2, num_rows=10, ttl_seconds=5.0),
])
def test_embedding_def_refuses_bad_values_naming_the_table(bad) -> None:
    with pytest.raises(ValueError) as raised:
        EmbeddingDef(**bad)
    if bad["name"]:
        assert "'t'" in str(raised.value)


# ---- build_model -------------------------------------------------------------------------

def test_build_model_builds_embedding_mlp_from_the_data_sets_fields() -> None:
    data = load_dataset("synthetic_ctr:100")
    model = build_model("embedding_mlp", num_features=data.num_features,
                        num_classes=data.num_classes, hidden=(8,), field_sizes=data.field_sizes)
    assert isinstance(model, EmbeddingModel) and isinstance(model, ScoringModel)
    [table] = model.tables()
    assert (table.name, table.num_rows, table.dim) == ("embedding", sum(data.field_sizes), 8)
    assert table.optimizer_spec()["name"] == "adagrad"
    assert [v.shape for v in model.variables()] == [
        (len(data.field_sizes) * 8 + data.num_features, 8), (8,), (8, 1), (1,)]


@pytest.mark.parametrize("name, kwargs", [
    ("embedding_mlp", dict(num_features=4, num_classes=2)),  # no categorical fields
    ("embedding_mlp", dict(num_features=4, num_classes=3, field_sizes=(5,))),  # not binary
    ("mlp", dict(num_features=4, num_classes=2, field_sizes=(5,))),  # fields it cannot use
    ("logreg", dict(num_features=4, num_classes=2, field_sizes=(5,))),
])
def test_build_model_refuses_a_model_that_does_not_fit_the_data(name, kwargs) -> None:
    with pytest.raises(ValueError) as raised:
        build_model(name, **kwargs)
    assert name in str(raised.value)


def test_user_models_get_the_field_sizes_and_names_must_be_unique(monkeypatch) -> None:
    module = types.ModuleType("paramserve_test_table_models")
    module.factory = lambda num_features, field_sizes: EmbeddingMLP(num_features, field_sizes)

    class Clash(EmbeddingMLP):
        def variables(self):
            return [*super().variables(), VariableDef("embedding", (2,))]

    module.Clash = Clash
    monkeypatch.setitem(sys.modules, module.__name__, module)
    made = build_model(f"{module.__name__}:factory", num_features=3, num_classes=2,
                       field_sizes=(7, 9))
    assert made.field_sizes == (7, 9) and made.num_features == 3
    with pytest.raises(ValueError) as raised:
        build_model(f"{module.__name__}:Clash", num_features=3, num_classes=2, field_sizes=(7,))
    assert "embedding" in str(raised.value)
