"""Every Python code block of the README runs as written, so the README cannot drift from
the code: each block in a fresh interpreter against a cluster of its own, with the address
it names ("127.0.0.1:50050") replaced by that cluster's. A block that reads RANK runs as two
processes, ranks 0 and 1; a block that defines test functions has them called."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ps_server.testing import InProcessCluster

pytestmark = pytest.mark.system

README = Path(__file__).resolve().parents[2] / "README.md"
ADDRESS_IN_README = "127.0.0.1:50050"
RUN_S = 120.0  # bound of one block's run; never reached when the code is right

# Appended to a block that defines tests (as pytest would, it calls them).
CALL_TESTS = """
for _name, _test in list(globals().items()):
    if _name.startswith("test_") and callable(_test):
        _test()
"""


def python_blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("line, code", python_blocks(),
                         ids=[f"line {line}" for line, _ in python_blocks()])
def test_a_readme_python_block_runs_as_written(line, code, tmp_path):
    with InProcessCluster(servers=2) as cluster:
        source = code.replace(ADDRESS_IN_README, cluster.coordinator_address)
        if re.search(r"^def test_", code, re.M):
            source += CALL_TESTS
        script = tmp_path / f"readme_line_{line}.py"
        script.write_text(source)
        ranks = [0, 1] if 'os.environ["RANK"]' in code else [None]
        procs = [subprocess.Popen(
            [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **({"RANK": str(rank)} if rank is not None else {})})
            for rank in ranks]
        try:
            outputs = [proc.communicate(timeout=RUN_S)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, f"README line {line}:\n{source}\n--- output:\n{output}"

