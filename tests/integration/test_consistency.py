"""The consistency modes through PSClient against in-process clusters (ps_common.consistency,
ps_server.consistency): sync trains exactly as one process applying the average of every
client's gradient each step (SGD and Adam, variables split over two servers); ssp:1 keeps a
fast client within one step of a straggler; a client that leaves, is closed or is replaced
while others wait in sync lets their step complete; a late sync gradient is dropped and
counted; bad modes and mode conflicts are refused; async clients never wait.

Several PSClients are driven from threads; every thread is joined with a bound, and every
wait is a bounded wait for an event or a predicate, never a sleep."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import numpy as np
import pytest

from ps_server.optimizers import OPTIMIZERS
from ps_server.testing import wait_until
from ps_worker import PSClient, RemoteError
from ps_worker.client import StepStats

WAIT_S = 30.0  # bound of every wait; never reached when the code is right
SPLIT_BYTES = 64  # every test variable of 8 x 4 float32 (128 bytes) is cut in two shards


@pytest.fixture(params=["grpc", "shm"])
def data_path(request):
    """Every test here runs over gRPC and with shared memory offered (see test_pull_push):
    steps are carried and waited for the same way on both."""
    return request.param


pytestmark = pytest.mark.usefixtures("data_path")


# ---- helpers ------------------------------------------------------------------------------

def pushes(cluster) -> int:
    """Push calls that reached a server so far (each server's part of a push is one)."""
    return cluster.faults.calls.get("Push", 0)


def expect_error(code: grpc.StatusCode, fn, *args, **kwargs) -> RemoteError:
    with pytest.raises(RemoteError) as caught:
        fn(*args, **kwargs)
    assert caught.value.code() == code, caught.value
    return caught.value


@contextlib.contextmanager
def sync_pair(cluster):
    """Two clients taking part in sync steps of two (replicas=2), and "w" of 4 (SGD, lr 1)."""
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        a.declare("w", (4,), optimizer=sgd(1.0))
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        yield a, b


def together(spawn, *fns) -> list:
    """Run every fn() in its own thread at once; their results, or the first error."""
    calls = [spawn(fn) for fn in fns]
    return [call.result() for call in calls]


def split_over_both_servers(ps: PSClient, name: str) -> None:
    shards = ps.refresh().shards_of(name)
    assert len({s.server_id for s in shards}) == 2, shards


def sgd(lr: float) -> dict:
    return {"name": "sgd", "lr": lr}


# ---- sync: one process's training, averaged ----------------------------------------------

N_STEPS = 5
SGD_LR = 0.1
ADAM = {"name": "adam", "lr": 0.05}
# Client i's gradient of a variable whose pulled values are v, at step t: v * SCALE[i] +
# (t + 1) * SHIFT[i]. It depends on the values the client saw, so stale or partly updated
# values show in the result; the average (v * 0.1 + (t + 1)) stays far from 0, where Adam's
# first steps would amplify float32 rounding.
SCALE = (0.5, -0.3)
SHIFT = (1.5, 0.5)


def gradient(client: int, values: np.ndarray, step: int) -> np.ndarray:
    return (values * np.float32(SCALE[client]) + np.float32((step + 1) * SHIFT[client])).astype(
        np.float32)


def reference(start: dict[str, np.ndarray], steps: int) -> dict[str, np.ndarray]:
    """One process, in float64: each step, the average of both clients' gradients (computed
    from the same values) applied once; w by SGD, m by Adam (ps_server.optimizers' formula
    and defaults)."""
    w, m = start["w"].astype(np.float64), start["m"].astype(np.float64)
    knobs = {**OPTIMIZERS["adam"], **{k: v for k, v in ADAM.items() if k != "name"}}
    b1, b2, eps, lr = knobs["beta1"], knobs["beta2"], knobs["eps"], knobs["lr"]
    first, second = np.zeros_like(m), np.zeros_like(m)
    for step in range(steps):
        gw = sum(w * SCALE[i] + (step + 1) * SHIFT[i] for i in (0, 1)) / 2
        gm = sum(m * SCALE[i] + (step + 1) * SHIFT[i] for i in (0, 1)) / 2
        w = w - SGD_LR * gw
        t = step + 1  # every shard gets one update per step
        first = b1 * first + (1 - b1) * gm
        second = b2 * second + (1 - b2) * gm * gm
        m = m - lr * (first / (1 - b1 ** t)) / (np.sqrt(second / (1 - b2 ** t)) + eps)
    return {"w": w, "m": m}


def step_gate(server):
    """A server's StepGate: ParameterServer offers no public handle to it (used only to
    read the steps it applied)."""
    return server._servicer.steps


def test_sync_two_clients_train_exactly_as_one_process_averaging_their_gradients(
        make_cluster, spawn):
    cluster = make_cluster(servers=2, split_threshold_bytes=SPLIT_BYTES)
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", (8, 4), init={"name": "uniform", "minval": -1.0, "maxval": 1.0},
                      optimizer=sgd(SGD_LR), seed=1)
        setup.declare("m", (8, 4), init={"name": "uniform", "minval": -1.0, "maxval": 1.0},
                      optimizer=ADAM, seed=2)
        for name in ("w", "m"):
            split_over_both_servers(setup, name)
        start = setup.pull(["w", "m"])
    cluster.wait_until_synced()

    final_steps: dict[int, dict[str, int]] = {}

    def train(client: int, ps: PSClient) -> None:
        if client == 1:  # joins late: client 0's first push already waits at both servers
            wait_until(lambda: pushes(cluster) == 2, "client 0's push of step 0")
        ps.join_steps("sync", replicas=2)  # so the first step waits for the second client
        assert ps.mode == "sync"
        for step in range(N_STEPS):
            values = ps.pull(["w", "m"])
            ps.push({name: gradient(client, v, step) for name, v in values.items()})
        # The step it would compute next at each server (PSClient keeps it privately).
        final_steps[client] = dict(ps._steps)
        ps.leave_steps()

    with PSClient(cluster.coordinator_address) as one, \
            PSClient(cluster.coordinator_address) as two:
        together(spawn, lambda: train(0, one), lambda: train(1, two))
        final = one.pull(["w", "m"])
        expected = reference(start, N_STEPS)
        np.testing.assert_allclose(final["w"], expected["w"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final["m"], expected["m"], rtol=1e-5, atol=1e-5)
        for ps in (one, two):
            assert ps.step_stats.staleness_max == 0 and ps.step_stats.dropped_stale == 0
            assert ps.mode == "async"  # left
    servers = sorted(s.server_id for s in cluster.servers)
    assert final_steps[0] == final_steps[1] == {server: N_STEPS for server in servers}
    # Both servers applied one averaged update per step: N, not one per gradient.
    assert [step_gate(s).current_step() for s in cluster.servers] == [N_STEPS, N_STEPS]
    assert [step_gate(s).dropped_stale for s in cluster.servers] == [0, 0]


# ---- ssp:K: a fast client and a straggler -------------------------------------------------

SSP_STEPS = 12


def test_ssp_1_keeps_a_fast_client_within_one_step_of_a_straggler(make_cluster, spawn):
    cluster = make_cluster(servers=2, split_threshold_bytes=SPLIT_BYTES)
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", (8, 4), optimizer=sgd(1.0))
        split_over_both_servers(setup, "w")
    cluster.wait_until_synced()
    joined = threading.Barrier(2, timeout=WAIT_S)
    slow_started = slow_done = 0  # the straggler's pushes begun / returned
    gaps: list[tuple[int, int]] = []  # at each step the fast client starts

    def fast(ps: PSClient) -> None:
        ps.join_steps("ssp:1")
        joined.wait()
        for done in range(SSP_STEPS):  # done: the steps it finished before this one
            gaps.append((done - slow_started, done - slow_done))
            ps.push({"w": np.ones((8, 4), np.float32)})
        ps.leave_steps()

    def slow(ps: PSClient) -> None:
        nonlocal slow_started, slow_done
        ps.join_steps("ssp:1")
        joined.wait()
        # Start once the fast client's pushes of steps 0 and 1 reached both servers: ssp:1
        # must hold it in its push of step 1 until this client finishes step 0.
        wait_until(lambda: pushes(cluster) >= 4, "the fast client's first two pushes")
        for _ in range(SSP_STEPS):
            slow_started += 1
            ps.push({"w": np.full((8, 4), 1000.0, np.float32)})
            slow_done += 1
            time.sleep(0.01)  # a straggler
        ps.leave_steps()

    with PSClient(cluster.coordinator_address) as quick, \
            PSClient(cluster.coordinator_address) as straggler:
        together(spawn, lambda: fast(quick), lambda: slow(straggler))
        # A push of step t returns once no live client is more than 1 step behind, so when
        # the fast client starts a step, the straggler has at least begun every push but
        # its last 1: the gap to the pushes it began is at most 1, and was 1 at the start
        # (the straggler waited for two fast pushes). Its pushes that returned may lag one
        # more (one may be applied but not yet answered): at most 1 + 1.
        assert max(started for started, _ in gaps) == 1, gaps
        assert max(returned for _, returned in gaps) <= 2, gaps
        assert quick.step_stats.wait_s > 0
        assert quick.step_stats.staleness_max == 1  # its step 0 went 1 ahead, never more
        assert straggler.step_stats.staleness_max <= 1
        assert quick.step_stats.dropped_stale == straggler.step_stats.dropped_stale == 0
        # Every push applied exactly once (SGD, lr 1: the value is minus their sum).
        np.testing.assert_array_equal(quick.pull("w"),
                                      np.full((8, 4), -1001.0 * SSP_STEPS, np.float32))


# ---- sync: a client gone while another waits ---------------------------------------------

@pytest.mark.parametrize("how", ["leave_steps", "close", "replaced"])
def test_sync_a_client_gone_while_another_waits_lets_its_step_complete(
        make_cluster, spawn, how):
    cluster = make_cluster(servers=2, split_threshold_bytes=SPLIT_BYTES)
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", (8, 4), init={"name": "constant", "value": 1.0},
                      optimizer=sgd(0.5))
        split_over_both_servers(setup, "w")
    cluster.wait_until_synced()
    grad = {n: np.full((8, 4), float(n), np.float32) for n in (1, 3, 4, 8)}
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        together(spawn, lambda: a.push({"w": grad[1]}), lambda: b.push({"w": grad[3]}))
        np.testing.assert_array_equal(a.pull("w"), np.full((8, 4), 0.0, np.float32))
        before = pushes(cluster)
        waiting = spawn(a.push, {"w": grad[4]})
        wait_until(lambda: pushes(cluster) == before + 2, "a's push of step 1 at both servers")
        assert not waiting.done.is_set()  # b has not pushed step 1
        if how == "leave_steps":
            b.leave_steps()
        elif how == "close":
            # Closing without leave_steps, as a process that ends would: the coordinator
            # retires the client's incarnation (ReleaseClient) and the servers, told by
            # their heartbeats, drop it from the steps. (In-process PSClients have no
            # heartbeat to miss: closing is how one is declared gone here.)
            b.close()
        else:
            # The same client id registers again (a restarted trainer): the coordinator
            # retires the old incarnation; the new one has not joined the steps.
            with PSClient(cluster.coordinator_address, client_id=b.client_id) as again:
                assert again.incarnation > b.incarnation
        waiting.result()
        a.push({"w": grad[8]})  # alone from now on: applied at once
        # 1 - 0.5 * (1 + 3) / 2 = 0, then - 0.5 * 4 - 0.5 * 8
        np.testing.assert_array_equal(a.pull("w"), np.full((8, 4), -6.0, np.float32))
        assert a.step_stats.staleness_max == 0 and a.step_stats.dropped_stale == 0
    assert [step_gate(s).current_step() for s in cluster.servers] == [3, 3]


