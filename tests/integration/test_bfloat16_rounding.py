"""A float64 variable pulled, or a float64 gradient pushed, in bfloat16 is rounded to the
nearest bfloat16 value (ties to even), on every data path: rounded to float32 first and
then to bfloat16, a value just past the midpoint of two bfloat16 values would land on the
midpoint and then on the even one, the farther."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.tensors import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from ps_worker import PSClient

SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.fixture(params=["grpc", "shm", "grpc-staged"])
def data_path(request):
    return request.param


def nearest_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 rounded once, to nearest even, to bfloat16's 8 significant bits (normal
    range), as float64."""
    bits = np.ascontiguousarray(x, np.float64).view(np.uint64)
    drop = np.uint64(52 - 7)
    lowest_kept = (bits >> drop) & np.uint64(1)
    rounded = (bits + (np.uint64(1) << (drop - np.uint64(1))) - np.uint64(1) + lowest_kept)
    return ((rounded >> drop) << drop).view(np.float64)


def above_midpoints() -> np.ndarray:
    """For bfloat16 values b = 1 + k/128 (k = 0..31): a float64 just above the midpoint of b
    and the next bfloat16 value, whose nearest bfloat16 is that next value."""
    k = np.arange(32, dtype=np.float64)
    x = 1.0 + k / 128 + 2.0**-8 + 2.0**-30
    return np.concatenate([x, -x])


def test_reference_rounding_is_the_nearest_value():
    x = above_midpoints()
    near = nearest_bfloat16(x)
    assert np.all(np.abs(near) > np.abs(x))  # above a midpoint: rounded away from zero
    assert np.all(np.abs(near - x) < 2.0**-8)  # by less than half a step (1/128 here)
    # Where one rounding is all there is (float32 input), it agrees with the project's.
    f32 = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    ours = bfloat16_bits_to_float32(float32_to_bfloat16_bits(f32)).astype(np.float64)
    np.testing.assert_array_equal(nearest_bfloat16(f32.astype(np.float64)), ours)


def test_a_float64_variable_pulled_as_bfloat16_is_rounded_to_nearest(make_cluster, data_path):
    cluster = make_cluster(servers=2)
    x = above_midpoints()
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("d", shape=x.shape, dtype="float64", optimizer=SGD1)
        ps.push({"d": -x})  # zeros - (-x): the variable holds x exactly
        np.testing.assert_array_equal(ps.pull("d"), x)
        pulled = ps.pull("d", wire_dtype="bfloat16")
        assert pulled.dtype == np.float64
        wrong = np.flatnonzero(pulled != nearest_bfloat16(x))
        assert not wrong.size, (
            f"{wrong.size} of {x.size} values not rounded to the nearest bfloat16: "
            f"{x[wrong[0]]!r} came back {pulled[wrong[0]]!r}, nearest is "
            f"{nearest_bfloat16(x)[wrong[0]]!r}")


def test_a_float64_gradient_pushed_as_bfloat16_is_rounded_to_nearest(make_cluster, data_path):
    cluster = make_cluster(servers=2)
    x = above_midpoints()
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("d", shape=x.shape, dtype="float64", optimizer=SGD1)
        ps.push({"d": x}, wire_dtype="bfloat16")
        applied = -ps.pull("d")
        wrong = np.flatnonzero(applied != nearest_bfloat16(x))
        assert not wrong.size, (
            f"{wrong.size} of {x.size} gradients not rounded to the nearest bfloat16: "
            f"{x[wrong[0]]!r} was applied as {applied[wrong[0]]!r}, nearest is "
            f"{nearest_bfloat16(x)[wrong[0]]!r}")
