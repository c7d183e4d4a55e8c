"""Tensor serde: bfloat16 conversion, chunked streams, byte readers, dtype rules, TensorMeta."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_common.errors import InvalidArgument
from ps_common.tensors import (
    WIRE_DTYPES,
    StreamAssembler,
    TensorMeta,
    array_reader,
    bfloat16_bits_to_float32,
    check_narrowing,
    count_non_finite,
    dtype_from_proto,
    dtype_to_proto,
    float32_to_bfloat16_bits,
    from_wire,
    iter_chunks,
    to_wire,
    view_bytes,
    wire_itemsize,
    wire_raw_dtype,
)
from ps_proto.v1 import tensor_pb2


def f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


# ---- bfloat16 ---------------------------------------------------------------------------

def test_bfloat16_round_trip_is_exact_for_representable_values():
    rng = np.random.default_rng(0)
    # Random upper halves (all finite, non-NaN patterns) with zero lower halves.
    upper = rng.integers(0, 1 << 16, size=10_000, dtype=np.uint32)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # drop inf/NaN exponents
    values = (upper << np.uint32(16)).view(np.float32)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0**-130, 2.0**127 * 1.5, -256.0, 1.0 + 2.0**-7],
                        dtype=np.float32)
    values = np.concatenate([values, specials])
    bits = float32_to_bfloat16_bits(values)
    assert bits.dtype == np.dtype("<u2") and bits.shape == values.shape
    back = bfloat16_bits_to_float32(bits)
    assert back.dtype == np.float32
    assert np.array_equal(back.view(np.uint32), values.view(np.uint32))  # bit-exact, -0.0 too


def test_bfloat16_rounds_to_nearest_even():
    cases = {
        0x3F808000: 0x3F80,  # 1 + 2^-8: exact tie, upper is even -> stays down
        0x3F818000: 0x3F82,  # 1 + 3*2^-8: exact tie, upper is odd -> rounds up to even
        0x3F808001: 0x3F81,  # just above the tie -> up
        0x3F807FFF: 0x3F80,  # just below the tie -> down
        0xBF818000: 0xBF82,  # negative tie, odd -> away from zero to even
        0x3F80FFFF: 0x3F81,
        0x3FFFFFFF: 0x4000,  # carries into the exponent
        0x7F7FFFFF: 0x7F80,  # float32 max rounds to +inf, as IEEE round-to-nearest does
    }
    values = np.array([f32(b) for b in cases], dtype=np.float32)
    got = float32_to_bfloat16_bits(values)
    assert [hex(int(b)) for b in got] == [hex(v) for v in cases.values()]


def test_bfloat16_keeps_nan_and_inf():
    values = np.array([np.nan, -np.nan, np.inf, -np.inf, f32(0x7F800001), f32(0xFFFFFFFF)],
                      dtype=np.float32)
    back = bfloat16_bits_to_float32(float32_to_bfloat16_bits(values))
    assert np.isnan(back[0]) and np.isnan(back[1])
    assert back[2] == np.inf and back[3] == -np.inf
    # signalling NaN / all-ones NaN must not round into inf or wrap around to zero
    assert np.isnan(back[4]) and np.isnan(back[5])


def test_bfloat16_works_on_multidimensional_and_non_contiguous_input():
    values = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    values[0, 0] = np.nan
    bits = float32_to_bfloat16_bits(values)
    assert bits.shape == (4, 3)
    back = bfloat16_bits_to_float32(bits)
    assert np.isnan(back[0, 0])
    assert np.array_equal(back.reshape(-1)[1:], values.reshape(-1)[1:])


def _bfloat16_bits_whole(values: np.ndarray) -> np.ndarray:
    """The rounding spelled out on whole arrays: what the blocked conversion must equal."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype("<u2")
    out[np.isnan(values)] = 0x7FC0
    return out


