"""PSClient at its edges: inputs a real user passes, and what comes back. Before:
- `out=` holding something other than an array (a dict for pull_rows, as pull takes it; None
  or a list as a value of pull's mapping) raised a bare AttributeError;
- non-integral shapes, dims and seeds were silently truncated (shape (2.5,) declared (2,));
- dimensions beyond int64 raised protobuf's bare ValueError "Value out of range";
- a spec whose default knobs are spelled out ({"name": "adam", "lr": 0.001} for "adam") was
  taken for another spec: FAILED_PRECONDITION on redeclaring, and a resumed job silently
  started the variable from its initializer instead of restoring it from the checkpoint.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps_worker import PSClient, RemoteError

SGD1 = {"name": "sgd", "lr": 1.0}


def refused(call) -> BaseException:
    """`call()` must be refused the documented way: RemoteError (INVALID_ARGUMENT) or
    ValueError, never a bare AttributeError/TypeError/KeyError."""
    try:
        call()
    except RemoteError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        return error
    except ValueError as error:
        return error
    except Exception as error:  # noqa: BLE001 - the point of the test
        pytest.fail(f"refused with a bare {type(error).__name__}: {error}")
    pytest.fail("accepted")


# ---- out= that is not what the call takes ---------------------------------------------------

@pytest.fixture
def table_client(make_cluster):
    cluster = make_cluster(servers=2)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("t", dim=4, num_rows=16, init="zeros", optimizer=SGD1)
        yield ps


@pytest.mark.parametrize("call", ["pull_rows", "pull_rows_async", "push_pull_rows"])
def test_a_mapping_as_the_out_of_a_row_pull_is_refused_and_nothing_changes(table_client, call):
    """pull(..., out=) takes {name: array}; pull_rows(..., out=) an array. A user who passes
    pull's form to pull_rows gets INVALID_ARGUMENT (as for any bad out), not AttributeError,
    and a push_pull_rows so refused applies nothing."""
    ps = table_client
    buffer = np.zeros((2, 4), np.float32)
    out = {"t": buffer}
    calls = {
        "pull_rows": lambda: ps.pull_rows("t", [1, 2], out=out),
        "pull_rows_async": lambda: ps.pull_rows_async("t", [1, 2], out=out).result(timeout=30),
        "push_pull_rows": lambda: ps.push_pull_rows("t", [1], np.ones((1, 4), np.float32),
                                                    [1, 2], out=out),
    }
    refused(calls[call])
    assert (buffer == 0).all()
    np.testing.assert_array_equal(ps.pull_rows("t", [1, 2]), np.zeros((2, 4), np.float32))


@pytest.mark.parametrize("value", [None, [0.0, 0.0, 0.0], (0.0, 0.0, 0.0)],
                         ids=["None", "list", "tuple"])
@pytest.mark.parametrize("call", ["pull", "push_pull"])
def test_an_out_mapping_whose_value_is_not_an_array_is_refused_and_nothing_changes(
        make_cluster, call, value):
    """pull documents ValueError for a bad `out` (or RemoteError): a value that is a list
    must get one of those, not AttributeError, and push_pull refuses it before anything is
    sent. None (a buffer not made yet) may instead be taken as "no buffer" (a fresh array);
    either way, no AttributeError."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("b", shape=(3,), init={"name": "constant", "value": 2.0}, optimizer=SGD1)
        calls = {"pull": lambda: ps.pull("b", out={"b": value}),
                 "push_pull": lambda: ps.push_pull({"b": np.ones(3, np.float32)}, "b",
                                                   out={"b": value})}
        expected = np.full(3, 2.0, np.float32)
        if value is None:
            try:
                got = calls[call]()
            except (RemoteError, ValueError):
                pass
            except Exception as error:  # noqa: BLE001 - the point of the test
                pytest.fail(f"refused with a bare {type(error).__name__}: {error}")
            else:
                if call == "push_pull":
                    expected = expected - 1.0  # taken: the push went too
                np.testing.assert_array_equal(got, expected)
        else:
            refused(calls[call])
        np.testing.assert_array_equal(ps.pull("b"), expected)


# ---- declarations: numbers that are not what they look like --------------------------------

