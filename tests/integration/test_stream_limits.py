"""Bounded data-path streams and consistent pulls, against in-process servers on OS-chosen
ports: stalled Push and Pull streams are cancelled after --stream-idle-timeout, at most
--max-streams are served at once (RESOURCE_EXHAUSTED beyond, while control-plane calls and
health checks still answer), healthy clients go on meanwhile, and a pull of a shard larger
than one chunk never mixes values from before and after a push."""

from __future__ import annotations

import math
import threading
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.clock import FakeClock
from ps_common.errors import NotReady, ResourceExhausted
from ps_common.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_proto.v1 import tensor_pb2
from ps_server.app import SERVICE_NAME, ParameterServer, ServerConfig
from ps_server.cli import build_parser, config_from_args
from ps_server.streams import StreamLimiter
from ps_server.testing import first_shard_push_header, wait_until
from ps_worker import PSClient, RemoteError, RetryPolicy

# These tests inject faults into calls on the wire: servers without shared memory.
SHARED_MEMORY = False

SGD1 = {"name": "sgd", "lr": 1.0}
ZEROS = {"name": "constant", "value": 0.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right
SHORT_IDLE_S = 1.0  # --stream-idle-timeout of the servers whose streams are meant to be cut
NO_RETRY = RetryPolicy(max_attempts=1)


# ---- helpers ------------------------------------------------------------------------------

@pytest.fixture
def channels():
    """open(address, options=()) -> a channel, closed after the test."""
    opened: list[grpc.Channel] = []

    def open_(address: str, options=()) -> grpc.Channel:
        opened.append(grpc.insecure_channel(address, options=list(options)))
        return opened[-1]

    yield open_
    for channel in opened:
        channel.close()


@pytest.fixture
def bare_server(make_cluster):
    """start(**ServerConfig fields) -> (cluster, server): a coordinator with one parameter
    server that has no FaultInjector in front of it (the injector collects a pull's whole
    response before sending any of it, so it would hide how a pull streams). Stopped after
    the test, before the coordinator."""
    started: list[ParameterServer] = []

    def start(**config):
        cluster = make_cluster(servers=0)
        server = ParameterServer(ServerConfig(
            server_id=f"bare-{len(started)}", coordinator=cluster.coordinator_address,
            heartbeat_interval_s=0.2, grace_s=0.5, **config)).start()
        started.append(server)
        assert server.registered.wait(WAIT_S), "the server did not register"
        return cluster, server

    yield start
    for server in started:
        server.stop(grace_s=0.5)


class StalledPush:
    """A raw Push stream to the server holding shard 0 of `name`: it sends its header and
    8 bytes, then nothing until `release` is set (on exit at the latest), then ends short
    of the bytes its header announced. `future` is the call."""

    def __init__(self, channel: grpc.Channel, ps: PSClient, name: str):
        header = first_shard_push_header(ps.shard_map, name, f"stalled-{uuid.uuid4().hex}")
        self.release = threading.Event()

        def chunks():
            yield ps_pb.PushChunk(header=header, data=b"\0" * 8)
            self.release.wait(WAIT_S)

        self.future = ps_grpc.ParameterServerStub(channel).Push.future(chunks(), timeout=WAIT_S)

    def code(self) -> grpc.StatusCode:
        error = self.future.exception(timeout=WAIT_S)
        return grpc.StatusCode.OK if error is None else error.code()

    def __enter__(self) -> "StalledPush":
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.future.exception(timeout=WAIT_S)  # ended, one way or the other


def raw_pull(channel: grpc.Channel, ps: PSClient, name: str, *, timeout: float = WAIT_S):
    """The response iterator of a raw Pull of every shard of `name` (all on one server)."""
    shard_map = ps.shard_map
    request = ps_pb.PullRequest(epoch=shard_map.epoch, shards=[
        ps_pb.ShardRef(variable=name, index=s.index) for s in shard_map.shards[name]])
    return ps_grpc.ParameterServerStub(channel).Pull(request, timeout=timeout)


def pull_code(channel: grpc.Channel, ps: PSClient, name: str) -> grpc.StatusCode:
    try:
        for _ in raw_pull(channel, ps, name):
            pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S).status


# ---- defect A: stalled streams no longer stop a server ------------------------------------

