"""Checkpoint under training: how long a checkpoint stalls pushes, and how much memory it takes.

The claim measured (ps_server/snapshots.py): "writing a checkpoint must not stall training
for longer than copying the values in memory takes; it must not need twice the memory of a
multi-GiB variable."

One run, servers in this process (InProcessCluster, so this process's RSS is the servers'
plus the client's):

1. declares one float32 variable of `--mib` MiB (SGD), split by the coordinator's default
   64 MiB split threshold into min(servers, ceil(bytes / 64 MiB)) shards (the split never
   makes more shards than there are servers: with 1 server the variable is ONE shard);
2. in-run baselines: np.copy of 64 MiB, of the largest shard and of the whole variable
   (medians), sha256 of the variable's bytes (the checkpoint hashes what it writes), a plain
   open().write() + fsync of the checkpoint's bytes (once after the first checkpoint, twice
   at the end), and the latency of a push of the whole variable's gradient (the only push
   that touches all of it: pushes are dense) with no checkpoint running;
3. one checkpoint with no pushes, then `--rounds` checkpoints while a thread pushes the
   whole gradient back to back; every push that overlaps a checkpoint is recorded, and the
   process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each checkpoint,
   and a VmRSS sampler as a cross-check) is compared with the peak while pushing without
   a checkpoint;
4. checks the last checkpoint's file: every shard at the same update count k and every value
   equal to -lr * k * g (a consistent cut); exits 1 if not, else 0.

Where the time goes, unless `--no-trace`: timers wrapped around the server's checkpoint
steps (the push's apply, its copy-on-write copies, its waits for the writer; the writer's
sha256 + write, fsync and copies), each with the wall time and its thread's CPU time. They
only read the clocks; the figures above do not depend on them.

On a VM whose memory the host backs on first touch, writing into pages the guest has never
used costs several times more CPU than into reused ones, for the page cache as for numpy
arrays: the "first" np.copy and the spread of the plain writes show it in the same run.

    python benchmarks/checkpoint.py                       # 512 MiB, 1 server
    python benchmarks/checkpoint.py --mib 1024
    python benchmarks/checkpoint.py --servers 8           # 8 servers: 64 MiB shards
    python benchmarks/checkpoint.py --quick               # 4 MiB, 2 rounds: does it run?
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from ps_common import checkpoints as checkpoints_module
from ps_common.checkpoints import TensorFile, values_name
from ps_server import snapshots
from ps_server import store as store_module
from ps_server.testing import InProcessCluster
from ps_worker import PSClient

NAME = "big"
SPLIT_BYTES = 64 << 20  # the coordinator's default split threshold
GRAD_VALUE = 1e-3
CHECK_BLOCK = 1 << 24  # elements per block of the blocked full-array checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="size of the variable (default 512)")
    p.add_argument("--servers", type=int, default=1,
                   help="in-process servers (default 1); the variable is split into at most "
                   "this many shards")
    p.add_argument("--rounds", type=int, default=6,
                   help="checkpoints taken under pushes (default 6)")
    p.add_argument("--pushes", type=int, default=8,
                   help="pushes timed with no checkpoint running (default 8, after 2 warm-up)")
    p.add_argument("--copies", type=int, default=5, help="np.copy repetitions (default 5)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--dir", default=None,
                   help="where the temporary checkpoint directory goes (default: $TMPDIR)")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="do not time the server's checkpoint steps")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="hard bound on the whole run (default: generous, from --mib)")
    harness.add_quick_flag(p)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.mib < 1 or args.servers < 1 or args.rounds < 1 or args.pushes < 1 or args.copies < 1:
        p.error("--mib, --servers, --rounds, --pushes and --copies must be >= 1")
    if not args.lr > 0:
        p.error(f"--lr {args.lr} must be > 0")
    nbytes = args.mib << 20
    # values + the server's push receive buffer + the client's gradient + the whole-variable
    # copy baseline + the checkpoint's copies (at most the values), slack.
    need = 5 * nbytes + (1 << 30)
    if need > harness.mem_available_bytes():
        p.error(f"--mib {args.mib} needs about {harness.mib(need)} of memory; "
                f"{harness.mib(harness.mem_available_bytes())} is available")


def checkpoint_memory_bytes(config) -> int:
    """The copy bound a server's checkpoints run under (--checkpoint-memory), in the trees
    that have one: the configured value, else its default."""
    configured = getattr(config, "checkpoint_memory_bytes", None)
    if configured is not None:
        return configured
    try:
        from ps_server.memory import default_checkpoint_memory
    except ImportError:  # before the default was a share of the machine's memory
        return snapshots.DEFAULT_MEMORY_BYTES
    return default_checkpoint_memory()


# ---- measuring tools -------------------------------------------------------------------

def median_seconds(fn, repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: "5" > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples this process's VmRSS every `interval_s` in a named thread; keeps the max."""

    def __init__(self, interval_s: float = 0.005):
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)
        self.max_bytes = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.max_bytes = max(self.max_bytes, harness.rss_bytes())
            self._stop.wait(self._interval)

    def __enter__(self) -> Self:
        self.max_bytes = harness.rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class Pusher:
    """Pushes the whole gradient back to back in a named thread while its `with` block runs;
    records the (start, end) perf_counter times of every push. An error ends the loop and
    is re-raised by `wait()` and `stop()`."""

    def __init__(self, client: PSClient, grad: np.ndarray):
        self._client = client
        self._grad = grad
        self._stop = threading.Event()
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="bench-pusher", daemon=True)
        self.spans: list[tuple[float, float]] = []
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                self._client.push({NAME: self._grad})
                with self._done:
                    self.spans.append((t0, time.perf_counter()))
                    self._done.notify_all()
        except Exception as error:  # noqa: BLE001 (re-raised by stop())
            self.error = error
            with self._done:
                self._done.notify_all()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stops the thread (bounded) on any exit; `stop()` is the way to get the spans."""
        self._stop.set()
        self._thread.join(timeout=60.0)

    def wait(self, predicate, timeout_s: float) -> None:
        """Until `predicate(spans)` holds; bounded."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while not predicate(self.spans) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"pushes did not progress within {timeout_s:g} s")
                self._done.wait(left)
        if self.error is not None:
            raise self.error

    def stop(self, timeout_s: float) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the pusher did not stop within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return list(self.spans)


