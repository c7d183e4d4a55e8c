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
from ps_common.rows import check_ids, id_normal, id_uniform
from ps_common.shardmap import INITIALIZER_KNOBS, STORED_DTYPES, Component, VariableSpec

# knob -> default, per initializer
INITIALIZERS = INITIALIZER_KNOBS
BLOCK_ELEMENTS = 1 << 16


# A normal initializer's values stay within this many standard deviations of the mean
# (a draw beyond 10 has a probability of about 1.5e-23): the span checked to fit the dtype.
NORMAL_SPAN = 10.0


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
    _check_finite_values(spec)
    if init.name == "uniform" and not init.get("minval", -0.05) < init.get("maxval", 0.05):
        raise InvalidArgument(f"variable {spec.name!r}: uniform needs minval < maxval")
    if init.name == "normal" and init.get("stddev", 0.05) < 0:
        raise InvalidArgument(f"variable {spec.name!r}: normal needs stddev >= 0")
    if spec.seed < 0:
        raise InvalidArgument(f"variable {spec.name!r}: seed must be >= 0, got {spec.seed}")
    if spec.dynamic and init.name == "glorot_uniform":
        raise InvalidArgument(f"embedding table {spec.name!r}: glorot_uniform needs the table's "
                              "number of rows, which a dynamic table does not have; use "
                              "uniform or normal")


def _check_finite_values(spec: VariableSpec) -> None:
    """Refuse knobs that make values NaN or infinite in the variable's dtype: nothing could
    repair such a variable (non-finite gradients are refused, finite ones leave it so)."""
    init = spec.initializer
    largest = float(np.finfo(spec.dtype).max)
    for key, knob in init.params:
        if not math.isfinite(knob):
            raise InvalidArgument(f"variable {spec.name!r}: initializer {init.name} knob "
                                  f"{key!r} is {knob}: it must be finite")
        if key in ("value", "minval", "maxval", "mean") and abs(knob) > largest:
            raise InvalidArgument(f"variable {spec.name!r}: initializer {init.name} knob "
                                  f"{key!r} = {knob:g} does not fit {spec.dtype} (largest "
                                  f"{largest:g})")
    if init.name == "uniform":
        # The width multiplies values made in float32 (float64 for a float64 variable);
        # the results, between minval and maxval, are what the variable's dtype holds.
        made_in = "float64" if spec.dtype == "float64" else "float32"
        width = init.get("maxval", 0.05) - init.get("minval", -0.05)
        if abs(width) > float(np.finfo(made_in).max):
            raise InvalidArgument(f"variable {spec.name!r}: uniform's maxval - minval "
                                  f"({width:g}) does not fit {made_in}, which its values are "
                                  f"made in")
    if init.name == "normal":
        mean, stddev = init.get("mean", 0.0), init.get("stddev", 0.05)
        if abs(mean) + NORMAL_SPAN * abs(stddev) > largest:
            raise InvalidArgument(
                f"variable {spec.name!r}: normal's mean {mean:g} and stddev {stddev:g} make "
                f"values beyond {spec.dtype}'s largest ({largest:g}), which would be infinite: "
                f"|mean| + {NORMAL_SPAN:g} x stddev must fit")


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


def initialize_ids(initializer: Component, seed: int, ids: np.ndarray, dim: int, dtype: str, *,
                   num_rows: int | None, out: np.ndarray | None = None) -> np.ndarray:
    """The initial rows of embedding-table `ids`: shape (len(ids), dim), dtype `dtype`, written
    into `out` (of exactly that shape and dtype) if given, else into a new array.

    Same initializers and knob defaults as INITIALIZERS. The row of an id is a function of
    (initializer, seed, id) alone (see ps_common.rows.id_uniform), never of the batch it is
    generated in, so any server creates the same row for an id, in any run, whatever the
    number of servers. glorot_uniform's limit is sqrt(6 / (num_rows + dim)); a table of
    unknown size (num_rows None) cannot use it.

    Values are generated BLOCK_ELEMENTS at a time, so temporaries stay a few MB however many
    ids there are. Raises InvalidArgument for an unknown initializer or knob, glorot_uniform
    without num_rows, dim < 1, a dtype that is not stored, or ids check_ids refuses; ValueError
    for an `out` of the wrong shape or dtype.
    """
    ids = check_ids(ids, what=f"initializer {initializer.name}")
    _check_id_initializer(initializer, dim, dtype, num_rows)
    shape = (len(ids), dim)
    if out is None:
        out = np.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != np.dtype(dtype):
        raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; "
                         f"expected {shape} and {dtype}")
    name = initializer.name
    if name in ("zeros", "constant"):
        out.fill(initializer.get("value", 0.0) if name == "constant" else 0)
        return out

    if name == "normal":
        generate, offset, scale = (id_normal, initializer.get("mean", 0.0),
                                   initializer.get("stddev", 0.05))
    else:
        if name == "glorot_uniform":
            limit = glorot_limit((num_rows, dim))
            low, high = -limit, limit
        else:
            low, high = initializer.get("minval", -0.05), initializer.get("maxval", 0.05)
        generate, offset, scale = id_uniform, low, high - low
    block_ids = max(1, BLOCK_ELEMENTS // dim)
    for start in range(0, len(ids), block_ids):
        stop = min(start + block_ids, len(ids))
        values = generate(seed, ids[start:stop], dim)  # float64, then rounded once to dtype
        values *= scale
        values += offset
        out[start:stop] = values
    return out


def _check_id_initializer(init: Component, dim: int, dtype: str, num_rows: int | None) -> None:
    if init.name not in INITIALIZERS:
        raise InvalidArgument(
            f"unknown initializer {init.name!r}; expected one of {sorted(INITIALIZERS)}"
        )
    unknown = set(dict(init.params)) - set(INITIALIZERS[init.name])
    if unknown:
        raise InvalidArgument(
            f"initializer {init.name} has no knob(s) {sorted(unknown)}; "
            f"it takes {sorted(INITIALIZERS[init.name]) or 'none'}"
        )
    if init.name == "glorot_uniform" and num_rows is None:
        raise InvalidArgument(
            "glorot_uniform needs the number of rows of the table, and a dynamic table has "
            "none: use uniform (minval, maxval) or normal (mean, stddev) instead"
        )
    if dim < 1:
        raise InvalidArgument(f"embedding dim must be >= 1, got {dim}")
    if dtype not in STORED_DTYPES:
        raise InvalidArgument(f"dtype {dtype!r} is not one of {STORED_DTYPES}")
