"""Evidence for a bug the W2 3 GiB run surfaced: a big declare is initialized twice on its
server, and a push applied between the two initializations is silently lost.

Declaring a variable makes the coordinator send AssignShards; initializing a big shard takes
seconds, during which the server's heartbeat still reports the old epoch, so the coordinator
syncs it again and a second AssignShards of the same epoch runs concurrently. Both see the
shard missing, both allocate and initialize it (2x memory, 2x CPU), and the one that finishes
last replaces the other: updates applied to the first are gone.

This declares a big variable (default 2 GiB) together with a 4-element one in one request,
pushes to the small one right away, waits, and pulls it again. Exit status 1 when the push
was lost; the server's "created N shard(s)" log lines are printed either way.

    python benchmarks/repro_duplicate_assign.py            # ~20 s, needs ~5 GiB free
    python benchmarks/repro_duplicate_assign.py --quick    # 4 MiB: runs, cannot show the race
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from ps_common.shardmap import Component, VariableSpec
from ps_worker import PSClient


def spec(name: str, rows: int) -> VariableSpec:
    return VariableSpec(name=name, shape=(rows,), dtype="float32",
                        initializer=Component.of({"name": "constant", "value": 1.0}),
                        optimizer=Component.of({"name": "sgd", "lr": 1.0}), seed=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=536_870_912, help="float32 elements of the big "
                   "variable (default 2 GiB); the race needs its init to outlast a heartbeat")
    p.add_argument("--wait", type=float, default=8.0, help="seconds before the second pull")
    harness.add_quick_flag(p)
    args = p.parse_args(argv)
    harness.apply_quick(p, args, size=1 << 20, wait=0.5)
    if 3 * 4 * args.size + 2**30 > harness.mem_available_bytes():
        p.error(f"--size {args.size:,} needs about {harness.mib(12 * args.size)} free")
    with harness.bounded(180 + 4 * args.size / 50e6, "repro_duplicate_assign"), \
            harness.cluster(1, log_level="warning") as c:
        with PSClient(c.address) as client:
            t0 = time.perf_counter()
            client.declare_many([spec("big", args.size), spec("small", 4)])
            declared = time.perf_counter() - t0
            client.push({"small": np.full(4, 0.25, np.float32)})
            right_after = client.pull("small").tolist()
            time.sleep(args.wait)
            later = client.pull("small").tolist()
        created = [line for line in c.servers[0].log_path.read_text().splitlines()
                   if "created" in line]
    lost = later != [0.75] * 4
    rows = [("declare", f"{declared:.2f} s for {harness.mib(4 * args.size)} + 16 B"),
            ("small after push", f"{right_after} (want 0.75)"),
            (f"small {args.wait:g} s later", f"{later} (want 0.75)"),
            ("verdict", "PUSH LOST" if lost else "ok this time (the race depends on timing)"),
            *((f"server log {i}", line) for i, line in enumerate(created))]
    harness.report("duplicate assign repro", rows, {
        "size": args.size, "declare_s": declared, "right_after": right_after, "later": later,
        "lost": lost, "creations": len(created)}, quick=args.quick)
    return 1 if lost else 0


if __name__ == "__main__":
    harness.run_main(main)
