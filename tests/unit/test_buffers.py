"""BufferPool: push receive buffers are reused by size, within a cap on idle bytes."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

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


def test_ps_server_asks_glibc_for_one_malloc_arena():
    """In a child process: the setting is process-wide and must not leak into the tests."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's arena setting is glibc's")
    code = "from ps_server.memory import use_one_malloc_arena as f; print(f())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "True", done.stderr
