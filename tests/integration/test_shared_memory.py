"""The shared-memory data path against in-process clusters: pulls without calls, pushes as
PushShared headers, owner-only segments that servers remove, consistent snapshots under
concurrent updates, the fallbacks to gRPC, bad input straight to a server, exactly-once
over shared memory, a server restart ending a connection, and the clearing of a dead server's
segments.

The servers of these clusters run in this process, so their segments are named with this
process's pid: a test tells its own servers' segments apart from those of other clusters
by what appeared in /dev/shm while it ran (names carry a per-process serial)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

import ps_worker.client as client_module
import ps_worker.shared_memory as client_shm
from ps_common import shm
from ps_common.cli import run_until_signal
from ps_common.errors import InvalidArgument, StaleEpoch
from ps_common.job import JobSpec
from ps_common.shardmap import Shard, VariableSpec
from ps_common.tensors import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_proto.v1 import tensor_pb2
from ps_server import shared_memory as server_shm
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.initializers import initialize_rows
from ps_server.pushes import PushReceiver
from ps_server import store as store_module
from ps_server.optimizers import make_state
from ps_server.store import HeldShard, ShardStore
from ps_server.testing import InProcessCluster, cut_off_from_coordinator, wait_until
from ps_worker import PSClient, RemoteError

UNSUPPORTED = shm.supported()
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")

SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 30.0  # bound of every wait; never reached when the code is right


# ---- helpers ------------------------------------------------------------------------------

def calls(cluster: InProcessCluster, family: str) -> int:
    return cluster.faults.calls.get(family, 0)


def own_prefix() -> str:
    """The name prefix of segments made by servers running in this process."""
    return f"{shm.PREFIX}{os.getpid()}.{shm.process_start_time(os.getpid())}."


def own_segments() -> set[str]:
    return {p.name for p in shm.DIRECTORY.iterdir() if p.name.startswith(own_prefix())}


def exists(name: str) -> bool:
    return (shm.DIRECTORY / name).exists()


def value_segments(server: ParameterServer) -> list[str]:
    return [server.shared.segment_of(h.values).name for h in server.store.held()]


def grpc_pull(cluster: InProcessCluster, names, **kwargs):
    """What a client that uses gRPC only gets."""
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        return ps.pull(names, **kwargs)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return bfloat16_bits_to_float32(float32_to_bfloat16_bits(x.astype(np.float32)))


class RawConnection:
    """The handshake done by hand with a raw stub, as a client on this host would."""

    def __init__(self, stub, client_id: str = "raw-client"):
        self.stub = stub
        reply = stub.OpenSharedMemory(ps_pb.OpenSharedMemoryRequest(client_id=client_id),
                                      timeout=10)
        assert reply.offered
        self.probe_name, self.control_name = reply.probe, reply.control
        self.connection = reply.connection
        self.secret = bytes(shm.attach(reply.probe, writable=False).data[:shm.SECRET_BYTES])

    def new_slot(self, nbytes: int, *, secret: bytes | None = None) -> ps_pb.PushSharedReply:
        return self.stub.PushShared(ps_pb.PushSharedRequest(
            connection=self.connection, secret=self.secret if secret is None else secret,
            slot_bytes=nbytes), timeout=10)

    def push(self, slot: int, header: ps_pb.PushHeader, *,
             secret: bytes | None = None) -> ps_pb.PushSharedReply:
        return self.stub.PushShared(ps_pb.PushSharedRequest(
            connection=self.connection, secret=self.secret if secret is None else secret, slot=slot,
            header=header), timeout=10)


def push_header(epoch: int, variable: str, shape, *, client_id: str,
                sequence: int = 1) -> ps_pb.PushHeader:
    return ps_pb.PushHeader(
        client_id=client_id, incarnation=1, sequence=sequence, acked_through=0, epoch=epoch,
        shards=[ps_pb.ShardRef(variable=variable, index=0)],
        tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=list(shape))])


@pytest.fixture
def stub_of(make_cluster):
    """stub_of(cluster, server index) -> a raw ParameterServerStub; channels closed after."""
    channels: list[grpc.Channel] = []

    def make(cluster: InProcessCluster, index: int = 0):
        channel = grpc.insecure_channel(cluster.servers[index].address)
        channels.append(channel)
        return ps_grpc.ParameterServerStub(channel)

    yield make
    for channel in channels:
        channel.close()


# ---- the fast path: no pull calls, pushes as headers --------------------------------------

def test_pulls_make_no_call_pushes_go_as_push_shared_and_values_equal_grpc(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=1000)
    rng = np.random.default_rng(3)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare("w", shape=(61, 10), init="glorot_uniform", optimizer=SGD1, seed=7)
        ps.declare("b", shape=(10,), init={"name": "constant", "value": 0.5}, optimizer=SGD1)
        assert len({s.server_id for s in ps.shard_map.shards_of("w")}) == 2
        cluster.wait_until_synced()  # a server behind the client's epoch is pulled over gRPC

        values = ps.pull(["w", "b"])
        np.testing.assert_array_equal(values["w"], initialize_rows(spec, 0, 61))
        np.testing.assert_array_equal(values["b"], np.full(10, 0.5, np.float32))
        grads = [rng.standard_normal((61, 10)).astype(np.float32) for _ in range(3)]
        for g in grads:
            ps.push({"w": g, "b": np.ones(10, np.float32)})
        for _ in range(5):
            after = ps.pull(["w", "b"])

        assert calls(cluster, "Pull") == 0  # not one Pull or PullUnary
        # One header per server per push; slots were asked for separately (no push in them).
        assert calls(cluster, "Push") == 3 * 2
        assert calls(cluster, "PushShared") == 0  # counted as "Push" or "PushSharedSlot"
        assert 1 <= calls(cluster, "PushSharedSlot") <= 2
        assert ps.data_paths == {s.address: "shm" for s in cluster.servers}

        expected = initialize_rows(spec, 0, 61) - grads[0] - grads[1] - grads[2]
        np.testing.assert_allclose(after["w"], expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(after["b"], np.full(10, -2.5, np.float32))
        for wire in (None, "float16", "bfloat16"):
            mine = ps.pull(["w", "b"], wire_dtype=wire)
            theirs = grpc_pull(cluster, ["w", "b"], wire_dtype=wire)
            for name in ("w", "b"):
                np.testing.assert_array_equal(mine[name], theirs[name], err_msg=f"{name} {wire}")
        np.testing.assert_array_equal(ps.pull("w", wire_dtype="bfloat16"),
                                      bf16_round(after["w"]))
        assert calls(cluster, "Pull") > 0  # the gRPC client did pull over the wire


@pytest.fixture
def block_reads(monkeypatch) -> list[int]:
    """The bytes of each block the server reads from a slot's file (BlockReader), in order."""
    read: list[int] = []
    original = shm.BlockReader.__call__

    def counting(self, block):
        read.append(block.nbytes)
        return original(self, block)

    monkeypatch.setattr(shm.BlockReader, "__call__", counting)
    return read


