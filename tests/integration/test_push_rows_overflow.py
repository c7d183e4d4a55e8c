"""push_rows sums the gradients of repeated ids before sending. When finite gradients of
one id sum past float32, the client refuses the push with INVALID_ARGUMENT saying so (as
the server does: "the gradients of a repeated id sum to a non-finite value"), applies
nothing, and lets no NumPy overflow warning reach the caller."""

from __future__ import annotations

import warnings

import grpc
import numpy as np

from ps_worker import PSClient, RemoteError


def test_an_overflowing_sum_of_repeated_ids_is_refused_saying_so_without_warnings(cluster):
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=10, init="zeros",
                             optimizer={"name": "sgd", "lr": 1.0})
        ids = np.array([1, 1], np.int64)
        grads = np.full((2, 2), 3e38, np.float32)  # finite, as the caller sees them
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ps.push_rows("emb", ids, grads)
                raise AssertionError("the push was not refused")
            except RemoteError as error:
                refused = error
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "repeated" in str(refused), str(refused)
        assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], \
            [str(w.message) for w in caught]
        np.testing.assert_array_equal(ps.pull("emb"), np.zeros((10, 2), np.float32))
