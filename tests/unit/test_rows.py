"""Embedding-table ids: validation, dedup and gradient summing, hashing, per-id random rows.

Reference values are computed independently in this file: sums with np.add.at in float64,
splitmix64 with Python ints.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.rows import (
    check_ids,
    dedup,
    hash_ids,
    id_normal,
    id_uniform,
    sum_duplicates,
)
from ps_common.shardmap import Component
from ps_server.initializers import BLOCK_ELEMENTS, initialize_ids

INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def some_ids(n: int, seed: int = 0) -> np.ndarray:
    """n distinct ids spread over all of int64, extremes and negatives included."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(INT64_MIN, INT64_MAX, size=n + 16, dtype=np.int64, endpoint=True)
    ids[:5] = [0, -1, 1, INT64_MIN, INT64_MAX]
    return np.unique(ids)[:n][rng.permutation(n)]


# ---- check_ids ---------------------------------------------------------------------------

@pytest.mark.parametrize("ids, expected", [
    (np.array([3, -1, 7], dtype=np.int64), [3, -1, 7]),
    ([3, -1, 7], [3, -1, 7]),
    ((5,), [5]),
    ([INT64_MIN, INT64_MAX], [INT64_MIN, INT64_MAX]),
    ([np.int64(4), np.int32(2)], [4, 2]),
    ([], []),
    ((), []),
    (np.empty(0, dtype=np.int64), []),
    (np.arange(10, dtype=np.int64)[::3], [0, 3, 6, 9]),  # strided
    (np.arange(4, dtype=">i8"), [0, 1, 2, 3]),  # big-endian int64
], ids=["array", "list", "tuple", "extremes", "numpy-int-scalars", "empty-list",
        "empty-tuple", "empty-array", "strided", "big-endian"])
def test_check_ids_accepts_int64_arrays_and_lists_of_ints(ids, expected):
    result = check_ids(ids, what="push emb")
    assert result.dtype == np.dtype(np.int64) and result.ndim == 1
    assert result.flags.c_contiguous
    np.testing.assert_array_equal(result, np.array(expected, dtype=np.int64))


def test_check_ids_returns_a_contiguous_int64_array_itself():
    ids = np.arange(5, dtype=np.int64)
    assert check_ids(ids, what="x") is ids


@pytest.mark.parametrize("ids", [
    np.arange(3, dtype=np.int32),
    np.arange(3, dtype=np.uint64),
    np.arange(3, dtype=np.int16),
    np.arange(3, dtype=np.float64),
    np.array([True, False]),
    np.zeros((2, 3), dtype=np.int64),
    np.zeros((0, 1), dtype=np.int64),
    np.array(7, dtype=np.int64),  # 0-d
    [1, 2.0],
    [1.0],
    [True, 2],
    [1, "2"],
    [1, None],
    [[1, 2], [3, 4]],
    [2 ** 63],
    [-1, 2 ** 63],
    [INT64_MIN - 1],
    7,
    "1,2",
    {1, 2},
    range(3),
], ids=["int32", "uint64", "int16", "float64", "bool", "2-D", "2-D-empty", "0-d",
        "list-with-float", "list-of-float", "list-with-bool", "list-with-str",
        "list-with-none", "nested-list", "too-big", "mixed-too-big", "too-small", "int",
        "str", "set", "range"])
def test_check_ids_refuses_anything_else_naming_what(ids):
    with pytest.raises(InvalidArgument) as info:
        check_ids(ids, what="table user_emb")
    assert info.value.code == "INVALID_ARGUMENT"
    assert "table user_emb" in info.value.message


# ---- dedup and sum_duplicates ------------------------------------------------------------

def id_cases():
    rng = np.random.default_rng(1)
    zipf = (rng.zipf(1.3, 4096) % 100_000).astype(np.int64)
    return {
        "zipf-heavy-duplicates": zipf,
        "few-distinct-shuffled": rng.integers(-3, 4, 1000).astype(np.int64),
        "all-the-same": np.full(300, 42, dtype=np.int64),
        "no-duplicates-shuffled": rng.permutation(2000).astype(np.int64) * 7 - 5000,
        "no-duplicates-sorted": np.arange(50, dtype=np.int64),
        "one": np.array([INT64_MIN], dtype=np.int64),
        "empty": np.empty(0, dtype=np.int64),
    }


ID_CASES = id_cases()


