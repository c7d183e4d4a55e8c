"""The data path while the cluster changes under it, each test with the promise (README) it
checks: exactly-once beside a moved part, and errors while a restarted coordinator knows
nothing yet (a shared-memory reader of a killed server: tests/system).

In-process clusters come from the `make_cluster` fixture (tests/conftest.py). Every wait is
bounded."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ps_common.status import RemoteError
from ps_server.coordinator.app import Coordinator
from ps_server.testing import wait_until
from ps_worker import PSClient, RetryPolicy

SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


# ---- a push whose server never moved is applied once, whatever moved beside it ----------------

def test_a_part_applied_by_a_server_that_never_moved_is_not_applied_again_beside_a_moved_part(
        make_cluster, tmp_path):
    """README, "What survives what": exactly-once holds for a server that stays put; only a
    part re-sent to a shard's *new* server may be applied twice. Here `x` never leaves
    ps-keep. The push {x, y} reaches ps-keep, which applies x, and its answer is lost (and
    the retries of its bounded policy find the server unreachable); meanwhile y's server is
    lost and y moves, from the checkpoint, to ps-keep. The client re-sends the failed parts
    with the new map: x as it went before (same shards, same sequence: ps-keep answers
    'duplicate'), and y in a call of its own, never x and y under one new sequence, which
    ps-keep could not tell from a new push."""
    cluster = make_cluster(servers=2, shared_memory=False, checkpoint_dir=tmp_path,
                           server_timeout_s=0.5)
    bounded = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    with PSClient(cluster.coordinator_address, shared_memory=False, retry=bounded) as ps:
        ps.declare("x", shape=(4,), init="zeros", optimizer=SGD1)
        ps.declare("y", shape=(4,), init="zeros", optimizer=SGD1)
        keep_id = ps.shard_map.shards_of("x")[0].server_id
        lost_id = ps.shard_map.shards_of("y")[0].server_id
        assert keep_id != lost_id
        keep = next(s for s in cluster.servers if s.server_id == keep_id)
        lost = next(s for s in cluster.servers if s.server_id == lost_id)
        cluster.checkpoint()  # y can move from here
        lost.stop(grace_s=0.2)
        state = cluster.coordinator.state

        def y_moves_to_keep_while_the_answer_is_lost():
            wait_until(lambda: state.shard_map.shards["y"][0].server_id == keep_id,
                       "y moved to the surviving server", WAIT_S)
            wait_until(lambda: keep.store.epoch >= state.shard_map.epoch,
                       "the surviving server holds the new map", WAIT_S)
            # The two retries of the bounded policy find the server unreachable too.
            cluster.faults.fail_next("Push", bounded.max_attempts - 1)

        # The first Push any server sees is x's on ps-keep (y's server is stopped).
        cluster.faults.drop_response_next("Push", 1,
                                          then=y_moves_to_keep_while_the_answer_is_lost)
        ps.push({"x": np.ones(4, np.float32), "y": np.ones(4, np.float32)})

        assert {s.server_id for s in ps.shard_map.shards_of("y")} == {keep_id}
        np.testing.assert_array_equal(ps.pull("y"), -np.ones(4, np.float32))
        # x was pushed once: SGD lr 1 from zeros gives -1, not -2.
        np.testing.assert_array_equal(ps.pull("x"), -np.ones(4, np.float32))


# ---- errors are RemoteError, also while a restarted coordinator knows nothing yet -------------

def test_a_push_whose_server_is_away_while_the_coordinator_restarts_raises_remote_error(
        make_cluster):
    """README, "Errors": errors are ps_worker.RemoteError with .code() a grpc.StatusCode.
    The coordinator and the server holding `w` go down together (one machine); the
    coordinator comes back first, before any server has registered with it again, so its
    map is empty (at an epoch higher than any before). A push of `w` finds its server
    unreachable and asks the coordinator whether the map moved: a map that places none of
    its variables is no move (the server's UNAVAILABLE stands), never a re-route through it
    that would raise a server-side catalogue error out of `push`."""
    cluster = make_cluster(servers=1, shared_memory=False)
    bounded = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)
    with PSClient(cluster.coordinator_address, shared_memory=False, retry=bounded) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})

        (server,) = cluster.servers
        port = cluster.coordinator.port
        cluster.coordinator.stop(grace_s=0.2)
        server.stop(grace_s=0.2)
        cluster.servers = []  # stopped: nothing for the fixture to stop
        cluster.coordinator = Coordinator(replace(
            cluster._coordinator_config, port=port, recovery_grace_s=3.0)).start()

        try:
            ps.push({"w": np.ones(4, np.float32)})
        except RemoteError:
            pass  # UNAVAILABLE (it waits for the map to be rebuilt) or NOT_FOUND: an API error
        except Exception as error:  # noqa: BLE001 - what the test is about
            pytest.fail(f"push raised {type(error).__module__}.{type(error).__name__} "
                        f"({error}), not RemoteError")
        else:
            pytest.fail("the push of a variable whose only server is away returned")