def test_sixteen_stalled_pushes_leave_pulls_and_pushes_working(make_cluster, channels):
    """16 push streams that never finish used to hold all 16 handler threads: every pull
    then failed with DEADLINE_EXCEEDED."""
    cluster = make_cluster(servers=1)
    (server,) = cluster.servers
    channel = channels(server.address)
    with PSClient(cluster.coordinator_address, timeout_s=10.0, retry=NO_RETRY) as ps:
        ps.declare("w", shape=(8, 4), init=ZEROS, optimizer=SGD1)
        stalled = [StalledPush(channel, ps, "w") for _ in range(16)]
        try:
            wait_until(lambda: cluster.faults.calls.get("Push", 0) >= 16,
                       "16 push streams running on the server")
            np.testing.assert_array_equal(ps.pull("w"), np.zeros((8, 4), np.float32))
            ps.push({"w": np.ones((8, 4), np.float32)})
            np.testing.assert_array_equal(ps.pull("w"), -np.ones((8, 4), np.float32))
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        finally:
            for push in stalled:
                push.release.set()
        # Released, each ends short of the bytes its header announced: refused, not applied.
        assert [push.code() for push in stalled] == [grpc.StatusCode.INVALID_ARGUMENT] * 16
        np.testing.assert_array_equal(ps.pull("w"), -np.ones((8, 4), np.float32))


def test_stalled_push_is_cancelled_after_the_idle_timeout(make_cluster, channels):
    cluster = make_cluster(servers=1, max_streams=1, stream_idle_timeout_s=SHORT_IDLE_S)
    (server,) = cluster.servers
    channel = channels(server.address)
    with PSClient(cluster.coordinator_address, retry=NO_RETRY) as ps:
        ps.declare("w", shape=(8, 4), init=ZEROS, optimizer=SGD1)
        with StalledPush(channel, ps, "w") as stalled:
            assert stalled.code() == grpc.StatusCode.CANCELLED
            # Its slot (the only one) is free again: the handler has unwound.
            wait_until(lambda: server.streams.active == 0, "the cancelled push's slot freed")
            ps.push({"w": np.ones((8, 4), np.float32)})
            np.testing.assert_array_equal(ps.pull("w"), -np.ones((8, 4), np.float32))


def test_push_that_keeps_sending_outlives_the_idle_timeout(make_cluster, channels):
    """Only silence counts: a slow push whose chunks come more often than the idle timeout
    is never cut, however long it takes in all."""
    idle_s = 1.0
    cluster = make_cluster(servers=1, stream_idle_timeout_s=idle_s, chunk_bytes=64)
    (server,) = cluster.servers
    channel = channels(server.address)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(16,), init=ZEROS, optimizer=SGD1)
        header = ps_pb.PushHeader(
            client_id=uuid.uuid4().hex, incarnation=1, sequence=1, acked_through=0,
            epoch=ps.shard_map.epoch, shards=[ps_pb.ShardRef(variable="w", index=0)],
            tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[16])])
        data = np.ones(16, np.float32).tobytes()
        paced = threading.Event()  # never set: each wait is the pace of a slow sender

        def chunks():
            yield ps_pb.PushChunk(header=header, data=data[:4])
            for i in range(4, 64, 4):  # 15 more chunks, idle_s / 5 apart: 3 idle timeouts
                paced.wait(idle_s / 5)
                yield ps_pb.PushChunk(data=data[i:i + 4])

        reply = ps_grpc.ParameterServerStub(channel).Push(chunks(), timeout=WAIT_S)
        assert reply.duplicate is False
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(16, np.float32))


def test_pull_whose_client_stops_reading_is_cancelled(bare_server, channels):
    cluster, server = bare_server(max_streams=1, stream_idle_timeout_s=SHORT_IDLE_S,
                                  chunk_bytes=1 << 20)
    # Without BDP probing the client's flow-control window stays at 64 KiB, so what the
    # transport buffers for a reader that stopped is far less than the pull.
    channel = channels(server.address, options=[("grpc.http2.bdp_probe", 0)])
    with PSClient(cluster.coordinator_address, retry=NO_RETRY) as ps:
        n = 8 << 20  # 32 MiB of float32, sent in 1 MiB chunks
        ps.declare("big", shape=(n,), init=ZEROS, optimizer=SGD1)
        responses = raw_pull(channel, ps, "big")
        next(responses)  # the stream is open; then this client stops reading
        wait_until(lambda: server.streams.active == 0, "the stalled pull cancelled")
        with pytest.raises(grpc.RpcError) as caught:
            for _ in responses:  # what was buffered, then the end of the cancelled call
                pass
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        # The slot (the only one) serves the next pull.
        np.testing.assert_array_equal(ps.pull("big"), np.zeros(n, np.float32))