@dataclass
class Trace:
    """Wall-clock spans of the server's checkpoint steps, by kind. Thread-safe.

    Installed by wrapping attributes of ps_server.snapshots, ps_server.store and
    ps_common.checkpoints (a benchmark's instrument; restored by `uninstall`)."""

    spans: list[tuple[str, float, float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _local: threading.local = field(default_factory=threading.local)
    _restore: list = field(default_factory=list)

    def _add(self, kind: str, t0: float, cpu0: float) -> None:
        """A span of `kind` from perf_counter `t0` to now; `cpu0`: thread_time() at t0."""
        span = (kind, t0, time.perf_counter(), time.thread_time() - cpu0)
        with self._lock:
            self.spans.append(span)

    def _wrap(self, owner, attr: str, kind, *, classmethod_: bool = False):
        original = owner.__dict__[attr]
        call = original.__func__ if classmethod_ else original
        trace = self

        def wrapper(*args, **kwargs):
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                trace._add(kind() if callable(kind) else kind, t0, cpu0)

        setattr(owner, attr, classmethod(wrapper) if classmethod_ else wrapper)
        self._restore.append((owner, attr, original))

    def install(self) -> Trace:
        local = self._local

        def preserve(original):
            def wrapper(capture, targets):
                local.in_push = True
                t0, cpu0 = time.perf_counter(), time.thread_time()
                try:
                    return original(capture, targets)
                finally:
                    local.in_push = False
                    self._add("push: copy-on-write (preserve)", t0, cpu0)
            return wrapper

        original = snapshots.Capture.__dict__["preserve"]
        snapshots.Capture.preserve = preserve(original)
        self._restore.append((snapshots.Capture, "preserve", original))
        self._wrap(snapshots.Capture, "wait_written", "push: wait for the writer")
        self._wrap(store_module.ShardStore, "apply",
                   "push: apply (shard locks, copy-on-write, SGD)")
        self._wrap(snapshots.ShardCopy, "of",
                   lambda: ("push: shard copies" if getattr(local, "in_push", False)
                            else "writer: shard copies"), classmethod_=True)
        # The writer's per-shard step: one call per shard since the writer reads blocks of
        # the live values (_write_shard), one call for all of them before (_write_arrays).
        step = "_write_shard" if "_write_shard" in snapshots.__dict__ else "_write_arrays"
        self._wrap(snapshots, step, "writer: blocks + sha256 + write (to the page cache)")
        original_hashlib = checkpoints_module.hashlib
        trace = self

        class TimedSha256:
            """hashlib.sha256 whose update() is timed; everything else is delegated."""

            def __init__(self, *args, **kwargs):
                self._hash = original_hashlib.sha256(*args, **kwargs)

            def update(self, data) -> None:
                t0, cpu0 = time.perf_counter(), time.thread_time()
                self._hash.update(data)
                trace._add("writer: of which sha256", t0, cpu0)

            def __getattr__(self, name):
                return getattr(self._hash, name)

        shim = types.SimpleNamespace(**{k: getattr(original_hashlib, k)
                                        for k in dir(original_hashlib) if not k.startswith("__")})
        shim.sha256 = TimedSha256
        checkpoints_module.hashlib = shim
        self._restore.append((checkpoints_module, "hashlib", original_hashlib))
        self._wrap(snapshots.TensorFileWriter, "commit", "writer: fsync + rename")
        self._wrap(snapshots, "save", "server: save (all of it)")
        return self

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()

    def within(self, t0: float, t1: float) -> dict[str, tuple[int, float, float, float]]:
        """kind -> (count, total s, longest s, thread CPU s) of the spans overlapping [t0, t1]."""
        out: dict[str, tuple[int, float, float, float]] = {}
        with self._lock:
            spans = list(self.spans)
        for kind, a, b, cpu in spans:
            if b >= t0 and a <= t1:
                n, total, longest, cpu_total = out.get(kind, (0, 0.0, 0.0, 0.0))
                out[kind] = (n + 1, total + (b - a), max(longest, b - a), cpu_total + cpu)
        return out


def plain_write_fsync(path: Path, data: np.ndarray, nbytes: int) -> float:
    """Seconds to open(), write `nbytes` (from `data`, repeated as needed) and fsync."""
    view = memoryview(data).cast("B")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def sha256_seconds(data: np.ndarray) -> float:
    view = memoryview(data).cast("B")
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    for i in range(0, len(view), 4 << 20):
        digest.update(view[i:i + (4 << 20)])
    return time.perf_counter() - t0


def check_checkpoint(manifest, lr: float) -> dict:
    """Consistent cut: every shard at the same update count k, every value -lr * k * g."""
    shards = [s for s in manifest.shards if s.variable == NAME]
    updates = {s.updates for s in shards}
    k = max(updates)
    expected = np.float32(-lr * GRAD_VALUE * k)
    ok = len(updates) == 1 and k > 0
    first = None
    for s in shards:
        flat = TensorFile(manifest.directory / s.file).array(values_name(NAME, s.index)).reshape(-1)
        if first is None:
            first = flat[0]
        ok = ok and all(bool((flat[i:i + CHECK_BLOCK] == first).all())
                        for i in range(0, flat.size, CHECK_BLOCK))
        del flat
    first = float(first)
    ok = ok and bool(np.isclose(first, expected, rtol=1e-3))
    return {"ok": bool(ok), "shard_updates": sorted(updates), "value": first,
            "expected": float(expected)}


def latency_summary(latencies: list[float]) -> dict:
    s = sorted(latencies)
    return {"count": len(s), "p50_s": harness.percentile(s, 50),
            "max_s": s[-1] if s else float("nan"),
            "all_s": s}


# ---- the run ----------------------------------------------------------------------------

def run(args: argparse.Namespace, root: Path) -> tuple[list[tuple[str, str]], dict, bool]:
    nbytes = args.mib << 20
    size = nbytes // 4
    trace = Trace().install() if args.trace else None
    try:
        with InProcessCluster(servers=args.servers, checkpoint_dir=root / "checkpoints",
                              split_threshold_bytes=SPLIT_BYTES,
                              ready_timeout_s=60.0) as cluster, \
                PSClient(cluster.coordinator_address) as client:
            return measure(args, cluster, client, root, nbytes, size, trace)
    finally:
        if trace is not None:
            trace.uninstall()


def measure(args, cluster, client, root: Path, nbytes: int, size: int, trace: Trace | None):
    rss_idle = harness.rss_bytes()
    t0 = time.perf_counter()
    client.declare(NAME, (size,), "float32", init="zeros", optimizer={"name": "sgd", "lr": args.lr})
    declare_s = time.perf_counter() - t0
    shards = client.shard_map.shards_of(NAME)
    shard_bytes = [4 * (s.row_stop - s.row_start) for s in shards]
    largest = max(shard_bytes)
    grad = np.full(size, GRAD_VALUE, dtype=np.float32)
    bound_bytes = checkpoint_memory_bytes(cluster.servers[0].config)

    # Baselines: copies in memory (the cost the claim allows), hashing, the plain write.
    copy_64, copy_64_all = median_seconds(lambda: np.copy(grad[:SPLIT_BYTES // 4]), args.copies)
    copy_shard, copy_shard_all = median_seconds(lambda: np.copy(grad[:largest // 4]), args.copies)
    copy_whole, copy_whole_all = median_seconds(lambda: np.copy(grad), args.copies)
    sha_s = sha256_seconds(grad)

    # Pushes with no checkpoint running (2 warm-up pushes allocate the receive buffers).
    for _ in range(2):
        client.push({NAME: grad})
    rss_before_pushing = harness.rss_bytes()
    reset_peak_rss()
    with Pusher(client, grad) as pusher:
        pusher.wait(lambda spans: len(spans) >= args.pushes,
                    60.0 + 4 * args.pushes * nbytes / 50e6)
        spans = pusher.stop(60.0 + nbytes / 50e6)
    base = latency_summary([b - a for a, b in spans])
    peak_pushing = harness.peak_rss_bytes()

    # A checkpoint with no pushes, then the plain write of the same bytes.
    t0 = time.perf_counter()
    idle_manifest = cluster.checkpoint()
    idle_s = time.perf_counter() - t0
    ckpt_bytes = idle_manifest.bytes
    write_dir = root / "plain"
    write_dir.mkdir()
    write_s = [plain_write_fsync(write_dir / "plain.bin", grad, ckpt_bytes)]

    rounds = []
    bound = 120.0 + 8 * nbytes / 50e6
    for _ in range(args.rounds):
        with Pusher(client, grad) as pusher:
            pusher.wait(lambda spans: len(spans) >= 1, bound)
            rss_before = harness.rss_bytes()
            reset_peak_rss()
            with RssSampler() as sampler:
                t0 = time.perf_counter()
                manifest = cluster.checkpoint()
                t1 = time.perf_counter()
                # Until a push that started after the checkpoint has finished (the recovery).
                pusher.wait(lambda spans, t1=t1: any(a > t1 for a, _ in spans), bound)
            spans = pusher.stop(bound)
        peak = harness.peak_rss_bytes()
        during = [b - a for a, b in spans if b >= t0 and a <= t1]
        rounds.append({"checkpoint_s": t1 - t0, "bytes": manifest.bytes,
                       "pushes_during": latency_summary(during),
                       "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
                       "sampled_max_rss_bytes": sampler.max_bytes,
                       "trace": ({k: list(v) for k, v in trace.within(t0, t1).items()}
                                 if trace else None)})
    write_s += [plain_write_fsync(write_dir / "plain.bin", grad, ckpt_bytes) for _ in range(2)]
    check = check_checkpoint(manifest, args.lr)

    # ---- figures ----
    write_best = min(write_s)
    round_max = statistics.median(r["pushes_during"]["max_s"] for r in rounds)
    stall = max(r["pushes_during"]["max_s"] for r in rounds)
    worst = max(rounds, key=lambda r: r["pushes_during"]["max_s"])
    added = stall - base["p50_s"]
    ckpt_s = [r["checkpoint_s"] for r in rounds]
    ckpt_med = statistics.median(ckpt_s)
    increase = max(r["peak_rss_bytes"] - r["rss_before_bytes"] for r in rounds)
    over_pushing = max(r["peak_rss_bytes"] for r in rounds) - peak_pushing
    sampled_increase = max(r["sampled_max_rss_bytes"] - r["rss_before_bytes"] for r in rounds)
    over_bound = sum(b > bound_bytes for b in shard_bytes)

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:,.0f} ms"

    def gbs(seconds: float) -> str:
        return f"{ckpt_bytes / seconds / 1e9:.2f} GB/s"

    def seconds(value: float) -> str:
        return f"{value:.2f}"

    def listed(values, fmt) -> str:
        return ", ".join(fmt(v) for v in values)

    sizes = ", ".join(sorted({harness.mib(b) for b in shard_bytes}))
    rows = [
        ("variable", (f"{size:,} float32 = {harness.mib(nbytes)}, SGD; {len(shards)} shard(s) "
                      f"of {sizes} on {args.servers} server(s); declared in {declare_s:.2f} s")),
        ("checkpoint copy bound", (f"{harness.mib(bound_bytes)} per server; {over_bound} of "
                                   f"{len(shards)} shard(s) larger (written from the values "
                                   "with pushes to them held)")),
        ("np.copy 64 MiB (baseline)", f"{ms(copy_64)} median of {args.copies}"),
        ("np.copy one shard (baseline)", (f"{ms(copy_shard)} ({harness.mib(largest)}) median of "
                                          f"{args.copies} (first {ms(copy_shard_all[0])})")),
        ("np.copy whole variable (baseline)", (f"{ms(copy_whole)} median of {args.copies} "
                                               f"(first {ms(copy_whole_all[0])})")),
        ("push, no checkpoint (baseline)", (f"p50 {ms(base['p50_s'])}, max {ms(base['max_s'])} "
                                            f"({base['count']} pushes of the whole gradient)")),
        ("MAX PUSH LATENCY DURING CHECKPOINT",
         (f"{ms(stall)} = {stall / copy_whole:.1f}x the whole-variable copy, "
          f"{stall / copy_shard:.1f}x the one-shard copy, {stall / base['p50_s']:.2f}x the push "
          f"p50; median of the rounds' max {ms(round_max)} = {round_max / copy_whole:.1f}x the "
          f"whole-variable copy (per round: "
          f"{listed(rounds, lambda r: ms(r['pushes_during']['max_s']))})")),
        ("  added stall (max - push p50)", (f"{ms(added)} = {added / copy_whole:.1f}x the "
                                            f"whole-variable copy, {added / copy_shard:.1f}x the "
                                            "one-shard copy")),
        ("  pushes overlapping checkpoints",
         listed(rounds, lambda r: f"{r['pushes_during']['count']} "
                                  f"(p50 {ms(r['pushes_during']['p50_s'])})")),
        ("checkpoint under pushes", (f"{ckpt_med:.2f} s median ({listed(ckpt_s, seconds)}), "
                                     f"{gbs(ckpt_med)} for {harness.mib(ckpt_bytes)}")),
        ("checkpoint, no pushes", f"{idle_s:.2f} s, {gbs(idle_s)}"),
        ("plain write + fsync (baseline)", (f"{write_best:.2f} s best ({listed(write_s, seconds)})"
                                            f", {gbs(write_best)}")),
        ("  ratio checkpoint / plain write", (f"{ckpt_med / write_best:.2f}x under pushes, "
                                              f"{idle_s / write_best:.2f}x with no pushes")),
        ("sha256 of the same bytes (in memory)", (f"{sha_s:.2f} s ({gbs(sha_s)}); the "
                                                  "checkpoint hashes what it writes")),
        ("PEAK RSS INCREASE DURING CHECKPOINT",
         (f"{harness.mib(increase)} over the RSS just before = {increase / nbytes:.2f}x the "
          f"variable (sampled VmRSS: {harness.mib(sampled_increase)})")),
        ("  vs pushing without a checkpoint", (f"peak {harness.mib(peak_pushing)} without, "
                                               f"{harness.mib(peak_pushing + over_pushing)} with: "
                                               f"{over_pushing / nbytes:+.2f}x the variable")),
        ("  process RSS", (f"{harness.mib(rss_idle)} before the declare, "
                           f"{harness.mib(rss_before_pushing)} after warm-up pushes "
                           "(values + receive buffer + client gradient + runtime)")),
    ]
    if trace is not None:
        parts = "; ".join(f"{kind}: {n}x, {ms(total)} (longest {ms(longest)}, CPU {ms(cpu)})"
                          for kind, (n, total, longest, cpu) in sorted(worst["trace"].items()))
        rows.append(("where the time goes (worst round)", parts))
    rows.append(("checkpoint content", (
        f"{'OK' if check['ok'] else 'WRONG'}: shards at {check['shard_updates']} update(s), "
        f"value {check['value']:.6g} (expected {check['expected']:.6g})")))
    record = {
        "mib": args.mib, "servers": args.servers, "value_bytes": nbytes,
        "shard_bytes": shard_bytes, "checkpoint_memory_bytes": bound_bytes,
        "copy_64mib_s": copy_64_all, "copy_shard_s": copy_shard_all, "copy_whole_s": copy_whole_all,
        "sha256_s": sha_s, "push_no_checkpoint": base, "max_push_during_checkpoint_s": stall,
        "stall_over_whole_copy": stall / copy_whole, "stall_over_shard_copy": stall / copy_shard,
        "checkpoint_bytes": ckpt_bytes, "checkpoint_idle_s": idle_s, "plain_write_fsync_s": write_s,
        "rounds": rounds, "peak_rss_increase_bytes": increase,
        "peak_rss_increase_over_values": increase / nbytes, "peak_pushing_bytes": peak_pushing,
        "check": check, "code": str(Path(snapshots.__file__).resolve().parent.parent),
    }
    return rows, record, check["ok"]


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    harness.apply_quick(p, args, mib=4, rounds=2, pushes=2, copies=2)
    _check_args(p, args)
    nbytes = args.mib << 20
    bound = args.max_seconds or (180 + (args.pushes + 6 * args.rounds + 10) * nbytes / 50e6)
    root = Path(tempfile.mkdtemp(prefix="paramserve-ckpt-bench-", dir=args.dir))
    try:
        with harness.bounded(bound, "checkpoint"):
            rows, record, ok = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    harness.report("Checkpoint under pushes", rows, record, quick=args.quick)
    return 0 if ok else 1


if __name__ == "__main__":
    harness.run_main(main)