def test_a_large_push_slot_is_read_from_its_file_and_refused_whole_for_a_bad_value(
        make_cluster, block_reads):
    """A slot of READ_SLOTS_FROM_FILE_BYTES or more is read by the server with pread
    (ps_common.shm.BlockReader), by the check and by the update: a NaN in its last block,
    from a client that does not check (allow_non_finite), is refused by the server with
    nothing applied; a good push after it is applied exactly, and every file the reads
    opened is closed again."""
    read = block_reads
    cluster = make_cluster(servers=1)
    n = server_shm.READ_SLOTS_FROM_FILE_BYTES // 4 + 3  # a few bytes past the bound
    with PSClient(cluster.coordinator_address, allow_non_finite=True) as lax:
        lax.declare("big", shape=(n,), init="zeros", optimizer=SGD1)
        grad = np.ones(n, np.float32)
        grad[-1] = np.nan
        with pytest.raises(RemoteError) as refused:
            lax.push({"big": grad})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.target != "client" and "non-finite" in str(refused.value)
        # The check, then the count of bad values for the message; no update.
        assert sum(read) == 2 * n * 4
        np.testing.assert_array_equal(lax.pull("big"), np.zeros(n, np.float32))

        read.clear()
        grad[-1] = 2.0
        lax.push({"big": grad})
        assert sum(read) == 2 * n * 4  # the check, then the update
        expected = -np.ones(n, np.float32)
        expected[-1] = -2.0
        np.testing.assert_array_equal(lax.pull("big"), expected)
        assert lax.data_paths == {s.address: "shm" for s in cluster.servers}
        (slot,) = [entry for entry in shm.DIRECTORY.iterdir()
                   if entry.name.startswith(own_prefix()) and entry.name.endswith(".slot")]
        # Each mapping holds a descriptor (the server's and the client's): no reader's.
        assert sum(os.path.realpath(f"/proc/self/fd/{fd}") == str(slot)
                   for fd in os.listdir("/proc/self/fd")) == 2


def test_a_client_that_checks_its_slot_spares_the_server_reading_it_for_the_check(
        make_cluster, block_reads):
    """PSClient checks a slot for NaN and Inf as it writes it (PushHeader.finite_checked):
    the server reads a large slot once, for the update; a NaN is refused by the client,
    which sends nothing, and nothing is applied."""
    read = block_reads
    cluster = make_cluster(servers=1)
    n = server_shm.READ_SLOTS_FROM_FILE_BYTES // 4 + 3
    with PSClient(cluster.coordinator_address) as strict:
        strict.declare("big", shape=(n,), init="zeros", optimizer=SGD1)
        grad = np.ones(n, np.float32)
        strict.push({"big": grad})
        assert sum(read) == n * 4  # the update alone
        read.clear()
        grad[-1] = np.inf  # in the last block the client checks
        with pytest.raises(RemoteError) as refused:
            strict.push({"big": grad})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.target == "client" and "non-finite" in str(refused.value)
        assert read == []
        np.testing.assert_array_equal(strict.pull("big"), -np.ones(n, np.float32))
        assert strict.data_paths == {s.address: "shm" for s in cluster.servers}


def test_segments_are_owner_only_and_removed_when_the_cluster_stops(stub_of):
    before = own_segments()
    with InProcessCluster(servers=2) as cluster:
        with PSClient(cluster.coordinator_address) as ps:
            ps.declare("w", shape=(40, 4), optimizer=SGD1)
            ps.declare("b", shape=(4,), optimizer=SGD1)
            cluster.wait_until_synced()
            ps.pull(["w", "b"])
            ps.push({"w": np.ones((40, 4), np.float32), "b": np.ones(4, np.float32)})
            RawConnection(stub_of(cluster, 0))  # a connection whose probe is still there
            made = own_segments() - before
            kinds = {name.rsplit(".", 1)[1] for name in made}
            assert {"control", "values", "slot", "probe", "socket"} <= kinds, made
            for server in cluster.servers:
                assert server.shared.control.name.startswith(own_prefix())
                assert server.shared.control.name in made
                assert set(value_segments(server)) <= made
            for name in made:
                info = os.stat(shm.DIRECTORY / name)
                assert stat.S_IMODE(info.st_mode) == 0o600, name
                assert info.st_uid == os.getuid(), name
        assert own_segments() - before  # still serving: the segments are still there
    assert own_segments() - before == set()


# ---- gRPC whenever shared memory is off -----------------------------------------------------

