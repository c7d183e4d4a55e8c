"""The defaults a server takes from its machine's (or container's) memory: the budget for
values and slots, and the memory checkpoints may use for copies, which together never
commit more than the machine has."""

from __future__ import annotations

import pytest

from ps_server import memory

MiB = 1 << 20


@pytest.mark.parametrize("total_mib, checkpoint_mib", [
    (512, 512 - int(512 * MiB * 0.70) / MiB),  # a small container: what the budget leaves
    (16384, 16384 * 0.15),                     # 15%
    (1024, 256),                               # at least 256 MiB where the budget leaves it
])
def test_default_checkpoint_memory_fits_in_what_the_default_budget_leaves(
        monkeypatch, total_mib, checkpoint_mib):
    total = total_mib * MiB
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: total)
    budget = memory.default_memory_budget()
    assert budget == int(total * 0.70)
    checkpoint = memory.default_checkpoint_memory()
    assert budget + checkpoint <= total
    assert checkpoint == pytest.approx(checkpoint_mib * MiB, abs=1)
