"""Optimizers that run on the parameter server, updating values and slots in place.

Formulas (g is the pushed gradient, wd the coupled L2 `weight_decay`: g <- g + wd * w):
  sgd       w -= lr * g
  momentum  a = momentum * a + g;  w -= lr * a,  or with nesterov  w -= lr * (g + momentum * a)
  adagrad   s += g^2;  w -= lr * g / (sqrt(s) + eps);  s starts at initial_accumulator
  adam      m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
            w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (t counts this shard's steps)

Updates walk the flattened tensors in blocks of BLOCK_ELEMENTS with one small scratch buffer,
so no temporary the size of the whole tensor is ever made, and the gradient buffer (which the
server owns) is reused as scratch. Callers hold the shard's lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ps_common.errors import InvalidArgument
from ps_common.shardmap import OPTIMIZER_KNOBS, VariableSpec

BLOCK_ELEMENTS = 1 << 16

# knob -> default, per optimizer
OPTIMIZERS = OPTIMIZER_KNOBS
SLOTS: dict[str, tuple[str, ...]] = {
    "sgd": (), "momentum": ("accumulator",), "adagrad": ("accumulator",), "adam": ("m", "v"),
}


def _check_range(spec: VariableSpec, knob: str, value: float, ok: bool, want: str) -> None:
    if not ok or not math.isfinite(value):
        raise InvalidArgument(
            f"variable {spec.name!r}: optimizer {spec.optimizer.name} knob {knob}={value:g} "
            f"must be {want}"
        )


def resolve_knobs(spec: VariableSpec) -> dict[str, float]:
    """The optimizer's knobs with defaults filled in; InvalidArgument names a bad one."""
    opt = spec.optimizer
    if opt.name not in OPTIMIZERS:
        raise InvalidArgument(
            f"variable {spec.name!r}: unknown optimizer {opt.name!r}; "
            f"expected one of {sorted(OPTIMIZERS)}"
        )
    given = dict(opt.params)
    unknown = set(given) - set(OPTIMIZERS[opt.name])
    if unknown:
        raise InvalidArgument(
            f"variable {spec.name!r}: optimizer {opt.name} has no knob(s) {sorted(unknown)}; "
            f"it takes {sorted(OPTIMIZERS[opt.name])}"
        )
    knobs = {**OPTIMIZERS[opt.name], **given}
    for name, value in knobs.items():
        if name == "lr":
            _check_range(spec, name, value, value > 0, "> 0")
        elif name in ("momentum", "beta1", "beta2"):
            _check_range(spec, name, value, 0 <= value < 1, "in [0, 1)")
        elif name == "eps":
            _check_range(spec, name, value, value > 0, "> 0")
        elif name == "nesterov":
            _check_range(spec, name, value, value in (0.0, 1.0), "0 or 1 (false or true)")
        else:
            _check_range(spec, name, value, value >= 0, ">= 0")
    # The update computes with each knob in its compute dtype: lr=1e40 is inf in float32
    # (every update would make inf or NaN), eps=1e-50 is 0 there (adam divides by it).
    dtype = compute_dtype(spec.dtype)
    for name, value in knobs.items():
        with np.errstate(over="ignore", under="ignore"):
            cast = float(dtype.type(value))
        if not math.isfinite(cast) or (value > 0 and cast == 0.0):
            what = (f"past the largest {dtype} ({np.finfo(dtype).max:g})" if cast
                    else f"0 in {dtype}")
            raise InvalidArgument(
                f"variable {spec.name!r}: optimizer {opt.name} knob {name}={value:g} is "
                f"{what}, the dtype its update is computed in")
    return knobs


@dataclass
class ShardOptimizerState:
    """Slots and step count of one shard: lives beside the shard's values."""

    slots: dict[str, np.ndarray]
    steps: int = 0


def compute_dtype(stored: str) -> np.dtype:
    """float16 variables are updated (and their slots kept) in float32: in float16, eps
    rounds to 0 and squared gradients underflow, which turns adam's update into NaN/inf."""
    return np.dtype(np.float32) if np.dtype(stored) == np.float16 else np.dtype(stored)


def make_state(spec: VariableSpec, shape: tuple[int, ...]) -> ShardOptimizerState:
    knobs = resolve_knobs(spec)
    dtype = compute_dtype(spec.dtype)
    slots = {}
    for slot in SLOTS[spec.optimizer.name]:
        if spec.optimizer.name == "adagrad":
            slots[slot] = np.full(shape, knobs["initial_accumulator"], dtype=dtype)
        else:
            slots[slot] = np.zeros(shape, dtype=dtype)
    return ShardOptimizerState(slots)