def test_a_server_without_shared_memory_is_pulled_and_pushed_over_grpc(make_cluster):
    before = own_segments()
    cluster = make_cluster(servers=2, split_threshold_bytes=1000, shared_memory=False)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare("w", shape=(61, 10), init="uniform", optimizer=SGD1, seed=2)
        cluster.wait_until_synced()
        start = ps.pull("w")
        ps.push({"w": np.ones((61, 10), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), start - 1)
        np.testing.assert_array_equal(start, initialize_rows(spec, 0, 61))
        assert ps.data_paths == {s.address: "grpc" for s in cluster.servers}
    assert all(s.shared is None and s.data_path == "grpc" for s in cluster.servers)
    assert calls(cluster, "OpenSharedMemory") == 2  # asked, and told no
    assert calls(cluster, "Pull") == 2 * 2 and calls(cluster, "Push") == 2
    assert calls(cluster, "PushSharedSlot") == 0
    assert own_segments() - before == set()


def test_a_client_without_shared_memory_uses_grpc_and_gets_the_same_values(make_cluster):
    cluster = make_cluster(servers=2, split_threshold_bytes=1000)
    with PSClient(cluster.coordinator_address, shared_memory=False) as plain, \
            PSClient(cluster.coordinator_address) as fast:
        plain.declare("w", shape=(61, 10), init="normal", optimizer=SGD1, seed=4)
        cluster.wait_until_synced()
        plain.push({"w": np.full((61, 10), 0.25, np.float32)})
        fast.push({"w": np.full((61, 10), 0.5, np.float32)})
        np.testing.assert_array_equal(plain.pull("w"), fast.pull("w"))
        assert plain.data_paths == {s.address: "grpc" for s in cluster.servers}
        assert fast.data_paths == {s.address: "shm" for s in cluster.servers}
    assert calls(cluster, "OpenSharedMemory") == 2  # the fast client's, one per server
    assert calls(cluster, "Pull") == 2  # the plain client's pull, one per server
    assert calls(cluster, "Push") == 2 * 2


def test_a_client_that_cannot_read_the_probe_falls_back_to_grpc(make_cluster, monkeypatch):
    """Another user or another host: the probe cannot be opened, the client stays on gRPC."""
    cluster = make_cluster(servers=1)

    def refuse(name, *, writable):
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(client_shm.shm, "attach", refuse)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(5, 3), init="uniform", optimizer=SGD1, seed=9)
        start = ps.pull("w")
        ps.push({"w": np.ones((5, 3), np.float32)})
        after = ps.pull("w")
        assert ps.data_paths == {cluster.servers[0].address: "grpc"}
    monkeypatch.undo()
    np.testing.assert_array_equal(after, start - 1)
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), after)
    assert calls(cluster, "OpenSharedMemory") == 1  # offered, but not usable: never asked again
    assert calls(cluster, "Pull") >= 2 and calls(cluster, "Push") == 1
    assert calls(cluster, "PushSharedSlot") == 0


def test_a_server_without_room_for_a_probe_offers_no_shared_memory(make_cluster, monkeypatch,
                                                                    caplog):
    """/dev/shm full when a client asks: it is told no (not INTERNAL), and uses gRPC."""
    cluster = make_cluster(servers=1)
    made = server_shm.shm.create

    def no_room_for_probes(name, *args, **kwargs):
        if name.endswith(".probe"):
            raise OSError(28, "No space left on device", name)
        return made(name, *args, **kwargs)

    monkeypatch.setattr(server_shm.shm, "create", no_room_for_probes)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(5, 3), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones((5, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), np.full((5, 3), -1.0, np.float32))
        assert ps.data_paths == {cluster.servers[0].address: "grpc"}
    assert "internal error" not in caplog.text
    assert "No space left on device" in caplog.text


def test_data_paths_never_says_grpc_for_a_server_used_through_shared_memory(make_cluster):
    cluster = make_cluster(servers=1)
    address = cluster.servers[0].address
    ps = PSClient(cluster.coordinator_address)
    held = threading.Event()
    closing = threading.Thread(target=ps.close, name="test-close")
    try:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        ps.pull("w")
        assert ps.data_paths == {address: "shm"}
        cluster.faults.hold_next("CloseSharedMemory", held)  # a close that takes a moment
        closing.start()
        wait_until(lambda: calls(cluster, "CloseSharedMemory") == 1,
                   "close() to end the connection")
        while_closing = ps.data_paths
    finally:
        held.set()
        if closing.ident is not None:
            closing.join(WAIT_S)
        else:
            ps.close()
    assert not closing.is_alive()
    assert "grpc" not in while_closing.values(), while_closing


# ---- consistency ---------------------------------------------------------------------------

@pytest.mark.parametrize("wire_dtype", [None, "float16"])
def test_pulls_are_consistent_snapshots_while_pushes_keep_coming(make_cluster, wire_dtype):
    """One shard of 1 Mi float32, each push subtracting 1 from every element: a pull that
    mixed values from before and after an update would hold two different values."""
    cluster = make_cluster(servers=1)
    shape = (1024, 1024)
    ones = np.ones(shape, np.float32)
    stop = threading.Event()
    pushed = [0]
    errors: list[BaseException] = []
    with PSClient(cluster.coordinator_address) as ps, \
            PSClient(cluster.coordinator_address) as pusher:
        ps.declare("w", shape=shape, init="zeros", optimizer=SGD1)
        assert len(ps.shard_map.shards_of("w")) == 1

        def push_forever():
            try:
                while not stop.is_set():
                    pusher.push({"w": ones})
                    pushed[0] += 1
            except BaseException as error:  # noqa: BLE001 - reported by the test
                errors.append(error)

        thread = threading.Thread(target=push_forever, name="test-pusher")
        thread.start()
        seen: set[float] = set()
        pulls = 0
        try:
            wait_until(lambda: pushed[0] > 0 or errors, "the first push")
            deadline = time.monotonic() + WAIT_S
            while pulls < 40 or len(seen) < 3:
                assert time.monotonic() < deadline, f"{pulls} pulls saw only {seen}"
                assert not errors, errors
                value = ps.pull("w", wire_dtype=wire_dtype)
                pulls += 1
                first = value.flat[0]
                assert (value == first).all(), (
                    f"pull {pulls} mixed updates: values {np.unique(value)[:8]}")
                assert first <= 0 and first == np.round(first)
                if wire_dtype == "float16":
                    np.testing.assert_array_equal(value, value.astype(np.float16))
                seen.add(float(first))
        finally:
            stop.set()
            thread.join(WAIT_S)
        assert not thread.is_alive() and not errors, errors
        # Most pulls were copies out of the segment: only a few (the lock kept moving)
        # may have gone over gRPC.
        assert calls(cluster, "Pull") < pulls
        assert ps.data_paths == {cluster.servers[0].address: "shm"}
        final = ps.pull("w")
        np.testing.assert_array_equal(final, np.full(shape, -float(pushed[0]), np.float32))


