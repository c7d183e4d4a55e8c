"""How many bytes of shards a server may hold when the operator does not say."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# Headroom for the interpreter, gRPC buffers, receive buffers and pull snapshots.
DEFAULT_BUDGET_FRACTION = 0.7

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def machine_memory_bytes() -> int | None:
    """Physical memory, or the container's memory limit when that is lower; None if unknown."""
    candidates = []
    try:
        candidates.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) or a huge number (v1) mean no limit
            candidates.append(int(text))
    return min(candidates) if candidates else None


def default_memory_budget() -> int:
    """A share of the machine's memory (0 = unlimited where the machine's size is unknown).

    A declare larger than every server's budget is refused with RESOURCE_EXHAUSTED before
    the shard map changes, instead of a server failing to allocate it.
    """
    total = machine_memory_bytes()
    return int(total * DEFAULT_BUDGET_FRACTION) if total else 0


# Of the memory left over by the default budget, what a checkpoint may use for copies of
# shards being pushed to while it writes (ps_server.snapshots).
DEFAULT_CHECKPOINT_FRACTION = 0.15
MIN_CHECKPOINT_MEMORY = 256 << 20


def default_checkpoint_memory() -> int:
    """15% of the machine's (or container's) memory, at least 256 MiB."""
    total = machine_memory_bytes()
    return max(MIN_CHECKPOINT_MEMORY, int(total * DEFAULT_CHECKPOINT_FRACTION) if total else 0)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Blocks up to this size come from the heap, and are reused there once freed: every message
# gRPC carries (at most 4 MiB) and the buffers a call builds around it. Larger ones are
# mapped for themselves and given back to the kernel when freed, every time (see
# tune_malloc for why not more).
MMAP_THRESHOLD_BYTES = 4 << 20
# The heap gives memory back to the kernel only when this much lies free at its top: a
# server may keep that much resident after a burst of calls.
TRIM_THRESHOLD_BYTES = 32 << 20


def tune_malloc() -> bool:
    """Have glibc's malloc serve every thread from one arena, and keep freed message-sized
    blocks for reuse; False where it is not glibc.

    One arena: by default each thread that contends for malloc gets an arena of its own, up
    to 8 per core. A server's gRPC handler threads take turns receiving multi-MiB messages
    and building push buffers, so a buffer freed in one thread's arena is not reused by the
    next thread, which faults in fresh pages instead. In two alternating W2 runs over gRPC,
    one arena took the server's peak RSS above idle from 3.4x and 4.5x the values to 2.7x
    and 2.4x, and round trips were no slower. The handlers hold the GIL around most
    allocations anyway, and W4's latency did not move.

    Reuse: left to itself, glibc serves a block from the heap only once a block as large has
    been freed (up to 32 MiB), and gives the top of its heap back to the kernel whenever
    twice the largest block freed so far lies free there. A call that carries 1.6 MiB each
    way frees more than that, so every call gave its pages back and faulted them in again:
    on W1 over gRPC a server took 439 minor faults and 2.96 ms of CPU a step, 3.4 and 1.96
    ms with the thresholds fixed here (benchmarks/RESULTS.md, "W1 over gRPC: one call a
    step"). Fixed, they no longer follow the largest block freed: blocks of 4 to 32 MiB (a
    pull of more than 16,384 rows of 64 floats, say) are mapped and faulted in on every
    use, where glibc would have come to serve them from its heap. Serving those from the
    heap too (thresholds of 32 and 64 MiB) took W2's server peak RSS above idle to 1.68x and
    1.91x its values, against 1.57x and 1.62x with these, in alternating runs. Peak RSS is
    what the heap held at its fullest; between calls a server now keeps up to
    TRIM_THRESHOLD_BYTES of freed heap resident.

    Called by the ps-server command only, never by in-process servers: an embedding
    application's allocator is its own business.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # Fixing either threshold turns glibc's own adjustment of both off: both are set.
    return all([bool(mallopt(_M_ARENA_MAX, 1)),
                bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)),
                bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))])
