"""BufferPool: push receive buffers are reused by size, within a cap on idle bytes."""

from __future__ import annotations

from ps_server.buffers import BufferPool


def test_a_released_buffer_is_handed_out_again_for_the_same_size():
    pool = BufferPool()
    first = pool.acquire(4096)
    pool.release(first)
    assert pool.cached_bytes == 4096
    assert pool.acquire(4096) is first
    assert pool.cached_bytes == 0
    assert pool.acquire(4096) is not first  # the one idle buffer is in use again
    other = pool.acquire(100)
    assert other.nbytes == 100 and other.flags.writeable


def test_idle_buffers_beyond_the_cap_are_dropped():
    pool = BufferPool(max_cached_bytes=1000)
    kept, dropped = pool.acquire(800), pool.acquire(800)
    pool.release(kept)
    pool.release(dropped)
    assert pool.cached_bytes == 800
    assert pool.acquire(800) is kept
