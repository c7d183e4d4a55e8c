"""A process that maps shared-memory segments keeps a file descriptor per segment: it raises
its soft limit on open files to the hard one, so that the usual soft limit of 1024 does not
send a thousand-shard server's shards over gRPC."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

from ps_common import shm

SOFT = 64
SEGMENTS = 3 * SOFT

pytestmark = pytest.mark.skipif(shm.supported() is not None, reason="no shared memory here")


def run_child(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_process_maps_more_segments_than_its_soft_limit_on_open_files():
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < SEGMENTS + 64:
        pytest.skip("the hard limit on open files is too low for this test")
    out = run_child(f"""
        import os, resource
        from ps_common import shm
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, hard))
        shm.allow_more_open_files()
        # Named as a live server's would be: no other server clears them meanwhile.
        prefix = f"{{shm.PREFIX}}{{os.getpid()}}.{{shm.process_start_time(os.getpid())}}."
        made = []
        try:
            for i in range({SEGMENTS}):
                made.append(shm.create(f"{{prefix}}{{i}}.values", 8))
            print(len(made), resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)
        finally:
            for segment in made:
                shm.unlink(segment.path)
    """)
    assert out.split() == [str(SEGMENTS), "True"]


def test_a_server_raises_the_limit_before_it_maps_anything():
    out = run_child(f"""
        import resource
        from ps_server.shared_memory import SharedMemory
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, hard))
        memory = SharedMemory()
        try:
            print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > {SOFT})
        finally:
            memory.close()
    """)
    assert out.split() == ["True"]


def test_a_client_raises_the_limit_when_it_shares_memory_with_a_server(make_cluster):
    cluster = make_cluster(servers=1, shared_memory=True)
    out = run_child(f"""
        import resource
        from ps_worker import PSClient
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, hard))
        with PSClient({cluster.coordinator_address!r}) as ps:
            ps.declare("w", shape=(4, 2), init={{"name": "constant", "value": 1.5}})
            total = float(ps.pull("w").sum())
            print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > {SOFT}, total,
                  sorted(set(ps.data_paths.values())))
    """)
    assert out.strip().split(maxsplit=2) == ["True", "12.0", "['shm']"]
