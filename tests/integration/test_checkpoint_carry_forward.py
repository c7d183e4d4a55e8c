"""A resumed job that declares its variables in more than one call keeps the trained values of
those it declares late: a checkpoint taken before then (on a new variable, say) holds the
variables of the checkpoint before it that the job has not declared yet, their files linked
into it, so pruning the older checkpoint loses nothing."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.checkpoints import (
    CARRIED_PREFIX, CheckpointError, checkpoint_ids, newest_good, verify,
)
from ps_worker import PSClient

SHARED_MEMORY = False
SGD1 = {"name": "sgd", "lr": 1.0}


def declare(ps: PSClient, name: str, rows: int = 4) -> None:
    ps.declare(name, shape=(rows, 2), init="zeros", optimizer=SGD1)


def test_a_variable_declared_after_a_newer_checkpoint_comes_back_trained(make_cluster, tmp_path):
    first = make_cluster(servers=2, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        declare(ps, "a")
        declare(ps, "b", rows=6)
        ps.declare_embedding("t", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        ps.push({"a": np.ones((4, 2), np.float32), "b": np.full((6, 2), 2.0, np.float32)})
        ps.push_rows("t", np.array([3, 7]), np.ones((2, 2), np.float32))
        first.checkpoint()
    first.stop()

    resumed = make_cluster(servers=2, checkpoint_dir=tmp_path)
    resumed.coordinator.checkpointer._keep = 1  # --keep-checkpoints 1: the first one goes
    with PSClient(resumed.coordinator_address) as ps:
        declare(ps, "a")
        declare(ps, "c")  # new
        taken = resumed.checkpoint()
        assert checkpoint_ids(tmp_path) == [taken.id]
        assert set(taken.variables) == {"a", "b", "c", "t"}
        assert any(name.startswith(CARRIED_PREFIX) for name in taken.files)
        verify(tmp_path / taken.id)

        declare(ps, "b", rows=6)
        ps.declare_embedding("t", dim=2, num_rows=10, init="zeros", optimizer=SGD1)
        np.testing.assert_array_equal(ps.pull("a"), np.full((4, 2), -1.0, np.float32))
        np.testing.assert_array_equal(ps.pull("b"), np.full((6, 2), -2.0, np.float32))
        rows = ps.pull_rows("t", np.array([3, 7, 0]))
        np.testing.assert_array_equal(rows, [[-1, -1], [-1, -1], [0, 0]])

        # Declared now, they are saved from the servers again: nothing is carried.
        again = resumed.checkpoint()
        assert not any(name.startswith(CARRIED_PREFIX) for name in again.files)
        assert set(again.variables) == {"a", "b", "c", "t"}


def test_carried_variables_are_carried_again_until_declared(make_cluster, tmp_path):
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        declare(ps, "a")
        declare(ps, "b")
        ps.push({"b": np.ones((4, 2), np.float32)})
        first.checkpoint()
    first.stop()

    resumed = make_cluster(servers=1, checkpoint_dir=tmp_path)
    resumed.coordinator.checkpointer._keep = 1
    with PSClient(resumed.coordinator_address) as ps:
        declare(ps, "a")
        second = resumed.checkpoint()
        third = resumed.checkpoint()  # carries what the second carried, under the same name
        assert sorted(n for n in third.files if n.startswith(CARRIED_PREFIX)) == \
            sorted(n for n in second.files if n.startswith(CARRIED_PREFIX))
        assert checkpoint_ids(tmp_path) == [third.id]
        declare(ps, "b")
        np.testing.assert_array_equal(ps.pull("b"), np.full((4, 2), -1.0, np.float32))


def resumed_with_b_carried(make_cluster, tmp_path):
    """A first run checkpoints a and b; a resumed run declares a only and checkpoints: b is
    carried into its checkpoint. Returns (older, newest) manifests."""
    first = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(first.coordinator_address) as ps:
        declare(ps, "a")
        declare(ps, "b")
        ps.push({"a": np.ones((4, 2), np.float32), "b": np.ones((4, 2), np.float32)})
        older = first.checkpoint()
    first.stop()
    resumed = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(resumed.coordinator_address) as ps:
        declare(ps, "a")
        ps.push({"a": np.ones((4, 2), np.float32)})
        newest = resumed.checkpoint()
    resumed.stop()
    return older, newest


def alter(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_altered_carried_file_takes_only_the_carried_variables_out(make_cluster, tmp_path):
    older, newest = resumed_with_b_carried(make_cluster, tmp_path)
    (carried,) = [name for name in newest.files if name.startswith(CARRIED_PREFIX)]
    alter(tmp_path / newest.id / carried)  # the older checkpoint's own file too (one inode)

    manifest, skipped = newest_good(tmp_path)
    assert (manifest.id, skipped) == (newest.id, [])  # its own variables and progress hold
    assert set(manifest.variables) == {"a"}
    with pytest.raises(CheckpointError):
        verify(tmp_path / older.id)  # the older one's own file is altered: it is bad

    again = make_cluster(servers=1, checkpoint_dir=tmp_path)
    with PSClient(again.coordinator_address) as ps:
        declare(ps, "a")
        declare(ps, "b")
        np.testing.assert_array_equal(ps.pull("a"), np.full((4, 2), -2.0, np.float32))
        np.testing.assert_array_equal(ps.pull("b"), np.zeros((4, 2), np.float32))


def test_a_file_altered_before_it_is_carried_is_not_carried(make_cluster, tmp_path):
    older, newest = resumed_with_b_carried(make_cluster, tmp_path)
    (carried,) = [name for name in newest.files if name.startswith(CARRIED_PREFIX)]
    resumed = make_cluster(servers=1, checkpoint_dir=tmp_path)  # found newest good, with b
    with PSClient(resumed.coordinator_address) as ps:
        declare(ps, "a")
        alter(tmp_path / newest.id / carried)  # then b's file is altered
        taken = resumed.checkpoint()
    assert set(taken.variables) == {"a"}
    assert not any(name.startswith(CARRIED_PREFIX) for name in taken.files)
    verify(tmp_path / taken.id)