def test_bfloat16_conversion_is_the_same_in_every_block_and_at_their_edges():
    from ps_common.tensors import CONVERT_BLOCK_ELEMENTS
    n = 3 * CONVERT_BLOCK_ELEMENTS + 7  # a last block shorter than the others
    rng = np.random.default_rng(11)
    # Every bit pattern class: normals of all exponents, subnormals, zeros, ties, NaNs
    # (quiet and signalling, both signs), infinities, the largest finite values.
    values = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
                        0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x7F7FFFFF, 0x3F808000, 0x3F818000,
                        0x3F807FFF, 0x477FFFFF], np.uint32).view(np.float32)
    for edge in (0, CONVERT_BLOCK_ELEMENTS - 1, CONVERT_BLOCK_ELEMENTS, n - len(special)):
        values[edge:edge + len(special)] = special
    got = float32_to_bfloat16_bits(values.reshape(-1, 1))
    assert got.shape == (n, 1) and got.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(got.reshape(-1), _bfloat16_bits_whole(values))
    assert float32_to_bfloat16_bits(np.zeros((0, 3), np.float32)).shape == (0, 3)


def test_to_wire_and_from_wire():
    values = np.array([[1.0, -2.5], [3.25, 1e-3]], dtype=np.float32)
    for wire in WIRE_DTYPES:
        raw = to_wire(values, wire)
        assert raw.dtype == wire_raw_dtype(wire) and raw.flags.c_contiguous
        assert raw.itemsize == wire_itemsize(wire)
        decoded = from_wire(raw, wire)
        np.testing.assert_allclose(decoded, values, rtol=1e-2)
    # No copy when the array already is the wire's raw element type.
    assert np.shares_memory(to_wire(values, "float32"), values)


# ---- chunked streams --------------------------------------------------------------------

def _tensors():
    rng = np.random.default_rng(1)
    return [
        (rng.standard_normal((3, 5)).astype(np.float32), "float32"),
        (rng.standard_normal(7), "float64"),
        (np.zeros((0,), dtype=np.float32), "float32"),  # empty tensor in the middle
        (rng.standard_normal((11, 2)).astype(np.float32), "bfloat16"),
        (rng.standard_normal(9).astype(np.float32), "float16"),
        (rng.standard_normal((2, 2, 3)).astype(np.float64), "float16"),
        (np.zeros((0,), dtype=np.float64), "float64"),  # empty tensor at the end
    ]


def _expected_bytes(values, wire) -> bytes:
    return to_wire(values, wire).tobytes()