# ---- sync: late and retried gradients ------------------------------------------------------

def test_sync_a_gradient_for_a_step_already_applied_is_dropped_and_counted(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", (4,), optimizer=sgd(1.0))
        ps.join_steps("sync")
        release = threading.Event()
        cluster.faults.hold_next("Push", release)
        try:
            # Two pushes in flight carry the same step (the first has not answered). The
            # first is held at the server until the second's step has been applied.
            late = ps.push_async({"w": np.full(4, 100.0, np.float32)})
            wait_until(lambda: pushes(cluster) == 1, "the first push held at the server")
            ps.push({"w": np.ones(4, np.float32)})
        finally:
            release.set()
        late.result(timeout=WAIT_S)  # dropped, not an error
        assert ps.step_stats.dropped_stale == 1
        assert step_gate(cluster.servers[0]).dropped_stale == 1
        np.testing.assert_array_equal(ps.pull("w"), np.full(4, -1.0, np.float32))
        ps.push({"w": np.ones(4, np.float32)})  # the next step goes on
        np.testing.assert_array_equal(ps.pull("w"), np.full(4, -2.0, np.float32))
        assert ps.step_stats.dropped_stale == 1


def test_sync_a_push_whose_answer_was_lost_is_applied_once(make_cluster, spawn):
    cluster = make_cluster(servers=1)
    with sync_pair(cluster) as (a, b):
        # The first push to run is applied in the step's average, then its answer is lost:
        # its retry must find it applied (the ledger entry came with the step).
        cluster.faults.drop_response_next("Push", 1)
        together(spawn, lambda: a.push({"w": np.full(4, 1.0, np.float32)}),
                 lambda: b.push({"w": np.full(4, 3.0, np.float32)}))
        assert pushes(cluster) == 3  # one retry
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -2.0, np.float32))
        together(spawn, lambda: a.push({"w": np.full(4, 5.0, np.float32)}),
                 lambda: b.push({"w": np.full(4, 7.0, np.float32)}))
        np.testing.assert_array_equal(a.pull("w"), np.full(4, -8.0, np.float32))
        assert a.step_stats.dropped_stale == b.step_stats.dropped_stale == 0
    assert step_gate(cluster.servers[0]).current_step() == 2


