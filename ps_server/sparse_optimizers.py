"""Optimizers for embedding tables: the dense optimizers' formulas applied to touched rows only.

The formulas, knobs, slots and float16 handling are those of `ps_server.optimizers` (see its
docstring); only the rows a push names are read and written. One difference, by design: adam
counts steps per row (`row_steps`), so a row's bias correction uses the number of times that
row has been updated, not the number of pushes the shard has seen; a row touched for the
first time after a thousand pushes gets the bias correction of a first step.

Each update gathers the touched rows of the values and slots once (fancy indexing makes
compact copies), computes on those copies, and scatters them back once. Callers hold the
shard's lock.
"""

from __future__ import annotations

import numpy as np

from ps_common.shardmap import VariableSpec
from ps_server.optimizers import compute_dtype, make_state

ROW_STEPS = "row_steps"


def make_row_slots(spec: VariableSpec, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The slots of a table shard of `shape`: those of `optimizers.make_state(spec, shape)`
    (same names, dtypes and initial values), plus for adam ROW_STEPS, an int64 count per
    row. Raises InvalidArgument for a bad optimizer spec."""
    slots = dict(make_state(spec, shape).slots)
    if spec.optimizer.name == "adam":
        slots[ROW_STEPS] = np.zeros(shape[0], dtype=np.int64)
    return slots


def apply_rows(spec: VariableSpec, knobs: dict[str, float], values: np.ndarray,
               slots: dict[str, np.ndarray], rows: np.ndarray, grad: np.ndarray) -> None:
    """Apply one gradient to rows `rows` of `values` and of every slot, in place.

    `knobs` come from `optimizers.resolve_knobs(spec)`; `slots` from make_row_slots for
    values' shape. `rows` is a 1-D integer array of DISTINCT indices in [0, len(values)), in
    any order (a repeated row would get only one of its updates: sum duplicates first, see
    ps_common.rows.sum_duplicates); `grad[k]` is the gradient of row `rows[k]`, of any float
    dtype. `grad` is never modified. float16 values are updated in float32. Every row not
    in `rows`, of the values and of every slot, is left bit-for-bit as it was. An empty
    `rows` does nothing. Raises ValueError when grad's shape does not match, IndexError for
    a row outside the table (before anything is written).
    """
    rows = np.asarray(rows)
    if grad.shape != (len(rows), *values.shape[1:]):
        raise ValueError(f"grad of shape {grad.shape} does not match {len(rows)} rows of a "
                         f"table of shape {values.shape}")
    if len(rows) == 0:
        return
    if rows.min() < 0:  # a negative index would silently update a row counted from the end
        raise IndexError(f"row {int(rows.min())} is outside a table of {len(values)} rows")
    dtype = compute_dtype(spec.dtype)
    w = values[rows].astype(dtype, copy=False)  # a gathered copy: the caller's rows stay put
    g = grad.astype(dtype)  # always a private copy, used as scratch
    gathered = {name: slot[rows] for name, slot in slots.items() if name != ROW_STEPS}
    wd = knobs["weight_decay"]
    if wd:
        g += wd * w
    kind = spec.optimizer.name
    if kind == "adam":
        steps = slots[ROW_STEPS][rows] + 1
        _adam(w, g, gathered, knobs, steps, dtype)
        slots[ROW_STEPS][rows] = steps
    else:
        _STEPS[kind](w, g, gathered, knobs)
    values[rows] = w
    for name, block in gathered.items():
        slots[name][rows] = block


def _sgd(w, g, slots, k):
    g *= k["lr"]
    w -= g


def _momentum(w, g, slots, k):
    acc = slots["accumulator"]
    acc *= k["momentum"]
    acc += g
    if k["nesterov"]:
        g += k["momentum"] * acc
        g *= k["lr"]
        w -= g
    else:
        w -= k["lr"] * acc


def _adagrad(w, g, slots, k):
    acc = slots["accumulator"]
    acc += g * g
    denominator = np.sqrt(acc)
    denominator += k["eps"]
    g *= k["lr"]
    g /= denominator
    w -= g


def _adam(w, g, slots, k, steps, dtype):
    """Dense adam with per-row constants: lr_t = lr / (1 - b1^t), v_scale = 1/sqrt(1 - b2^t),
    t the row's own step count (column vectors, one entry per touched row)."""
    m, v = slots["m"], slots["v"]
    b1, b2 = k["beta1"], k["beta2"]
    t = steps.astype(np.float64)
    # Rounded to the compute dtype as the dense code's Python-float constants are.
    lr_t = (k["lr"] / (1.0 - np.power(b1, t))).astype(dtype)
    v_scale = (1.0 / np.sqrt(1.0 - np.power(b2, t))).astype(dtype)
    column = (slice(None),) + (None,) * (w.ndim - 1)  # broadcast one value over each row
    scratch = g * g
    scratch *= 1.0 - b2
    v *= b2
    v += scratch
    m *= b1
    g *= 1.0 - b1
    m += g
    np.sqrt(v, out=scratch)
    scratch *= v_scale[column]
    scratch += k["eps"]
    np.multiply(m, lr_t[column], out=g)
    g /= scratch
    w -= g


_STEPS = {"sgd": _sgd, "momentum": _momentum, "adagrad": _adagrad}