@pytest.mark.parametrize("chunk_bytes", [8, 24, 1000, 1 << 20, 7, 1])
def test_iter_chunks_and_assembler_round_trip(chunk_bytes):
    tensors = _tensors()
    metas = [TensorMeta(wire, values.shape) for values, wire in tensors]
    sizes = [m.nbytes for m in metas]
    assert sizes == [len(_expected_bytes(v, w)) for v, w in tensors]
    readers = [array_reader(values, wire) for values, wire in tensors]
    chunks = list(iter_chunks(sizes, readers, chunk_bytes))

    total = sum(sizes)
    assert b"".join(chunks) == b"".join(_expected_bytes(v, w) for v, w in tensors)
    assert all(len(c) == chunk_bytes for c in chunks[:-1])
    assert 0 < len(chunks[-1]) <= chunk_bytes
    assert len(chunks) == -(-total // chunk_bytes)

    buffers = [np.empty(m.shape, dtype=wire_raw_dtype(m.dtype)) for m in metas]
    assembler = StreamAssembler(buffers, what="test")
    assert assembler.expected == total
    for chunk in chunks:
        assembler.write(chunk)
    assembler.finish()
    assert assembler.received == total
    for (values, wire), buf, meta in zip(tensors, buffers, metas):
        decoded = from_wire(buf, wire)
        assert np.array_equal(decoded, from_wire(to_wire(values, wire), wire), equal_nan=True)
        # view_bytes over the raw bytes gives the same tensor
        assert np.array_equal(view_bytes(buf.tobytes(), meta), decoded)


def test_iter_chunks_of_nothing_yields_one_empty_piece_that_assembles():
    chunks = list(iter_chunks([0, 0], [array_reader(np.zeros(0, np.float32), "float32")] * 2, 16))
    assert chunks == [b""]
    assembler = StreamAssembler([bytearray(0), np.zeros(0, dtype=np.float32)], what="empty")
    for c in chunks:
        assembler.write(c)
    assembler.finish()
    assert list(iter_chunks([], [], 16)) == [b""]


def test_assembler_accepts_bytearray_and_memoryview_destinations():
    data = bytes(range(40))
    a, b = bytearray(10), bytearray(30)
    assembler = StreamAssembler([a, memoryview(b)], what="x")
    assembler.write(data[:3])
    assembler.write(b"")
    assembler.write(data[3:25])
    assembler.write(data[25:])
    assembler.finish()
    assert bytes(a) + bytes(b) == data


def test_assembler_accepts_an_empty_multidimensional_numpy_destination():
    assembler = StreamAssembler([np.zeros((0, 3), dtype=np.float32), bytearray(4)], what="x")
    assembler.write(b"abcd")
    assembler.finish()


def test_assembler_rejects_more_bytes_than_announced():
    buffers = [bytearray(4), bytearray(4)]
    assembler = StreamAssembler(buffers, what="push")
    assembler.write(b"12345")
    with pytest.raises(InvalidArgument) as info:
        assembler.write(b"6789")
    assert info.value.code == "INVALID_ARGUMENT"
    # nothing of the rejected chunk was written
    assert bytes(buffers[0]) + bytes(buffers[1]) == b"12345\0\0\0"


def test_assembler_rejects_any_byte_into_an_empty_stream():
    assembler = StreamAssembler([bytearray(0)], what="push")
    with pytest.raises(InvalidArgument):
        assembler.write(b"x")


def test_assembler_finish_rejects_too_few_bytes():
    assembler = StreamAssembler([bytearray(4), bytearray(4)], what="push")
    assembler.write(b"1234567")
    with pytest.raises(InvalidArgument):
        assembler.finish()
    untouched = StreamAssembler([bytearray(1)], what="push")
    with pytest.raises(InvalidArgument):
        untouched.finish()


# ---- array_reader -----------------------------------------------------------------------

@pytest.mark.parametrize("source_dtype", ["float32", "float64"])
@pytest.mark.parametrize("wire", ["float16", "bfloat16", "float32"])
def test_array_reader_arbitrary_ranges_match_the_encoding(source_dtype, wire):
    rng = np.random.default_rng(2)
    values = rng.standard_normal((13, 7)).astype(source_dtype)
    encoded = to_wire(values, wire).tobytes()
    read = array_reader(values, wire)
    n = len(encoded)
    ranges = [(0, n), (0, 1), (1, 2), (3, 5), (n - 1, n), (n, n), (17, 61), (5, 5)]
    ranges += [tuple(sorted(rng.integers(0, n + 1, size=2).tolist())) for _ in range(50)]
    for a, b in ranges:
        got = read(a, b - a)
        assert isinstance(got, (bytes, memoryview))  # a zero-copy view without a lock
        assert bytes(got) == encoded[a:b], (a, b)


def test_array_reader_same_dtype_reads_current_values_with_lock():
    values = np.arange(10, dtype=np.float32)
    lock = threading.Lock()
    read = array_reader(values, "float32", lock)
    assert read(4, 8) == values[1:3].tobytes()
    values[1] = 99.0  # the reader sees the live array, not a snapshot
    assert read(4, 4) == np.float32(99.0).tobytes()
    assert not lock.locked()
    read16 = array_reader(values, "float16", lock)
    assert read16(2, 3) == values.astype(np.float16).tobytes()[2:5]
    assert not lock.locked()


# ---- dtype rules and TensorMeta ---------------------------------------------------------

@pytest.mark.parametrize("stored, wire", [
    ("float32", "bfloat16"), ("float32", "float16"), ("float32", "float32"),
    ("float64", "float32"), ("float64", "bfloat16"), ("float64", "float64"),
    ("float16", "float16"),
])
def test_check_narrowing_allows_narrower_or_equal(stored, wire):
    check_narrowing(stored, wire, variable="v")


@pytest.mark.parametrize("stored, wire", [
    ("float16", "float32"), ("float16", "float64"), ("float32", "float64"),
])
def test_check_narrowing_refuses_wider(stored, wire):
    with pytest.raises(InvalidArgument) as info:
        check_narrowing(stored, wire, variable="dense/bias")
    assert "dense/bias" in info.value.message


@pytest.mark.parametrize("wire", WIRE_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (5, 6, 7)])
def test_tensor_meta_proto_round_trip(wire, shape):
    meta = TensorMeta(wire, shape)
    msg = meta.to_proto()
    assert isinstance(msg, tensor_pb2.TensorMeta)
    again = TensorMeta.from_proto(tensor_pb2.TensorMeta.FromString(msg.SerializeToString()),
                                  what="t")
    assert again == meta
    assert meta.nbytes == int(np.prod(shape, dtype=np.int64)) * wire_itemsize(wire)


