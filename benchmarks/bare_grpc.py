"""The transfer baseline: bare grpcio moving raw bytes, no protobuf, no paramserve code.

The server (`python benchmarks/bare_grpc.py serve --port 0`, a separate process) offers
three methods through `grpc.method_handlers_generic_handler` with identity (bytes in,
bytes out) serializers:

  /bare.Bench/Download  unary-stream: request = (total, chunk, copy) -> `total` bytes in
                        messages of `chunk` bytes
  /bare.Bench/Upload    stream-unary: first message (total, chunk, copy), then the data
                        messages -> 8 bytes, the count received
  /bare.Bench/Echo      unary-unary: returns the request bytes

With copy=True (the baseline) each side does exactly the one copy per byte that a Python
peer cannot avoid: the sender builds each message with bytes(memoryview slice) of a
long-lived buffer, the receiver writes each message into a long-lived buffer. With
copy=False the sender re-sends one prebuilt message and the receiver only counts bytes:
the ceiling of grpcio itself.

Run standalone (`python benchmarks/bare_grpc.py --seconds 3`) it prints all three;
`--quick` runs each for a moment (4 MiB transfers, 50 echoes) to show that it still runs.
"""

from __future__ import annotations

import argparse
import signal
import struct
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SERVICE = "bare.Bench"
DOWNLOAD = f"/{SERVICE}/Download"
UPLOAD = f"/{SERVICE}/Upload"
ECHO = f"/{SERVICE}/Echo"
_HEADER = struct.Struct("<QQ?")  # total bytes, chunk bytes, copy
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # grpc's default receive limit, as the library keeps it
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def _identity(data: bytes) -> bytes:
    return data


# ---- server ---------------------------------------------------------------------------

