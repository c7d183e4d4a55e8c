"""ps-worker at the edges of its own refusals and retries: a job lr the servers would refuse,
a step waited out over shared memory, a deadline waited out while a shard moves.

Real in-process daemons on OS-chosen ports; every wait is bounded (a bound a sound build
never reaches, not a timing); every worker and daemon started here is ended."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ps_common import shm

from ps_common.job import JobError, JobSpec
from ps_common.rpc import READ_RETRY_CODES, RetryPolicy
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.jobs import JobState
from ps_server.shared_memory import MAX_SLOTS_PER_CONNECTION
from ps_server.testing import InProcessCluster
from ps_worker import PSClient, RemoteError
from ps_worker.runtime import SERVER_OUTAGE_RETRY
from worker_threads import WAIT_S, Cluster, RunningWorker


# ---- a knob the servers refuse at declare, given as a job flag ------------------------------

def test_a_job_whose_lr_the_servers_refuse_is_refused_or_fails_instead_of_hanging():
    """The servers refuse, at declare, an optimizer knob that is infinite in the dtype the
    update computes in (README: "lr=1e40 ... is refused with INVALID_ARGUMENT"). A job's own
    `lr` (ps-coordinator --lr, a job file's) that float32 cannot hold is refused with it, at
    start, naming `lr`, or else the job fails once a worker reports it (README: "A job
    nobody can run ... fails as soon as a worker reports it"), never a job RUNNING for ever
    with every worker gone."""
    try:
        job = JobSpec(model="logreg", data="synthetic:64", epochs=1, tasks_per_epoch=1,
                      optimizer="adam", lr=1e39)
    except JobError as error:  # refused at start, as a malformed --model or --data is
        assert "lr" in str(error)
        return
    cluster = Cluster(job, heartbeat_timeout_s=30.0)
    worker = None
    try:
        worker = RunningWorker(cluster.coordinator.address, "w0")
        outcome = worker.join()
        assert outcome, "the worker did not end"
        snap = cluster.coordinator.runner.snapshot()
        assert snap["state"] is JobState.FAILED, (
            f"job {snap['state'].value} after its only worker ended with {outcome}: nobody "
            "told the coordinator that the job cannot run")
        assert "lr" in snap["failure"], snap["failure"]
    finally:
        if worker is not None:
            worker.end()
        cluster.stop()


# ---- a step waited out over shared memory ---------------------------------------------------

# As ps-worker's SERVER_OUTAGE_RETRY (no attempt limit, DEADLINE_EXCEEDED retried), with short
# backoffs.
_PATIENT = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05,
                       retry_codes=READ_RETRY_CODES)
ROUNDS = MAX_SLOTS_PER_CONNECTION + 1


@pytest.mark.skipif(shm.supported() is not None, reason="no shared memory here")
def test_a_step_waited_out_over_shared_memory_gives_its_push_slot_back(make_cluster):
    """A ps-worker "waits on, under the same push (counted once), until the straggler comes"
    (README), retrying the server's STEP_TIMEOUT. That answer is the server's own (it applied
    the push, ssp; or holds a copy of it in the step's sum, sync): the push slot it came
    from is free again, not held (its bytes in /dev/shm) as after a call nobody answered,
    until the server's slots per connection are spent and every push goes over gRPC.

    ssp:0 with a fast client A (shared memory) and a straggler B (gRPC); the server's 30 s
    wait is 0 here, so A's push of each step times out at once until B has pushed it."""
    cluster = make_cluster(servers=1, shared_memory=True)
    gate = cluster.servers[0].steps
    gate._wait_s = 0.0  # README's 30 s: every wait for the straggler times out at once
    timeouts = []
    timed_out = threading.Condition()
    raise_timeout = gate._timeout

    def counted_timeout(*args):
        with timed_out:
            timeouts.append(args)
            timed_out.notify_all()
        return raise_timeout(*args)

    gate._timeout = counted_timeout
    grad = {"w": np.ones(4, np.float32)}
    with PSClient(cluster.coordinator_address, client_id="fast", retry=_PATIENT) as fast, \
            PSClient(cluster.coordinator_address, client_id="slow",
                     shared_memory=False) as slow:
        fast.declare("w", shape=(4,), optimizer={"name": "sgd", "lr": 1.0})
        fast.join_steps("ssp:0")
        slow.join_steps("ssp:0")
        address = fast.shard_map.servers[fast.shard_map.shards_of("w")[0].server_id]
        for round_ in range(ROUNDS):
            seen = len(timeouts)
            pushed: dict = {}

            def push():
                try:
                    fast.push(grad)
                    pushed["ok"] = True
                except BaseException as error:  # noqa: BLE001 - inspected below
                    pushed["error"] = error

            thread = threading.Thread(target=push, name="fast-push", daemon=True)
            thread.start()
            try:
                with timed_out:  # the fast client's push of this step waited its longest
                    assert timed_out.wait_for(lambda: len(timeouts) > seen, WAIT_S)
                slow.push(grad)  # the straggler's step: the fast client's retry goes through
                thread.join(WAIT_S)
            finally:
                if thread.is_alive():  # bounded: a push that never ends is ended here
                    fast.interrupt()
                    thread.join(WAIT_S)
            assert pushed == {"ok": True}, (round_, pushed)
        connection = fast._shared[address]
        kept = (len(connection._free), connection._no_more_slots)
        fast.leave_steps()
        slow.leave_steps()
    assert kept == (1, False), (
        f"after {ROUNDS} steps that each waited out the straggler once, the fast client holds "
        f"{kept[0]} free push slot(s) and no_more_slots={kept[1]}: each timed-out step kept "
        "its slot, and past the server's limit its pushes went over gRPC")


# ---- a deadline waited out, then the shard moved ----------------------------------------------

class _NotAnswering(grpc.ServerInterceptor):
    """While `active`, every push to the server it is installed on ends DEADLINE_EXCEEDED
    (as a call to a server that is hung, stopped or cut off after the connection was made
    ends when its deadline passes), counting them."""

    def __init__(self):
        self.active = False
        self.refused = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith(
                ("/PushUnary", "/Push", "/PushThenPull")):
            return handler
        kind = "unary_unary" if handler.unary_unary else "stream_unary"
        behavior = getattr(handler, kind)

        def wrapped(request, context):
            if self.active:
                self.refused += 1
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "injected: the server did not answer within the deadline")
            return behavior(request, context)

        return handler._replace(**{kind: wrapped})


class _Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_a_worker_push_waiting_out_deadlines_follows_its_shard_when_it_moves(tmp_path):
    """ps-worker's calls to servers wait out an outage and a deadline passed, and each retry
    asks the coordinator whether the server moved. A push to a server that stopped
    answering within its deadline (hung, stopped, cut off after connecting) follows its
    shard once the coordinator has moved it (README: "--server-timeout ... its shards move
    to live servers from the checkpoint"), as a push to a server that is down does, rather
    than ending with DEADLINE_EXCEEDED at the moment it could go through."""
    not_answering = _NotAnswering()

    class Cluster(InProcessCluster):
        def _start_server(self, server_id, port):
            config = ServerConfig(server_id=server_id, port=port,
                                  coordinator=self.coordinator_address, **self._server_kwargs)
            extra = [not_answering] if server_id == "ps-0" else []
            return ParameterServer(config, interceptors=[self.faults, *extra]).start()

    cluster = Cluster(servers=2, checkpoint_dir=tmp_path, server_timeout_s=0.5,
                      shared_memory=False).start()
    try:
        with PSClient(cluster.coordinator_address, retry=SERVER_OUTAGE_RETRY) as ps:
            ps.declare("a", shape=(4,), optimizer={"name": "sgd", "lr": 1.0})
            ps.declare("b", shape=(4,), optimizer={"name": "sgd", "lr": 1.0})
            name = next(n for n in ("a", "b") if ps.shard_map.shards_of(n)[0].server_id == "ps-0")
            ps.push({name: np.ones(4, np.float32)})
            cluster.checkpoint()  # holds -1
            not_answering.active = True  # ps-0 answers no push in time from now on
            cluster.servers[0]._coordinator_call = lambda rpc, request: (_ for _ in ()).throw(
                _Unreachable())  # and the coordinator hears nothing from it: it moves `name`
            pushed: dict = {}

            def push():
                try:
                    ps.push({name: np.ones(4, np.float32)})
                    pushed["outcome"] = "applied"
                except RemoteError as error:
                    pushed["outcome"] = f"{error.code().name}: {error.details()}"

            thread = threading.Thread(target=push, name="worker-push", daemon=True)
            thread.start()
            thread.join(WAIT_S)
            if thread.is_alive():  # bounded: a push that never ends is ended here
                ps.interrupt()
                thread.join(WAIT_S)
                pytest.fail("the push still waited after the shard had had time to move")
            outcome = pushed["outcome"]
            moved_to = ps.refresh().shards_of(name)[0].server_id
            values = ps.pull(name) if outcome == "applied" else None
        assert not_answering.refused >= 1 and moved_to == "ps-1"
        assert outcome == "applied", (
            f"the push waited out {not_answering.refused} deadline(s) until the shard moved to "
            f"{moved_to}, then failed: {outcome}")
        np.testing.assert_array_equal(values, np.full(4, -2.0, np.float32))
    finally:
        cluster.stop()
