"""ps_common.shm.BlockReader: a large push read from its file, never resident in the reader.

A server checks, then applies, a large push from a client's slot (or a staged push's file)
a block at a time through a BlockReader. These tests read a segment that another mapping
(the client's) wrote, and look at the reader's own mapping in /proc/self/smaps: none of it
may become resident, and the values must be exactly what was written.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from ps_common import shm
from ps_common.errors import InvalidArgument
from ps_common.shardmap import Component, VariableSpec
from ps_common.tensors import all_finite, count_non_finite
from ps_server.optimizers import apply_update, make_state, resolve_knobs

pytestmark = pytest.mark.skipif(shm.supported() is not None,
                                reason=f"no shared memory here: {shm.supported()}")

ELEMENTS = 3 << 20  # 12 MiB of float32: several blocks of every reader


def open_descriptors_of(path: Path) -> int:
    """How many of this process's file descriptors are open on `path` (each mapping holds
    one too: Python's mmap keeps a duplicate of the descriptor it was made from)."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:  # closed meanwhile (e.g. the descriptor listing the directory)
            pass
    return count


def resident_kib(array: np.ndarray) -> int:
    """The resident KiB of the mapping of this process that holds `array`'s first byte."""
    address = array.ctypes.data
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" not in span or line.startswith(("Rss", "Size")):
            continue
        try:
            start, end = (int(part, 16) for part in span.split("-"))
        except ValueError:
            continue
        if start <= address < end:
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping holds address {address:#x}")


def own_name(kind: str) -> str:
    """A segment name that says this process made it: a server starting meanwhile (in
    another test run on this host) leaves it alone, as it leaves a live server's."""
    pid = os.getpid()
    return f"{shm.PREFIX}{pid}.{shm.process_start_time(pid)}.test{uuid.uuid4().hex}.{kind}"


@pytest.fixture
def written_segment():
    """A segment made as a server makes a large push slot, written through a second mapping
    (as the client writes it), and the array that was written."""
    segment = shm.create(own_name("slot"), ELEMENTS * 4)
    try:
        writer = shm.attach(segment.name, writable=True)
        grad = np.random.default_rng(0).standard_normal(ELEMENTS).astype(np.float32)
        np.copyto(writer.array(np.float32, (ELEMENTS,)), grad)
        yield segment, grad
    finally:
        shm.unlink(segment.path)


def test_a_check_and_an_update_read_through_it_leave_nothing_resident(written_segment):
    segment, grad = written_segment
    view = segment.array(np.float32, (ELEMENTS,))
    mappings = open_descriptors_of(segment.path)
    reader = segment.reader()
    assert reader is not None
    assert open_descriptors_of(segment.path) == mappings + 1
    header_page = resident_kib(view)  # the segment's header, which create() wrote
    assert header_page <= 4

    assert all_finite(view, reader)
    spec = VariableSpec("w", (ELEMENTS,), optimizer=Component.of({"name": "sgd", "lr": 0.5}))
    values = np.ones(ELEMENTS, np.float32)
    apply_update(spec, resolve_knobs(spec), values, make_state(spec, (ELEMENTS,)), view,
                 reader)

    np.testing.assert_array_equal(values, np.float32(1) - np.float32(0.5) * grad)
    assert resident_kib(view) == header_page
    reader.finish()
    assert resident_kib(view) == 0
    np.testing.assert_array_equal(view, grad)  # the slot itself was not used as scratch
    assert open_descriptors_of(segment.path) == mappings


def test_finish_drops_what_was_read_through_the_mapping(written_segment):
    segment, grad = written_segment
    view = segment.array(np.float32, (ELEMENTS,))
    reader = segment.reader()
    assert count_non_finite(view) == 0  # through the mapping: resident now
    assert resident_kib(view) >= ELEMENTS * 4 // 1024 // 2
    reader.finish()
    assert resident_kib(view) == 0
    np.testing.assert_array_equal(view, grad)  # dropped from this process, not from the file


def test_a_block_that_is_not_in_the_mapping_is_returned_as_it_is(written_segment):
    segment, _ = written_segment
    reader = segment.reader()
    elsewhere = np.arange(10, dtype=np.float32)
    assert reader(elsewhere) is elsewhere
    strided = segment.array(np.float32, (ELEMENTS,))[::2]
    assert reader(strided) is strided
    reader.finish()


def test_it_reads_the_bytes_a_later_write_put_there(written_segment):
    segment, _ = written_segment
    writer = shm.attach(segment.name, writable=True)
    view = segment.array(np.float32, (ELEMENTS,))
    reader = segment.reader()
    writer.array(np.float32, (ELEMENTS,))[5:9] = [np.nan, 1.0, np.inf, 2.0]
    block = reader(view[4:10])
    assert block.dtype == np.float32 and block.shape == (6,)
    assert count_non_finite(view[:16], reader) == 2
    assert not all_finite(view, reader)
    reader.finish()


def test_a_segment_whose_file_is_gone_has_no_reader():
    segment = shm.create(own_name("slot"), 64)
    shm.unlink(segment.path)
    assert segment.reader() is None


def test_a_file_shorter_than_its_mapping_is_refused_before_anything_is_read(written_segment):
    segment, _ = written_segment
    os.truncate(segment.path, 4096)  # a client that truncated its slot
    mappings = open_descriptors_of(segment.path)
    with pytest.raises(InvalidArgument, match="fewer than"):
        segment.reader()
    assert open_descriptors_of(segment.path) == mappings


def test_finish_closes_the_file_it_opened(written_segment):
    segment, _ = written_segment
    mappings = open_descriptors_of(segment.path)
    reader = segment.reader()
    assert open_descriptors_of(segment.path) == mappings + 1
    reader(segment.array(np.float32, (ELEMENTS,))[:10])
    reader.finish()
    assert open_descriptors_of(segment.path) == mappings