# ---- pushes through slots --------------------------------------------------------------------

def test_a_client_that_dies_after_writing_its_slot_leaves_nothing_applied(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        spec = ps.declare("w", shape=(30, 4), init="uniform", optimizer=SGD1, seed=1)
        start = ps.pull("w")

        dying = PSClient(cluster.coordinator_address)
        try:
            shard_map = dying.shard_map
            (shard,) = shard_map.shards_of("w")
            connection = dying._shared_connection(shard_map, shard.server_id)
            assert connection is not None
            slot = connection.push_slot(start.nbytes, timeout_s=10)
            assert slot is not None
            slot.write([np.full((30, 4), 1000.0, np.float32)])
            slot_path = slot.segment.path
            assert slot_path.exists()
        finally:
            dying.close()  # it never sends the header
        assert calls(cluster, "Push") == 0 and calls(cluster, "PushSharedSlot") == 1
        np.testing.assert_array_equal(ps.pull("w"), start)
        np.testing.assert_array_equal(grpc_pull(cluster, "w"), start)
        assert not slot_path.exists()  # its connection ended with it (CloseSharedMemory)

        ps.push({"w": np.ones((30, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), start - 1)
        np.testing.assert_array_equal(grpc_pull(cluster, "w"), initialize_rows(spec, 0, 30) - 1)


def test_raw_push_shared_with_a_nan_gradient_is_invalid_argument(make_cluster, stub_of):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), init="uniform", optimizer=SGD1, seed=2)
        before = ps.pull("w")
        epoch = ps.shard_map.epoch
    raw = RawConnection(stub_of(cluster))
    reply = raw.new_slot(8 * 4 * 4)
    assert reply.slot and not reply.connection_lost
    segment = shm.attach(reply.segment, writable=True)
    grad = np.ones((8, 4), np.float32)
    grad[3, 2] = np.nan
    np.copyto(segment.array(np.float32, (8, 4)), grad)
    header = push_header(epoch, "w", (8, 4), client_id=uuid.uuid4().hex)
    with pytest.raises(grpc.RpcError) as caught:
        raw.push(reply.slot, header)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), before)

    # Control: the same header with a finite gradient in the slot is applied.
    np.copyto(segment.array(np.float32, (8, 4)), np.ones((8, 4), np.float32))
    assert raw.push(reply.slot, header).reply.duplicate is False
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), before - 1)


def test_raw_push_shared_with_a_wrong_secret_is_connection_lost_and_applies_nothing(
        make_cluster, stub_of):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), init="uniform", optimizer=SGD1, seed=3)
        before = ps.pull("w")
        epoch = ps.shard_map.epoch
    raw = RawConnection(stub_of(cluster))
    wrong = bytes(b ^ 0xFF for b in raw.secret)
    assert raw.new_slot(128, secret=wrong).connection_lost
    reply = raw.new_slot(8 * 4 * 4)
    segment = shm.attach(reply.segment, writable=True)
    np.copyto(segment.array(np.float32, (8, 4)), np.ones((8, 4), np.float32))
    header = push_header(epoch, "w", (8, 4), client_id=uuid.uuid4().hex)

    lost = raw.push(reply.slot, header, secret=wrong)
    assert lost.connection_lost and not lost.HasField("reply")
    assert raw.push(reply.slot, header, secret=b"").connection_lost
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), before)
    # The right secret: the very same push is applied, once.
    assert raw.push(reply.slot, header).reply.duplicate is False
    assert raw.push(reply.slot, header).reply.duplicate is True
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), before - 1)


def test_raw_slot_requests_outside_the_limits_are_refused(make_cluster, stub_of):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), optimizer=SGD1)
    raw = RawConnection(stub_of(cluster))
    held = cluster.servers[0].store.nbytes()
    for nbytes in (held + 1, 0, -1):
        with pytest.raises(grpc.RpcError) as caught:
            raw.new_slot(nbytes)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, nbytes
    slots = [raw.new_slot(held) for _ in range(server_shm.MAX_SLOTS_PER_CONNECTION)]
    assert len({s.slot for s in slots}) == server_shm.MAX_SLOTS_PER_CONNECTION
    with pytest.raises(grpc.RpcError) as caught:
        raw.new_slot(16)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Pushing into a slot of another connection is refused too.
    other = RawConnection(stub_of(cluster), client_id="other")
    header = push_header(ps.shard_map.epoch, "w", (8, 4), client_id=uuid.uuid4().hex)
    with pytest.raises(grpc.RpcError) as caught:
        other.push(slots[0].slot, header)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_client_refused_more_slots_pushes_over_grpc(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(8, 4), init="uniform", optimizer=SGD1, seed=5)
        start = ps.pull("w")
        (shard,) = ps.shard_map.shards_of("w")
        connection = ps._shared_connection(ps.shard_map, shard.server_id)
        taken = [connection.push_slot(start.nbytes, timeout_s=10)
                 for _ in range(server_shm.MAX_SLOTS_PER_CONNECTION)]
        assert all(slot is not None for slot in taken)  # every slot is held by the test
        asked = calls(cluster, "PushSharedSlot")

        ps.push({"w": np.ones((8, 4), np.float32)})
        assert calls(cluster, "PushSharedSlot") == asked + 1  # refused: RESOURCE_EXHAUSTED
        ps.push({"w": np.ones((8, 4), np.float32)})
        assert calls(cluster, "PushSharedSlot") == asked + 1  # not asked again
        assert calls(cluster, "Push") == 2
        np.testing.assert_array_equal(ps.pull("w"), (start - 1) - 1)
        np.testing.assert_array_equal(grpc_pull(cluster, "w"), (start - 1) - 1)
        assert ps.data_paths == {cluster.servers[0].address: "shm"}  # pulls still are
        for slot in taken:
            connection.release(slot)


