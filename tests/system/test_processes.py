"""Real ps-coordinator and ps-server processes: start-up on port 0, the data path through
PSClient, graceful SIGTERM, SIGKILL and restart, and refused command lines."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_server.initializers import initialize_rows
from ps_worker import PSClient, RemoteError, RetryPolicy
from ps_worker.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.system

COORDINATOR = [sys.executable, "-m", "ps_server.coordinator.cli"]
SERVER = [sys.executable, "-m", "ps_server.cli"]
LISTENING = re.compile(r"listening on (\S+:\d+)")
START_TIMEOUT_S = 20.0
EXIT_TIMEOUT_S = 15.0
# Declaring waits for the server to register: retry UNAVAILABLE for a bounded while.
PATIENT = RetryPolicy(max_attempts=60, initial_backoff_s=0.05, max_backoff_s=0.25)
SGD1 = {"name": "sgd", "lr": 1.0}


class Process:
    """A child process whose stdout is read line by line by a named thread."""

    def __init__(self, argv: list[str], stderr_path: Path):
        self.argv = argv
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._stderr,
                                      stdin=subprocess.DEVNULL, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"test-reader-{self.popen.pid}")
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def wait_for_address(self, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.argv}: no 'listening on' line within {timeout} s; "
                                     f"stderr:\n{self.stderr()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"{self.argv} exited with {self.popen.wait(5)} before "
                                     f"listening; stderr:\n{self.stderr()}")
            match = LISTENING.search(line)
            if match:
                return match.group(1)

    def terminate_and_wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout)

    def kill(self) -> None:
        """End the process (if still running), its reader thread and files. Idempotent."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(EXIT_TIMEOUT_S)
        self._reader.join(EXIT_TIMEOUT_S)
        self.popen.stdout.close()
        self._stderr.close()


