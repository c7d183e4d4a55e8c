"""glibc's malloc set for a process that moves multi-MiB gRPC messages: ps-server, ps-worker,
and any training process that calls `tune_malloc()` (exported as `ps_worker.tune_malloc`).

The setting is process-wide, so the commands make it and the library never does on its own:
an application that embeds a client or a server owns its allocator.
"""

from __future__ import annotations

import ctypes

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
# process may keep that much resident after a burst of calls.
TRIM_THRESHOLD_BYTES = 32 << 20


def tune_malloc(*, one_arena: bool = False) -> bool:
    """Have glibc's malloc keep freed message-sized blocks for reuse, and with `one_arena`
    serve every thread from one arena; False where it is not glibc.

    Reuse: left to itself, glibc serves a block from the heap only once a block as large has
    been freed (up to 32 MiB), and gives the top of its heap back to the kernel whenever
    twice the largest block freed so far lies free there. A call that carries 1.6 MiB each
    way frees more than that, so every call gave its pages back and faulted them in again:
    on W1 over gRPC a server took 439 minor faults and 2.96 ms of CPU a step, 3.4 and 1.96
    ms with the thresholds fixed here (benchmarks/RESULTS.md, "W1 over gRPC: one call a
    step"). A W2 client over gRPC took 4,000 to 12,000 minor faults a round trip (64 MiB
    each way in 2 MiB messages), about a hundred with them. Fixed, they no longer follow the
    largest block freed: blocks of 4 to 32 MiB (a pull of more than 16,384 rows of 64 floats,
    say) are mapped and faulted in on every use, where glibc would have come to serve them
    from its heap. Serving those from the heap too (thresholds of 32 and 64 MiB) took W2's
    server peak RSS above idle to 1.68x and 1.91x its values, against 1.57x and 1.62x with
    these, in alternating runs. Between calls a process now keeps up to
    TRIM_THRESHOLD_BYTES of freed heap resident.

    One arena (ps-server): by default each thread that contends for malloc gets an arena of
    its own, up to 8 per core. A server's gRPC handler threads take turns receiving
    multi-MiB messages and building push buffers, so a buffer freed in one thread's arena is
    not reused by the next thread, which faults in fresh pages instead. In two alternating
    W2 runs over gRPC, one arena took the server's peak RSS above idle from 3.4x and 4.5x
    the values to 2.7x and 2.4x, and round trips were no slower. The handlers hold the GIL
    around most allocations anyway, and W4's latency did not move. A worker keeps glibc's
    arenas: its training code may allocate from native threads of its own (data loaders,
    BLAS), which one arena would serialize, and the fixed thresholds alone remove its faults.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # Fixing either threshold turns glibc's own adjustment of both off: both are set.
    return all([bool(mallopt(_M_ARENA_MAX, 1)) if one_arena else True,
                bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)),
                bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))])