def test_streams_beyond_max_streams_are_refused_while_control_plane_answers(
        make_cluster, channels):
    cluster = make_cluster(servers=1, max_streams=2)  # default idle timeout: nothing is cut
    (server,) = cluster.servers
    channel = channels(server.address)
    # 64-byte chunks: the 128-byte pushes below go out as streams.
    with PSClient(cluster.coordinator_address, retry=NO_RETRY, chunk_bytes=64) as ps, \
            PSClient(cluster.coordinator_address, retry=NO_RETRY) as one_message:
        ps.declare("w", shape=(8, 4), init=ZEROS, optimizer=SGD1)
        with StalledPush(channel, ps, "w") as first, StalledPush(channel, ps, "w") as second:
            wait_until(lambda: server.streams.active == 2, "both slots taken")
            assert pull_code(channel, ps, "w") == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(RemoteError) as caught:
                ps.push({"w": np.ones((8, 4), np.float32)})
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Pulls and pushes that fit in one message hold no stream slot: served meanwhile.
            one_message.push({"w": np.ones((8, 4), np.float32)})
            np.testing.assert_array_equal(one_message.pull("w"), -np.ones((8, 4), np.float32))
            # Control plane: health, and a declaration (the coordinator's AssignShards).
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING
            ps.declare("v", shape=(3,), init=ZEROS, optimizer=SGD1)
            assert server.store.epoch == ps.shard_map.epoch
            first.release.set()
            second.release.set()
            assert first.code() == second.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_until(lambda: server.streams.active == 0, "slots freed")
        values = ps.pull(["w", "v"])
        np.testing.assert_array_equal(values["w"], -np.ones((8, 4), np.float32))
        np.testing.assert_array_equal(values["v"], np.zeros(3, np.float32))


def test_a_client_backs_off_and_retries_while_every_slot_is_taken(make_cluster, channels):
    """The refusal carries a retry delay (google.rpc.RetryInfo): a job briefly above
    --max-streams slows down instead of failing."""
    cluster = make_cluster(servers=1, max_streams=1)
    (server,) = cluster.servers
    channel = channels(server.address)
    patient = RetryPolicy(max_attempts=1000, initial_backoff_s=0.01, max_backoff_s=0.05)
    # 64-byte chunks: these pulls and pushes of 128 bytes are streams.
    with PSClient(cluster.coordinator_address, retry=patient, chunk_bytes=64) as ps:
        ps.declare("w", shape=(8, 4), init=ZEROS, optimizer=SGD1)
        with StalledPush(channel, ps, "w") as stalled:
            wait_until(lambda: server.streams.active == 1, "the slot taken")
            with pytest.raises(RemoteError) as caught:
                with PSClient(cluster.coordinator_address, retry=NO_RETRY,
                              chunk_bytes=64) as impatient:
                    impatient.pull("w")
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
            pushed = threading.Thread(target=ps.push, args=({"w": np.ones((8, 4), np.float32)},),
                                      name="push-while-full")
            pushed.start()
            wait_until(lambda: cluster.faults.calls.get("Push", 0) >= 3,
                       "the push to be refused and retried")
            stalled.release.set()
            pushed.join(WAIT_S)
            assert not pushed.is_alive()
        np.testing.assert_array_equal(ps.pull("w"), -np.ones((8, 4), np.float32))


# ---- defect B: a pull of one shard is a consistent snapshot --------------------------------

@pytest.mark.parametrize("wire", [None, "float16"], ids=["stored-dtype", "narrowed"])
def test_pull_of_a_shard_larger_than_a_chunk_never_mixes_pushes(bare_server, wire):
    """Every element moves by the same amount per push, so any pulled array whose elements
    differ mixes values from before and after a push. 16 KiB in 64-byte chunks: 256 reads
    per pull, with pushes applied all the while. The client streams over gRPC in 64-byte
    chunks too: with its default chunk size a 16 KiB pull would be one PullUnary message."""
    cluster, _ = bare_server(chunk_bytes=64)
    shape, pulls = (256, 16), 20
    with PSClient(cluster.coordinator_address, chunk_bytes=64, shared_memory=False) as ps:
        ps.declare("w", shape=shape, init=ZEROS, optimizer=SGD1)
        assert len(ps.shard_map.shards["w"]) == 1
        stop = threading.Event()
        pushed: list[int] = [0]
        errors: list[BaseException] = []

        def pusher():
            grad = np.ones(shape, np.float32)
            try:
                while not stop.is_set():
                    ps.push({"w": grad})
                    pushed[0] += 1
            except BaseException as error:  # reported below
                errors.append(error)

        thread = threading.Thread(target=pusher, name="test-pusher")
        thread.start()
        values = []
        try:
            wait_until(lambda: pushed[0] > 0 or errors, "the first push")
            for _ in range(pulls):
                values.append(ps.pull("w", wire_dtype=wire))
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert not thread.is_alive() and not errors, errors
        mixed = [i for i, v in enumerate(values) if v.min() != v.max()]
        assert not mixed, f"{len(mixed)} of {pulls} pulls mixed values of different pushes"
        firsts = [float(v.flat[0]) for v in values]
        assert all(x <= 0 and x == math.floor(x) for x in firsts)  # -(pushes applied)
        assert firsts == sorted(firsts, reverse=True)  # later pulls see no fewer pushes
        final = ps.pull("w")
        np.testing.assert_array_equal(final, np.full(shape, -pushed[0], np.float32))