@pytest.fixture
def spawn(tmp_path):
    """spawn(argv) -> Process; every process is killed after the test, pass or fail."""
    started: list[Process] = []

    def start(argv: list[str]) -> Process:
        proc = Process(argv, tmp_path / f"stderr-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.kill()


def start_cluster(spawn, *coordinator_args: str) -> tuple[Process, str, Process, str]:
    coordinator = spawn([*COORDINATOR, "--port", "0", "--grace", "1", "--recovery-grace", "0",
                         *coordinator_args])
    coordinator_address = coordinator.wait_for_address()
    server = spawn([*SERVER, "--port", "0", "--coordinator", coordinator_address,
                    "--server-id", "s0", "--grace", "1", "--heartbeat-interval", "0.2"])
    server_address = server.wait_for_address()
    return coordinator, coordinator_address, server, server_address


def test_declare_push_pull_then_sigterm_exits_zero(spawn):
    coordinator, coordinator_address, server, server_address = start_cluster(spawn)
    with PSClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
        spec = ps.declare("w", shape=(300, 7), init="glorot_uniform", optimizer=SGD1, seed=5)
        assert ps.shard_map.servers == {"s0": server_address}
        start = ps.pull("w")
        np.testing.assert_array_equal(start, initialize_rows(spec, 0, 300))
        grad = np.arange(2100, dtype=np.float32).reshape(300, 7) % 3
        ps.push({"w": grad})
        ps.push({"w": grad})
        np.testing.assert_array_equal(ps.pull("w"), (start - grad) - grad)

    assert server.terminate_and_wait() == 0
    assert coordinator.terminate_and_wait() == 0


def _kill_and_restart_server(spawn, server: Process, server_address: str,
                             coordinator_address: str) -> Process:
    server.popen.kill()
    assert server.popen.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL
    again = spawn([*SERVER, "--port", server_address.rsplit(":", 1)[1], "--coordinator",
                   coordinator_address, "--server-id", "s0", "--grace", "1",
                   "--heartbeat-interval", "0.2"])
    assert again.wait_for_address() == server_address
    return again


def test_killed_server_back_without_its_values_fails_with_data_loss(spawn):
    coordinator, coordinator_address, server, server_address = start_cluster(spawn)
    with PSClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
        ps.declare("w", shape=(50, 4), init="uniform", optimizer=SGD1, seed=2)
        ps.push({"w": np.ones((50, 4), np.float32)})
        again = _kill_and_restart_server(spawn, server, server_address, coordinator_address)
        # No checkpoints: the trained values are gone, and nobody trains on from scratch.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                ps.refresh()
            except RemoteError as error:
                if error.code() == grpc.StatusCode.DATA_LOSS:
                    assert "s0" in error.details() and "w[0:50]" in error.details()
                    break
                raise
            assert time.monotonic() < deadline, "the coordinator never reported the loss"
            time.sleep(0.05)
    assert "came back without the trained values" in coordinator.stderr()
    assert again.terminate_and_wait() == 0
    assert coordinator.terminate_and_wait() == 0


def test_killed_server_restarts_on_its_port_and_clients_recover(spawn):
    coordinator, coordinator_address, server, server_address = start_cluster(
        spawn, "--reinitialize-lost-shards")
    with PSClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
        spec = ps.declare("w", shape=(50, 4), init="uniform", optimizer=SGD1, seed=2)
        ps.push({"w": np.ones((50, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), initialize_rows(spec, 0, 50) - 1)
        again = _kill_and_restart_server(spawn, server, server_address, coordinator_address)

        # Opted in: the shard is re-created with its initial values, and the client (which
        # retries UNAVAILABLE) keeps working without being told anything.
        np.testing.assert_array_equal(ps.pull("w"), initialize_rows(spec, 0, 50))
        ps.push({"w": np.ones((50, 4), np.float32)})
        np.testing.assert_array_equal(ps.pull("w"), initialize_rows(spec, 0, 50) - 1)

    assert again.terminate_and_wait() == 0
    assert coordinator.terminate_and_wait() == 0


@pytest.mark.parametrize("argv,flag", [
    ([*SERVER, "--port", "70000"], "--port"),
    ([*SERVER, "--coordinator", "nonsense"], "--coordinator"),
    ([*SERVER, "--chunk-bytes", "12"], "--chunk-bytes"),
    ([*SERVER, "--memory-budget", "lots"], "--memory-budget"),
    ([*COORDINATOR, "--port", "70000"], "--port"),
    ([*COORDINATOR, "--heartbeat-interval", "2", "--heartbeat-timeout", "1"],
     "--heartbeat-timeout"),
    ([*COORDINATOR, "--split-threshold", "0"], "--split-threshold"),
    ([*COORDINATOR, "--checkpoint-every", "soon"], "--checkpoint-every"),
    ([*COORDINATOR, "--keep-checkpoints", "0"], "--keep-checkpoints"),
    ([sys.executable, "-m", "ps_worker.cli", "--coordinator", "127.0.0.1:1",
      "--step-delay", "-1"], "--step-delay"),
], ids=["server-port", "server-coordinator", "server-chunk-bytes", "server-memory-budget",
        "coordinator-port", "coordinator-heartbeat", "coordinator-split-threshold",
        "coordinator-checkpoint-every", "coordinator-keep-checkpoints", "worker-step-delay"])
def test_bad_flag_exits_nonzero_naming_the_flag(argv, flag):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert flag in done.stderr
    assert "listening on" not in done.stdout


@pytest.mark.parametrize("program", [SERVER, COORDINATOR], ids=["server", "coordinator"])
def test_port_in_use_exits_nonzero_naming_the_flag(program):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*program, "--port", str(port)], capture_output=True, text=True,
                              timeout=EXIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "--port" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_lets_a_push_in_flight_finish_and_exits_zero(spawn):
    """SIGTERM arrives while a push is on the wire: the server stops taking new RPCs but
    finishes this one within its grace period, applies it, and exits 0."""
    import grpc

    from ps_proto.v1 import parameter_server_pb2 as ps_pb
    from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
    from ps_proto.v1 import tensor_pb2

    coordinator = spawn([*COORDINATOR, "--port", "0", "--grace", "1"])
    coordinator_address = coordinator.wait_for_address()
    server = spawn([*SERVER, "--port", "0", "--coordinator", coordinator_address,
                    "--server-id", "s0", "--grace", "10", "--heartbeat-interval", "0.2"])
    server_address = server.wait_for_address()
    rows, cols, chunk = 512, 1024, 64 * 1024
    with PSClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
        ps.declare("w", shape=(rows, cols), optimizer=SGD1)
        epoch = ps.shard_map.epoch
    payload = np.ones((rows, cols), np.float32).tobytes()
    pushing = threading.Event()
    header = ps_pb.PushHeader(
        client_id="sigterm-test", incarnation=1, sequence=1, epoch=epoch,
        shards=[ps_pb.ShardRef(variable="w", index=0)],
        tensors=[tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[rows, cols])])

    # gRPC asks for a chunk once the one before is written to the transport, which buffers
    # at most the server's receive window (1 MiB, --receive-window) of a stream it has not
    # taken in: once 1.5 MiB have been asked for, the call is on the server, not only queued
    # on the client (a SIGTERM then would refuse it as a new call: UNAVAILABLE).
    on_the_server = 3 * (1 << 20) // 2 // chunk

    def chunks():
        yield ps_pb.PushChunk(header=header, data=payload[:chunk])
        for index, start in enumerate(range(chunk, len(payload), chunk), 1):
            if index == on_the_server:
                pushing.set()
            yield ps_pb.PushChunk(data=payload[start:start + chunk])

    outcome = {}

    def push():
        with grpc.insecure_channel(server_address) as channel:
            try:
                outcome["reply"] = ps_grpc.ParameterServerStub(channel).Push(chunks(), timeout=30)
            except grpc.RpcError as error:
                outcome["error"] = error.code()

    pusher = threading.Thread(target=push, name="sigterm-test-push")
    pusher.start()
    assert pushing.wait(30)
    server.popen.send_signal(signal.SIGTERM)
    pusher.join(40)
    assert not pusher.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["reply"].duplicate is False  # a Push answers only once it is applied
    assert server.popen.wait(EXIT_TIMEOUT_S) == 0



@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_server_starts_stops_it_gracefully_leaving_no_segment(spawn, signum):
    """Sent as soon as its first shared-memory segment exists, before it says it listens."""
    from ps_common import shm

    if shm.supported() is not None:
        pytest.skip(shm.supported())
    server = spawn([*SERVER, "--port", "0", "--grace", "1"])
    prefix = f"{shm.PREFIX}{server.popen.pid}."

    def segments() -> list[str]:
        return [p.name for p in shm.DIRECTORY.iterdir() if p.name.startswith(prefix)]

    deadline = time.monotonic() + START_TIMEOUT_S
    while not segments() and server.popen.poll() is None and time.monotonic() < deadline:
        pass  # a bounded busy wait: the window before the ready line is milliseconds
    assert segments(), f"no segment made; stderr:\n{server.stderr()}"
    server.popen.send_signal(signum)
    assert server.popen.wait(EXIT_TIMEOUT_S) == 0, server.stderr()
    assert segments() == []

# ---- durability: checkpoints across a server SIGKILL ---------------------------------------

CTL = [sys.executable, "-m", "ps_worker.ctl"]
COUNT_UP = -np.ones(1, np.float32)  # SGD lr 1: every push adds exactly 1.0 to the counter


class LostResponse(grpc.RpcError):
    """What a client sees when a push's response is lost after the server applied it."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "injected loss of the Push response"


class _ResponseLost:
    """A push future whose answer is dropped once the server has answered."""

    def __init__(self, inner):
        self._inner = inner

    def result(self, timeout=None):
        self._inner.result(timeout)
        raise LostResponse()

    def cancel(self):
        return self._inner.cancel()


class LossyClient(PSClient):
    """Loses the response of every `every`-th push attempt (the push itself lands), on
    every way a push goes out: a stream, one message, or a header for shared memory (over
    gRPC or the push socket)."""

    def __init__(self, *args, every: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self._every, self._attempts, self.lost = every, 0, 0

    def _lose_this_one(self, reply) -> bool:
        if isinstance(reply, ps_pb.PushSharedReply) and not reply.HasField("reply"):
            return False  # a slot handed out: no push in it
        self._attempts += 1
        if self._attempts % self._every:
            return False
        self.lost += 1
        return True

    def _stub(self, address):
        stub, client = super()._stub(address), self

        class LossyPush:
            def future(self, chunks, timeout=None):
                call = stub.Push.future(chunks, timeout=timeout)
                return _ResponseLost(call) if client._lose_this_one(None) else call

        def lossy(method):
            def call(request, timeout=None):
                reply = method(request, timeout=timeout)
                if client._lose_this_one(reply):
                    raise LostResponse()
                return reply
            return call

        class Stub:
            Push = LossyPush()
            PushUnary = staticmethod(lossy(stub.PushUnary))
            PushShared = staticmethod(lossy(stub.PushShared))

            def __getattr__(self, name):
                return getattr(stub, name)

        return Stub()

    def _shared_connection(self, shard_map, server_id):
        connection = super()._shared_connection(shard_map, server_id)
        if connection is not None and not getattr(connection, "lossy", False):
            push, client = connection.push, self

            def lossy_push(request, timeout_s):  # the push socket's way
                reply = push(request, timeout_s)
                if reply is not None and client._lose_this_one(reply):
                    raise LostResponse()
                return reply

            connection.push, connection.lossy = lossy_push, True
        return connection


def checkpointed_counter(manifest_dir: Path) -> float:
    """The counter as the checkpoint holds it, read with the reference safetensors library."""
    from safetensors.numpy import load_file

    manifest = json.loads((manifest_dir / "manifest.json").read_text())
    (shard,) = manifest["shards"]
    tensors = load_file(manifest_dir / shard["file"])
    return float(tensors[f"count/{shard['index']}"][0])


def test_a_counter_equals_the_acknowledged_pushes_across_lost_responses_and_a_server_sigkill(
        spawn, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    coordinator, coordinator_address, server, server_address = start_cluster(
        spawn, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3600s")
    with LossyClient(coordinator_address, retry=PATIENT, timeout_s=10) as ps:
        ps.declare("count", shape=(1,), init="zeros", optimizer=SGD1)
        for _ in range(20):
            ps.push({"count": COUNT_UP})
        assert ps.lost >= 6  # retries of applied pushes were deduplicated:
        assert ps.pull("count")[0] == 20.0

        taken = subprocess.run([*CTL, "--coordinator", coordinator_address, "checkpoint"],
                               capture_output=True, text=True, timeout=60)
        assert taken.returncode == 0, taken.stderr
        info = json.loads(taken.stdout)
        assert checkpointed_counter(checkpoints / info["id"]) == 20.0
        for _ in range(7):  # acknowledged after the checkpoint: within the bound that is lost
            ps.push({"count": COUNT_UP})
        assert ps.pull("count")[0] == 27.0

        server.popen.kill()
        assert server.popen.wait(EXIT_TIMEOUT_S) == -signal.SIGKILL
        # A push while the server is down retries until it is back, and lands exactly once.
        waiting = threading.Thread(target=ps.push, args=({"count": COUNT_UP},))
        waiting.start()
        again = spawn([*SERVER, "--port", server_address.rsplit(":", 1)[1], "--coordinator",
                       coordinator_address, "--server-id", "s0", "--grace", "1",
                       "--heartbeat-interval", "0.2"])
        again.wait_for_address()
        waiting.join(START_TIMEOUT_S)
        assert not waiting.is_alive()
        assert ps.pull("count")[0] == 21.0  # the checkpoint's 20, then the retried push
        for _ in range(9):
            ps.push({"count": COUNT_UP})
        assert ps.pull("count")[0] == 30.0

    assert re.search(r"restored variable 'count' shard 0 .* from checkpoint .*"
                     + info["id"] + r" \(step", again.stderr())
    assert again.terminate_and_wait() == 0
    assert coordinator.terminate_and_wait() == 0


def test_a_checkpoint_of_three_servers_restores_onto_two_skipping_a_truncated_newer_one(
        spawn, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    flags = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "off",
             "--split-threshold", "1KiB")

    def start(servers: int) -> tuple[Process, str, list[Process]]:
        coordinator = spawn([*COORDINATOR, "--port", "0", "--grace", "1",
                             "--recovery-grace", "0", *flags])
        address = coordinator.wait_for_address()
        procs = [spawn([*SERVER, "--port", "0", "--coordinator", address, "--server-id",
                        f"s{i}", "--grace", "1", "--heartbeat-interval", "0.2"])
                 for i in range(servers)]
        for proc in procs:
            proc.wait_for_address()
        with CoordinatorClient(address) as client:  # placement needs them all registered
            deadline = time.monotonic() + START_TIMEOUT_S
            while sum(v["state"] == "alive" for v in client.status()["servers"]) < servers:
                assert time.monotonic() < deadline, "servers did not register"
                time.sleep(0.05)
        return coordinator, address, procs

    def checkpoint(address: str) -> str:
        taken = subprocess.run([*CTL, "--coordinator", address, "checkpoint"],
                               capture_output=True, text=True, timeout=60)
        assert taken.returncode == 0, taken.stderr
        return json.loads(taken.stdout)["id"]

    def declare(ps: PSClient) -> None:
        ps.declare("w", shape=(90, 8), init="glorot_uniform", seed=4,
                   optimizer={"name": "adam", "lr": 0.01})

    coordinator, address, servers = start(3)
    rng = np.random.default_rng(1)
    with PSClient(address, retry=PATIENT, timeout_s=10) as ps:
        declare(ps)
        assert len({s.server_id for s in ps.shard_map.shards_of("w")}) == 3
        ps.push({"w": rng.normal(size=(90, 8)).astype(np.float32)})
        kept = ps.pull("w")
        good = checkpoint(address)
        ps.push({"w": rng.normal(size=(90, 8)).astype(np.float32)})
        bad = checkpoint(address)
    for proc in (*servers, coordinator):
        assert proc.terminate_and_wait() == 0
    truncated = next((checkpoints / bad).glob("*.safetensors"))
    truncated.write_bytes(truncated.read_bytes()[:-8])

    coordinator, address, servers = start(2)
    with PSClient(address, retry=PATIENT, timeout_s=10) as ps:
        declare(ps)
        assert len({s.server_id for s in ps.shard_map.shards_of("w")}) == 2
        np.testing.assert_array_equal(ps.pull("w"), kept)
    for proc in (*servers, coordinator):
        assert proc.terminate_and_wait() == 0
    log = coordinator.stderr()
    assert f"checkpoint {checkpoints / bad} is unusable" in log and "truncated" in log
    assert f"newest good checkpoint: {checkpoints / good}" in log