def test_dtype_enum_round_trip_and_unknown_values():
    assert [dtype_from_proto(dtype_to_proto(d)) for d in WIRE_DTYPES] == list(WIRE_DTYPES)
    for bad in (0, 99):
        with pytest.raises(InvalidArgument):
            dtype_from_proto(bad)
    with pytest.raises(InvalidArgument):
        dtype_to_proto("int8")


def test_tensor_meta_from_proto_rejects_negative_dims_and_unspecified_dtype():
    with pytest.raises(InvalidArgument):
        TensorMeta.from_proto(tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[2, -1]),
                              what="t")
    with pytest.raises(InvalidArgument):
        TensorMeta.from_proto(tensor_pb2.TensorMeta(shape=[2]), what="t")


def test_view_bytes_is_a_zero_copy_view_of_a_bytearray():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = bytearray(values.tobytes())
    view = view_bytes(buf, TensorMeta("float32", (2, 3)))
    assert np.array_equal(view, values) and view.flags.writeable
    view[0, 0] = 42.0
    assert np.frombuffer(buf, dtype=np.float32)[0] == 42.0


# ---- chunk codec: protobuf's wire format, written by hand ---------------------------------

from ps_common.errors import InvalidArgument as _InvalidArgument  # noqa: E402
from ps_common.tensors import decode_chunk, encode_chunk  # noqa: E402
from ps_proto.v1 import parameter_server_pb2 as _ps_pb  # noqa: E402


@pytest.mark.parametrize("with_header", [False, True])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 70_000])
def test_chunk_codec_matches_protobuf_both_ways(with_header, size):
    data = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    header = _ps_pb.PushHeader(client_id="c", sequence=size + 1, epoch=3)
    ours = encode_chunk(header.SerializeToString() if with_header else None, data)
    parsed = _ps_pb.PushChunk.FromString(ours)
    assert parsed.data == data
    assert parsed.HasField("header") == with_header
    if with_header:
        assert parsed.header == header
    theirs = _ps_pb.PushChunk(data=data)
    if with_header:
        theirs.header.CopyFrom(header)
    decoded = decode_chunk(theirs.SerializeToString())
    assert bytes(decoded.data) == data
    assert (decoded.header is not None) == with_header
    if with_header:
        assert _ps_pb.PushHeader.FromString(decoded.header) == header


def test_chunk_codec_skips_unknown_fields_like_protobuf():
    unknown = b"\x18\x05" + b"\x21" + b"\x00" * 8 + b"\x2d" + b"\x00" * 4  # varint, 64, 32-bit
    decoded = decode_chunk(unknown + encode_chunk(None, b"abc"))
    assert bytes(decoded.data) == b"abc" and decoded.header is None