@pytest.mark.parametrize("declare", [
    lambda ps: ps.declare("q", shape=(2.5,)),
    lambda ps: ps.declare("q", shape=(784, 10.5)),
    lambda ps: ps.declare("q", shape=(3,), seed=1.5),
    lambda ps: ps.declare_embedding("q", dim=2.7, num_rows=8),
    lambda ps: ps.declare_embedding("q", dim=4, num_rows=10.9),
    lambda ps: ps.declare_embedding("q", dim=4, num_rows=None, capacity=100.5),
], ids=["shape", "shape-2d", "seed", "dim", "num_rows", "capacity"])
def test_a_non_integral_shape_dim_or_seed_is_refused_not_truncated(make_cluster, declare):
    """int(2.5) == 2: shape (2.5,) declared a variable of shape (2,). Like float ids of a
    table (ps_common.rows.check_ids), a non-integral size is the caller's bug: refused with
    INVALID_ARGUMENT, nothing declared."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        try:
            spec = declare(ps)
        except RemoteError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert "q" not in ps.refresh().variables
            return
        pytest.fail(f"declared {spec.describe()} from a non-integral size")


@pytest.mark.parametrize("declare", [
    lambda ps: ps.declare("q", shape=(2**64,)),
    lambda ps: ps.declare("q", shape=(2**63, 1)),
    lambda ps: ps.declare_embedding("q", dim=4, num_rows=2**64),
    lambda ps: ps.declare_embedding("q", dim=4, num_rows=None, capacity=2**64),
], ids=["shape", "shape-2d", "num_rows", "capacity"])
def test_sizes_beyond_int64_are_invalid_argument_naming_the_variable(make_cluster, declare):
    """The docstring promises INVALID_ARGUMENT for a bad spec; protobuf's own ValueError
    ("Value out of range: 18446744073709551616") names neither the variable nor the field."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        with pytest.raises(RemoteError) as caught:
            declare(ps)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert "'q'" in str(caught.value)
        assert "q" not in ps.refresh().variables


# ---- the same spec, spelled two ways -------------------------------------------------------

SAME_SPECS = {
    "adam-defaults": ({"optimizer": "adam"}, {"optimizer": {"name": "adam", "lr": 0.001}}),
    "sgd-weight-decay-0": ({"optimizer": {"name": "sgd", "lr": 0.5}},
                           {"optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0}}),
    "uniform-defaults": ({"init": "uniform"},
                         {"init": {"name": "uniform", "minval": -0.05, "maxval": 0.05}}),
}


@pytest.mark.parametrize("case", sorted(SAME_SPECS))
def test_redeclaring_with_the_default_knobs_spelled_out_is_a_no_op(make_cluster, case):
    """README: a name alone takes the defaults, and declaring again with the same spec is a
    no-op. "adam" and {"name": "adam", "lr": 0.001} are the same optimizer (one worker may
    write one, another the other; a VariableSpec's own default is sgd(lr=0.01), declare's
    "sgd"): not FAILED_PRECONDITION."""
    first, second = SAME_SPECS[case]
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(3,), **first)
        ps.push({"w": np.ones(3, np.float32)})
        trained = ps.pull("w")
        ps.declare("w", shape=(3,), **second)
        np.testing.assert_array_equal(ps.pull("w"), trained)


@pytest.mark.parametrize("case", sorted(SAME_SPECS))
def test_a_resumed_job_that_spells_out_the_default_knobs_gets_its_trained_values_back(
        make_cluster, tmp_path, case):
    """A restore needs the checkpoint's spec to equal the declared one; spelled differently
    but equal in meaning, the variable silently started again from its initializer (nothing
    logged), and its trained values were no longer carried into later checkpoints."""
    first_kwargs, second_kwargs = SAME_SPECS[case]
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        ps.declare("w", shape=(3,), seed=1, **first_kwargs)
        ps.push({"w": np.ones(3, np.float32)})
        trained = ps.pull("w")
        first.checkpoint()
    first.stop()

    second = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(second.coordinator_address) as ps:
        ps.declare("w", shape=(3,), seed=1, **second_kwargs)
        np.testing.assert_array_equal(ps.pull("w"), trained)