@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_dedup_gives_sorted_unique_ids_and_their_inverse(case):
    ids = ID_CASES[case]
    unique, inverse = dedup(ids)
    np.testing.assert_array_equal(unique, np.unique(ids))
    assert unique.dtype == np.int64
    assert inverse.shape == ids.shape
    np.testing.assert_array_equal(unique[inverse], ids)


def reference_sum(grads: np.ndarray, inverse: np.ndarray, n_unique: int):
    """Exact-ish float64 sums, and the float64 sums of magnitudes (for the error bound)."""
    shape = (n_unique, *grads.shape[1:])
    total, magnitude = np.zeros(shape), np.zeros(shape)
    np.add.at(total, inverse, grads.astype(np.float64))
    np.add.at(magnitude, inverse, np.abs(grads.astype(np.float64)))
    return total, magnitude


def assert_sums_close(result, grads, inverse, n_unique):
    """Recursive summation of k terms in a dtype with unit roundoff u errs by at most
    (k - 1) u sum|x|; float16 sums are made in float32 and rounded to float16 once more."""
    expected, magnitude = reference_sum(grads, inverse, n_unique)
    counts = np.bincount(inverse, minlength=n_unique).reshape(-1, *[1] * (grads.ndim - 1))
    sum_dtype = np.float32 if grads.dtype == np.float16 else grads.dtype
    bound = 2 * np.maximum(counts - 1, 0) * np.finfo(sum_dtype).eps * magnitude
    if grads.dtype == np.float16:
        bound = bound + np.finfo(np.float16).eps * np.abs(expected) + np.finfo(np.float16).tiny
    error = np.abs(result.astype(np.float64) - expected)
    assert np.all(error <= bound), float((error - bound).max())


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("row_shape", [(1,), (64,), (4, 3)], ids=["dim1", "dim64", "3-D"])
@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_sum_duplicates_matches_float64_reference(case, row_shape, dtype):
    ids = ID_CASES[case]
    grads = np.random.default_rng(len(ids)).standard_normal((len(ids), *row_shape))
    grads = grads.astype(dtype)
    before = grads.copy()
    unique, inverse = dedup(ids)

    result = sum_duplicates(grads, inverse, len(unique))

    assert result.shape == (len(unique), *row_shape) and result.dtype == np.dtype(dtype)
    assert_sums_close(result, grads, inverse, len(unique))
    np.testing.assert_array_equal(grads, before)  # the caller's gradients are untouched


def test_sum_duplicates_without_duplicates_only_reorders():
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((500, 8)).astype(np.float32)
    inverse = rng.permutation(500)
    result = sum_duplicates(grads, inverse, 500)
    expected = np.empty_like(grads)
    expected[inverse] = grads
    np.testing.assert_array_equal(result, expected)


def test_sum_duplicates_of_float16_sums_in_float32():
    """A float16 running sum of 0.1s stops growing at 256, where float16's spacing (0.25)
    exceeds twice 0.1; summed in float32, 4000 of them come to about 400."""
    grads = np.full((4000, 2), 0.1, dtype=np.float16)
    result = sum_duplicates(grads, np.zeros(4000, dtype=np.int64), 1)
    assert result.dtype == np.float16
    np.testing.assert_allclose(result, 4000 * float(np.float16(0.1)), atol=0.25)


def test_sum_duplicates_leaves_rows_nobody_maps_to_at_zero():
    grads = np.ones((4, 3), dtype=np.float32)
    for inverse in ([0, 0, 3, 3], [4, 0, 2, 1]):
        result = sum_duplicates(grads, np.array(inverse), 6)
        expected = np.zeros((6, 3))
        np.add.at(expected, inverse, 1.0)
        np.testing.assert_array_equal(result, expected)


def test_sum_duplicates_of_nothing():
    result = sum_duplicates(np.empty((0, 5), np.float32), np.empty(0, np.int64), 0)
    assert result.shape == (0, 5) and result.dtype == np.float32
    result = sum_duplicates(np.empty((0, 5), np.float16), np.empty(0, np.int64), 2)
    np.testing.assert_array_equal(result, np.zeros((2, 5), np.float16))


@pytest.mark.parametrize("inverse, n_unique", [([0, 3], 3), ([0, -1], 3), ([0], 3)],
                         ids=["too-big", "negative", "length-mismatch"])