# ---- the pieces: watchdog decisions, configuration, keepalive -----------------------------

class FakeContext:
    def __init__(self):
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_watchdog_cancels_only_streams_silent_for_the_idle_timeout():
    clock = FakeClock()
    limiter = StreamLimiter(max_streams=3, idle_timeout_s=10.0, clock=clock)
    a, b, c = FakeContext(), FakeContext(), FakeContext()
    with limiter.admit(a, "Push") as sa, limiter.admit(b, "Pull") as sb, \
            limiter.admit(c, "Push"):
        with pytest.raises(ResourceExhausted):
            limiter.admit(FakeContext(), "Pull")
        assert limiter.active == 3
        assert limiter.sweep() is None  # nobody waits on a peer: the server's own time
        sa.arm()
        clock.advance(5.0)
        sb.arm()
        assert limiter.sweep() == 5.0
        clock.advance(5.0)
        assert limiter.sweep() == 5.0  # a waited 10 s: cut; b has 5 s left
        assert (a.cancelled, b.cancelled, c.cancelled) == (1, 0, 0)
        sb.disarm()  # b's peer took the message
        clock.advance(100.0)
        assert limiter.sweep() is None
        assert (a.cancelled, b.cancelled, c.cancelled) == (1, 0, 0)  # a is cut only once
    assert limiter.active == 0
    with limiter.admit(FakeContext(), "Pull"):  # the slots are free again
        pass


def test_request_stream_is_armed_only_while_the_peer_is_awaited():
    clock = FakeClock()
    limiter = StreamLimiter(max_streams=1, idle_timeout_s=10.0, clock=clock)
    context = FakeContext()

    def peer():
        for wait in (9.0, 9.0, 11.0):
            clock.advance(wait)
            limiter.sweep()
            yield wait

    with limiter.admit(context, "Push") as stream:
        # The message that comes after the cut is not handed on: the call is being
        # cancelled, and its handler must not act on it.
        with pytest.raises(NotReady, match="--stream-idle-timeout"):
            for _ in stream.requests(peer()):
                clock.advance(60.0)  # the server's own work between chunks never counts
                limiter.sweep()
                assert not context.cancelled
    assert context.cancelled == 1  # at the 11 s wait, not before


@pytest.mark.parametrize("fields", [
    {"max_streams": 0}, {"stream_idle_timeout_s": 0.0}, {"stream_idle_timeout_s": -1.0},
    {"stream_idle_timeout_s": math.inf}, {"stream_idle_timeout_s": math.nan},
], ids=["no-streams", "zero-idle", "negative-idle", "infinite-idle", "nan-idle"])
def test_bad_stream_limits_are_refused(fields):
    with pytest.raises(ValueError):
        ServerConfig(**fields)


def test_stream_limit_flags():
    parser = build_parser()
    config = config_from_args(parser, parser.parse_args([]))
    assert (config.max_streams, config.stream_idle_timeout_s) == (128, 30.0)
    config = config_from_args(parser, parser.parse_args(
        ["--max-streams", "8", "--stream-idle-timeout", "2.5"]))
    assert (config.max_streams, config.stream_idle_timeout_s) == (8, 2.5)


def test_server_keepalive_is_on_and_permits_the_clients_pings():
    server, client = dict(SERVER_OPTIONS), dict(CHANNEL_OPTIONS)
    assert server["grpc.keepalive_time_ms"] > 0 and server["grpc.keepalive_timeout_ms"] > 0
    assert server["grpc.keepalive_permit_without_calls"] == 1
    # Clients ping after keepalive_time_ms of silence: never "too many pings" to the server.
    assert (server["grpc.http2.min_ping_interval_without_data_ms"]
            <= client["grpc.keepalive_time_ms"])