def test_a_counter_equals_the_pushes_across_lost_push_shared_responses(make_cluster):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("count", shape=(1,), init="zeros", optimizer=SGD1)
        ps.pull("count")
        cluster.faults.drop_response_next("Push", 3)
        for _ in range(10):
            ps.push({"count": -np.ones(1, np.float32)})
        assert calls(cluster, "Push") == 10 + 3  # each lost answer: the header sent again
        assert ps.pull("count")[0] == 10.0
        assert ps.data_paths == {cluster.servers[0].address: "shm"}
    assert grpc_pull(cluster, "count")[0] == 10.0


def test_a_push_that_timed_out_is_never_applied_with_the_next_push_s_gradient(
        make_cluster, monkeypatch):
    cluster = make_cluster(servers=1)
    finished: dict[int, threading.Event] = {}
    receive_shared = PushReceiver.receive_shared

    def observed(self, header, data, release=None, **kwargs):
        try:
            return receive_shared(self, header, data, release, **kwargs)
        finally:
            finished.setdefault(header.sequence, threading.Event()).set()

    monkeypatch.setattr(PushReceiver, "receive_shared", observed)
    first_held, second_held = threading.Event(), threading.Event()
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
    with PSClient(cluster.coordinator_address, timeout_s=1.5) as ps:
        ps.push({"w": np.zeros(4, np.float32)})  # sequence 1: the connection and its slot
        try:
            cluster.faults.hold_next("Push", first_held)  # sequence 2 stalls in the server
            with pytest.raises(RemoteError) as caught:
                ps.push({"w": np.full(4, 1.0, np.float32)})
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            cluster.faults.hold_next("Push", second_held)
            second = threading.Thread(target=ps.push, args=({"w": np.full(4, 100.0, np.float32)},),
                                      name="test-second-push")
            second.start()
            wait_until(lambda: calls(cluster, "Push") == 3, "the second push to arrive")
            first_held.set()  # the late push runs now, before the second one
            finished.setdefault(2, threading.Event())
            assert finished[2].wait(WAIT_S)
        finally:
            first_held.set()
            second_held.set()
        second.join(WAIT_S)
        assert not second.is_alive()
    value = grpc_pull(cluster, "w")
    # Over gRPC the late push carries its own gradient: applied (-1) or not; then -100.
    assert value[0] in (-101.0, -100.0), value


# ---- connections end with their server -------------------------------------------------

def test_a_restarted_server_ends_the_connection_and_the_client_opens_a_new_one(
        make_cluster, tmp_path):
    cluster = make_cluster(servers=1, checkpoint_dir=tmp_path / "checkpoints")
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(6, 3), init={"name": "constant", "value": 2.0}, optimizer=SGD1)
        ps.push({"w": np.ones((6, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), np.ones((6, 3), np.float32))
        address = cluster.servers[0].address
        assert ps.data_paths == {address: "shm"}
        cluster.checkpoint()
        ps.push({"w": np.ones((6, 3), np.float32)})  # after the checkpoint: lost
        old = cluster.servers[0]
        old_segments = [old.shared.control.name, *value_segments(old)]
        assert all(exists(name) for name in old_segments)

        new = cluster.restart_server(0)
        assert not any(exists(name) for name in old_segments)
        assert new.shared.control.name not in old_segments
        # Restored from the checkpoint: the next calls find the connection gone and go on.
        np.testing.assert_array_equal(ps.pull("w"), np.ones((6, 3), np.float32))
        ps.push({"w": np.ones((6, 3), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), np.zeros((6, 3), np.float32))
        assert ps.data_paths == {address: "shm"}
        pulled = calls(cluster, "Pull")
        pushed = calls(cluster, "Push")
        np.testing.assert_array_equal(ps.pull("w"), np.zeros((6, 3), np.float32))
        ps.push({"w": np.ones((6, 3), np.float32)})
        assert calls(cluster, "Pull") == pulled  # through the new connection's segments
        assert calls(cluster, "Push") == pushed + 1
        assert value_segments(new)  # the restored shard lives in shared memory
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), -np.ones((6, 3), np.float32))


# ---- segments a dead server left behind ---------------------------------------------------------

@pytest.fixture
def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait(WAIT_S) == 0
    return child.pid


@pytest.fixture
def planted():
    """plant(name) -> a real segment made by the test; removed after it in any case."""
    made: list[Path] = []

    def plant(name: str) -> shm.Segment:
        segment = shm.create(name, 64)
        made.append(segment.path)
        return segment

    yield plant
    for path in made:
        shm.unlink(path)


def test_clear_dead_removes_segments_of_dead_servers_and_keeps_live_ones(dead_pid, planted):
    me = os.getpid()
    serial = 900_000 + (uuid.uuid4().int % 99_999)
    dead = planted(f"{shm.PREFIX}{dead_pid}.12345.{serial}.values")
    reused = planted(f"{shm.PREFIX}{me}.1.{serial}.values")  # this pid, another start time
    live = planted(f"{own_prefix()}{serial}.values")
    assert not dead.retired

    server_shm.clear_dead()
    assert not dead.path.exists() and not reused.path.exists()
    assert dead.retired and reused.retired  # marked first: mappings of it stop being used
    assert live.path.exists() and not live.retired



def test_clear_dead_removes_a_control_segment_its_dead_maker_never_renamed(dead_pid):
    half_made = shm.DIRECTORY / f".{shm.PREFIX}{dead_pid}.777.1.control.{dead_pid}.new"
    half_made.write_bytes(b"")
    try:
        server_shm.clear_dead()
        assert not half_made.exists()
    finally:
        shm.unlink(half_made)

def test_a_starting_server_clears_what_a_dead_server_left(dead_pid, planted):
    serial = 900_000 + (uuid.uuid4().int % 99_999)
    control = planted(f"{shm.PREFIX}{dead_pid}.777.{serial}.control")
    values = planted(f"{shm.PREFIX}{dead_pid}.777.{serial + 1}.values")
    with ParameterServer(ServerConfig(grace_s=0.5)) as server:
        assert server.data_path == "shm"
        assert not control.path.exists() and not values.path.exists()
        assert control.retired and values.retired
        assert exists(server.shared.control.name)
    assert not exists(server.shared.control.name)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "no-shm"])
