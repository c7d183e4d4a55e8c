"""W2 big-dense: one float32 variable on 1 server; 1 client loops pull -> push.

Timed mode (default): `--seconds` of pull-whole-variable + push-same-size-gradient round
trips (SGD on the server), beside the transfer baseline measured in the same run, for as
long, alternating with it in slices: bare grpcio downloading and uploading the same bytes in
the same chunks. Reports round trips/s,
GB/s (1 GB = 1e9 bytes; 2 x 4 x size bytes per round trip), the ratio to the baseline, and
the server's peak RSS against the bytes of values it holds (SGD has no slots).

`--once`: one pull, one push and one more pull of the variable (constant 1.0, SGD lr=1, a
constant gradient 0.25, so every value must read 1.0 then 0.75), timing each; made for
`--size 805306368` (3 GiB). The client holds at most one full-size array at a time.

    python benchmarks/w2_big_dense.py                          # 10 s, 64 MiB
    python benchmarks/w2_big_dense.py --once --size 805306368  # the 3 GiB proof
    python benchmarks/w2_big_dense.py --quick [--once]         # 1 MiB, briefly: does it run?
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bare_grpc
import harness

from ps_common.tensors import from_wire, to_wire
from ps_worker import PSClient

DEFAULT_SIZE = 16_777_216  # 64 MiB of float32
NAME = "w2"
SEED = 2
CHECK_BLOCK = 1 << 24  # elements per block of the blocked full-array checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0,
                   help="timed loop length, for paramserve and again for the baseline (default 10)")
    p.add_argument("--size", type=int, default=DEFAULT_SIZE,
                   help=f"float32 elements of the variable (default {DEFAULT_SIZE:,} = 64 MiB)")
    p.add_argument("--chunk-bytes", type=int, default=2 * 2**20,
                   help="stream chunk size, for client, server and baseline (default 2MiB; "
                   "the server caps it at 3MiB)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (timed mode)")
    p.add_argument("--once", action="store_true",
                   help="one pull + one push (+ a verifying pull) instead of a timed loop")
    p.add_argument("--no-pull-out", dest="pull_out", action="store_false",
                   help="pull into a fresh array each time instead of reusing one via "
                   "pull(..., out=) (the default where the client offers `out`)")
    p.add_argument("--push-wire-dtype", choices=("float32", "float16", "bfloat16"),
                   default="float32",
                   help="wire dtype of the pushes (default float32): a narrower one shows the "
                   "server's memory for narrowed pushes, but its ratios compare unequal bytes")
    p.add_argument("--slices", type=int, default=5,
                   help="paramserve and the baseline alternate in this many slices (default 5)")
    p.add_argument("--no-baseline", action="store_true", help="skip the bare-grpc baseline")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="hard bound on the whole run (default: generous, from --size/--seconds)")
    harness.add_path_flag(p)
    harness.add_quick_flag(p)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.size < 1:
        p.error(f"--size {args.size} must be >= 1")
    if args.chunk_bytes < 8 or args.chunk_bytes % 8 or args.chunk_bytes > 3 * 2**20:
        p.error(f"--chunk-bytes {args.chunk_bytes} must be a multiple of 8 in 8..3MiB")
    if args.seconds <= 0 or args.slices < 1:
        p.error("--seconds must be > 0 and --slices >= 1")
    # Server: values + one gradient buffer; client: one array (+ the gradient in timed mode).
    need = args.size * 4 * (3 if args.once else 4) + 2**30
    if need > harness.mem_available_bytes():
        p.error(f"--size {args.size:,} needs about {harness.mib(need)} of memory; "
                f"{harness.mib(harness.mem_available_bytes())} is available")


def _blocked_all_equal(values: np.ndarray, expected: float) -> bool:
    """values == expected everywhere, without a full-size boolean temporary."""
    flat = values.reshape(-1)
    return all(bool((flat[i:i + CHECK_BLOCK] == expected).all())
               for i in range(0, flat.size, CHECK_BLOCK))


def _probe_indices(size: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return np.unique(np.concatenate([[0, size // 2, size - 1], rng.integers(0, size, 5)]))


def run_once(client: PSClient, size: int) -> dict:
    """Pull (expect 1.0), push 0.25 with lr=1, pull again (expect 0.75). Times each step."""
    client.declare(NAME, (size,), "float32", init={"name": "constant", "value": 1.0},
                   optimizer={"name": "sgd", "lr": 1.0})
    probes = _probe_indices(size)
    t0 = time.perf_counter()
    values = client.pull(NAME)
    t_pull = time.perf_counter() - t0
    pulled_probe = values[probes].tolist()
    pulled_ok = _blocked_all_equal(values, 1.0)
    del values  # the client holds one full-size array at a time

    grad = np.full(size, 0.25, dtype=np.float32)
    t0 = time.perf_counter()
    client.push({NAME: grad})
    t_push = time.perf_counter() - t0
    del grad

    t0 = time.perf_counter()
    values = client.pull(NAME)
    t_pull2 = time.perf_counter() - t0
    after_probe = values[probes].tolist()
    after_ok = _blocked_all_equal(values, 0.75)
    del values
    return {"pull_s": t_pull, "push_s": t_push, "verify_pull_s": t_pull2,
            "probe_indices": probes.tolist(), "pulled_probe": pulled_probe,
            "after_push_probe": after_probe, "pulled_all_1.0": pulled_ok,
            "after_push_all_0.75": after_ok, "ok": pulled_ok and after_ok}


class Series:
    """Round trips of one side (paramserve or the baseline), accumulated over slices."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes  # per direction
        self.n = 0
        self.elapsed = self.first = self.second = 0.0

    def run(self, round_trip, seconds: float) -> None:
        """Call `round_trip()` (returns its two halves' seconds) for at least `seconds`."""
        start = time.perf_counter()
        while True:
            first, second = round_trip()
            self.n, self.first, self.second = self.n + 1, self.first + first, self.second + second
            if time.perf_counter() - start >= seconds:
                break
        self.elapsed += time.perf_counter() - start

    def summary(self, first: str, second: str) -> dict:
        return {"round_trips": self.n, "elapsed_s": self.elapsed,
                "round_trips_per_s": self.n / self.elapsed,
                "gb_per_s": 2 * self.nbytes * self.n / self.elapsed / 1e9,
                f"{first}_ms": 1e3 * self.first / self.n, f"{second}_ms": 1e3 * self.second / self.n}