@pytest.mark.parametrize("raw", [
    b"\x12\x05abc",            # data runs past the end
    b"\x12",                   # length missing
    b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # overlong varint
    b"\x13",                   # wire type 3 (groups) is not supported
    b"\x21\x00",              # a 64-bit field cut short
    b"\x02\x00",              # field number 0
    b"\x0a\x00\x0a\x00",      # two headers in one chunk (protobuf would merge them)
    b"\x1a\x00\x1a\x00",      # two attached messages (the same)
])
def test_malformed_chunk_messages_are_invalid_argument(raw):
    with pytest.raises(_InvalidArgument):
        decode_chunk(raw)


def test_push_then_pull_messages_carry_their_third_field_both_ways():
    header = _ps_pb.PushHeader(client_id="c", sequence=2)
    pull = _ps_pb.PullRequest(epoch=4, shards=[_ps_pb.ShardRef(variable="t", row_ids=b"\0" * 8)])
    ours = encode_chunk(header.SerializeToString(), b"grad", pull.SerializeToString())
    assert _ps_pb.PushThenPullRequest.FromString(ours) == _ps_pb.PushThenPullRequest(
        header=header, data=b"grad", pull=pull)
    reply = _ps_pb.PushThenPullReply(data=b"rows", push=_ps_pb.PushReply(duplicate=True))
    decoded = decode_chunk(reply.SerializeToString())
    assert bytes(decoded.data) == b"rows" and decoded.header is None
    assert _ps_pb.PushReply.FromString(decoded.attached).duplicate
    assert decode_chunk(encode_chunk(None, b"x")).attached is None


# ---- finiteness and one-message chunks ---------------------------------------------------

from ps_common.tensors import FINITE_BLOCK_ELEMENTS, all_finite  # noqa: E402


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, FINITE_BLOCK_ELEMENTS + 3, -1])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_all_finite_finds_one_bad_element_in_any_block(bad, where, dtype):
    values = np.ones(2 * FINITE_BLOCK_ELEMENTS + 10, dtype)
    assert all_finite(values)
    values[where] = bad
    assert not all_finite(values)


def test_all_finite_on_float16_reads_the_exponent_of_every_element():
    """float16 is tested on its bit patterns: the largest finite values, subnormals and
    signed zeros pass; every NaN and infinity fails, in any block."""
    edges = np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000, 0x3C00], np.uint16)
    bad = np.array([0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFFFF, 0x7FFF], np.uint16)
    values = np.resize(edges, 2 * FINITE_BLOCK_ELEMENTS + 5).view(np.float16)
    assert all_finite(values) and np.isfinite(values).all()
    for pattern in bad:
        for where in (1, FINITE_BLOCK_ELEMENTS, len(values) - 1):
            broken = values.copy()
            broken.view(np.uint16)[where] = pattern
            assert not all_finite(broken), hex(pattern)
    assert all_finite(np.zeros(0, np.float16))
    strided = values.copy()
    strided.view(np.uint16)[3] = 0x7C00
    assert not all_finite(strided[::3]) and all_finite(strided[1::3])


def test_finite_in_both_holds_for_every_narrowing_but_bfloat16_into_float16():
    from ps_common.tensors import finite_in_both
    for stored in ("float16", "float32", "float64"):
        for wire in WIRE_DTYPES:
            if wire_itemsize(wire) > np.dtype(stored).itemsize:
                continue  # refused (check_narrowing)
            largest = (3.3895313892515355e38 if wire == "bfloat16"
                       else float(np.finfo(wire).max))
            with np.errstate(over="ignore"):
                stays_finite = bool(np.isfinite(np.array(largest).astype(stored)))
            assert finite_in_both(wire, stored) == stays_finite, (wire, stored)
    assert not finite_in_both("bfloat16", "float16")


def test_all_finite_takes_bfloat16_in_its_raw_wire_form():
    values = np.array([1.0, -3.38e38, 3.38e38, 1e-40, 0.0, -0.0], np.float32)  # max 3.39e38
    raw = to_wire(values, "bfloat16")
    assert raw.dtype == np.uint16 and all_finite(raw)
    for bad in (np.inf, -np.inf, np.nan):
        broken = to_wire(np.append(values, bad), "bfloat16")
        assert not all_finite(broken) and count_non_finite(broken) == 1
    assert not all_finite(to_wire(np.array([3.4e38 * 1.0001], np.float32), "bfloat16"))