def test_sum_duplicates_refuses_an_inverse_that_does_not_fit(inverse, n_unique):
    with pytest.raises(ValueError):
        sum_duplicates(np.ones((2, 4), np.float32), np.array(inverse), n_unique)


# ---- hash_ids ----------------------------------------------------------------------------

def splitmix64_finalizer(x: int) -> int:
    mask = (1 << 64) - 1
    x &= mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_hash_ids_is_splitmix64s_finalizer_of_the_ids_bits():
    ids = np.concatenate([some_ids(200), np.arange(-3, 3, dtype=np.int64)])
    hashes = hash_ids(ids)
    assert hashes.dtype == np.uint64 and hashes.shape == ids.shape
    assert [int(h) for h in hashes] == [splitmix64_finalizer(int(i)) for i in ids]
    np.testing.assert_array_equal(hash_ids(ids), hashes)  # deterministic
    np.testing.assert_array_equal(hash_ids(list(ids[:7])), hashes[:7])
    assert hash_ids(np.empty(0, np.int64)).shape == (0,)


def test_hash_ids_raises_no_warning_and_keeps_the_input(recwarn):
    ids = np.array([INT64_MAX, INT64_MIN, -1], dtype=np.int64)
    before = ids.copy()
    with np.errstate(all="raise"):  # wraparound is intended and must not trip errstate
        hash_ids(ids)
        hash_ids(ids[:1])
    assert not recwarn.list
    np.testing.assert_array_equal(ids, before)


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 1024])
@pytest.mark.parametrize("offset", [0, -50_000, 1 << 40])
@pytest.mark.parametrize("buckets", [2, 3, 4])
def test_hash_ids_spreads_strided_ids_evenly_over_buckets(buckets, stride, offset):
    ids = offset + stride * np.arange(100_000, dtype=np.int64)
    counts = np.bincount((hash_ids(ids) % np.uint64(buckets)).astype(np.int64),
                         minlength=buckets)
    share = len(ids) / buckets
    # A fair split has a standard deviation under 0.6% of the share here; 3% is > 5 sigma.
    assert np.all(np.abs(counts - share) < 0.03 * share), counts


def test_hash_ids_refuses_non_int64_ids():
    with pytest.raises(InvalidArgument):
        hash_ids(np.arange(3, dtype=np.int32))


# ---- id_uniform and id_normal ------------------------------------------------------------

GENERATORS = [pytest.param(id_uniform, id="uniform"), pytest.param(id_normal, id="normal")]


@pytest.mark.parametrize("dim", [1, 7, 16])
@pytest.mark.parametrize("generate", GENERATORS)
def test_an_ids_row_does_not_depend_on_its_batch(generate, dim):
    ids = some_ids(3000)
    whole = generate(5, ids, dim)
    assert whole.shape == (3000, dim) and whole.dtype == np.float64
    rng = np.random.default_rng(dim)
    for size in (1, 2, 3, 8, 9, 100, 1001):
        positions = rng.choice(len(ids), size, replace=False)  # any subset, any order
        np.testing.assert_array_equal(generate(5, ids[positions], dim), whole[positions])
    # The same id twice in one batch, and alone.
    twice = generate(5, ids[[10, 10, 11, 10]], dim)
    np.testing.assert_array_equal(twice, whole[[10, 10, 11, 10]])
    np.testing.assert_array_equal(generate(5, [int(ids[0])], dim), whole[:1])
    # Column j of an id is the same for any dim.
    np.testing.assert_array_equal(generate(5, ids, dim + 3)[:, :dim], whole)