def supports_pull_out() -> bool:
    return "out" in inspect.signature(PSClient.pull).parameters


def run_timed(client: PSClient, bare: bare_grpc.BareClient | None, size: int, lr: float,
              chunk_bytes: int, seconds: float, slices: int, pull_out: bool,
              wire: str = "float32") -> dict:
    """paramserve and the baseline, alternating in `slices` slices of seconds/slices each
    (so both see the same drift in machine load); then check the variable's values.
    With `pull_out`, every pull lands in one reused array (pull(..., out=)); pushes go in
    the `wire` dtype."""
    nbytes = 4 * size
    client.declare(NAME, (size,), "float32", init="zeros", optimizer={"name": "sgd", "lr": lr})
    grad = np.random.default_rng(SEED).standard_normal(size, dtype=np.float32)
    if wire != "float32":  # what the server receives: the gradient rounded to the wire dtype
        grad = from_wire(to_wire(grad, wire), wire).astype(np.float32)
    push_kwargs = {} if wire == "float32" else {"wire_dtype": wire}
    out = {NAME: np.empty(size, np.float32)} if pull_out else None
    last: list = [None]
    pushes = [0]

    def ps_round_trip() -> tuple[float, float]:
        last[0] = None  # let the previous pull's array go before the next one arrives
        t0 = time.perf_counter()
        last[0] = client.pull(NAME, out=out) if out is not None else client.pull(NAME)
        t1 = time.perf_counter()
        client.push({NAME: grad}, **push_kwargs)
        pushes[0] += 1
        return t1 - t0, time.perf_counter() - t1

    def bare_round_trip(copy: bool = True) -> tuple[float, float]:
        t0 = time.perf_counter()
        bare.download(nbytes, chunk_bytes, copy=copy)
        t1 = time.perf_counter()
        bare.upload(nbytes, chunk_bytes, copy=copy)
        return t1 - t0, time.perf_counter() - t1

    ps_round_trip()  # warm-up: connections, first touch of every buffer
    if bare is not None:
        bare_round_trip()
        bare_round_trip(copy=False)
    ps, base, ceiling = Series(nbytes), Series(nbytes), Series(nbytes)
    for _ in range(slices):
        ps.run(ps_round_trip, seconds / slices)
        if bare is not None:
            base.run(bare_round_trip, seconds / slices)
            ceiling.run(lambda: bare_round_trip(copy=False), seconds / slices)
    client_peak = harness.peak_rss_bytes()  # before the check's full-size temporaries
    # The last pull saw pushes - 1 updates of w -= lr * g, from zeros.
    expected = np.float32(-lr * (pushes[0] - 1)) * grad
    ok = bool(np.allclose(last[0], expected, rtol=1e-4, atol=1e-5))
    out = {"paramserve": {**ps.summary("pull", "push"), "values_ok": ok},
           "client_peak_rss_bytes": client_peak}
    if bare is not None:
        out["baseline"] = base.summary("download", "upload")
        out["ratio"] = ps.n / ps.elapsed / (base.n / base.elapsed)
        # grpcio's own ceiling: the same transfers with no copy on either side.
        out["ceiling"] = ceiling.summary("download", "upload")
        out["ratio_to_ceiling"] = ps.n / ps.elapsed / (ceiling.n / ceiling.elapsed)
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    # 1 MiB, chunks of 256 KiB (4 a transfer), 2 slices of a few round trips each.
    harness.apply_quick(p, args, size=262_144, chunk_bytes=256 * 1024, seconds=0.2, slices=2)
    _check_args(p, args)
    nbytes = 4 * args.size
    # Generous: startup, then each full-size transfer at >= 50 MB/s, plus the loops.
    bound = args.max_seconds or (120 + 4 * nbytes / 50e6
                                 + (0 if args.once else 2 * args.seconds + 60))
    server_args = ["--chunk-bytes", str(args.chunk_bytes), *harness.no_shm_args(args)]
    with harness.bounded(bound, "w2_big_dense"), \
            harness.cluster(1, server_args=server_args, log_level="warning") as c, \
            harness.ProcessGroup() as group:
        server = c.servers[0]
        idle_rss = server.rss_bytes()
        with PSClient(c.address, chunk_bytes=args.chunk_bytes,
                      **harness.client_path_args(args)) as client:
            if args.once:
                result = run_once(client, args.size)
                timed = {"paramserve": result, "client_peak_rss_bytes": harness.peak_rss_bytes()}
            else:
                with contextlib.ExitStack() as stack:
                    bare = bare_server = None
                    if not args.no_baseline:
                        bare_server = bare_grpc.start_server(group)
                        bare_idle_rss = bare_server.rss_bytes()
                        bare = stack.enter_context(bare_grpc.BareClient(bare_server.address))
                    pull_out = args.pull_out and supports_pull_out()
                    timed = run_timed(client, bare, args.size, args.lr, args.chunk_bytes,
                                      args.seconds, args.slices, pull_out,
                                      args.push_wire_dtype)
                    timed["pull_out"] = pull_out
                result = timed["paramserve"]
        server_peak = server.peak_rss_bytes()
        record = {"size": args.size, "value_bytes": nbytes, "chunk_bytes": args.chunk_bytes,
                  "push_wire_dtype": args.push_wire_dtype,
                  "mode": "once" if args.once else "timed", **timed,
                  "server_idle_rss_bytes": idle_rss, "server_peak_rss_bytes": server_peak,
                  "server_peak_over_values": server_peak / nbytes,
                  "server_peak_above_idle_over_values": (server_peak - idle_rss) / nbytes}
        rows = [("variable", f"{args.size:,} float32 = {harness.mib(nbytes)}, 1 server, sgd, "
                             f"chunks of {harness.mib(args.chunk_bytes)}, pushes in "
                             f"{args.push_wire_dtype}")]
        if args.once:
            rows += [("pull", f"{result['pull_s']:.2f} s  ({nbytes / result['pull_s'] / 1e9:.3f} GB/s)"),
                     ("push", f"{result['push_s']:.2f} s  ({nbytes / result['push_s'] / 1e9:.3f} GB/s)"),
                     ("verifying pull", f"{result['verify_pull_s']:.2f} s"),
                     ("values", f"{'OK' if result['ok'] else 'WRONG'}: 1.0 before, 0.75 after "
                                f"(probes {result['pulled_probe'][:3]} -> {result['after_push_probe'][:3]})")]
        else:
            rows += [("pulls land in", "one reused array (pull(..., out=))" if record["pull_out"]
                      else "a fresh array each time"),
                     ("paramserve", f"{result['round_trips_per_s']:.2f} round trips/s  "
                                    f"{result['gb_per_s']:.3f} GB/s  (pull {result['pull_ms']:.0f} ms, "
                                    f"push {result['push_ms']:.0f} ms; {result['round_trips']} in "
                                    f"{result['elapsed_s']:.1f} s; values "
                                    f"{'OK' if result['values_ok'] else 'WRONG'})")]
        if "baseline" in record:
            base = record["baseline"]
            record["baseline_server_peak_rss_bytes"] = bare_server.peak_rss_bytes()
            # The same measure for grpcio's own server, which holds one buffer of the bytes
            # it moves: what gRPC alone keeps beside such a buffer.
            record["baseline_server_idle_rss_bytes"] = bare_idle_rss
            record["baseline_server_peak_above_idle_over_values"] = (
                record["baseline_server_peak_rss_bytes"] - bare_idle_rss) / nbytes
            rows += [("bare grpc", f"{base['round_trips_per_s']:.2f} round trips/s  "
                                   f"{base['gb_per_s']:.3f} GB/s  (download "
                                   f"{base['download_ms']:.0f} ms, upload {base['upload_ms']:.0f} ms; "
                                   f"{base['round_trips']} in {base['elapsed_s']:.1f} s)"),
                     ("ratio", f"{record['ratio']:.2f} of the baseline (alternating in "
                               f"{args.slices} slices)")]
            if "ceiling" in record:
                top = record["ceiling"]
                rows += [("bare grpc, no copies", f"{top['round_trips_per_s']:.2f} round trips/s  "
                                                  f"{top['gb_per_s']:.3f} GB/s (grpcio's ceiling)"),
                         ("ratio to the ceiling", f"{record['ratio_to_ceiling']:.2f}")]
        rows += [("server peak RSS", f"{harness.mib(server_peak)} = "
                                     f"{server_peak / nbytes:.2f} x the {harness.mib(nbytes)} of "
                                     f"values (idle before declare: {harness.mib(idle_rss)}; "
                                     f"above idle: {(server_peak - idle_rss) / nbytes:.2f} x)"),
                 ("client peak RSS", harness.mib(record["client_peak_rss_bytes"]) +
                  ("" if args.once or args.no_baseline else " (with the baseline client's buffer)"))]
        if "baseline_server_peak_rss_bytes" in record:
            rows.append(("bare server peak RSS", (
                f"{harness.mib(record['baseline_server_peak_rss_bytes'])} (idle: "
                f"{harness.mib(record['baseline_server_idle_rss_bytes'])}; above idle: "
                f"{record['baseline_server_peak_above_idle_over_values']:.2f} x the "
                f"{harness.mib(nbytes)} it moves, one buffer of which it holds)")))
        record["path"] = harness.path_name(args)
        rows.insert(0, ("path", harness.path_name(args)))
        harness.report("W2 big-dense" + (" once" if args.once else ""), rows, record,
                       quick=args.quick)
    ok = result["ok"] if args.once else result["values_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    harness.run_main(main)
