"""Row-wise optimizers of embedding tables against an independent float64 NumPy reference.

The reference below is written from the formulas in the `ps_server.optimizers` docstring,
one touched row set at a time, with adam's step count kept per row. It stores its values
and slots rounded to the dtypes the server keeps them in after every step, so what remains
between the two is the precision of the arithmetic (float64 here, the compute dtype there).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ps_common.shardmap import Component, VariableSpec
from ps_server.optimizers import apply_update, compute_dtype, make_state, resolve_knobs
from ps_server.sparse_optimizers import ROW_STEPS, apply_rows, make_row_slots

ROWS, DIM, STEPS = 60, 8, 7
HOT_ROWS = np.arange(0, 5)  # touched at every step
COLD_ROWS = np.arange(50, 60)  # never touched

OPTIMIZER_CASES = [
    ("sgd", {"name": "sgd", "lr": 0.05}),
    ("momentum", {"name": "momentum", "lr": 0.03, "momentum": 0.8}),
    ("nesterov", {"name": "momentum", "lr": 0.03, "momentum": 0.8, "nesterov": 1.0}),
    ("adagrad", {"name": "adagrad", "lr": 0.1, "initial_accumulator": 0.2, "eps": 1e-6}),
    ("adam", {"name": "adam", "lr": 0.01, "beta1": 0.85, "beta2": 0.99, "eps": 1e-7}),
    ("adam-defaults", {"name": "adam"}),
]
# Defaults written out independently of the module under test.
DOCUMENTED_DEFAULTS = {
    "sgd": {"lr": 0.01, "weight_decay": 0.0},
    "momentum": {"lr": 0.01, "momentum": 0.9, "nesterov": 0.0, "weight_decay": 0.0},
    "adagrad": {"lr": 0.01, "initial_accumulator": 0.1, "eps": 1e-7, "weight_decay": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
}
# float16 values are rounded every step, from float32 arithmetic on the server and float64
# arithmetic in the reference: a few may land one float16 step (<= 2**-10 |w|) apart.
TOLERANCES = {
    "float64": {"rtol": 1e-11, "atol": 1e-13},
    "float32": {"rtol": 2e-5, "atol": 2e-6},
    "float16": {"rtol": 2.5e-3, "atol": 1e-4},
}
SLOT_TOLERANCES = {
    "float64": {"rtol": 1e-11, "atol": 1e-13},
    "float32": {"rtol": 2e-5, "atol": 2e-7},
    "float16": {"rtol": 3e-3, "atol": 2e-5},  # slots are float32, fed by float16-rounded values
}


class ReferenceTable:
    """Textbook float64 updates of the rows of a table, storing in the server's dtypes."""

    def __init__(self, kind: str, knobs: dict, values: np.ndarray, dtype: str):
        self.kind, self.knobs = kind, knobs
        self.stored, self.slot_dtype = np.dtype(dtype), compute_dtype(dtype)
        self.w = values.astype(np.float64)
        self.acc = np.full_like(self.w, knobs.get("initial_accumulator", 0.0))
        self.m = np.zeros_like(self.w)
        self.v = np.zeros_like(self.w)
        self.steps = np.zeros(len(values), dtype=np.int64)

    def slots(self) -> dict[str, np.ndarray]:
        return {"sgd": {}, "momentum": {"accumulator": self.acc},
                "adagrad": {"accumulator": self.acc},
                "adam": {"m": self.m, "v": self.v, ROW_STEPS: self.steps}}[self.kind]

    def step(self, rows: np.ndarray, grad: np.ndarray) -> None:
        k = self.knobs
        w = self.w[rows]
        g = grad.astype(self.slot_dtype).astype(np.float64) + k["weight_decay"] * w
        if self.kind == "sgd":
            w = w - k["lr"] * g
        elif self.kind == "momentum":
            acc = k["momentum"] * self.acc[rows] + g
            if k["nesterov"]:
                w = w - k["lr"] * (g + k["momentum"] * acc)
            else:
                w = w - k["lr"] * acc
            self.acc[rows] = self._slot(acc)
        elif self.kind == "adagrad":
            acc = self.acc[rows] + g * g
            w = w - k["lr"] * g / (np.sqrt(acc) + k["eps"])
            self.acc[rows] = self._slot(acc)
        elif self.kind == "adam":
            b1, b2 = k["beta1"], k["beta2"]
            self.steps[rows] += 1
            t = self.steps[rows][:, None]
            m = b1 * self.m[rows] + (1 - b1) * g
            v = b2 * self.v[rows] + (1 - b2) * g * g
            w = w - k["lr"] * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + k["eps"])
            self.m[rows], self.v[rows] = self._slot(m), self._slot(v)
        else:
            raise AssertionError(self.kind)
        self.w[rows] = w.astype(self.stored).astype(np.float64)

    def _slot(self, value: np.ndarray) -> np.ndarray:
        return value.astype(self.slot_dtype).astype(np.float64)