def test_a_starting_server_clears_what_a_dead_server_left_with_or_without_shm(
        dead_pid, planted, shared_memory):
    serial = 900_000 + (uuid.uuid4().int % 99_999)
    values = planted(f"{shm.PREFIX}{dead_pid}.777.{serial}.values")
    with ParameterServer(ServerConfig(grace_s=0.5, shared_memory=shared_memory)):
        assert not values.path.exists() and values.retired


def test_a_live_server_in_another_pid_namespace_keeps_its_segments(
        dead_pid, planted, monkeypatch):
    """Containers of one pod share /dev/shm but not their pids: a live server's pid may mean
    nothing here. Its lock on its control segment says it runs."""
    with ParameterServer(ServerConfig(grace_s=0.5)) as live:
        live_segments = {p for p in shm.DIRECTORY.iterdir() if p.name.startswith(own_prefix())}
        assert live.shared.control.path in live_segments
        assert not [p for p in shm.DIRECTORY.iterdir() if p.name.endswith(".new")]
        serial = 900_000 + (uuid.uuid4().int % 99_999)
        dead_control = planted(f"{shm.PREFIX}{dead_pid}.777.{serial}.control")  # no lock
        alive = shm.owner_alive  # this process's pid is not visible, as if in another pod
        monkeypatch.setattr(shm, "owner_alive",
                            lambda name: not name.startswith(own_prefix()) and alive(name))
        server_shm.clear_dead()
        assert all(p.exists() for p in live_segments)
        assert not live.shared.control.retired
        assert not dead_control.path.exists()
    assert not live.shared.control.path.exists()  # and once it stops, nothing is left