class _Buffers:
    """Long-lived buffers, one per size; shared by concurrent calls (a benchmark runs one)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_size: dict[int, memoryview] = {}

    def get(self, nbytes: int) -> memoryview:
        with self._lock:
            view = self._by_size.get(nbytes)
            if view is None:
                self._by_size.clear()  # keep one: the server's RSS should stay ~ one buffer
                buffer = bytearray(nbytes)
                buffer[::4096] = b"\x01" * len(range(0, nbytes, 4096))  # touch every page
                view = self._by_size[nbytes] = memoryview(buffer)
            return view


def _make_handler() -> grpc.GenericRpcHandler:
    buffers = _Buffers()

    def download(request: bytes, context):
        total, chunk, copy = _HEADER.unpack(request)
        if copy:
            source = buffers.get(total)
            for offset in range(0, total, chunk):
                yield bytes(source[offset:offset + chunk])
        else:
            block = bytes(chunk)
            for offset in range(0, total, chunk):
                yield block if offset + chunk <= total else block[:total - offset]

    def upload(request_iterator, context):
        chunks = iter(request_iterator)
        total, _, copy = _HEADER.unpack(next(chunks))
        received = 0
        dest = buffers.get(total) if copy else None
        for data in chunks:
            if dest is not None:
                dest[received:received + len(data)] = data
            received += len(data)
        return received.to_bytes(8, "little")

    def echo(request: bytes, context):
        return request

    kw = {"request_deserializer": _identity, "response_serializer": _identity}
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Download": grpc.unary_stream_rpc_method_handler(download, **kw),
        "Upload": grpc.stream_unary_rpc_method_handler(upload, **kw),
        "Echo": grpc.unary_unary_rpc_method_handler(echo, **kw),
    })


def serve(host: str, port: int, max_workers: int = 16) -> int:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="bare-rpc"),
                         options=OPTIONS)
    server.add_generic_rpc_handlers([_make_handler()])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        print(f"bare-grpc: could not bind {host}:{port}", file=sys.stderr)
        return 1
    return serve_until_signalled(server, f"bare-grpc listening on {host}:{bound}")


def serve_until_signalled(server: grpc.Server, listening: str) -> int:
    """Start `server`, print `listening` (the line harness.spawn waits for), serve until
    SIGTERM or SIGINT, then stop it."""
    # A plain flag: a handler that took a lock (Event.set) could interrupt the main thread
    # while it holds that very lock in Event.wait, and deadlock.
    stopping = [False]

    def on_signal(signum, frame):
        stopping[0] = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    server.start()
    print(listening, flush=True)
    while not stopping[0]:
        time.sleep(0.1)
    server.stop(1.0).wait(2.0)
    return 0


def start_server(group: harness.ProcessGroup) -> harness.Process:
    """The baseline server as a separate process owned by `group`."""
    return group.spawn("bare-grpc", [sys.executable, str(Path(__file__).resolve()), "serve",
                                     "--host", harness.HOST, "--port", "0"])


# ---- client ---------------------------------------------------------------------------

class BareClient:
    """Times the baseline calls against a running baseline server. Not thread-safe."""

    def __init__(self, address: str, timeout_s: float = 120.0):
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        kw = {"request_serializer": _identity, "response_deserializer": _identity}
        self._download = self.channel.unary_stream(DOWNLOAD, **kw)
        self._upload = self.channel.stream_unary(UPLOAD, **kw)
        self._echo = self.channel.unary_unary(ECHO, **kw)
        self._timeout_s = timeout_s
        self._buffer = memoryview(bytearray(0))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> BareClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _buffer_of(self, nbytes: int) -> memoryview:
        if len(self._buffer) != nbytes:
            self._buffer = memoryview(bytearray(nbytes))
            self._buffer[::4096] = b"\x01" * len(range(0, nbytes, 4096))
        return self._buffer

    def download(self, total: int, chunk: int, *, copy: bool = True) -> int:
        """Receive `total` bytes (into a long-lived buffer with copy=True)."""
        dest = self._buffer_of(total) if copy else None
        received = 0
        for data in self._download(_HEADER.pack(total, chunk, copy), timeout=self._timeout_s):
            if dest is not None:
                dest[received:received + len(data)] = data
            received += len(data)
        if received != total:
            raise RuntimeError(f"download: {received} of {total} bytes")
        return received

    def upload(self, total: int, chunk: int, *, copy: bool = True) -> int:
        """Send `total` bytes (each message a fresh copy of a buffer slice with copy=True)."""
        source = self._buffer_of(total) if copy else None
        block = None if copy else bytes(chunk)

        def messages():
            yield _HEADER.pack(total, chunk, copy)
            for offset in range(0, total, chunk):
                if source is not None:
                    yield bytes(source[offset:offset + chunk])
                else:
                    yield block if offset + chunk <= total else block[:total - offset]

        received = int.from_bytes(self._upload(messages(), timeout=self._timeout_s), "little")
        if received != total:
            raise RuntimeError(f"upload: server got {received} of {total} bytes")
        return received

    def echo(self, payload: bytes) -> bytes:
        return self._echo(payload, timeout=self._timeout_s)


def time_round_trips(client: BareClient, nbytes: int, chunk: int, seconds: float,
                     *, copy: bool = True) -> dict:
    """Loop download(nbytes) + upload(nbytes) for `seconds` (after one warm-up round trip)."""
    client.download(nbytes, chunk, copy=copy)
    client.upload(nbytes, chunk, copy=copy)
    down = up = 0.0
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        client.download(nbytes, chunk, copy=copy)
        t1 = time.perf_counter()
        client.upload(nbytes, chunk, copy=copy)
        t2 = time.perf_counter()
        down, up, n = down + t1 - t0, up + t2 - t1, n + 1
    elapsed = time.perf_counter() - start
    return {"round_trips": n, "elapsed_s": elapsed, "round_trips_per_s": n / elapsed,
            "gb_per_s": 2 * nbytes * n / elapsed / 1e9,
            "download_ms": 1e3 * down / n, "upload_ms": 1e3 * up / n}


def time_calls(call, count: int, warmup: int) -> list[float]:
    """Latencies (microseconds, sorted) of `count` calls of `call()` after `warmup` calls."""
    for _ in range(warmup):
        call()
    out = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        call()
        out.append((clock() - t0) / 1e3)
    out.sort()
    return out


# ---- standalone run -------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        p = argparse.ArgumentParser(prog="bare_grpc.py serve")
        p.add_argument("--host", default=harness.HOST)
        p.add_argument("--port", type=int, default=0)
        args = p.parse_args(argv[1:])
        return serve(args.host, args.port)
    p = argparse.ArgumentParser(description="bare grpcio transfer and latency baseline")
    p.add_argument("--seconds", type=float, default=3.0, help="per transfer mode (default 3)")
    p.add_argument("--bytes", type=int, default=64 * 2**20, help="per direction (default 64MiB)")
    p.add_argument("--chunk-bytes", type=int, default=2 * 2**20, help="default 2MiB")
    p.add_argument("--calls", type=int, default=5000, help="echo calls (default 5000)")
    p.add_argument("--warmup", type=int, default=500, help="untimed echo calls (default 500)")
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, seconds=0.2, bytes=4 * 2**20, calls=50, warmup=10)
    if args.seconds <= 0 or args.bytes < 1 or args.chunk_bytes < 1 or args.calls < 1 \
            or args.warmup < 0:
        p.error("--seconds must be > 0, --bytes, --chunk-bytes and --calls >= 1, "
                "--warmup >= 0")
    with harness.bounded(4 * args.seconds + 120, "bare_grpc"), harness.ProcessGroup() as group:
        server = start_server(group)
        with BareClient(server.address) as client:
            copy = time_round_trips(client, args.bytes, args.chunk_bytes, args.seconds)
            ceiling = time_round_trips(client, args.bytes, args.chunk_bytes, args.seconds,
                                       copy=False)
            payload = bytes(1024)
            echo = time_calls(lambda: client.echo(payload), args.calls, args.warmup)
        rows = [
            ("transfer (1 copy/side)", f"{copy['round_trips_per_s']:.2f} round trips/s  "
                                       f"{copy['gb_per_s']:.3f} GB/s"),
            ("transfer (no copies)", f"{ceiling['round_trips_per_s']:.2f} round trips/s  "
                                     f"{ceiling['gb_per_s']:.3f} GB/s"),
            ("echo 1 KiB p50 / p99", f"{harness.percentile(echo, 50):.0f} / "
                                     f"{harness.percentile(echo, 99):.0f} us"),
            ("server peak RSS", harness.mib(server.peak_rss_bytes())),
        ]
        harness.report("bare-grpc", rows, {
            "transfer": copy, "transfer_no_copy": ceiling,
            "echo_us": {"p50": harness.percentile(echo, 50), "p99": harness.percentile(echo, 99)},
            "server_peak_rss_bytes": server.peak_rss_bytes()}, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