def reference_knobs(component: dict) -> dict:
    knobs = dict(DOCUMENTED_DEFAULTS[component["name"]])
    knobs.update({k: float(v) for k, v in component.items() if k != "name"})
    return knobs


def touched_rows(rng: np.random.Generator) -> np.ndarray:
    """Hot rows, plus a random handful of the middle rows, in a random order."""
    middle = np.arange(HOT_ROWS[-1] + 1, COLD_ROWS[0])
    some = rng.choice(middle, rng.integers(1, len(middle)), replace=False)
    return rng.permutation(np.concatenate([HOT_ROWS, some])).astype(np.int64)


def snapshot(values: np.ndarray, slots: dict[str, np.ndarray]):
    return values.copy(), {name: slot.copy() for name, slot in slots.items()}


def assert_untouched(rows, before, values, slots):
    """Every row not in `rows`, of the values and every slot, is bit-for-bit as before."""
    untouched = np.ones(len(values), dtype=bool)
    untouched[rows] = False
    old_values, old_slots = before
    assert np.array_equal(values[untouched], old_values[untouched])
    assert set(slots) == set(old_slots)
    for name, slot in slots.items():
        assert np.array_equal(slot[untouched], old_slots[name][untouched]), name


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no-wd", "wd"])
@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=lambda c: c[0])
def test_matches_float64_reference_and_leaves_other_rows_alone(case, weight_decay, dtype):
    label, component = case
    component = dict(component, **({"weight_decay": weight_decay} if weight_decay else {}))
    spec = VariableSpec("emb", (ROWS, DIM), dtype=dtype, optimizer=Component.of(component))
    knobs = resolve_knobs(spec)
    rng = np.random.default_rng(zlib.crc32(repr((label, weight_decay, dtype)).encode()))
    values = rng.standard_normal((ROWS, DIM)).astype(dtype)
    slots = make_row_slots(spec, values.shape)
    reference = ReferenceTable(component["name"], reference_knobs(component), values, dtype)
    initial = snapshot(values, slots)

    for _ in range(STEPS):
        rows = touched_rows(rng)
        grad = rng.standard_normal((len(rows), DIM)).astype(dtype)
        grad_before = grad.copy()
        before = snapshot(values, slots)
        apply_rows(spec, knobs, values, slots, rows, grad)
        reference.step(rows, grad)
        assert_untouched(rows, before, values, slots)
        np.testing.assert_array_equal(grad, grad_before)

    assert values.dtype == np.dtype(dtype)
    np.testing.assert_allclose(values, reference.w, **TOLERANCES[dtype])
    expected_slots = reference.slots()
    assert set(slots) == set(expected_slots)
    for name, expected in expected_slots.items():
        if name == ROW_STEPS:
            np.testing.assert_array_equal(slots[name], expected)
        else:
            assert slots[name].dtype == compute_dtype(dtype)
            np.testing.assert_allclose(slots[name], expected, **SLOT_TOLERANCES[dtype])
    # Over all the steps, the cold rows were never written.
    assert_untouched(np.setdiff1d(np.arange(ROWS), COLD_ROWS), initial, values, slots)
    # The touched rows did move.
    assert not np.array_equal(values[HOT_ROWS], initial[0][HOT_ROWS])


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=lambda c: c[0])
def test_touching_every_row_equals_the_dense_optimizer(case):
    """The row formulas are the dense ones: the same pushes, given as all rows in shuffled
    order, end where optimizers.apply_update ends."""
    _, component = case
    component = dict(component, weight_decay=0.01)
    spec = VariableSpec("emb", (40, 6), optimizer=Component.of(component))
    knobs = resolve_knobs(spec)
    rng = np.random.default_rng(7)
    sparse = rng.standard_normal(spec.shape).astype(np.float32)
    dense = sparse.copy()
    slots, state = make_row_slots(spec, spec.shape), make_state(spec, spec.shape)
    for _ in range(5):
        grad = rng.standard_normal(spec.shape).astype(np.float32)
        order = rng.permutation(40)
        apply_rows(spec, knobs, sparse, slots, order, grad[order])
        apply_update(spec, knobs, dense, state, grad.copy())
    np.testing.assert_allclose(sparse, dense, rtol=1e-6, atol=1e-7)
    for name, slot in state.slots.items():
        np.testing.assert_allclose(slots[name], slot, rtol=1e-6, atol=1e-7)


