"""A job's seed is an int64 on the wire once each variable's offset is added to it
(VariableSpec.seed = job seed + VariableDef/EmbeddingDef seed): a seed that leaves no room for
the offsets is refused when the job is validated, naming `seed`, and so is an offset beyond
the room kept for it."""

from __future__ import annotations

import pytest

from ps_common.job import MAX_SEED, MAX_SEED_OFFSET, JobError, JobSpec
from ps_worker.models import EmbeddingDef, VariableDef


@pytest.mark.parametrize("seed", [2**63, 2**64])
def test_a_seed_too_large_for_the_wire_is_refused_naming_the_field(seed):
    with pytest.raises(JobError) as refused:
        JobSpec.from_mapping({"seed": seed}, source="--job job.yaml")
    assert refused.value.field == "seed"


def test_the_largest_seed_leaves_room_for_every_offset_on_the_wire():
    job = JobSpec.from_mapping({"seed": MAX_SEED}, source="--job job.yaml")
    assert job.seed + MAX_SEED_OFFSET == 2**63 - 1  # the int64 VariableSpec.seed holds
    with pytest.raises(JobError) as refused:
        JobSpec(seed=MAX_SEED + 1)
    assert refused.value.field == "seed"


@pytest.mark.parametrize("make", [
    lambda seed: VariableDef("w", (2,), seed=seed),
    lambda seed: EmbeddingDef("t", 4, 10, seed=seed),
], ids=["variable", "table"])
def test_a_variable_seed_offset_beyond_the_room_kept_for_it_is_refused(make):
    assert make(MAX_SEED_OFFSET).seed == MAX_SEED_OFFSET
    with pytest.raises(ValueError, match="seed"):
        make(MAX_SEED_OFFSET + 1)
