"""Built-in and example models: gradients against finite differences, learning, build_model."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from ps_worker.data import load_dataset
from ps_worker.models import (
    MLP,
    EvaluableModel,
    LogisticRegression,
    Model,
    VariableDef,
    build_model,
    initial_values,
)
from ps_worker.models.example_user_model import SoftmaxRegression

EXAMPLE_REF = "ps_worker.models.example_user_model:SoftmaxRegression"
NUM_FEATURES, NUM_CLASSES = 5, 3


def _small_models() -> list[Model]:
    return [
        LogisticRegression(NUM_FEATURES, NUM_CLASSES),
        MLP(NUM_FEATURES, NUM_CLASSES, hidden=(4, 3)),
        SoftmaxRegression(NUM_FEATURES, NUM_CLASSES),
    ]


def _random_params(model: Model, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {var.name: rng.normal(0.0, 0.7, var.shape) for var in model.variables()}


@pytest.mark.parametrize("model", _small_models(), ids=lambda model: type(model).__name__)
def test_gradients_match_central_finite_differences_in_float64(model: Model) -> None:
    rng = np.random.default_rng(7)
    params = _random_params(model, rng)
    x = rng.normal(size=(6, NUM_FEATURES))
    y = np.array([0, 1, 2, 2, 1, 0])
    loss, grads = model.loss_and_grads(params, (x, y))
    assert isinstance(loss, float)
    assert set(grads) == set(params)
    eps = 1e-6
    for name, value in params.items():
        assert grads[name].shape == value.shape and grads[name].dtype == np.float64
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            original = value[index]
            value[index] = original + eps
            loss_plus, _ = model.loss_and_grads(params, (x, y))
            value[index] = original - eps
            loss_minus, _ = model.loss_and_grads(params, (x, y))
            value[index] = original
            numeric[index] = (loss_plus - loss_minus) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("model", _small_models(), ids=lambda model: type(model).__name__)
def test_float32_params_give_float32_grads_of_each_variable_shape(model: Model) -> None:
    rng = np.random.default_rng(0)
    params = {name: value.astype(np.float32) for name, value in _random_params(model, rng).items()}
    _, grads = model.loss_and_grads(params, (rng.normal(size=(4, NUM_FEATURES)), np.array([0, 1, 2, 0])))
    for var in model.variables():
        assert grads[var.name].dtype == np.float32
        assert grads[var.name].shape == var.shape


def test_loss_is_finite_for_huge_logits() -> None:
    model = LogisticRegression(2, 2)
    params = {"dense0/kernel": np.array([[1e4, -1e4], [0.0, 0.0]], np.float32), "dense0/bias": np.zeros(2, np.float32)}
    batch = (np.array([[1.0, 0.0], [1.0, 0.0]]), np.array([0, 1]))
    loss, grads = model.loss_and_grads(params, batch)
    assert np.isfinite(loss) and loss == pytest.approx(1e4, rel=1e-6)
    assert all(np.isfinite(grad).all() for grad in grads.values())
    loss_sum, correct = model.evaluate(params, batch)
    assert loss_sum == pytest.approx(2e4, rel=1e-6) and correct == 1


@pytest.mark.parametrize("name", ["logreg", "mlp", EXAMPLE_REF])
def test_a_few_sgd_steps_on_digits_lower_the_loss(name: str) -> None:
    digits = load_dataset("digits")
    model = build_model(name, num_features=digits.num_features, num_classes=digits.num_classes, hidden=(32,))
    params = initial_values(model.variables(), seed=3)
    batch = (digits.x_train[:512], digits.y_train[:512])
    first_loss, _ = model.loss_and_grads(params, batch)
    for _ in range(30):
        _, grads = model.loss_and_grads(params, batch)
        for var_name, grad in grads.items():
            params[var_name] -= 0.5 * grad
    final_loss, _ = model.loss_and_grads(params, batch)
    assert final_loss < 0.6 * first_loss
    assert isinstance(model, EvaluableModel)
    loss_sum, correct = model.evaluate(params, (digits.x_test, digits.y_test))
    assert correct > 0.7 * digits.num_test
    assert loss_sum / digits.num_test < first_loss


def test_mlp_variables_are_named_dense_layers_with_glorot_kernels_and_zero_biases() -> None:
    variables = MLP(64, 10, hidden=(128, 64)).variables()
    assert [(v.name, v.shape, v.init) for v in variables] == [
        ("dense0/kernel", (64, 128), "glorot_uniform"),
        ("dense0/bias", (128,), "zeros"),
        ("dense1/kernel", (128, 64), "glorot_uniform"),
        ("dense1/bias", (64,), "zeros"),
        ("dense2/kernel", (64, 10), "glorot_uniform"),
        ("dense2/bias", (10,), "zeros"),
    ]
    assert len({v.seed for v in variables}) == len(variables)


def test_build_model_passes_sizes_to_builtins_and_user_classes() -> None:
    mlp = build_model("mlp", num_features=7, num_classes=3, hidden=(5,))
    assert [v.shape for v in mlp.variables()] == [(7, 5), (5,), (5, 3), (3,)]
    assert [v.shape for v in build_model("logreg", num_features=7, num_classes=3).variables()] == [(7, 3), (3,)]
    user = build_model(EXAMPLE_REF, num_features=7, num_classes=3, hidden=(5,))
    assert isinstance(user, SoftmaxRegression)
    assert {v.name: v.shape for v in user.variables()} == {"weights": (7, 3), "bias": (3,)}


def test_build_model_uses_a_model_object_as_is_and_calls_factories(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("paramserve_test_user_models")
    module.ready = SoftmaxRegression(2, 2)
    module.factory = lambda num_classes, **_: SoftmaxRegression(4, num_classes)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert build_model(f"{module.__name__}:ready", num_features=9, num_classes=9) is module.ready
    made = build_model(f"{module.__name__}:factory", num_features=9, num_classes=6)
    assert made.variables()[0].shape == (4, 6)


@pytest.mark.parametrize(
    "reference",
    [
        "no_such_module_for_paramserve:Model",
        "ps_worker.models.example_user_model:NoSuchModel",
        "ps_worker.models.example_user_model:VariableDef",  # constructing it fails
        "numpy:pi",  # not a model
        "resnet",
        "module_without_attribute:",
    ],
)
def test_build_model_rejects_a_bad_reference_naming_it(reference: str) -> None:
    with pytest.raises(ValueError) as raised:
        build_model(reference, num_features=4, num_classes=2)
    assert reference in str(raised.value)


def test_variable_def_validates_shape_and_initializer() -> None:
    assert VariableDef("w", [2, 3], {"name": "uniform", "minval": -1, "maxval": 1}).shape == (2, 3)
    for bad in [
        dict(name="w", shape=(0,)),
        dict(name="", shape=(1,)),
        dict(name="w", shape=(1,), init="orthogonal"),
        dict(name="w", shape=(1,), init={"name": "normal", "scale": 2}),
        dict(name="w", shape=(1,), init={"name": "uniform", "minval": 1, "maxval": 0}),
        dict(name="w", shape=(1,), seed=-1),
    ]:
        with pytest.raises(ValueError):
            VariableDef(**bad)


def test_initial_values_follow_initializers_and_are_deterministic() -> None:
    variables = [
        VariableDef("k", (30, 20), "glorot_uniform", seed=1),
        VariableDef("b", (20,), "zeros"),
        VariableDef("c", (3,), {"name": "constant", "value": 2.5}),
        VariableDef("n", (1000,), {"name": "normal", "mean": 1.0, "stddev": 0.1}),
    ]
    values = initial_values(variables, seed=5)
    assert values["k"].dtype == np.float32
    assert np.abs(values["k"]).max() <= np.sqrt(6 / 50) and values["k"].std() > 0
    assert not values["b"].any()
    np.testing.assert_array_equal(values["c"], [2.5, 2.5, 2.5])
    assert values["n"].mean() == pytest.approx(1.0, abs=0.02)
    np.testing.assert_array_equal(initial_values(variables, seed=5)["k"], values["k"])
    assert not np.array_equal(initial_values(variables, seed=6)["k"], values["k"])


@pytest.mark.parametrize("name", ["logreg", "mlp"])
def test_loss_grads_and_correct_agrees_with_loss_and_grads_and_evaluate(name: str) -> None:
    data = load_dataset("digits")
    model = build_model(name, num_features=data.num_features, num_classes=data.num_classes,
                        hidden=(16,))
    params = _random_params(model, np.random.default_rng(1))
    batch = (data.x_train[:64], data.y_train[:64])
    loss, grads, correct = model.loss_grads_and_correct(params, batch)
    expected_loss, expected_grads = model.loss_and_grads(params, batch)
    loss_sum, expected_correct = model.evaluate(params, batch)
    assert loss == pytest.approx(expected_loss) == pytest.approx(loss_sum / 64)
    assert correct == expected_correct
    for key, grad in expected_grads.items():
        np.testing.assert_allclose(grads[key], grad)
