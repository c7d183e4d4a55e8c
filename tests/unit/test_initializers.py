"""Seeded, row-addressable initializers: any split of the rows gives the unsplit values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.shardmap import Component, VariableSpec
from ps_server.initializers import (
    BLOCK_ELEMENTS,
    glorot_limit,
    initialize_rows,
    validate_initializer,
)

INITIALIZERS = [
    pytest.param({"name": "zeros"}, id="zeros"),
    pytest.param({"name": "constant", "value": 0.75}, id="constant"),
    pytest.param({"name": "uniform", "minval": -2.0, "maxval": 3.0}, id="uniform"),
    pytest.param({"name": "normal", "mean": 1.0, "stddev": 0.5}, id="normal"),
    pytest.param({"name": "glorot_uniform"}, id="glorot_uniform"),
]

SHAPES = [
    pytest.param((1000,), id="1d"),
    # 8 elements per row: 8192 rows per block, so a 20_000-row variable has 3 blocks.
    pytest.param((20_000, 8), id="2d-narrow-rows"),
    # rows wider than a block: one row per block.
    pytest.param((5, BLOCK_ELEMENTS + 3), id="2d-wide-rows"),
    pytest.param((50, 7, 300), id="3d"),
]


def splits(rows: int) -> list[list[tuple[int, int]]]:
    """Several ways to cut range(rows) into contiguous pieces."""
    def cut(points):
        points = sorted({0, rows, *[p for p in points if 0 < p < rows]})
        return list(zip(points[:-1], points[1:]))

    rng = np.random.default_rng(rows)
    return [
        [(0, rows)],
        cut([rows // 2]),
        cut([rows // 3, 2 * rows // 3]),
        cut(rng.integers(1, rows, size=6).tolist()),  # 7 uneven parts (fewer if rows is small)
        cut([1, rows - 1]),
        [(r, r + 1) for r in range(min(rows, 12))] + ([(12, rows)] if rows > 12 else []),
    ]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("init", INITIALIZERS)
def test_any_split_concatenates_to_the_unsplit_value(init, shape):
    spec = VariableSpec("v", shape, initializer=Component.of(init), seed=7)
    validate_initializer(spec)
    whole = initialize_rows(spec, 0, spec.rows)
    assert whole.shape == shape and whole.dtype == np.float32
    assert whole.flags.c_contiguous
    for parts in splits(spec.rows):
        pieces = [initialize_rows(spec, a, b) for a, b in parts]
        for (a, b), piece in zip(parts, pieces):
            assert piece.shape == (b - a, *shape[1:])
            assert piece.flags.c_contiguous
        assert np.array_equal(np.concatenate(pieces), whole), parts


@pytest.mark.parametrize("init", INITIALIZERS)
def test_block_boundary_single_rows(init):
    """Rows on either side of every block boundary, fetched alone, equal the unsplit rows."""
    shape = (3 * (BLOCK_ELEMENTS // 16) + 5, 16)
    spec = VariableSpec("v", shape, initializer=Component.of(init), seed=11)
    whole = initialize_rows(spec, 0, spec.rows)
    block_rows = BLOCK_ELEMENTS // 16
    for boundary in (block_rows, 2 * block_rows, 3 * block_rows):
        for r in (boundary - 1, boundary):
            assert np.array_equal(initialize_rows(spec, r, r + 1)[0], whole[r])
        assert np.array_equal(initialize_rows(spec, boundary - 2, boundary + 2),
                              whole[boundary - 2:boundary + 2])


RANDOM_INITIALIZERS = [p for p in INITIALIZERS if p.id in ("uniform", "normal", "glorot_uniform")]


@pytest.mark.parametrize("init", RANDOM_INITIALIZERS)
def test_same_seed_same_values_different_seed_different_values(init):
    def make(seed, name="v"):
        return initialize_rows(
            VariableSpec(name, (300, 40), initializer=Component.of(init), seed=seed), 0, 300)

    assert np.array_equal(make(3), make(3))
    assert np.array_equal(make(3, "v"), make(3, "other-name"))  # the seed, not the name, decides
    assert not np.array_equal(make(3), make(4))
    assert np.mean(make(3) == make(4)) < 0.01
    # Seed 0 is a valid seed and differs from seed 1.
    assert not np.array_equal(make(0), make(1))


@pytest.mark.parametrize("shape", [(10,), (100, 30), (3, 3, 16, 32), (50, 7, 300)])
def test_glorot_values_within_limit_and_spread_over_it(shape):
    spec = VariableSpec("k", shape, initializer=Component("glorot_uniform"), seed=5)
    values = initialize_rows(spec, 0, spec.rows).astype(np.float64)
    limit = glorot_limit(shape)
    assert np.all(np.abs(values) <= limit * (1 + 1e-6))
    if values.size >= 1000:
        assert values.max() > 0.9 * limit and values.min() < -0.9 * limit
        assert abs(values.mean()) < 0.05 * limit


def test_glorot_limit_uses_keras_fans():
    assert glorot_limit((10,)) == pytest.approx(math.sqrt(6 / 20))
    assert glorot_limit((100, 30)) == pytest.approx(math.sqrt(6 / 130))
    # convolution kernel (h, w, in, out): fans multiplied by the receptive field h * w
    assert glorot_limit((3, 3, 16, 32)) == pytest.approx(math.sqrt(6 / (9 * 16 + 9 * 32)))


def test_uniform_within_bounds():
    spec = VariableSpec("u", (500, 200), initializer=Component.of(
        {"name": "uniform", "minval": -2.0, "maxval": 3.0}), seed=1)
    values = initialize_rows(spec, 0, spec.rows)
    assert values.min() >= -2.0 and values.max() <= 3.0
    assert values.mean() == pytest.approx(0.5, abs=0.02)
    assert values.min() < -1.99 and values.max() > 2.99


def test_normal_mean_and_stddev_for_a_big_tensor():
    spec = VariableSpec("n", (400, 500), initializer=Component.of(
        {"name": "normal", "mean": 1.5, "stddev": 0.25}), seed=2)
    values = initialize_rows(spec, 0, spec.rows).astype(np.float64)
    assert values.mean() == pytest.approx(1.5, abs=0.005)
    assert values.std() == pytest.approx(0.25, rel=0.01)


def test_defaults():
    assert np.array_equal(initialize_rows(VariableSpec("z", (4, 3)), 0, 4), np.zeros((4, 3)))
    c = initialize_rows(VariableSpec("c", (4, 3), initializer=Component("constant")), 0, 4)
    assert np.array_equal(c, np.zeros((4, 3)))
    u = initialize_rows(VariableSpec("u", (100, 100), initializer=Component("uniform")), 0, 100)
    assert u.min() >= -0.05 and u.max() <= 0.05
    n = initialize_rows(VariableSpec("n", (100, 100), initializer=Component("normal")), 0, 100)
    assert n.std() == pytest.approx(0.05, rel=0.05)


def test_constant_value():
    spec = VariableSpec("c", (3, 2), initializer=Component.of({"name": "constant", "value": -4.5}))
    assert np.array_equal(initialize_rows(spec, 1, 3), np.full((2, 2), -4.5, dtype=np.float32))


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("init", INITIALIZERS)
def test_other_dtypes_split_consistently(init, dtype):
    spec = VariableSpec("d", (9000, 9), dtype=dtype, initializer=Component.of(init), seed=9)
    whole = initialize_rows(spec, 0, spec.rows)
    assert whole.dtype == np.dtype(dtype)
    pieces = [initialize_rows(spec, a, b) for a, b in [(0, 1), (1, 7281), (7281, 7282), (7282, 9000)]]
    assert all(p.dtype == np.dtype(dtype) for p in pieces)
    assert np.array_equal(np.concatenate(pieces), whole)
    assert np.all(np.isfinite(whole))


def test_float16_glorot_within_limit_rounded_to_float16():
    spec = VariableSpec("h", (200, 100), dtype="float16",
                        initializer=Component("glorot_uniform"), seed=1)
    values = initialize_rows(spec, 0, spec.rows)
    limit16 = float(np.float16(glorot_limit(spec.shape)))
    # rounding to float16 may land one float16 step past the exact limit, no further
    bound = float(np.nextafter(np.float16(limit16), np.float16(np.inf)))
    assert np.all(np.abs(values.astype(np.float64)) <= bound)


def test_float64_values_use_float64_precision():
    spec = VariableSpec("d", (1000,), dtype="float64", initializer=Component("uniform"), seed=4)
    values = initialize_rows(spec, 0, 1000)
    # float32-generated values would all survive a round trip through float32
    assert not np.array_equal(values, values.astype(np.float32).astype(np.float64))


# ---- validation -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "initializer, seed, must_name",
    [
        ({"name": "xavier"}, 0, "xavier"),
        ({"name": "uniform", "low": -1.0}, 0, "low"),
        ({"name": "zeros", "value": 1.0}, 0, "value"),
        ({"name": "uniform", "minval": 1.0, "maxval": 1.0}, 0, "minval"),
        ({"name": "uniform", "minval": 2.0, "maxval": 1.0}, 0, "minval"),
        ({"name": "uniform", "minval": 0.1}, 0, "minval"),  # above the default maxval 0.05
        ({"name": "normal", "stddev": -1.0}, 0, "stddev"),
        ({"name": "normal"}, -1, "seed"),
    ],
)
def test_validation_errors(initializer, seed, must_name):
    with pytest.raises(InvalidArgument) as info:  # the spec itself refuses a negative seed
        validate_initializer(VariableSpec("emb/table", (4, 2),
                                          initializer=Component.of(initializer), seed=seed))
    assert info.value.code == "INVALID_ARGUMENT"
    assert "emb/table" in info.value.message
    assert must_name in info.value.message


@pytest.mark.parametrize("init", INITIALIZERS)
def test_valid_specs_validate(init):
    validate_initializer(VariableSpec("ok", (4, 2), initializer=Component.of(init), seed=0))