def test_all_finite_takes_huge_finite_values_whose_sum_overflows():
    values = np.full(1000, np.finfo(np.float32).max, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(values.sum())
    assert all_finite(values)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_all_finite_finds_a_bad_element_at_every_position_of_short_blocks(dtype):
    """Every lane and tail position of the vectorized one-pass check."""
    for size in (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129):
        for where in range(size):
            for bad in (np.nan, np.inf, -np.inf):
                values = np.full(size, -2.5, dtype)
                values[where] = bad
                assert not all_finite(values), (size, where, bad)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_all_finite_takes_finite_values_whose_squares_overflow(dtype):
    values = np.full(1000, np.finfo(dtype).max / 3, dtype)
    values[::2] *= -1
    assert all_finite(values)
    values[-1] = np.nan
    assert not all_finite(values)


def test_all_finite_checks_what_read_block_returns_for_each_block():
    asked = []

    def nan_in_the_second_block(block):
        asked.append(block.size)
        return np.full_like(block, np.nan) if len(asked) == 2 else block

    values = np.ones(FINITE_BLOCK_ELEMENTS + 1, np.float32)
    assert not all_finite(values, nan_in_the_second_block)
    assert asked == [FINITE_BLOCK_ELEMENTS, 1]
    assert all_finite(values, lambda block: block)


def test_count_non_finite_counts_across_blocks():
    values = np.ones(FINITE_BLOCK_ELEMENTS + 3, np.float32)
    values[[0, FINITE_BLOCK_ELEMENTS - 1, FINITE_BLOCK_ELEMENTS + 2]] = [np.nan, np.inf, -np.inf]
    assert count_non_finite(values) == 3
    assert count_non_finite(values, lambda block: np.zeros_like(block)) == 0


def test_a_chunk_of_several_data_pieces_is_one_data_field():
    message = encode_chunk(b"hdr", [b"ab", memoryview(b"cd"), np.arange(2, dtype=np.uint8)])
    chunk = decode_chunk(message)
    assert bytes(chunk.header) == b"hdr"
    assert bytes(chunk.data) == b"abcd\x00\x01"


def test_a_shape_of_more_dimensions_than_numpy_allows_is_refused_before_it_is_multiplied():
    from ps_proto.v1 import tensor_pb2

    # 400,000 dimensions fit one message; multiplying them out would take minutes.
    many = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[2**62] * 400_000)
    with pytest.raises(InvalidArgument, match="400000 dimensions .at most 64"):
        TensorMeta.from_proto(many, what="push tensor 0")
    most = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[1] * 64)
    assert TensorMeta.from_proto(most, what="push tensor 0").nbytes == 4


@pytest.mark.parametrize("stored, wire, beyond", [
    ("float32", "float16", 7e4), ("float32", "bfloat16", 3.4e38),
    ("float64", "float32", 1e300), ("float64", "bfloat16", 1e300)])
def test_narrowed_refuses_a_value_the_wire_dtype_cannot_hold(stored, wire, beyond):
    """A pull's narrowing never turns a finite value into an infinity; the values' own NaNs
    and infinities pass as they are, and a value that fits is only rounded."""
    from ps_common.errors import OutOfRange
    from ps_common.tensors import narrowed

    values = np.array([1.5, -np.inf, np.nan, 2.0], stored)
    decoded = from_wire(narrowed(values, wire, "variable 'v'"), wire)
    assert decoded[0] == 1.5 and decoded[1] == -np.inf and np.isnan(decoded[2])
    values[3] = -beyond
    with pytest.raises(OutOfRange, match=f"variable 'v'.*{wire}"):
        narrowed(values, wire, "variable 'v'")
    assert narrowed(values, stored) is not None  # no narrowing: nothing refused