def test_adam_bias_correction_uses_each_rows_own_step_count():
    """Row 0 is updated three times, row 1 once (after row 0's third), row 2 never. With a
    constant gradient a bias-corrected adam step moves a row by lr, whenever it comes."""
    spec = VariableSpec("emb", (3, 4), optimizer=Component.of({"name": "adam", "lr": 0.1}))
    knobs = resolve_knobs(spec)
    values = np.zeros((3, 4), dtype=np.float32)
    slots = make_row_slots(spec, values.shape)
    ones = np.ones((1, 4), dtype=np.float32)
    for _ in range(3):
        apply_rows(spec, knobs, values, slots, np.array([0]), ones)
    apply_rows(spec, knobs, values, slots, np.array([1]), ones)
    np.testing.assert_array_equal(slots[ROW_STEPS], [3, 1, 0])
    np.testing.assert_allclose(values[0], -0.3, rtol=1e-5)
    np.testing.assert_allclose(values[1], -0.1, rtol=1e-5)  # a first step, not a fourth
    np.testing.assert_array_equal(values[2], 0.0)
    # Both rows in one push: each uses its own count (t = 4 and t = 2).
    apply_rows(spec, knobs, values, slots, np.array([1, 0]), np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(slots[ROW_STEPS], [4, 2, 0])
    np.testing.assert_allclose(values[:2], [[-0.4] * 4, [-0.2] * 4], rtol=1e-5)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_empty_rows_change_nothing(name, dtype):
    spec = VariableSpec("emb", (5, 3), dtype=dtype, optimizer=Component(name))
    values = np.arange(15, dtype=dtype).reshape(5, 3)
    slots = make_row_slots(spec, values.shape)
    before = snapshot(values, slots)
    apply_rows(spec, resolve_knobs(spec), values, slots, np.empty(0, np.int64),
               np.empty((0, 3), dtype=dtype))
    assert_untouched(np.empty(0, np.int64), before, values, slots)


@pytest.mark.parametrize("name, dtype", [("sgd", "float32"), ("adam", "float32"),
                                         ("adagrad", "float16"), ("momentum", "float64")])
def test_make_row_slots_are_the_dense_slots_plus_adams_row_steps(name, dtype):
    component = {"name": name, **({"initial_accumulator": 0.25} if name == "adagrad" else {})}
    spec = VariableSpec("emb", (9, 4), dtype=dtype, optimizer=Component.of(component))
    slots = make_row_slots(spec, (9, 4))
    dense = make_state(spec, (9, 4)).slots
    assert set(slots) == set(dense) | ({ROW_STEPS} if name == "adam" else set())
    for slot_name, slot in dense.items():
        assert slots[slot_name].dtype == slot.dtype == compute_dtype(dtype)
        np.testing.assert_array_equal(slots[slot_name], slot)
    if name == "adagrad":
        np.testing.assert_array_equal(slots["accumulator"], 0.25)
    if name == "adam":
        assert slots[ROW_STEPS].dtype == np.int64
        np.testing.assert_array_equal(slots[ROW_STEPS], np.zeros(9, np.int64))


def test_gradient_of_another_dtype_or_read_only_is_converted_not_touched():
    spec = VariableSpec("emb", (10, 4), optimizer=Component.of({"name": "adagrad", "lr": 0.5}))
    knobs = resolve_knobs(spec)
    rows = np.array([7, 2, 5])
    grad64 = np.random.default_rng(1).standard_normal((3, 4))
    grad64.flags.writeable = False
    results = []
    for grad in (grad64, grad64.astype(np.float32)):
        values = np.ones((10, 4), dtype=np.float32)
        slots = make_row_slots(spec, values.shape)
        apply_rows(spec, knobs, values, slots, rows, grad)
        results.append(values)
    np.testing.assert_array_equal(results[0], results[1])
    assert results[0].dtype == np.float32


def test_bad_rows_or_gradient_shape_raise_before_anything_is_written():
    spec = VariableSpec("emb", (6, 2), optimizer=Component.of({"name": "adam"}))
    knobs = resolve_knobs(spec)
    values = np.ones((6, 2), dtype=np.float32)
    slots = make_row_slots(spec, values.shape)
    before = snapshot(values, slots)
    with pytest.raises(IndexError):
        apply_rows(spec, knobs, values, slots, np.array([1, 6]), np.ones((2, 2), np.float32))
    with pytest.raises(IndexError):
        apply_rows(spec, knobs, values, slots, np.array([1, -1]), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError):
        apply_rows(spec, knobs, values, slots, np.array([1, 2]), np.ones((2, 3), np.float32))
    with pytest.raises(ValueError):
        apply_rows(spec, knobs, values, slots, np.array([1, 2]), np.ones((3, 2), np.float32))
    assert_untouched(np.empty(0, np.int64), before, values, slots)
