"""What declare accepts as knobs and seeds, and the values that follow: initializer knobs
that would make a variable's values NaN or infinite, and seeds beyond int64, are refused
with INVALID_ARGUMENT naming them (nothing could repair a non-finite variable: non-finite
gradients are refused); NumPy scalar knobs are taken as the numbers they are."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_worker import PSClient, RemoteError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype, init, knob", [
    ("float32", {"name": "normal", "stddev": INF}, "stddev"),
    ("float32", {"name": "normal", "stddev": NAN}, "stddev"),
    ("float32", {"name": "normal", "mean": NAN}, "mean"),
    ("float32", {"name": "constant", "value": NAN}, "value"),
    ("float32", {"name": "uniform", "minval": 0.0, "maxval": INF}, "maxval"),
    ("float16", {"name": "constant", "value": 1e6}, "value"),  # inf once stored in float16
], ids=["normal-stddev-inf", "normal-stddev-nan", "normal-mean-nan", "constant-nan",
        "uniform-maxval-inf", "constant-overflows-float16"])
def test_an_initializer_knob_that_makes_non_finite_values_is_invalid_argument(
        cluster, dtype, init, knob):
    with PSClient(cluster.coordinator_address) as ps:
        try:
            ps.declare("w", shape=(4, 3), dtype=dtype, init=init, seed=1)
        except RemoteError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert knob in str(error)
            assert "w" not in ps.refresh().variables
            return
        values = ps.pull("w")
        pytest.fail(f"declare accepted init={init} for a {dtype} variable; its initial values "
                    f"are {values.ravel()[:4]} (all finite: {bool(np.isfinite(values).all())})")


@pytest.mark.parametrize("knob_value", [np.float32(0.5), np.int64(1), np.float16(0.25)],
                         ids=["np.float32", "np.int64", "np.float16"])
def test_a_numpy_scalar_knob_is_taken_as_the_number_it_is(cluster, knob_value):
    """`lr = np.float32(...)` (a value read from a float32 array, say) is a number: the
    client refuses it with "knob 'lr' must be a number, got np.float32(0.5)"."""
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(5,), init={"name": "constant", "value": 1.0},
                   optimizer={"name": "sgd", "lr": knob_value}, seed=0)
        grad = np.arange(5, dtype=np.float32)
        ps.push({"w": grad})
        np.testing.assert_array_equal(
            ps.pull("w"), np.float32(1.0) - grad * np.float32(float(knob_value)))


@pytest.mark.parametrize("seed", [2**63, 2**64 + 5])
def test_a_seed_beyond_int64_is_invalid_argument_naming_the_seed(cluster, seed):
    """A negative seed gets INVALID_ARGUMENT "seed must be >= 0"; one past int64 (the wire
    type) escapes as a bare ValueError("Value out of range: ...") from protobuf."""
    with PSClient(cluster.coordinator_address) as ps:
        with pytest.raises(RemoteError) as caught:
            ps.declare("w", shape=(3,), init="normal", seed=seed)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "seed" in str(caught.value)
