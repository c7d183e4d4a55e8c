"""The stream watchdog decides to cut a Push stream, and its last message arrives before
the cut is carried out: the push is either answered and applied, or cut and not applied,
never applied and answered CANCELLED (which PSClient does not take for an answer that the
push was applied: a caller pushing again would apply it twice).

The interleaving is forced: the watchdog runs on a FakeClock (the real watchdog thread
sleeps the hour-long idle timeout and never sweeps during the test); the sweep's log line,
between its decision and its cancel, is the hook at which the client's last message
arrives, and the handler then either applies the push (held until the sweep has returned)
or unwinds.
"""

from __future__ import annotations

import math
import threading
import uuid

import grpc
import numpy as np

from ps_common.clock import FakeClock
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_server import streams as streams_module
from ps_server.testing import first_shard_push_header, wait_until
from ps_worker import PSClient

SHARED_MEMORY = False  # the stream is gRPC's
WAIT_S = 30.0
IDLE_S = 3600.0  # the watchdog thread itself never sweeps during the test
SGD1 = {"name": "sgd", "lr": 1.0}


def test_a_push_whose_last_message_arrives_as_the_watchdog_cuts_it_is_not_applied_and_cancelled(
        make_cluster, monkeypatch):
    cluster = make_cluster(servers=1, stream_idle_timeout_s=IDLE_S)
    (server,) = cluster.servers
    clock = FakeClock()
    server.streams._clock = clock

    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8,), init="zeros", optimizer=SGD1)
        header = first_shard_push_header(ps.shard_map, "w", f"raw-{uuid.uuid4().hex}")
        data = np.ones(8, np.float32).tobytes()

        release = threading.Event()  # the client's end of stream goes out
        applied = threading.Event()  # the server has applied the push
        swept = threading.Event()  # the sweep (and its cancel) has returned

        def chunks():
            yield ps_pb.PushChunk(header=header, data=data)  # everything, then silence
            release.wait(WAIT_S)

        real_apply = server.store.apply

        def apply_then_wait(*args, **kwargs):
            result = real_apply(*args, **kwargs)
            applied.set()
            swept.wait(WAIT_S)  # the reply goes out only after the sweep's cancel
            return result

        monkeypatch.setattr(server.store, "apply", apply_then_wait)

        real_log = streams_module.log

        class LastMessageArrivesNow:
            """The sweep's log line, between its decision and its cancel."""

            def warning(self, *args, **kwargs):
                real_log.warning(*args, **kwargs)
                release.set()  # the peer's end of stream arrives at this instant ...
                # ... and the handler applies the push, or unwinds (its stream released).
                wait_until(lambda: applied.is_set() or server.streams.active == 0,
                           "the handler applied the push or gave up its stream", WAIT_S)

            def __getattr__(self, name):
                return getattr(real_log, name)

        with grpc.insecure_channel(server.address) as channel:
            call = ps_grpc.ParameterServerStub(channel).Push.future(chunks(), timeout=WAIT_S)
            try:
                # The handler waits for the end of the stream: armed.
                wait_until(lambda: any(s.deadline != math.inf
                                       for s in list(server.streams._open)),
                           "the push stream waiting on its peer", WAIT_S)
                clock.advance(IDLE_S + 1.0)  # silent past the idle timeout
                monkeypatch.setattr(streams_module, "log", LastMessageArrivesNow())
                server.streams.sweep()
            finally:
                swept.set()
                release.set()
            error = call.exception(timeout=WAIT_S)
        code = grpc.StatusCode.OK if error is None else error.code()
        values = ps.pull("w")

    applied_here = bool(np.array_equal(values, -np.ones(8, np.float32)))
    # Either the push was answered (applied), or it was cut and nothing was applied.
    assert not (code == grpc.StatusCode.CANCELLED and applied_here), (
        f"the push was applied (w = {values.tolist()}) but its call ended {code.name}")
    assert (code == grpc.StatusCode.OK) == applied_here, (code, values.tolist())
