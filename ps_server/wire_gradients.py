"""A push's gradients as they arrived, converted to their variables' dtypes a block at a time.

A gradient pushed in another wire dtype than its variable's (float16 or bfloat16 into a
float32 variable, to halve the bytes on the wire) used to be converted whole on arrival:
a temporary the size of the variable's values, beside them, for as long as the push took
to check and apply (the server's peak RSS about twice the values for a large variable).
Instead, the update reads such a gradient through a `ConvertingReader`, which converts
each block it reads, in the cache-sized blocks it already works in; the finiteness check
reads it as it came (a value finite in the narrower dtype is finite in the wider one, and
ps_common.tensors.all_finite takes bfloat16's raw form), but for bfloat16 into float16,
whose finite values may overflow: that is checked converted, a block at a time.

Only what needs a gradient whole converts it whole (`whole_gradient`): the sum of a row push's
repeated ids and a sync step's sum, which hold copies of their own anyway.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ps_common.tensors import TensorMeta, finite_in_both, from_wire, wire_raw_dtype


def raw_gradient(buffer, meta: TensorMeta) -> np.ndarray:
    """The gradient in `buffer` as its raw wire elements, in place (uint16 for bfloat16)."""
    return np.frombuffer(buffer, dtype=wire_raw_dtype(meta.dtype)).reshape(meta.shape)


def whole_gradient(grad: np.ndarray, meta: TensorMeta, stored_dtype: str) -> np.ndarray:
    """`grad` (raw_gradient) whole in its variable's dtype: a converted copy, or `grad`
    itself where it needs no conversion."""
    with np.errstate(over="ignore"):  # bfloat16 into float16: Inf, refused unless allowed
        return from_wire(grad, meta.dtype).astype(stored_dtype, copy=False)


class ConvertingReader:
    """A `read_block` (ShardStore.check_gradients, ShardStore.apply) over `grads`, the raw
    gradients of one push (raw_gradient), whose tensors came as `metas` and belong to
    variables of `stored_dtypes`. Called with a block of one of them (a contiguous view, as
    the check and the update take them), it returns the block's contents in its variable's
    dtype: read through `read_block` first where one is given (ps_common.shm.BlockReader),
    then converted where the wire dtype is not the variable's. The result is valid until
    the next call. `for_update()` and `for_finiteness()` say what to read each pass with."""

    def __init__(self, grads: Sequence[np.ndarray], metas: Sequence[TensorMeta],
                 stored_dtypes: Sequence[str], read_block: Callable | None = None):
        self._read_block = read_block
        # Per gradient to convert: its address range, wire dtype and the dtype to make.
        self._converted: list[tuple[int, int, str, np.dtype]] = []
        for grad, meta, stored in zip(grads, metas, stored_dtypes):
            if grad.dtype != np.dtype(stored) and grad.size:
                start = grad.ctypes.data
                self._converted.append((start, start + grad.nbytes, meta.dtype,
                                        np.dtype(stored)))

    def for_update(self) -> Callable | None:
        """What the update reads blocks with: this reader, or `read_block` alone where no
        gradient needs converting."""
        return self if self._converted else self._read_block

    def for_finiteness(self) -> Callable | None:
        """What the finiteness check reads blocks with: a gradient is checked as it came
        (all_finite takes every wire dtype's raw form) unless a finite value of its wire
        dtype may overflow its variable's (ps_common.tensors.finite_in_both: bfloat16 into
        float16), which is checked converted."""
        overflowing = [entry for entry in self._converted
                       if not finite_in_both(entry[2], entry[3].name)]
        if not overflowing:
            return self._read_block
        checking = ConvertingReader((), (), (), self._read_block)
        checking._converted = overflowing
        return checking

    def __call__(self, block: np.ndarray) -> np.ndarray:
        contents = block if self._read_block is None else self._read_block(block)
        address = block.ctypes.data
        for start, stop, wire, stored in self._converted:
            if start <= address < stop:
                with np.errstate(over="ignore"):  # bfloat16 into float16: Inf, refused
                    return from_wire(contents, wire).astype(stored, copy=False)
        return contents

    def finish(self) -> None:
        """The push is done with its gradients: `read_block`'s own finish, if it has one."""
        finish = getattr(self._read_block, "finish", None)
        if finish is not None:
            finish()