def test_a_small_slot_its_client_truncated_is_refused_before_it_is_read(make_cluster):
    """Read through its mapping, a truncated slot would kill the server with SIGBUS."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        epoch = ps.refresh().epoch
    stub = ps_grpc.ParameterServerStub(grpc.insecure_channel(cluster.servers[0].address))
    opened = stub.OpenSharedMemory(ps_pb.OpenSharedMemoryRequest(client_id="c"), timeout=10)
    secret = bytes(shm.attach(opened.probe, writable=False).data[:shm.SECRET_BYTES])
    made = stub.PushShared(ps_pb.PushSharedRequest(
        connection=opened.connection, secret=secret, slot_bytes=16), timeout=10)
    os.truncate(shm.DIRECTORY / made.segment, 0)
    header = ps_pb.PushHeader(
        client_id="c", incarnation=1, sequence=1, acked_through=0, epoch=epoch,
        shards=[ps_pb.ShardRef(variable="w", index=0)],
        tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[4])])
    with pytest.raises(grpc.RpcError) as caught:
        stub.PushShared(ps_pb.PushSharedRequest(connection=opened.connection, secret=secret,
                                                slot=made.slot, header=header), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fewer than" in caught.value.details()
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.zeros(4, np.float32))


def test_handshakes_never_proven_do_not_end_a_proven_connection(make_cluster, monkeypatch):
    """A caller that cannot read the probe (another host) may open connections without end:
    past the limit, those go first, not the connections of workers on this host."""
    monkeypatch.setattr(server_shm, "MAX_CONNECTIONS", 8)
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})  # a proven connection, holding a slot
        stub = ps_grpc.ParameterServerStub(grpc.insecure_channel(cluster.servers[0].address))
        for _ in range(2 * server_shm.MAX_CONNECTIONS):
            stub.OpenSharedMemory(ps_pb.OpenSharedMemoryRequest(client_id="remote"), timeout=10)
        handshakes, through_socket = calls(cluster, "OpenSharedMemory"), cluster.faults.socket_calls
        for _ in range(2):
            ps.push({"w": np.ones(4, np.float32)})
        assert calls(cluster, "OpenSharedMemory") == handshakes  # no new handshake
        assert cluster.faults.socket_calls == through_socket + 2  # both through its slot
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.full(4, -3.0, np.float32))



def test_a_new_connection_makes_room_when_every_other_one_is_proven(monkeypatch):
    monkeypatch.setattr(server_shm, "MAX_CONNECTIONS", 2)
    memory = server_shm.SharedMemory()
    try:
        first = memory.open_connection("a")
        for client in ("a", "b"):
            made = first if client == "a" else memory.open_connection(client)
            assert memory.connection(made.id, made.secret) is made  # proven
        new = memory.open_connection("c")
        assert not new.ended and memory.connection(new.id, new.secret) is new
        assert first.ended  # the least recently used made room
    finally:
        memory.close()

# ---- a server told to exit by its coordinator ----------------------------------------------------

def test_a_server_told_to_exit_has_removed_its_segments_when_its_main_loop_returns(monkeypatch):
    coordinator = Coordinator(CoordinatorConfig(
        job=JobSpec(epochs=1), heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0,
        recovery_grace_s=0.0, grace_s=0.5, checkpoint_every=None)).start()
    server = ParameterServer(ServerConfig(
        coordinator=coordinator.address, server_id="ps-0", heartbeat_interval_s=0.1,
        grace_s=0.5)).start()
    control = server.shared.control.name
    closing, go_on = threading.Event(), threading.Event()
    close = server.shared.close

    def slow_close():  # a close that takes a while (many segments, a slow tmpfs)
        closing.set()
        go_on.wait(WAIT_S)
        close()

    monkeypatch.setattr(server.shared, "close", slow_close)
    try:
        assert server.registered.wait(WAIT_S)
        assert coordinator.runner.fail("the test ends the job")
        # What ps-server's main thread runs; the process exits when it returns.
        code = run_until_signal(server.stop, server.wait, lambda: None)
        left = exists(control)
    finally:
        go_on.set()
        wait_until(lambda: not exists(control), "the server's stop() to finish")
        server.stop()
        coordinator.stop()
    assert code == 0
    assert not left, f"ps-server's main loop returned with {control} still in /dev/shm"


# ---- no segment outlives its use -----------------------------------------------------------

class _Restored:
    """A prepared restore (ps_server.restore.ShardRestore) that read `held` from a checkpoint."""

    def __init__(self, held: dict):
        self.shards, self.created = set(held), held

    @staticmethod
    def failure(shard) -> str:
        return f"checkpoint could not give {shard.key}"


@pytest.fixture
def shared_store():
    """(SharedMemory, ShardStore keeping its values in it, restored(spec, shard))."""
    memory = server_shm.SharedMemory()
    store = ShardStore(memory=memory)

    def restored(spec: VariableSpec, shard: Shard) -> _Restored:
        values = memory.empty(shard.shape(spec), spec.dtype)
        values[...] = 7.0
        return _Restored({shard.key: HeldShard(spec, shard, values,
                                               make_state(spec, values.shape), {})})

    yield memory, store, restored
    memory.close()


def _spec_and_shard(rows: int = 8) -> tuple[VariableSpec, Shard]:
    spec = VariableSpec("w", (rows, 4))
    return spec, Shard("w", 0, 0, rows, "s0")


def test_restored_shards_an_assignment_does_not_install_are_removed(shared_store):
    memory, store, restored = shared_store
    spec, shard = _spec_and_shard()
    before = own_segments()
    store.assign(2, {"w": spec}, [shard])
    installed = own_segments() - before
    assert len(installed) == 1

    # The same assignment delivered again while a restore was read for it: the shard is in
    # place already, so the restored copy is dropped.
    store.assign(2, {"w": spec}, [shard], restore=restored(spec, shard))
    assert own_segments() - before == installed
    # Refused as stale, and refused for naming an undeclared variable: nothing stays.
    with pytest.raises(StaleEpoch):
        store.assign(1, {"w": spec}, [shard], restore=restored(spec, shard))
    with pytest.raises(InvalidArgument):
        store.assign(3, {}, [shard], restore=restored(spec, shard))
    assert own_segments() - before == installed
    assert store.epoch == 2


def test_a_shard_whose_optimizer_state_runs_out_of_memory_leaves_no_segment(
        shared_store, monkeypatch):
    memory, store, _ = shared_store
    spec, shard = _spec_and_shard()
    before = own_segments()

    def out_of_memory(spec, shape):
        raise MemoryError

    monkeypatch.setattr(store_module, "make_state", out_of_memory)
    outcome = store.assign(1, {"w": spec}, [shard])
    assert [failed.key for failed, _ in outcome.failed] == [shard.key]
    assert own_segments() == before


def test_nothing_made_after_close_is_left_in_shared_memory(shared_store):
    memory, _, _ = shared_store
    connection = memory.open_connection("late-client")
    memory.close()
    assert not own_segments()
    values = memory.empty((16,), "float32")  # a handler still running as the server stops
    values[...] = 1.0  # still usable: its mapping outlives the name
    assert memory.new_slot(connection, 64, 1024) is None
    assert memory.slot(connection, 1) is None
    assert not own_segments()


def test_a_push_to_a_connection_ending_meanwhile_is_connection_lost_not_invalid_argument(
        make_cluster, stub_of, monkeypatch):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        epoch = ps.shard_map.epoch
    raw = RawConnection(stub_of(cluster))
    made = raw.new_slot(16)
    assert made.slot
    memory = cluster.servers[0].shared
    found = memory.connection

    def found_then_ended(connection_id, secret):
        """The connection is evicted just after the call found it."""
        connection = found(connection_id, secret)
        memory.close_connection(connection)
        return connection

    monkeypatch.setattr(memory, "connection", found_then_ended)
    reply = raw.push(made.slot, push_header(epoch, "w", (4,), client_id="raw-client"))
    assert reply.connection_lost
    monkeypatch.undo()
    raw = RawConnection(stub_of(cluster))
    monkeypatch.setattr(memory, "connection", found_then_ended)
    assert raw.new_slot(16).connection_lost
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.zeros(4, np.float32))


def test_shared_memory_calls_on_a_closed_channel_fall_back_instead_of_raising(make_cluster):
    """interrupt() closes a client's channels: the shared-memory handshake, attach and slot
    calls then leave the call to gRPC (which says CANCELLED) instead of raising ValueError."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        shards = ps.shard_map.shards_of("w")
        epoch = ps.shard_map.epoch
    channel = grpc.insecure_channel(cluster.servers[0].address)
    stub = ps_grpc.ParameterServerStub(channel)
    connection = client_shm.SharedConnection.open(stub, "closing-client", "s0")
    assert connection is not None
    channel.close()
    assert client_shm.SharedConnection.open(stub, "closing-client", "s0") is None
    assert connection.push_slot(16, 5.0) is None
    out = np.empty(4, np.float32)
    assert not connection.read(epoch, list(shards), [out], 5.0)
    connection.close()


