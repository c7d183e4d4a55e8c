"""Seeded, row-addressable initializers.

Values are generated in fixed blocks of rows, block `b` from its own generator seeded with
(seed, b). A shard holding rows [start, stop) of a larger variable therefore gets exactly the
values the unsplit variable has in those rows, for any way of splitting it, and generating a
shard costs time proportional to its own size.
"""

from __future__ import annotations

import math

import numpy as np

from ps_common.errors import InvalidArgument
from ps_common.shardmap import VariableSpec

# knob -> default, per initializer
INITIALIZERS: dict[str, dict[str, float]] = {
    "zeros": {},
    "constant": {"value": 0.0},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "normal": {"mean": 0.0, "stddev": 0.05},
    "glorot_uniform": {},
}
BLOCK_ELEMENTS = 1 << 16


def validate_initializer(spec: VariableSpec) -> None:
    init = spec.initializer
    if init.name not in INITIALIZERS:
        raise InvalidArgument(
            f"variable {spec.name!r}: unknown initializer {init.name!r}; "
            f"expected one of {sorted(INITIALIZERS)}"
        )
    unknown = set(dict(init.params)) - set(INITIALIZERS[init.name])
    if unknown:
        raise InvalidArgument(
            f"variable {spec.name!r}: initializer {init.name} has no knob(s) {sorted(unknown)}; "
            f"it takes {sorted(INITIALIZERS[init.name]) or 'none'}"
        )
    if init.name == "uniform" and not init.get("minval", -0.05) < init.get("maxval", 0.05):
        raise InvalidArgument(f"variable {spec.name!r}: uniform needs minval < maxval")
    if init.name == "normal" and init.get("stddev", 0.05) < 0:
        raise InvalidArgument(f"variable {spec.name!r}: normal needs stddev >= 0")
    if spec.seed < 0:
        raise InvalidArgument(f"variable {spec.name!r}: seed must be >= 0, got {spec.seed}")


def glorot_limit(shape: tuple[int, ...]) -> float:
    """sqrt(6 / (fan_in + fan_out)), with Keras' fans for 1-D and convolution kernels."""
    if len(shape) == 1:
        fan_in = fan_out = shape[0]
    else:
        receptive = math.prod(shape[:-2]) if len(shape) > 2 else 1
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
    return math.sqrt(6.0 / (fan_in + fan_out))


def initialize_rows(spec: VariableSpec, row_start: int, row_stop: int,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows [row_start, row_stop) of `spec`'s initial value, as a C-contiguous array: `out`
    (of that shape and dtype) if given, else a new one."""
    shape = (row_stop - row_start, *spec.shape[1:])
    if out is None:
        out = np.empty(shape, dtype=spec.dtype)
    init = spec.initializer
    if init.name in ("zeros", "constant"):
        out.fill(init.get("value", 0.0) if init.name == "constant" else 0)
        return out

    flat_out = out.reshape(row_stop - row_start, -1)
    gen_dtype = np.float64 if spec.dtype == "float64" else np.float32
    if init.name == "glorot_uniform":
        limit = glorot_limit(spec.shape)
        low, high = -limit, limit
    elif init.name == "uniform":
        low, high = init.get("minval", -0.05), init.get("maxval", 0.05)
    block_rows = max(1, BLOCK_ELEMENTS // spec.row_elements)
    for block in range(row_start // block_rows, (row_stop - 1) // block_rows + 1):
        b_start = block * block_rows
        b_stop = min(b_start + block_rows, spec.rows)
        rng = np.random.default_rng([spec.seed, block])
        size = (b_stop - b_start, spec.row_elements)
        if init.name == "normal":
            values = rng.standard_normal(size, dtype=gen_dtype)
            values *= init.get("stddev", 0.05)
            values += init.get("mean", 0.0)
        else:
            values = rng.random(size, dtype=gen_dtype)
            values *= high - low
            values += low
        lo, hi = max(b_start, row_start), min(b_stop, row_stop)
        flat_out[lo - row_start:hi - row_start] = values[lo - b_start:hi - b_start]
    return out
