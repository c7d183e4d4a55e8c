"""Argument checks of PSClient's public methods: a spec whose name, shape or seed has the
wrong type, and a wire dtype given as a NumPy dtype object rather than its name, are
RemoteError INVALID_ARGUMENT (as a bad spec and an unknown wire dtype are), never a bare
TypeError, ValueError or KeyError; nothing is sent or applied."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_worker import PSClient

SGD1 = {"name": "sgd", "lr": 1.0}


def expect_invalid(fn, *args, **kwargs) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        fn(*args, **kwargs)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    return caught.value


@pytest.mark.parametrize("kwargs", [dict(name=5, shape=(3,)),
                                    dict(name="q", shape="abc"),
                                    dict(name="q", shape=(3,), seed="x")],
                         ids=["name-not-str", "shape-not-ints", "seed-not-int"])
def test_declare_with_a_bad_spec_is_invalid_argument(make_cluster, kwargs):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        expect_invalid(ps.declare, **kwargs)
        assert set(ps.refresh().variables) == set()


@pytest.mark.parametrize("call", ["push", "pull", "push_rows", "pull_rows"])
def test_a_numpy_dtype_as_wire_dtype_is_taken_or_refused_with_invalid_argument(make_cluster,
                                                                              call):
    cluster = make_cluster(servers=2)
    f16 = np.dtype("float16")
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), optimizer=SGD1)
        ps.declare_embedding("t", dim=4, num_rows=16, init="zeros", optimizer=SGD1)
        ones = np.ones((8, 4), np.float32)
        calls = {
            "push": lambda: ps.push({"w": ones}, wire_dtype=f16),
            "pull": lambda: ps.pull("w", wire_dtype=f16),
            "push_rows": lambda: ps.push_rows("t", [1, 2], ones[:2], wire_dtype=f16),
            "pull_rows": lambda: ps.pull_rows("t", [1, 2], wire_dtype=f16),
        }
        try:
            calls[call]()  # taken as "float16": fine
        except RemoteError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
