"""Server-side optimizers against an independent float64 NumPy reference, and knob validation.

The reference below is written from the formulas in the `ps_server.optimizers` docstring,
element-wise on whole arrays, without the blocked loop or in-place scratch tricks.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.shardmap import Component, VariableSpec
from ps_server.optimizers import BLOCK_ELEMENTS, apply_update, make_state, resolve_knobs

STEPS = 5

# (id, optimizer component without weight_decay)
OPTIMIZER_CASES = [
    ("sgd", {"name": "sgd", "lr": 0.05}),
    ("momentum", {"name": "momentum", "lr": 0.03, "momentum": 0.8}),
    ("nesterov", {"name": "momentum", "lr": 0.03, "momentum": 0.8, "nesterov": 1.0}),
    ("adagrad", {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.2, "eps": 1e-6}),
    ("adam", {"name": "adam", "lr": 0.01, "beta1": 0.85, "beta2": 0.99, "eps": 1e-7}),
]
# Defaults only: catches a default that disagrees with the documented one.
DEFAULT_CASES = [
    ("sgd-defaults", {"name": "sgd"}),
    ("momentum-defaults", {"name": "momentum"}),
    ("adagrad-defaults", {"name": "adagrad"}),
    ("adam-defaults", {"name": "adam"}),
]
DOCUMENTED_DEFAULTS = {
    "sgd": {"lr": 0.01, "weight_decay": 0.0},
    "momentum": {"lr": 0.01, "momentum": 0.9, "nesterov": 0.0, "weight_decay": 0.0},
    "adagrad": {"lr": 0.01, "initial_accumulator": 0.1, "eps": 1e-7, "weight_decay": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
}

SHAPES = [
    pytest.param((7,), id="1d-small"),
    pytest.param((13, 5), id="2d-small"),
    # 200_000 elements: three full blocks of 65_536 and a partial fourth.
    pytest.param((400, 500), id="2d-over-block"),
]


def reference(kind: str, knobs: dict, w0: np.ndarray, grads: list[np.ndarray]):
    """Textbook float64 updates. Returns (w, slots)."""
    w = w0.astype(np.float64).copy()
    lr, wd = knobs["lr"], knobs.get("weight_decay", 0.0)
    acc = np.zeros_like(w)
    if kind == "adagrad":
        acc = np.full_like(w, knobs["initial_accumulator"])
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g_raw in enumerate(grads, start=1):
        g = g_raw.astype(np.float64) + wd * w
        if kind == "sgd":
            w = w - lr * g
        elif kind == "momentum":
            mu = knobs["momentum"]
            acc = mu * acc + g
            if knobs["nesterov"]:
                w = w - lr * (g + mu * acc)
            else:
                w = w - lr * acc
        elif kind == "adagrad":
            acc = acc + g * g
            w = w - lr * g / (np.sqrt(acc) + knobs["eps"])
        elif kind == "adam":
            b1, b2, eps = knobs["beta1"], knobs["beta2"], knobs["eps"]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
        else:
            raise AssertionError(kind)
    slots = {"sgd": {}, "momentum": {"accumulator": acc}, "adagrad": {"accumulator": acc},
             "adam": {"m": m, "v": v}}[kind]
    return w, slots


def run_server_optimizer(spec: VariableSpec, w0: np.ndarray, grads: list[np.ndarray]):
    knobs = resolve_knobs(spec)
    values = w0.astype(spec.dtype).copy()
    state = make_state(spec, values.shape)
    for g in grads:
        apply_update(spec, knobs, values, state, g.astype(spec.dtype).copy())
    return values, state


def knobs_for_reference(component: dict) -> dict:
    knobs = dict(DOCUMENTED_DEFAULTS[component["name"]])
    knobs.update({k: float(v) for k, v in component.items() if k != "name"})
    return knobs


def make_inputs(shape, seed: int):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(STEPS)]
    return w0, grads


TOLERANCES = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-12, atol=1e-13)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no-wd", "wd"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", OPTIMIZER_CASES + DEFAULT_CASES, ids=lambda c: c[0])
def test_matches_float64_reference(case, shape, weight_decay, dtype):
    _, component = case
    component = dict(component)
    if weight_decay:
        component["weight_decay"] = weight_decay
    spec = VariableSpec("w", shape, dtype=dtype, optimizer=Component.of(component))
    w0, grads = make_inputs(shape, seed=zlib.crc32(repr((case[0], shape, weight_decay)).encode()))
    # The reference starts from what the server actually stores (rounded to dtype).
    w0 = w0.astype(dtype)
    grads = [g.astype(dtype) for g in grads]

    values, state = run_server_optimizer(spec, w0, grads)
    expected_w, expected_slots = reference(
        component["name"], knobs_for_reference(component), w0, grads)

    assert values.shape == shape and values.dtype == np.dtype(dtype)
    np.testing.assert_allclose(values, expected_w, **TOLERANCES[dtype])
    assert state.steps == STEPS
    assert set(state.slots) == set(expected_slots)
    for name, expected in expected_slots.items():
        assert state.slots[name].shape == shape
        assert state.slots[name].dtype == np.dtype(dtype)
        np.testing.assert_allclose(state.slots[name], expected, **TOLERANCES[dtype])


def test_big_tensor_is_updated_in_every_block_and_identically_to_a_small_one():
    """Elements straddling block boundaries get exactly the update their neighbours get."""
    n = 3 * BLOCK_ELEMENTS + 17
    spec = VariableSpec("big", (n,), optimizer=Component.of({"name": "adam", "lr": 0.01}))
    w0 = np.linspace(-1, 1, n).astype(np.float32)
    grads = [np.full(n, 0.5 * (i + 1), dtype=np.float32) for i in range(STEPS)]
    values, _ = run_server_optimizer(spec, w0, grads)
    # Constant gradients: every element moves by the same amount (up to float32 rounding).
    delta = values.astype(np.float64) - w0
    assert np.ptp(delta) < 1e-6
    small = VariableSpec("small", (4,), optimizer=spec.optimizer)
    small_values, _ = run_server_optimizer(small, w0[:4], [g[:4] for g in grads])
    np.testing.assert_allclose(delta.mean(), (small_values - w0[:4]).mean(), rtol=1e-4)


def test_float16_variable_keeps_float16_values_and_float32_slots():
    spec = VariableSpec("h", (300,), dtype="float16",
                        optimizer=Component.of({"name": "momentum", "lr": 0.1}))
    w0, grads = make_inputs((300,), seed=3)
    w0 = w0.astype(np.float16)
    grads = [g.astype(np.float16) for g in grads]
    values, state = run_server_optimizer(spec, w0, grads)
    assert values.dtype == np.float16
    assert state.slots["accumulator"].dtype == np.float32  # see optimizers.compute_dtype
    expected, _ = reference("momentum", knobs_for_reference({"name": "momentum", "lr": 0.1}),
                            w0, grads)
    np.testing.assert_allclose(values, expected, rtol=2e-2, atol=2e-2)


def test_update_is_in_place_on_the_callers_array():
    spec = VariableSpec("w", (10, 3), optimizer=Component.of({"name": "sgd", "lr": 0.5}))
    values = np.ones((10, 3), dtype=np.float32)
    before = values
    state = make_state(spec, values.shape)
    apply_update(spec, resolve_knobs(spec), values, state, np.ones((10, 3), dtype=np.float32))
    assert values is before
    np.testing.assert_array_equal(values, np.full((10, 3), 0.5, dtype=np.float32))


def test_adam_bias_correction_counts_steps_per_state():
    """Two shards of one variable each count their own steps (t is per shard)."""
    spec = VariableSpec("w", (4,), optimizer=Component.of({"name": "adam", "lr": 0.1}))
    knobs = resolve_knobs(spec)
    a = np.zeros(4, dtype=np.float32)
    b = np.zeros(4, dtype=np.float32)
    sa, sb = make_state(spec, a.shape), make_state(spec, b.shape)
    for _ in range(3):
        apply_update(spec, knobs, a, sa, np.ones(4, dtype=np.float32))
    apply_update(spec, knobs, b, sb, np.ones(4, dtype=np.float32))
    assert (sa.steps, sb.steps) == (3, 1)
    # First adam step with a constant gradient moves by ~lr (bias-corrected).
    np.testing.assert_allclose(b, -0.1, rtol=1e-5)
    np.testing.assert_allclose(a, -0.3, rtol=1e-5)


# ---- knob validation --------------------------------------------------------------------

def _spec(optimizer: dict, name: str = "layer1/kernel", dtype: str = "float32") -> VariableSpec:
    return VariableSpec(name, (3, 2), dtype=dtype, optimizer=Component.of(optimizer))


@pytest.mark.parametrize(
    "optimizer, knob",
    [
        ({"name": "sgd", "learning_rate": 0.1}, "learning_rate"),
        ({"name": "adam", "momentum": 0.9}, "momentum"),
        ({"name": "sgd", "lr": 0.0}, "lr"),
        ({"name": "sgd", "lr": -0.1}, "lr"),
        ({"name": "adam", "lr": float("nan")}, "lr"),
        ({"name": "adam", "lr": float("inf")}, "lr"),
        ({"name": "adam", "beta1": 1.0}, "beta1"),
        ({"name": "adam", "beta1": 1.5}, "beta1"),
        ({"name": "adam", "beta2": 1.0}, "beta2"),
        ({"name": "adam", "beta1": -0.1}, "beta1"),
        ({"name": "adam", "eps": 0.0}, "eps"),
        ({"name": "momentum", "momentum": 1.0}, "momentum"),
        ({"name": "momentum", "nesterov": 2.0}, "nesterov"),
        ({"name": "momentum", "nesterov": 0.5}, "nesterov"),
        ({"name": "sgd", "weight_decay": -0.01}, "weight_decay"),
        ({"name": "adagrad", "initial_accumulator": -1.0}, "initial_accumulator"),
        ({"name": "rmsprop"}, "rmsprop"),
        ({"name": "rmsprop", "lr": 0.1}, "rmsprop"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_knobs_raise_invalid_argument_naming_variable_and_knob(optimizer, knob):
    spec = _spec(optimizer)
    with pytest.raises(InvalidArgument) as info:
        resolve_knobs(spec)
    assert info.value.code == "INVALID_ARGUMENT"
    assert "layer1/kernel" in info.value.message
    assert knob in info.value.message
    # make_state validates too: no state is built for a bad spec.
    with pytest.raises(InvalidArgument):
        make_state(spec, (3, 2))


@pytest.mark.parametrize("optimizer, dtype, knob", [
    ({"name": "sgd", "lr": 1e40}, "float32", "lr"),
    ({"name": "adam", "eps": 1e-50}, "float32", "eps"),
    ({"name": "momentum", "weight_decay": 1e39}, "float16", "weight_decay"),  # computed in f32
    ({"name": "adagrad", "initial_accumulator": 1e300}, "float32", "initial_accumulator"),
])
def test_knobs_that_do_not_fit_the_update_dtype_are_refused(optimizer, dtype, knob):
    """A knob is used in the dtype the update computes in: one that is infinite there (every
    update would make inf or NaN) or a positive one that is 0 there is refused, naming it."""
    with pytest.raises(InvalidArgument) as info:
        resolve_knobs(_spec(optimizer, dtype=dtype))
    assert "layer1/kernel" in info.value.message and f"{knob}=" in info.value.message
    assert "float32" in info.value.message
    resolve_knobs(_spec(optimizer, dtype="float64"))  # fits float64


@pytest.mark.parametrize("name, defaults", sorted(DOCUMENTED_DEFAULTS.items()))
def test_resolve_knobs_fills_documented_defaults(name, defaults):
    assert resolve_knobs(_spec({"name": name})) == pytest.approx(defaults)


def test_resolve_knobs_keeps_given_values_and_accepts_boundaries():
    knobs = resolve_knobs(_spec({"name": "momentum", "lr": 0.5, "momentum": 0.0,
                                 "nesterov": True, "weight_decay": 0.0}))
    assert knobs == {"lr": 0.5, "momentum": 0.0, "nesterov": 1.0, "weight_decay": 0.0}
    assert resolve_knobs(_spec({"name": "adam", "beta1": 0.0, "beta2": 0.0}))["beta1"] == 0.0


@pytest.mark.parametrize("name, slots", [("sgd", set()), ("momentum", {"accumulator"}),
                                         ("adagrad", {"accumulator"}), ("adam", {"m", "v"})])
def test_make_state_slot_names_and_initial_values(name, slots):
    spec = _spec({"name": name, **({"initial_accumulator": 0.25} if name == "adagrad" else {})})
    state = make_state(spec, (3, 2))
    assert set(state.slots) == slots and state.steps == 0
    for slot in state.slots.values():
        assert slot.shape == (3, 2) and slot.dtype == np.float32
        expected = 0.25 if name == "adagrad" else 0.0
        np.testing.assert_array_equal(slot, np.full((3, 2), expected, dtype=np.float32))
    assert math.isfinite(sum(float(s.sum()) for s in state.slots.values()))


def test_adam_on_float16_variable_stays_finite_with_zero_and_tiny_gradients():
    spec = VariableSpec("h", (6,), dtype="float16", optimizer=Component("adam"))
    w0 = np.ones(6, dtype=np.float16)
    grads = [np.array([0.0, 1.0, -1.0, 1e-4, -1e-4, 0.0], dtype=np.float16)] * 3
    with np.errstate(divide="ignore", invalid="ignore"):  # the bug's symptom, not the test's
        values, _ = run_server_optimizer(spec, w0, grads)
    assert np.all(np.isfinite(values))
    expected, _ = reference("adam", knobs_for_reference({"name": "adam"}), w0, grads)
    np.testing.assert_allclose(values, expected, atol=2e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam"])
def test_a_read_only_gradient_gives_the_same_update_and_stays_untouched(optimizer):
    """A push applied straight from its received message: the gradient cannot be used as
    scratch, and the result must be the same as from a writable copy."""
    spec = VariableSpec("w", (3 * BLOCK_ELEMENTS + 5,), "float32", Component("zeros"),
                        Component(optimizer, (("lr", 0.1),)), 0)
    knobs = resolve_knobs(spec)
    grad = np.random.default_rng(0).standard_normal(spec.shape).astype(np.float32)
    results = []
    for writable in (True, False):
        values, state = np.ones(spec.shape, np.float32), make_state(spec, spec.shape)
        g = grad.copy()
        g.flags.writeable = writable
        for _ in range(2):
            apply_update(spec, knobs, values, state, g if not writable else g.copy())
        if not writable:
            np.testing.assert_array_equal(g, grad)
        results.append(values)
    np.testing.assert_array_equal(results[0], results[1])
