"""Staging files kept between pushes (ps_server.push_staging): which one a push gets, how
many bytes of them are kept, and which are never reused."""

from __future__ import annotations

import contextlib
import errno
import os

import numpy as np
import pytest

from ps_common.errors import ResourceExhausted

from ps_server import push_staging
from ps_server.push_staging import PushStaging

KIB = 1 << 10


@pytest.fixture
def staging(tmp_path):
    """Every push staged in a file (no memory for pushes)."""
    made = PushStaging(held_bytes=lambda: 0, memory_bytes=0,
                       directory=str(tmp_path))
    yield made
    made.close()


def stage(staging: PushStaging, nbytes: int, data: bytes | None = None):
    """One push of `nbytes` through `staging`, its bytes written as a push's are; the
    staging file it used (its inode, to tell files apart)."""
    data = data if data is not None else bytes([nbytes % 251]) * nbytes
    with staging.stage([nbytes]) as staged:
        staged.destinations[0].write_at(0, memoryview(data))
        staged.finish()
        assert bytes(staged.data[0]) == data
        return os.fstat(staged.file.fileno()).st_ino


def test_a_push_writes_over_the_file_of_the_last_one(staging):
    first = stage(staging, 64 * KIB)
    assert stage(staging, 64 * KIB) == first
    assert stage(staging, 16 * KIB) == first  # smaller: the kept file has room
    assert (staging.staged_pushes, staging.staging_files_made) == (3, 1)
    assert staging.idle_file_bytes() == 64 * KIB


def test_a_larger_push_gets_a_file_of_its_own_and_a_smaller_one_the_smallest_that_fits(
        staging):
    small, large = stage(staging, 16 * KIB), stage(staging, 64 * KIB)
    assert small != large
    assert staging.staging_files_made == 2
    assert stage(staging, 8 * KIB) == small
    assert stage(staging, 32 * KIB) == large
    assert staging.idle_file_bytes() == 80 * KIB


def test_concurrent_pushes_never_share_a_file(staging):
    with staging.stage([KIB]) as one, staging.stage([KIB]) as other:
        assert one.file is not other.file
    assert staging.staging_files_made == 2
    with staging.stage([KIB]) as one, staging.stage([KIB]) as other:
        assert one.file is not other.file
    assert staging.staging_files_made == 2  # both kept, both reused


def test_files_past_the_kept_bytes_are_closed(staging, monkeypatch):
    monkeypatch.setattr(push_staging, "KEEP_IDLE_BYTES", 100 * KIB)
    with staging.stage([64 * KIB]) as one, staging.stage([64 * KIB]) as other:
        files = [one.file, other.file]
    assert staging.idle_file_bytes() == 64 * KIB
    assert sorted(f.closed for f in files) == [False, True]
    big = staging.stage([200 * KIB])
    with big as staged:
        file = staged.file
    assert file.closed and staging.idle_file_bytes() == 64 * KIB


def test_a_push_that_fails_keeps_its_file_unless_the_file_failed(staging):
    with pytest.raises(ValueError), staging.stage([KIB]) as staged:
        refused = staged.file
        raise ValueError("a refused push")
    assert not refused.closed and staging.idle_file_bytes() == KIB
    with pytest.raises(OSError), staging.stage([KIB]) as staged:
        assert staged.file is refused
        raise OSError(errno.EIO, "Input/output error")
    assert refused.closed and staging.idle_file_bytes() == 0


def test_close_releases_the_kept_files_and_those_given_back_later(staging):
    stage(staging, KIB)
    with staging.stage([KIB]) as busy:
        staging.close()
        assert staging.idle_file_bytes() == 0
        file = busy.file
        assert not file.closed  # still in use by its push
    assert file.closed
    assert staging.idle_file_bytes() == 0


def test_at_most_max_idle_files_are_kept_the_longest_idle_closed_first(staging):
    with contextlib.ExitStack() as pushes:
        files = [pushes.enter_context(staging.stage([KIB])).file
                 for _ in range(push_staging.MAX_IDLE_FILES + 2)]
    # Given back in the reverse order of entering: the first two given back are closed.
    assert [f.closed for f in files] == [False] * push_staging.MAX_IDLE_FILES + [True, True]
    assert staging.idle_file_bytes() == push_staging.MAX_IDLE_FILES * KIB


def test_a_file_whose_mapping_a_view_outlived_is_not_reused(staging):
    data = b"\x01" * KIB
    with staging.stage([KIB]) as staged:
        staged.destinations[0].write_at(0, memoryview(data))
        staged.finish()
        outliving = np.frombuffer(staged.data[0], np.uint8)
        file = staged.file
    assert file.closed and staging.idle_file_bytes() == 0
    assert bytes(outliving) == data  # still readable: the mapping went with the file's last view
    stage(staging, KIB)
    assert staging.staging_files_made == 2  # the next push got a new file


def test_a_full_file_system_is_resource_exhausted_naming_the_flags(staging, monkeypatch):
    stage(staging, KIB)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ResourceExhausted) as raised, staging.stage([KIB]) as staged:
        staged.destinations[0].write_at(0, memoryview(b"\0" * KIB))
    assert "--spill-dir" in str(raised.value) and "--push-memory" in str(raised.value)