def apply_update(
    spec: VariableSpec, knobs: dict[str, float], values: np.ndarray,
    state: ShardOptimizerState, grad: np.ndarray, read_block=None,
) -> None:
    """Apply one gradient to `values` in place. A writable `grad` may be clobbered (used as
    scratch); a read-only one (a view of a received message) is copied a block at a time
    where the step needs scratch (every optimizer but SGD, and any with weight decay).
    `read_block(block)`, if given, returns the contents of each block of `grad` to use (a
    private copy, read from a file instead of a mapping: ps_common.shm.BlockReader)."""
    state.steps += 1
    w = values.reshape(-1)
    g = grad.reshape(-1)
    slots = {k: v.reshape(-1) for k, v in state.slots.items()}
    dtype = compute_dtype(spec.dtype)
    widen = dtype != w.dtype
    scratch = np.empty(min(BLOCK_ELEMENTS, w.size), dtype=dtype)
    # A read-only block is copied into a block-sized buffer (made on first need): the copy
    # stays in cache, unlike a copy of the whole gradient.
    grad_block = None
    kind = spec.optimizer.name
    step = _STEPS[kind]
    constants = _constants(kind, knobs, state.steps)
    wd = knobs["weight_decay"]
    for start in range(0, w.size, BLOCK_ELEMENTS):
        stop = min(start + BLOCK_ELEMENTS, w.size)
        wb, gb, sb = w[start:stop], g[start:stop], scratch[:stop - start]
        if read_block is not None:
            gb = read_block(gb)
        if widen:  # block-sized float32 copies, written back below
            wb, gb = wb.astype(dtype), gb.astype(dtype)
        elif not gb.flags.writeable and (wd or kind in _WRITES_GRADIENT):
            if grad_block is None:
                grad_block = np.empty(min(BLOCK_ELEMENTS, w.size), dtype=dtype)
            np.copyto(grad_block[:stop - start], gb)
            gb = grad_block[:stop - start]
        if wd:
            np.multiply(wb, wd, out=sb)
            gb += sb
        step(wb, gb, sb, {k: v[start:stop] for k, v in slots.items()}, constants)
        if widen:
            w[start:stop] = wb


# The steps that use the gradient's block as scratch: a read-only one (a view of a received
# message or of a client's push slot) is copied first. SGD reads it once, into its own
# scratch, and spares the copy.
_WRITES_GRADIENT = frozenset({"momentum", "adagrad", "adam"})


def _constants(kind: str, knobs: dict[str, float], t: int) -> dict[str, float]:
    if kind == "adam":
        return {
            **knobs,
            "lr_t": knobs["lr"] / (1.0 - knobs["beta1"] ** t),
            "v_scale": 1.0 / math.sqrt(1.0 - knobs["beta2"] ** t),
        }
    return knobs


def _sgd(w, g, scratch, slots, k):
    np.multiply(g, k["lr"], out=scratch)
    w -= scratch


def _momentum(w, g, scratch, slots, k):
    acc = slots["accumulator"]
    acc *= k["momentum"]
    acc += g
    if k["nesterov"]:
        np.multiply(acc, k["momentum"], out=scratch)
        g += scratch
        g *= k["lr"]
        w -= g
    else:
        np.multiply(acc, k["lr"], out=scratch)
        w -= scratch


def _adagrad(w, g, scratch, slots, k):
    acc = slots["accumulator"]
    np.multiply(g, g, out=scratch)
    acc += scratch
    np.sqrt(acc, out=scratch)
    scratch += k["eps"]
    g *= k["lr"]
    g /= scratch
    w -= g


def _adam(w, g, scratch, slots, k):
    m, v = slots["m"], slots["v"]
    b1, b2 = k["beta1"], k["beta2"]
    np.multiply(g, g, out=scratch)
    scratch *= 1.0 - b2
    v *= b2
    v += scratch
    m *= b1
    g *= 1.0 - b1
    m += g
    np.sqrt(v, out=scratch)
    scratch *= k["v_scale"]
    scratch += k["eps"]
    np.multiply(m, k["lr_t"], out=g)
    g /= scratch
    w -= g


_STEPS = {"sgd": _sgd, "momentum": _momentum, "adagrad": _adagrad, "adam": _adam}