# ---- bad input -----------------------------------------------------------------------------


def test_sync_a_step_whose_sum_would_overflow_is_averaged_all_the_same(make_cluster, spawn):
    """Two finite gradients of 3e38 sum past float32's largest value, but their average is
    3e38: the step is applied as any other (ps_server.consistency.StepSum)."""
    cluster = make_cluster(servers=1)
    with sync_pair(cluster) as (a, b):
        big = np.full(4, 3e38, np.float32)
        together(spawn, lambda: a.push({"w": big}), lambda: b.push({"w": big}))
        np.testing.assert_array_equal(a.pull("w"), -big)
        together(spawn, lambda: a.push({"w": np.full(4, 1.0, np.float32)}),
                 lambda: b.push({"w": np.full(4, 3.0, np.float32)}))
        np.testing.assert_array_equal(a.pull("w"), -big - 2.0)


def test_sync_a_split_variable_whose_sum_would_overflow_on_one_server_is_applied_on_all(
        make_cluster, spawn):
    """Each server averages its own shards. A server that refused a step whose sum
    overflowed refused only its shards while the variable's other servers applied theirs,
    and every push still got INVALID_ARGUMENT, which says nothing was applied."""
    cluster = make_cluster(servers=2, split_threshold_bytes=64)  # (8, 4) float32: 2 shards
    with PSClient(cluster.coordinator_address) as a, PSClient(cluster.coordinator_address) as b:
        a.declare("w", (8, 4), init="zeros", optimizer=sgd(1.0))
        shards = a.refresh().shards_of("w")
        assert len({s.server_id for s in shards}) == 2
        for ps in (a, b):
            ps.join_steps("sync", replicas=2)
        grad = np.ones((8, 4), np.float32)
        grad[shards[0].row_start:shards[0].row_stop] = 3e38  # two of them overflow float32
        together(spawn, lambda: a.push({"w": grad}), lambda: b.push({"w": grad}))
        np.testing.assert_array_equal(a.pull("w"), -grad)


