"""W4 latency: 1 server holding a 256-float32 (1 KiB) variable; 1 client pulls it back to back.

Beside it, in the same run, the baseline: a bare grpcio unary call (echo) of the same 1 KiB,
and, to separate the cost of the RPC shape from the library's, a bare unary-stream call
returning the same 1 KiB in one message (Pull's shape); and, to separate the client
library's cost from the server's, the same PullUnary request made with a bare generated stub
(the paramserve server and gRPC, no PSClient). Every series is timed after a
warm-up, and the series alternate in blocks so that all see the same machine load.
Latencies are in microseconds.

    python benchmarks/w4_latency.py
    python benchmarks/w4_latency.py --quick    # 50 calls a series: does it run?
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bare_grpc
import harness

from ps_common.rpc import make_channel
from ps_proto.v1 import parameter_server_pb2 as ps_pb
from ps_proto.v1 import parameter_server_pb2_grpc as ps_grpc
from ps_worker import PSClient

NAME = "w4"
ELEMENTS = 256


def _summary(latencies_us: list[float]) -> dict:
    return {"count": len(latencies_us), "p50_us": harness.percentile(latencies_us, 50),
            "p99_us": harness.percentile(latencies_us, 99),
            "mean_us": float(np.mean(latencies_us)), "max_us": latencies_us[-1]}


def interleaved(series: dict, calls: int, warmup: int, blocks: int) -> dict[str, list[float]]:
    """Sorted latencies (us) of `calls` calls of each series, after `warmup` calls of each,
    taken in `blocks` rounds that visit every series in turn (so all see the same drift),
    each round starting one series further on (so that no series always comes first, or
    always after the same one)."""
    out: dict[str, list[float]] = {name: [] for name in series}
    for call in series.values():
        for _ in range(warmup):
            call()
    clock = time.perf_counter_ns
    order = list(series.items())
    for block in range(blocks):
        count = calls // blocks + (1 if block < calls % blocks else 0)
        turn = block % len(order)
        for name, call in order[turn:] + order[:turn]:
            times = out[name]
            for _ in range(count):
                t0 = clock()
                call()
                times.append((clock() - t0) / 1e3)
    for times in out.values():
        times.sort()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5000, help="timed calls per series (default 5000)")
    p.add_argument("--warmup", type=int, default=500, help="untimed calls first (default 500)")
    p.add_argument("--blocks", type=int, default=100,
                   help="the series alternate in this many blocks of calls (default 100)")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, calls=50, warmup=10, blocks=2)
    if args.calls < 1 or args.warmup < 0 or not 1 <= args.blocks <= args.calls:
        p.error("--calls must be >= 1, --warmup >= 0 and --blocks in 1..calls")
    nbytes = 4 * ELEMENTS
    # Bounded: startup plus four series at <= 10 ms per call.
    bound = 120 + 4 * (args.calls + args.warmup) * 0.01
    with harness.bounded(bound, "w4_latency"), \
            harness.cluster(1, log_level="warning", server_args=harness.no_shm_args(args)) as c, \
            harness.ProcessGroup() as group:
        bare_server = bare_grpc.start_server(group)
        with PSClient(c.address, **harness.client_path_args(args)) as client, \
                bare_grpc.BareClient(bare_server.address) as bare:
            client.declare(NAME, (ELEMENTS,), "float32", init="normal", seed=4)
            expected = client.pull(NAME)
            payload = bytes(nbytes)
            shard_map = client.shard_map
            (shard,) = shard_map.shards[NAME]
            request = ps_pb.PullRequest(epoch=shard_map.epoch, shards=[
                ps_pb.ShardRef(variable=NAME, index=shard.index)])
            channel = make_channel(shard_map.servers[shard.server_id])
            pull_unary = ps_grpc.ParameterServerStub(channel).PullUnary
            series = {"paramserve": lambda: client.pull(NAME),
                      "bare_unary": lambda: bare.echo(payload),
                      "bare_unary_stream": lambda: bare.download(nbytes, nbytes),
                      "stub_pull_unary": lambda: pull_unary(request, timeout=30)}
            try:
                latencies = interleaved(series, args.calls, args.warmup, args.blocks)
            finally:
                channel.close()
            if not np.array_equal(client.pull(NAME), expected):
                raise RuntimeError("pulled values changed without a push")
    ps, unary, stream, stub = (latencies[k] for k in series)
    record = {"value_bytes": nbytes, "paramserve": _summary(ps),
              "bare_unary": _summary(unary), "bare_unary_stream": _summary(stream),
              "stub_pull_unary": _summary(stub)}
    record["ratio_p50"] = record["paramserve"]["p50_us"] / record["bare_unary"]["p50_us"]
    record["ratio_p99"] = record["paramserve"]["p99_us"] / record["bare_unary"]["p99_us"]
    # Where the p50 above a bare unary call goes: the client library, the server and gRPC.
    record["client_library_p50_us"] = (record["paramserve"]["p50_us"]
                                       - record["stub_pull_unary"]["p50_us"])
    record["server_p50_us"] = record["stub_pull_unary"]["p50_us"] - record["bare_unary"]["p50_us"]

    def line(s: dict) -> str:
        return (f"p50 {s['p50_us']:7.0f}  p99 {s['p99_us']:7.0f}  mean {s['mean_us']:7.0f}  "
                f"max {s['max_us']:7.0f} us")

    rows = [("series", f"{args.calls} calls each after {args.warmup} warm-up, 1 KiB"),
            ("paramserve pull", line(record["paramserve"])),
            ("bare unary echo", line(record["bare_unary"])),
            ("bare unary-stream", line(record["bare_unary_stream"])),
            ("PullUnary, bare stub", line(record["stub_pull_unary"]) + "  (server + gRPC, no PSClient)"),
            ("ratio to bare unary", f"p50 {record['ratio_p50']:.2f}x  p99 {record['ratio_p99']:.2f}x"),
            ("p50 above bare unary", f"{record['client_library_p50_us']:.0f} us in PSClient, "
                                     f"{record['server_p50_us']:.0f} us in the server's call"),
            ("ratio to bare stream", f"p50 {record['paramserve']['p50_us'] / record['bare_unary_stream']['p50_us']:.2f}x")]
    record["path"] = harness.path_name(args)
    rows.insert(0, ("path", harness.path_name(args)))
    harness.report("W4 latency", rows, record, quick=args.quick)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
