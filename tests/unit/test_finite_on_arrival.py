"""FiniteOnArrival: a streamed push's gradients checked piece by piece as they arrive; what
it cannot vouch for is left to the full check."""

from __future__ import annotations

import numpy as np

from ps_common.tensors import StreamAssembler, TensorMeta
from ps_server.pushes import FiniteOnArrival


def arrive(tensors: list[np.ndarray], wire: list[str], chunk: int) -> frozenset[int]:
    metas = [TensorMeta(w, t.shape) for t, w in zip(tensors, wire)]
    check = FiniteOnArrival(metas, [t.dtype.name if t.dtype != np.uint16 else "float32"
                                    for t in tensors])
    buffers = [np.empty(t.nbytes, np.uint8) for t in tensors]
    assembler = StreamAssembler(buffers, what="push", on_write=check)
    stream = b"".join(t.tobytes() for t in tensors)
    for start in range(0, len(stream), chunk):
        assembler.write(stream[start:start + chunk])
    assembler.finish()
    return check.finite()


def test_finite_tensors_in_aligned_pieces_are_vouched_for():
    a, b = np.ones(100, np.float32), np.arange(50, dtype=np.float64)
    assert arrive([a, b], ["float32", "float64"], chunk=64) == {0, 1}


def test_a_non_finite_value_in_any_piece_is_left_to_the_full_check():
    a, b = np.ones(100, np.float32), np.ones(100, np.float32)
    b[77] = np.inf
    assert arrive([a, b], ["float32", "float32"], chunk=64) == {0}
    a[0] = np.nan
    assert arrive([a, b], ["float32", "float32"], chunk=64) == frozenset()


def test_a_piece_that_splits_an_element_is_left_to_the_full_check():
    # 3 float16 (6 bytes) first: every later chunk boundary falls 2 bytes into a float32.
    a, b = np.ones(3, np.float16), np.ones(100, np.float32)
    assert arrive([a, b], ["float16", "float32"], chunk=64) == {0}


def test_bfloat16_into_a_float16_variable_is_left_to_the_full_check():
    """Finite bfloat16 values may overflow float16: the full check converts them first."""
    metas = [TensorMeta("bfloat16", (64,))]
    check = FiniteOnArrival(metas, ["float16"])
    assembler = StreamAssembler([np.empty(128, np.uint8)], what="push", on_write=check)
    assembler.write(np.full(64, 0x3F80, np.uint16).tobytes())  # bfloat16 1.0
    assembler.finish()
    assert check.finite() == frozenset()


def test_bfloat16_is_checked_on_its_bit_patterns():
    raw = np.full(64, 0x3F80, np.uint16)  # bfloat16 1.0
    assert arrive([raw], ["bfloat16"], chunk=64) == {0}
    raw[-1] = 0x7F80  # +Inf
    assert arrive([raw], ["bfloat16"], chunk=64) == frozenset()


def test_an_empty_tensor_is_finite():
    assert arrive([np.ones(0, np.float32), np.ones(4, np.float32)],
                  ["float32", "float32"], chunk=8) == {0, 1}