def test_join_steps_refuses_a_bad_mode_before_asking_any_server(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", (4,))
        for bad in ("ssp:x", "ssp:-1", "ssp:", "bsp"):
            with pytest.raises(ValueError) as caught:
                ps.join_steps(bad)
            assert repr(bad) in str(caught.value) and "join_steps mode" in str(caught.value)
        with pytest.raises(ValueError, match="replicas"):
            ps.join_steps("sync", replicas=0)
        assert ps.mode == "async"
        assert cluster.faults.calls.get("JoinSteps", 0) == 0


def test_joining_sync_while_another_client_runs_ssp_2_is_refused(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=SPLIT_BYTES)
    with PSClient(cluster.coordinator_address) as first, \
            PSClient(cluster.coordinator_address) as second:
        first.declare("w", (8, 4), optimizer=sgd(1.0))
        first.join_steps("ssp:2")
        assert first.mode == "ssp:2"
        error = expect_error(grpc.StatusCode.FAILED_PRECONDITION, second.join_steps, "sync")
        assert "ssp:2" in str(error) and first.client_id in str(error)
        error = expect_error(grpc.StatusCode.FAILED_PRECONDITION, second.join_steps, "ssp:1")
        assert "ssp:2" in str(error)
        # The first client's steps are untouched by the refusals.
        first.push({"w": np.ones((8, 4), np.float32)})
        assert first.step_stats.staleness_max == 0
        np.testing.assert_array_equal(first.pull("w"), np.full((8, 4), -1.0, np.float32))
        second.join_steps("ssp:2")  # the same mode is welcome
        assert second.mode == "ssp:2"


def test_push_rows_in_sync_is_refused_and_changes_nothing(make_cluster):
    cluster = make_cluster(servers=2)
    ids = np.array([1, 4, 7], np.int64)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=4, num_rows=10, optimizer=sgd(1.0))
        ps.declare("w", (4,), optimizer=sgd(1.0))
        ps.join_steps("sync")
        before = ps.pull_rows("emb", ids)
        error = expect_error(grpc.StatusCode.FAILED_PRECONDITION, ps.push_rows, "emb", ids,
                             np.ones((3, 4), np.float32))
        assert "sync" in str(error)
        np.testing.assert_array_equal(ps.pull_rows("emb", ids), before)
        ps.push({"w": np.ones(4, np.float32)})  # whole variables still go in steps
        np.testing.assert_array_equal(ps.pull("w"), np.full(4, -1.0, np.float32))
        ps.leave_steps()
        ps.push_rows("emb", ids, np.ones((3, 4), np.float32))  # async again: applied
        np.testing.assert_allclose(ps.pull_rows("emb", ids), before - 1.0, rtol=1e-6)