@pytest.mark.parametrize("generate", GENERATORS)
def test_different_seeds_and_ids_give_unrelated_rows(generate):
    ids = np.arange(2000, dtype=np.int64)
    a, b = generate(0, ids, 8), generate(1, ids, 8)
    assert np.mean(a == b) < 1e-3
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.02
    # Neighbouring ids and neighbouring columns are uncorrelated.
    assert abs(np.corrcoef(a[:-1].ravel(), a[1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(a[:, :-1].ravel(), a[:, 1:].ravel())[0, 1]) < 0.02
    assert len(np.unique(a)) == a.size


def test_id_uniform_is_uniform_on_0_1():
    values = id_uniform(3, np.arange(25_000, dtype=np.int64), 4)  # 100k values
    assert values.min() >= 0.0 and values.max() < 1.0
    assert abs(values.mean() - 0.5) < 0.005
    assert abs(values.var() - 1 / 12) < 0.002
    deciles = np.histogram(values, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(deciles - 10_000) < 500), deciles


def test_id_normal_is_standard_normal():
    values = id_normal(3, some_ids(20_000), 5)  # 100k values
    assert np.all(np.isfinite(values))
    assert abs(values.mean()) < 0.015
    assert abs(values.std() - 1.0) < 0.015
    assert abs(np.mean(np.abs(values) < 1.0) - 0.6827) < 0.006
    assert abs(np.mean(np.abs(values) < 2.0) - 0.9545) < 0.004
    # Odd and even columns (cosine and sine halves) are both standard normal.
    for half in (values[:, 0::2], values[:, 1::2]):
        assert abs(half.mean()) < 0.02 and abs(half.std() - 1.0) < 0.02


def test_generators_accept_empty_batches_and_refuse_bad_ids():
    assert id_uniform(0, np.empty(0, np.int64), 4).shape == (0, 4)
    assert id_normal(0, [], 3).shape == (0, 3)
    with pytest.raises(InvalidArgument):
        id_uniform(0, np.arange(3, dtype=np.float64), 4)


# ---- initialize_ids ----------------------------------------------------------------------

INIT_CASES = [
    pytest.param({"name": "zeros"}, id="zeros"),
    pytest.param({"name": "constant", "value": -0.75}, id="constant"),
    pytest.param({"name": "uniform", "minval": -2.0, "maxval": 3.0}, id="uniform"),
    pytest.param({"name": "uniform"}, id="uniform-defaults"),
    pytest.param({"name": "normal", "mean": 1.0, "stddev": 0.5}, id="normal"),
    pytest.param({"name": "normal"}, id="normal-defaults"),
    pytest.param({"name": "glorot_uniform"}, id="glorot_uniform"),
]
NUM_ROWS = 1000


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("init", INIT_CASES)
def test_initial_row_of_an_id_does_not_depend_on_its_batch(init, dtype):
    """Batches larger than a block (the generator works a block of ids at a time), subsets
    straddling block boundaries, other orders, one id alone: always the same rows."""
    dim = 16
    block_ids = BLOCK_ELEMENTS // dim
    ids = some_ids(2 * block_ids + 100)
    component = Component.of(init)

    def initial(batch):
        return initialize_ids(component, 9, batch, dim, dtype, num_rows=NUM_ROWS)

    whole = initial(ids)
    assert whole.shape == (len(ids), dim) and whole.dtype == np.dtype(dtype)
    rng = np.random.default_rng(0)
    for positions in (np.arange(block_ids - 3, block_ids + 3),
                      np.arange(len(ids))[::-1],
                      rng.choice(len(ids), 777, replace=False),
                      np.array([block_ids])):
        np.testing.assert_array_equal(initial(ids[positions]), whole[positions])
    np.testing.assert_array_equal(initial([int(ids[-1])]), whole[-1:])
    assert initial(np.empty(0, np.int64)).shape == (0, dim)


@pytest.mark.parametrize("init", [p for p in INIT_CASES if p.id not in ("zeros", "constant")])
def test_initial_rows_change_with_the_seed(init):
    ids = np.arange(100, dtype=np.int64)
    a, b = (initialize_ids(Component.of(init), seed, ids, 8, "float32", num_rows=NUM_ROWS)
            for seed in (0, 1))
    assert np.mean(a == b) < 0.01


def test_zeros_and_constant_are_exact():
    ids = some_ids(50)
    zeros = initialize_ids(Component("zeros"), 0, ids, 3, "float16", num_rows=None)
    np.testing.assert_array_equal(zeros, np.zeros((50, 3), np.float16))
    constant = initialize_ids(Component.of({"name": "constant", "value": 0.1}), 0, ids, 3,
                              "float64", num_rows=None)
    np.testing.assert_array_equal(constant, np.full((50, 3), 0.1))
    default = initialize_ids(Component("constant"), 0, ids, 3, "float32", num_rows=None)
    np.testing.assert_array_equal(default, np.zeros((50, 3), np.float32))


@pytest.mark.parametrize("init, low, high", [
    ({"name": "uniform", "minval": -2.0, "maxval": 3.0}, -2.0, 3.0),
    ({"name": "uniform"}, -0.05, 0.05),
    ({"name": "glorot_uniform"}, -np.sqrt(6 / (NUM_ROWS + 4)), np.sqrt(6 / (NUM_ROWS + 4))),
], ids=["uniform", "uniform-defaults", "glorot_uniform"])
def test_uniform_initializers_fill_their_range(init, low, high):
    values = initialize_ids(Component.of(init), 2, some_ids(25_000), 4, "float64",
                            num_rows=NUM_ROWS)  # 100k values
    assert values.min() >= low and values.max() < high
    width = high - low
    assert values.min() < low + 0.001 * width and values.max() > high - 0.001 * width
    assert abs(values.mean() - (low + high) / 2) < 0.005 * width
    assert abs(values.std() - width / np.sqrt(12)) < 0.005 * width


def test_float32_uniform_rows_stay_within_the_bounds():
    values = initialize_ids(Component.of({"name": "uniform", "minval": 1.0, "maxval": 1.5}), 0,
                            some_ids(25_000), 4, "float32", num_rows=None)
    assert values.min() >= 1.0 and values.max() <= 1.5


@pytest.mark.parametrize("init, mean, stddev", [
    ({"name": "normal", "mean": 1.0, "stddev": 0.5}, 1.0, 0.5),
    ({"name": "normal"}, 0.0, 0.05),
], ids=["normal", "normal-defaults"])
def test_normal_initializer_has_its_mean_and_stddev(init, mean, stddev):
    values = initialize_ids(Component.of(init), 4, some_ids(12_500), 8, "float32",
                            num_rows=None)  # 100k values
    assert abs(values.mean() - mean) < 0.015 * stddev
    assert abs(values.std() - stddev) < 0.015 * stddev


def test_glorot_uniform_needs_the_number_of_rows():
    with pytest.raises(InvalidArgument) as info:
        initialize_ids(Component("glorot_uniform"), 0, np.arange(3), 4, "float32",
                       num_rows=None)
    assert info.value.code == "INVALID_ARGUMENT"
    # A larger table has a smaller limit.
    small, large = (initialize_ids(Component("glorot_uniform"), 0, np.arange(1000), 4,
                                   "float64", num_rows=rows) for rows in (10, 10_000))
    np.testing.assert_allclose(small / large, np.sqrt((10_000 + 4) / (10 + 4)))


def test_initialize_ids_writes_into_out():
    ids = some_ids(300)
    init = Component.of({"name": "normal", "stddev": 2.0})
    expected = initialize_ids(init, 1, ids, 6, "float32", num_rows=None)
    out = np.full((300, 6), np.nan, dtype=np.float32)
    assert initialize_ids(init, 1, ids, 6, "float32", num_rows=None, out=out) is out
    np.testing.assert_array_equal(out, expected)
    # A view into a larger table is written in place.
    table = np.zeros((500, 6), dtype=np.float32)
    initialize_ids(init, 1, ids, 6, "float32", num_rows=None, out=table[100:400])
    np.testing.assert_array_equal(table[100:400], expected)
    assert not table[:100].any() and not table[400:].any()
    with pytest.raises(ValueError):
        initialize_ids(init, 1, ids, 6, "float32", num_rows=None, out=np.empty((300, 5)))
    with pytest.raises(ValueError):
        initialize_ids(init, 1, ids, 6, "float32", num_rows=None,
                       out=np.empty((300, 6), np.float64))


@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_initialize_ids_temporaries_stay_small(init):
    """100,000 ids of dim 64: one float64 temporary of the whole batch would be 51 MB."""
    ids = np.arange(100_000, dtype=np.int64)
    out = np.empty((len(ids), 64), dtype=np.float32)
    tracemalloc.start()
    try:
        initialize_ids(Component(init), 0, ids, 64, "float32", num_rows=None, out=out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("init, kwargs", [
    ({"name": "xavier"}, {}),
    ({"name": "uniform", "stddev": 1.0}, {}),
    ({"name": "normal"}, {"dim": 0}),
    ({"name": "normal"}, {"dtype": "int32"}),
    ({"name": "normal"}, {"ids": np.arange(3, dtype=np.int32)}),
], ids=["unknown-initializer", "unknown-knob", "dim-0", "int-dtype", "int32-ids"])
def test_initialize_ids_refuses_bad_arguments(init, kwargs):
    args = {"ids": np.arange(3), "dim": 4, "dtype": "float32", **kwargs}
    with pytest.raises(InvalidArgument):
        initialize_ids(Component.of(init), 0, args["ids"], args["dim"], args["dtype"],
                       num_rows=10)
