"""Initial values for ``VariableDef``s computed locally, in NumPy.

In a cluster the parameter servers initialize variables; this is the reference used by
tests and by single-process runs. Values follow the same distributions and knob defaults
(Keras') as the servers' but are not bit-identical to theirs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ps_worker.models.base import VariableDef

__all__ = ["glorot_uniform_limit", "initial_values"]

_DEFAULT_KNOBS = {
    "constant": {"value": 0.0},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "normal": {"mean": 0.0, "stddev": 0.05},
}


def glorot_uniform_limit(shape: tuple[int, ...]) -> float:
    """``sqrt(6 / (fan_in + fan_out))`` with Keras' fans (the last two axes times the rest)."""
    if len(shape) == 1:
        fan_in = fan_out = shape[0]
    else:
        receptive_field = math.prod(shape[:-2])
        fan_in, fan_out = shape[-2] * receptive_field, shape[-1] * receptive_field
    return math.sqrt(6.0 / (fan_in + fan_out))


def initial_values(
    variables: Iterable[VariableDef], *, seed: int = 0, dtype: np.dtype | type = np.float32
) -> dict[str, np.ndarray]:
    """A fresh array per variable; deterministic in (``seed`` + the variable's seed offset)."""
    values = {}
    for variable in variables:
        spec = variable.init_spec()
        knobs = {**_DEFAULT_KNOBS.get(spec["name"], {}), **spec}
        rng = np.random.default_rng(seed + variable.seed)
        shape = variable.shape
        if knobs["name"] == "zeros":
            value = np.zeros(shape)
        elif knobs["name"] == "constant":
            value = np.full(shape, float(knobs["value"]))
        elif knobs["name"] == "uniform":
            value = rng.uniform(float(knobs["minval"]), float(knobs["maxval"]), shape)
        elif knobs["name"] == "normal":
            value = rng.normal(float(knobs["mean"]), float(knobs["stddev"]), shape)
        else:  # glorot_uniform; VariableDef rejects unknown names
            limit = glorot_uniform_limit(shape)
            value = rng.uniform(-limit, limit, shape)
        values[variable.name] = value.astype(dtype)
    return values
