"""How many bytes of shards a server may hold when the operator does not say."""

from __future__ import annotations

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
    """15% of the machine's (or container's) memory, at least 256 MiB, and never more than
    the default budget leaves free (a small container: 30% of it)."""
    total = machine_memory_bytes()
    if not total:
        return MIN_CHECKPOINT_MEMORY
    wanted = max(MIN_CHECKPOINT_MEMORY, int(total * DEFAULT_CHECKPOINT_FRACTION))
    return min(wanted, total - default_memory_budget())