def test_a_push_slot_is_never_reused_after_an_attempt_without_an_answer(make_cluster):
    """The first attempt's answer is lost, the retry is answered: the server may still have
    been reading the slot for the first, so the next push gets a new one."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        slots = calls(cluster, "PushSharedSlot")
        ps.push({"w": np.ones(4, np.float32)})
        assert calls(cluster, "PushSharedSlot") == slots  # an answered push frees its slot
        cluster.faults.drop_response_next("Push")
        ps.push({"w": np.ones(4, np.float32)})  # applied once, answered on the retry
        ps.push({"w": np.ones(4, np.float32)})
        assert calls(cluster, "PushSharedSlot") == slots + 1
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.full(4, -4.0, np.float32))



def test_a_push_slot_whose_write_fails_is_given_back_unsent(make_cluster, monkeypatch):
    """An error while the gradient is written into the slot (here, injected) reaches the
    caller with nothing sent, and the slot serves the next push."""
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"w": np.ones(4, np.float32)})
        slots, pushes = calls(cluster, "PushSharedSlot"), calls(cluster, "Push")
        write = client_shm.PushSlot.write

        def failing(slot, tensors, **kwargs):
            monkeypatch.setattr(client_shm.PushSlot, "write", write)
            raise MemoryError("injected")

        monkeypatch.setattr(client_shm.PushSlot, "write", failing)
        with pytest.raises(MemoryError, match="injected"):
            ps.push({"w": np.ones(4, np.float32)})
        assert calls(cluster, "Push") == pushes  # nothing went out
        ps.push({"w": np.ones(4, np.float32)})
        assert calls(cluster, "PushSharedSlot") == slots  # the same slot again
    np.testing.assert_array_equal(grpc_pull(cluster, "w"), np.full(4, -2.0, np.float32))

def test_a_server_that_cannot_bind_its_port_leaves_no_segment():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    before = own_segments()
    try:
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{taken.getsockname()[1]}"):
            ParameterServer(ServerConfig(host="127.0.0.1", port=taken.getsockname()[1]))
    finally:
        taken.close()
    assert own_segments() == before


def test_a_failed_handshake_is_tried_again_and_the_client_moves_to_shared_memory(
        make_cluster, monkeypatch):
    cluster = make_cluster(servers=1)
    with PSClient(cluster.coordinator_address) as setup:
        setup.declare("w", shape=(4,), init="zeros", optimizer=SGD1)
    monkeypatch.setattr(client_module, "HANDSHAKE_RETRY_S", 0.0, raising=False)
    with PSClient(cluster.coordinator_address) as ps:
        cluster.faults.fail_next("OpenSharedMemory")
        pulled = calls(cluster, "Pull")
        ps.pull("w")  # the handshake fails: over gRPC this time
        assert calls(cluster, "Pull") == pulled + 1
        assert ps.data_paths == {cluster.servers[0].address: "grpc"}
        ps.push({"w": np.ones(4, np.float32)})  # the next call tries again, and gets one
        assert ps.data_paths == {cluster.servers[0].address: "shm"}
        pulled = calls(cluster, "Pull")
        np.testing.assert_array_equal(ps.pull("w"), -np.ones(4, np.float32))
        assert calls(cluster, "Pull") == pulled


def test_a_client_unmaps_a_shard_that_moved_off_a_server_it_still_shares_memory_with(
        make_cluster, tmp_path):
    """A server out of reach past --server-timeout comes back after its shards moved: the
    client keeps its connection to it, but not its mapping of the moved shard's segment,
    which would hold the shard's memory (and a descriptor) for as long as the connection."""
    from ps_worker import RetryPolicy

    cluster = make_cluster(servers=2, checkpoint_dir=tmp_path, server_timeout_s=0.5)
    patient = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.05)
    with PSClient(cluster.coordinator_address, retry=patient) as ps:
        ps.declare("a", shape=(4,), init="zeros", optimizer=SGD1)
        ps.declare("b", shape=(4,), init="zeros", optimizer=SGD1)
        ps.push({"a": np.ones(4, np.float32)})
        cluster.checkpoint()
        holder_id = ps.shard_map.shards_of("a")[0].server_id
        holder = next(s for s in cluster.servers if s.server_id == holder_id)
        ps.pull(["a", "b"])
        connection = ps._shared[ps.shard_map.servers[holder_id]]
        assert connection._attached.get(("a", 0)) is not None  # mapped
        reachable = cut_off_from_coordinator(holder)
        wait_until(lambda: ps.refresh().shards_of("a")[0].server_id != holder_id,
                   "the shard to move", timeout_s=WAIT_S)
        reachable.set()
        np.testing.assert_array_equal(ps.pull("a"), np.full(4, -1.0, np.float32))
        assert ("a", 0) not in connection._attached


def test_a_shared_push_over_grpc_whose_call_is_not_answered_is_retried_exactly_once(
        make_cluster, monkeypatch):
    """A shared-memory push announced over gRPC (the server offers no push socket, as a
    server out of sockets or one just restarted does) whose call fails with UNAVAILABLE is
    retried under the same sequence, applied exactly once, like any other push (ps-cluster
    --chaos kills a server and its workers go on)."""
    from ps_server import push_socket

    cluster = make_cluster(servers=1)
    monkeypatch.setattr(push_socket, "MAX_SOCKETS", 0)  # PushShared goes over gRPC
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare("w", shape=(4,), optimizer=SGD1)
        cluster.wait_until_synced()
        ps.push({"w": np.ones(4, np.float32)})
        cluster.faults.fail_next("Push", 1, grpc.StatusCode.UNAVAILABLE)
        ps.push({"w": np.ones(4, np.float32)})
        assert ps.data_paths == {cluster.servers[0].address: "shm"}
    assert cluster.faults.socket_calls == 0
    assert cluster.faults.calls["Push"] == 3  # the failed call retried once
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        np.testing.assert_array_equal(ps.pull("w"), np.full(4, -2.0, np.float32))
