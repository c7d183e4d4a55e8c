"""Initial values that must fit their dtype, and a capped table restored onto more servers.

- Initializer knobs "that make values NaN or infinite in the variable's dtype" are refused,
  naming the knob (ps_server.initializers): nothing could repair such a variable, since
  non-finite gradients are refused. A normal initializer's stddev was never checked, and
  uniform's width was checked against the stored dtype rather than the one its values are
  made in (a float16 range of +-60000 was refused).
- A dynamic table's `capacity` holds after a restore onto more servers, where one shard
  may be dealt more than its share of the saved rows.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.shardmap import Component, VariableSpec
from ps_server.initializers import initialize_ids, initialize_rows, validate_initializer
from ps_worker import PSClient, RemoteError

SHARED_MEMORY = False

# ---- initial values ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype, init", [
    # Every |z| > 0.066 of a standard normal times 1e6 is past float16's 65504.
    ("float16", {"name": "normal", "stddev": 1e6}),
    # Half the values (z > 0.4) are past float32's 3.4e38.
    ("float32", {"name": "normal", "mean": 3e38, "stddev": 1e38}),
    # A mean that fits float16, and one stddev more that does not.
    ("float16", {"name": "normal", "mean": 65000.0, "stddev": 1000.0}),
], ids=["float16-stddev", "float32-mean-and-stddev", "float16-mean-and-stddev"])
def test_a_normal_initializer_whose_values_overflow_is_refused(dtype, init):
    spec = VariableSpec("w", (4, 3), dtype=dtype, initializer=Component.of(init), seed=1)
    try:
        validate_initializer(spec)
    except InvalidArgument as error:
        assert "stddev" in error.message or "mean" in error.message
        return
    with np.errstate(over="ignore", invalid="ignore"):
        values = initialize_rows(spec, 0, 4)
    assert np.isfinite(values).all(), (
        f"{init} passed validate_initializer for a {dtype} variable, but its initial "
        f"values are {values.ravel()}")


def test_a_dynamic_tables_normal_rows_that_overflow_are_refused():
    """The same for an embedding table (rows made per id on first use)."""
    init = {"name": "normal", "stddev": 1e6}
    spec = VariableSpec("t", (0, 4), dtype="float16", initializer=Component.of(init), seed=1,
                        kind="embedding")
    try:
        validate_initializer(spec)
    except InvalidArgument as error:
        assert "stddev" in error.message
        return
    with np.errstate(over="ignore", invalid="ignore"):
        rows = initialize_ids(spec.initializer, spec.seed, np.arange(3, dtype=np.int64), 4,
                              "float16", num_rows=None)
    assert np.isfinite(rows).all(), f"initial rows {rows.ravel()}"


@pytest.mark.parametrize("kind, shape", [("dense", (4, 3)), ("embedding", (0, 3))])
def test_a_float16_uniform_range_whose_every_value_fits_float16_is_accepted(kind, shape):
    """The width check refuses uniform(-60000, 60000) for float16 because 120000 does not fit
    float16, but the width is never held in float16: dense values are generated in float32
    (and tables' in float64) and only the results, all within +-60000, are rounded to
    float16."""
    init = Component.of({"name": "uniform", "minval": -60000.0, "maxval": 60000.0})
    spec = VariableSpec("w", shape, dtype="float16", initializer=init, seed=1, kind=kind)
    validate_initializer(spec)  # InvalidArgument: "maxval - minval (120000) does not fit"
    values = (initialize_rows(spec, 0, 4) if kind == "dense" else initialize_ids(
        init, 1, np.arange(4, dtype=np.int64), 3, "float16", num_rows=None))
    assert np.isfinite(values).all() and np.abs(values).max() <= 60000


def test_declare_refuses_a_normal_stddev_that_makes_the_values_infinite(cluster):
    """Through PSClient, as tests/integration/test_declare_knob_checks.py does for an
    infinite stddev: a finite one past float16's range is accepted, and the variable's
    values come back as +-inf."""
    with PSClient(cluster.coordinator_address) as ps:
        try:
            ps.declare("w", shape=(4, 3), dtype="float16",
                       init={"name": "normal", "stddev": 1e6}, seed=1)
        except RemoteError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "stddev" in str(error)
            return
        values = ps.pull("w")
        assert np.isfinite(values).all(), f"declared values {values.ravel()}"


# ---- a capped table restored onto more servers ----------------------------------------


def _ids_on_shard(shard: int, of: int, count: int, start: int) -> np.ndarray:
    """`count` ids from `start` on whose hash a dynamic table puts on shard `shard` of `of`
    (ps_common.shardmap.owners_of: a pure function of the id)."""
    from ps_common.rows import hash_ids

    candidates = np.arange(start, start + 64 * count, dtype=np.int64)
    mine = candidates[hash_ids(candidates) % np.uint64(of) == shard]
    assert len(mine) >= count
    return mine[:count]


def test_a_dynamic_table_restored_onto_more_servers_never_exceeds_its_capacity(
        make_cluster, tmp_path):
    """README, Embedding tables: `capacity` (rows, shared by the table's shards) evicts the
    least recently used rows so that the table never exceeds it; checkpoints restore
    tables onto any number of servers. Rows saved by one server are dealt by id hash to
    the new shards, and a shard may get more than its share of the capacity: it keeps
    them all (DynamicRows.adopt evicts nothing), while the other shards still fill their
    own shares."""
    capacity = 8
    crowded = _ids_on_shard(0, 2, 6, start=0)  # all on shard 0 once there are 2 servers

    def declare(ps):
        ps.declare_embedding("d", dim=2, num_rows=None, capacity=capacity, init="zeros",
                             optimizer={"name": "sgd", "lr": 1.0})

    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        declare(ps)
        ps.push_rows("d", crowded, np.ones((6, 2), np.float32))  # 6 rows of 8: within it
        first.checkpoint()
    first.stop()

    second = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(second.coordinator_address) as ps:
        declare(ps)
        # The restored rows are back (a request for more than a shard's share is refused).
        np.testing.assert_array_equal(ps.pull_rows("d", crowded[:4]),
                                      -np.ones((4, 2), np.float32))
        ps.pull_rows("d", _ids_on_shard(1, 2, 4, start=10**6))  # 4 new rows on shard 1
        held = sum(t.rows for s in second.servers for t in s.store.table_stats()
                   if t.variable == "d")
        assert held <= capacity, f"the table holds {held} rows, capacity {capacity}"