# ---- async ---------------------------------------------------------------------------------

def test_a_client_that_never_joined_pushes_without_waiting_for_a_sync_step(
        make_cluster, spawn):
    cluster = make_cluster(servers=2, split_threshold_bytes=SPLIT_BYTES)
    with PSClient(cluster.coordinator_address) as plain, \
            PSClient(cluster.coordinator_address) as s1, \
            PSClient(cluster.coordinator_address) as s2:
        plain.declare("w", (8, 4), optimizer=sgd(1.0))
        split_over_both_servers(plain, "w")
        s1.join_steps("sync", replicas=2)
        held = spawn(s1.push, {"w": np.full((8, 4), 2.0, np.float32)})  # waits for a replica
        wait_until(lambda: pushes(cluster) == 2, "the sync push at both servers")
        for i in range(3):
            plain.push({"w": np.ones((8, 4), np.float32)})  # applied at once, step or not
            np.testing.assert_array_equal(plain.pull("w"),
                                          np.full((8, 4), -(i + 1.0), np.float32))
        assert not held.done.is_set()
        assert plain.mode == "async" and plain.step_stats == StepStats()
        s2.join_steps("sync", replicas=2)
        s2.push({"w": np.full((8, 4), 4.0, np.float32)})
        held.result()
        np.testing.assert_array_equal(plain.pull("w"), np.full((8, 4), -6.0, np.float32))
        assert plain.step_stats == StepStats()
        for ps in (s1, s2):
            assert ps.step_stats.staleness_max == 0
        # Nothing of the steps on a plain push's way: it made no JoinSteps call.
        assert cluster.faults.calls.get("JoinSteps", 0) == 4  # s1 and s2, two servers each
        assert s1.step_stats.wait_s > 0


# ---- found wanting once: a refused join, two pushes of one step, a replica that left ------

def test_a_refused_join_steps_leaves_the_client_as_it_was(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as first, \
            PSClient(cluster.coordinator_address) as second:
        first.declare("w", (4,), optimizer=sgd(1.0))
        first.join_steps("ssp:2")
        expect_error(grpc.StatusCode.FAILED_PRECONDITION, second.join_steps, "sync")
        assert second.mode == "async"
        second.push({"w": np.ones(4, np.float32)})  # an async push, as before the call
        np.testing.assert_array_equal(first.pull("w"), np.full(4, -1.0, np.float32))


def test_sync_no_acknowledged_push_is_lost_when_a_client_has_two_in_flight(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as a, \
            PSClient(cluster.coordinator_address) as b:
        for name in ("w", "v"):
            a.declare(name, (4,), optimizer=sgd(1.0))
        for ps in (a, b):
            ps.join_steps("sync")
        in_flight = {name: a.push_async({name: np.ones(4, np.float32)}) for name in ("w", "v")}
        wait_until(lambda: pushes(cluster) == 2, "both of a's pushes at the server")
        b.push({"w": np.full(4, 3.0, np.float32), "v": np.full(4, 3.0, np.float32)})
        values = a.pull(["w", "v"])
        # A push acknowledged without an error had its gradient averaged in, or (a late
        # one) was counted as dropped; it is never lost silently.
        lost = [name for name, future in in_flight.items()
                if future.exception(timeout=WAIT_S) is None
                and not np.array_equal(values[name], np.full(4, -2.0, np.float32))]
        assert len(lost) <= a.step_stats.dropped_stale, (lost, values, a.step_stats)
