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


def test_past_the_cap_the_buffers_idle_longest_go_first():
    # Row pushes change size every step: a size that stopped coming back must not hold the
    # room that the sizes coming now need.
    pool = BufferPool(max_cached_bytes=1000)
    old, new = pool.acquire(800), pool.acquire(700)
    pool.release(old)
    pool.release(new)
    assert pool.cached_bytes == 700
    assert pool.acquire(700) is new
    assert pool.acquire(800) is not old
    pool.release(pool.acquire(1001))  # larger than the cap: never kept
    assert pool.cached_bytes == 0


def test_the_cap_may_be_read_when_a_buffer_is_released():
    cap = [1000]
    pool = BufferPool(max_cached_bytes=lambda: cap[0])
    first = pool.acquire(600)
    pool.release(first)
    cap[0] = 500
    pool.release(pool.acquire(400))
    assert pool.cached_bytes == 400


@pytest.mark.parametrize("tune", [
    "from ps_common.malloc import tune_malloc; assert tune_malloc(one_arena=True)",  # ps-server
    "from ps_worker import tune_malloc; assert tune_malloc()",  # ps-worker, training code
])
def test_tuned_glibc_keeps_freed_message_sized_blocks_for_reuse(tune):
    """In a child process (the setting is process-wide and must not leak into the tests):
    100 rounds of a call's allocations (2 MiB messages received and sent, a temporary as
    large) fault in fewer pages in all than one message has (512): freed blocks were reused,
    not given back to the kernel and faulted in again (untuned, glibc faults every page of
    them in every round)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = f"""
import resource
{tune}
def call():
    received, answer, temporary = bytearray(1 << 21), bytearray(1 << 21), bytearray(1 << 21)
for _ in range(5):
    call()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    call()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 512
