"""Tensor serde: the only place that builds or reads TensorMeta messages and tensor bytes.

A tensor crosses the wire as (dtype, shape) in a header plus its raw little-endian bytes,
concatenated with the other tensors of the same call and cut into chunks of at most
`chunk_bytes`, so no tensor is ever limited by gRPC's message size or protobuf's 2 GiB field
limit. Receivers write each chunk straight into its final buffer (one copy per byte).

bfloat16 is carried as the upper 16 bits of float32 (rounded to nearest even), since numpy
has no bfloat16 type; it decodes to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ps_common.errors import InvalidArgument, OutOfRange
from ps_proto.v1 import tensor_pb2

# wire name -> (enum, numpy dtype of the raw bytes, numpy dtype it decodes to)
_WIRE = {
    "float32": (tensor_pb2.FLOAT32, np.dtype("<f4"), np.dtype("float32")),
    "float64": (tensor_pb2.FLOAT64, np.dtype("<f8"), np.dtype("float64")),
    "float16": (tensor_pb2.FLOAT16, np.dtype("<f2"), np.dtype("float16")),
    "bfloat16": (tensor_pb2.BFLOAT16, np.dtype("<u2"), np.dtype("float32")),
}
_BY_ENUM = {enum: name for name, (enum, _, _) in _WIRE.items()}
WIRE_DTYPES = tuple(_WIRE)


def wire_itemsize(wire_dtype: str) -> int:
    return _WIRE[wire_dtype][1].itemsize


def wire_raw_dtype(wire_dtype: str) -> np.dtype:
    """The numpy dtype of a wire dtype's raw elements (uint16 for bfloat16)."""
    return _WIRE[wire_dtype][1]


def dtype_to_proto(name: str) -> int:
    if name not in _WIRE:
        raise InvalidArgument(f"dtype {name!r} is not one of {WIRE_DTYPES}")
    return _WIRE[name][0]


def dtype_from_proto(value: int, *, what: str = "dtype") -> str:
    try:
        return _BY_ENUM[value]
    except KeyError:
        raise InvalidArgument(f"{what}: unknown or unspecified dtype enum {value}") from None


def check_narrowing(stored: str, wire: str, *, variable: str) -> None:
    """A transport dtype may be narrower than the stored one, never wider."""
    if wire_itemsize(wire) > np.dtype(stored).itemsize:
        raise InvalidArgument(
            f"variable {variable!r}: wire dtype {wire} is wider than its stored dtype {stored}"
        )


# The largest finite value of each wire dtype, and so of each stored one.
_LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
            "float32": float(np.finfo(np.float32).max), "float64": float(np.finfo(np.float64).max)}


def finite_in_both(wire: str, stored: str) -> bool:
    """Whether a value finite in `wire` stays finite converted to `stored` (so that a
    gradient can be checked as it came). Every narrowing but bfloat16 into float16 (same
    size, far larger range)."""
    return _LARGEST[wire] <= _LARGEST[stored]


# By the numpy dtype of stored values (bfloat16 is only ever a wire dtype).
_LARGEST_OF = {np.dtype(name): largest for name, largest in _LARGEST.items()
               if name != "bfloat16"}

MAX_DIMS = 64  # NumPy's limit on an array's dimensions


@dataclass(frozen=True)
class TensorMeta:
    dtype: str  # a wire dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * wire_itemsize(self.dtype)

    def to_proto(self) -> tensor_pb2.TensorMeta:
        return tensor_pb2.TensorMeta(dtype=dtype_to_proto(self.dtype), shape=self.shape)

    @classmethod
    def from_proto(cls, msg: tensor_pb2.TensorMeta, *, what: str) -> "TensorMeta":
        if len(msg.shape) > MAX_DIMS:
            # Refused before anything multiplies them out: the product of a few hundred
            # thousand large dimensions takes minutes, holding the interpreter.
            raise InvalidArgument(f"{what}: a shape of {len(msg.shape)} dimensions (at most "
                                  f"{MAX_DIMS}, NumPy's limit)")
        shape = tuple(int(d) for d in msg.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"{what}: negative dimension in shape {list(shape)}")
        return cls(dtype_from_proto(msg.dtype, what=what), shape)


# ---- element conversion ---------------------------------------------------------------

# Elements converted at a time, in scratch arrays that stay in the CPU's caches: whole-array
# temporaries of a large tensor cost a page fault per 4 KiB, each time.
CONVERT_BLOCK_ELEMENTS = 1 << 16


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and return the 16-bit patterns."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    bits, out = flat.view(np.uint32), np.empty(flat.size, "<u2")
    scratch = np.empty(min(CONVERT_BLOCK_ELEMENTS, flat.size), np.uint32)
    rounding = np.empty_like(scratch)
    for start in range(0, flat.size, CONVERT_BLOCK_ELEMENTS):
        block = bits[start:start + CONVERT_BLOCK_ELEMENTS]
        s, r = scratch[:block.size], rounding[:block.size]
        np.right_shift(block, 16, out=r)  # r = 0x7FFF + the lowest bit kept: ties to even
        np.bitwise_and(r, 1, out=r)
        r += 0x7FFF
        np.add(block, r, out=s)
        np.right_shift(s, 16, out=s)
        np.copyto(out[start:start + block.size], s, casting="unsafe")
        nan = np.isnan(flat[start:start + block.size])
        if nan.any():  # rounding may carry a NaN's mantissa into its sign: a quiet NaN instead
            out[start:start + block.size][nan] = 0x7FC0
    return out.reshape(np.shape(values))


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    widened = bits.astype(np.uint32)
    widened <<= np.uint32(16)  # in place: one temporary, not two
    return widened.view(np.float32)


def wire_bytes(values: np.ndarray, wire_dtype: str, what: str = "the values") -> memoryview:
    """`values` (`what`) going out in `wire_dtype` (see `narrowed`), as bytes: a view when
    no conversion is needed."""
    return memoryview(narrowed(values, wire_dtype, what).reshape(-1).view(np.uint8))


def narrowed(values: np.ndarray, wire_dtype: str, what: str = "the values") -> np.ndarray:
    """`to_wire` for values a server hands out (a pull): raises OutOfRange, naming `what`,
    where the narrowing turned a finite value into an infinity, instead of sending it (a
    push narrowed so is refused too). The values' own NaNs and infinities pass as they are."""
    largest = _LARGEST[wire_dtype]
    if _LARGEST_OF.get(values.dtype, largest) <= largest:  # nothing can overflow
        return to_wire(values, wire_dtype)
    with np.errstate(over="ignore"):
        encoded = to_wire(values, wire_dtype)
    if encoded.size and not all_finite(encoded) \
            and count_non_finite(encoded) > count_non_finite(values):
        raise OutOfRange(f"{what}: values beyond the range of wire dtype {wire_dtype} "
                         f"(largest {largest:g}); pull them in a wider wire_dtype")
    return encoded


def to_wire(values: np.ndarray, wire_dtype: str) -> np.ndarray:
    """`values` as a C-contiguous array of the wire's raw element type (no copy if it is one)."""
    if wire_dtype == "bfloat16":
        if values.dtype == np.float64:
            return _float64_to_bfloat16_bits(values)
        return float32_to_bfloat16_bits(values.astype(np.float32, copy=False))
    return np.ascontiguousarray(values, dtype=_WIRE[wire_dtype][1])


def _float64_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float64 rounded to the nearest bfloat16 (ties to even), through float32 rounded to
    odd: rounding to nearest twice would put a value just past the midpoint of two bfloat16
    values onto it, and then on the even one, which may be the farther."""
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    out = np.empty(flat.size, "<u2")
    for start in range(0, flat.size, CONVERT_BLOCK_ELEMENTS):
        block = flat[start:start + CONVERT_BLOCK_ELEMENTS]
        nearest = block.astype(np.float32)
        bits = nearest.view(np.uint32)
        with np.errstate(invalid="ignore"):
            back = nearest.astype(np.float64)
            inexact = back != block  # NaN too: it stays NaN with its lowest bit set
            bits[np.abs(back) > np.abs(block)] -= 1  # toward zero (inf: to the largest)
        bits[inexact] |= 1
        out[start:start + CONVERT_BLOCK_ELEMENTS] = float32_to_bfloat16_bits(nearest)
    return out.reshape(values.shape)


def from_wire(raw: np.ndarray, wire_dtype: str) -> np.ndarray:
    """Decode raw wire elements to the numpy dtype they stand for (a view when possible)."""
    if wire_dtype == "bfloat16":
        return bfloat16_bits_to_float32(raw)
    return raw


# Finiteness is checked a block at a time, so that no full-size temporary is ever made.
FINITE_BLOCK_ELEMENTS = 1 << 20


def all_finite(values: np.ndarray, read_block=None) -> bool:
    """Whether every element is finite (no NaN, no +-Inf). `values` is a float array or
    bfloat16's raw wire form (uint16 bit patterns, to_wire), checked in its own dtype
    (finite_in_both says when that answers for the dtype it will be stored in).
    `read_block(block)`, if given, returns the contents of each block to check
    (ps_common.shm.BlockReader: read from a file instead of a mapping)."""
    with np.errstate(over="ignore", invalid="ignore"):  # (see _finite_block)
        return all(_finite_block(block) for block in _finite_blocks(values, read_block))


# The exponent bits of the 16-bit floats, by the numpy dtype they come as: a value is NaN or
# Inf exactly when all of them are set. numpy reduces float16 element by element, ten times
# slower than these integer operations, and knows nothing of bfloat16.
_EXPONENT_BITS = {np.dtype(np.float16): np.uint16(0x7C00),  # float16
                  np.dtype(np.uint16): np.uint16(0x7F80)}  # bfloat16's raw wire form


def _finite_block(block: np.ndarray) -> bool:
    exponent = _EXPONENT_BITS.get(block.dtype)
    if exponent is not None:
        exponents = np.bitwise_and(block.view(np.uint16), exponent)
        return not block.size or exponents.max() != exponent
    # One pass first: a block's dot product with itself is finite only when every element
    # is (a NaN or an infinity makes it NaN or +Inf; squares never cancel one). It also
    # overflows for some finite blocks (values past about 1e19 in float32); those, and the
    # blocks that are not finite, are settled by max and min, which are finite exactly when
    # every element is: two more passes, no temporary.
    if np.isfinite(np.dot(block, block)):
        return True
    return bool(np.isfinite(block.max()) and np.isfinite(block.min()))


def _non_finite_in(block: np.ndarray) -> int:
    exponent = _EXPONENT_BITS.get(block.dtype)
    if exponent is not None:
        return int(np.count_nonzero(np.bitwise_and(block.view(np.uint16), exponent) == exponent))
    return block.size - int(np.count_nonzero(np.isfinite(block)))


def count_non_finite(values: np.ndarray, read_block=None) -> int:
    """How many elements are NaN or +-Inf (for an error message), a block at a time."""
    return sum(_non_finite_in(block) for block in _finite_blocks(values, read_block))


def _finite_blocks(values: np.ndarray, read_block) -> Iterator[np.ndarray]:
    flat = values.reshape(-1)
    for start in range(0, flat.size, FINITE_BLOCK_ELEMENTS):
        block = flat[start:start + FINITE_BLOCK_ELEMENTS]
        yield block if read_block is None else read_block(block)


def view_bytes(buffer, meta: TensorMeta) -> np.ndarray:
    """The tensor in `buffer` (raw bytes of `meta`), decoded, as a view when no conversion."""
    raw = np.frombuffer(buffer, dtype=_WIRE[meta.dtype][1]).reshape(meta.shape)
    return from_wire(raw, meta.dtype)


# ---- chunked streams ------------------------------------------------------------------

ByteReader = Callable[[int, int], bytes]
"""read(offset, length) -> exactly `length` bytes of one tensor's wire encoding."""


def array_reader(values: np.ndarray, wire_dtype: str, lock=None,
                 what: str = "the values") -> ByteReader:
    """A reader over `values` (`what`) encoded as `wire_dtype` (see `narrowed`), converting
    only the elements asked for.

    With `lock`, each read copies under it, so a chunk never shows a half-applied update.
    Without one, reads in the stored dtype are zero-copy views (the caller keeps `values`
    unchanged until the stream is sent).
    """
    flat = values.reshape(-1)
    same = flat.dtype == _WIRE[wire_dtype][1] and flat.flags.c_contiguous
    step = wire_itemsize(wire_dtype)
    raw = memoryview(flat.view(np.uint8)) if same and lock is None else None

    def read(offset: int, length: int) -> bytes:
        if raw is not None:
            return raw[offset:offset + length]
        first, last = offset // step, -(-(offset + length) // step)
        if lock is not None:
            lock.acquire()
        try:
            if same:
                return flat[first:last].tobytes()[offset - first * step:][:length]
            encoded = narrowed(flat[first:last], wire_dtype, what)
        finally:
            if lock is not None:
                lock.release()
        return encoded.tobytes()[offset - first * step:][:length]

    return read


def iter_chunks(sizes: Sequence[int], readers: Sequence[ByteReader], chunk_bytes: int) -> Iterator[bytes]:
    """The concatenated bytes of several tensors, cut into pieces of at most chunk_bytes.

    Yields at least one (possibly empty) piece so the caller always has a message to send.
    """
    for spans in chunk_spans(sizes, chunk_bytes):
        parts = [readers[tensor](offset, length) for tensor, offset, length in spans]
        yield b"" if not parts else parts[0] if len(parts) == 1 else b"".join(parts)


def chunk_spans(sizes: Sequence[int], chunk_bytes: int) -> Iterator[list[tuple[int, int, int]]]:
    """What each piece of `iter_chunks` holds: (tensor, offset in it, length) spans, in
    order. Yields at least one (possibly empty) list."""
    total = sum(sizes)
    if total == 0:
        yield []
        return
    tensor, offset_in_tensor = 0, 0
    produced = 0
    while produced < total:
        want = min(chunk_bytes, total - produced)
        spans = []
        while want:
            while sizes[tensor] == offset_in_tensor:
                tensor, offset_in_tensor = tensor + 1, 0
            take = min(want, sizes[tensor] - offset_in_tensor)
            spans.append((tensor, offset_in_tensor, take))
            offset_in_tensor += take
            want -= take
            produced += take
        yield spans


def _byte_view(buffer):
    if hasattr(buffer, "write_at"):
        return buffer
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("destination arrays must be C-contiguous")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    return memoryview(buffer).cast("B")


class StreamAssembler:
    """Writes an incoming chunked byte stream into per-tensor destination buffers.

    `destinations` are writable byte buffers (memoryview, bytearray, numpy arrays), or
    objects with `write_at(offset, data)` (a region of a file), whose lengths are the
    expected tensor sizes. Not thread-safe: one stream, one assembler.
    """

    def __init__(self, destinations: Sequence, *, what: str, on_write=None):
        self._dest = [_byte_view(d) for d in destinations]
        # on_write(tensor, offset, data): told of each piece as it is written (while the
        # piece is still in the CPU's caches).
        self._on_write = on_write
        self._what = what
        self._tensor = 0
        self._offset = 0
        self.received = 0
        self.expected = sum(len(d) for d in self._dest)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        if self.received + len(view) > self.expected:
            raise InvalidArgument(
                f"{self._what}: stream carries more than the {self.expected} bytes its header "
                "announces"
            )
        self.received += len(view)
        while len(view):
            dest = self._dest[self._tensor]
            room = len(dest) - self._offset
            if room == 0:
                self._tensor, self._offset = self._tensor + 1, 0
                continue
            take = min(room, len(view))
            if isinstance(dest, memoryview):
                dest[self._offset:self._offset + take] = view[:take]
            else:
                dest.write_at(self._offset, view[:take])
            if self._on_write is not None:
                self._on_write(self._tensor, self._offset, view[:take])
            self._offset += take
            view = view[take:]

    def finish(self) -> None:
        if self.received != self.expected:
            raise InvalidArgument(
                f"{self._what}: stream ended after {self.received} of {self.expected} bytes"
            )


# ---- chunk messages ---------------------------------------------------------------------
#
# PullChunk and PushChunk (field 1: header message, field 2: data bytes) are encoded and
# decoded here by hand, in protobuf's own wire format, because the generic protobuf path is
# slow for large bytes fields: building and serializing a message around a 2 MiB chunk
# takes ~3 ms where one join takes ~50 us, and parsing copies the bytes once more. Any
# protobuf implementation reads what we write, and we read what it writes (a chunk with two
# header fields, which protobuf would merge, is refused instead).

_HEADER_TAG = b"\x0a"  # field 1, length-delimited
_DATA_TAG = b"\x12"  # field 2, length-delimited
_ATTACHED_TAG = b"\x1a"  # field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise InvalidArgument("malformed chunk message: truncated or overlong varint")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(header: bytes | None, data, attached: bytes | None = None) -> bytes:
    """A serialized chunk message: `header` (serialized header message) and raw `data`, a
    bytes-like object or a list of them (concatenated: one copy of each into the message);
    `attached`, a serialized message for field 3 (PushThenPull's pull request or push
    reply)."""
    pieces = data if isinstance(data, list) else [data]
    size = sum(memoryview(piece).nbytes for piece in pieces)
    parts = [chunk_prefix(header, size)]
    if size:
        parts += pieces
    if attached is not None:
        parts.append(attached_field(attached))
    return b"".join(parts)


def chunk_prefix(header: bytes | None, data_size: int) -> bytes:
    """What comes before the `data_size` bytes of data in a chunk message: the header field,
    and the data field's tag and length (none for empty data, as protobuf writes it)."""
    parts = []
    if header is not None:
        parts += [_HEADER_TAG, _varint(len(header)), header]
    if data_size:
        parts += [_DATA_TAG, _varint(data_size)]
    return b"".join(parts)


def attached_field(attached) -> bytes:
    """Field 3 of a chunk message, `attached` its serialized message: it goes last."""
    return b"".join([_ATTACHED_TAG, _varint(len(attached)), attached])


@dataclass(frozen=True)
class Chunk:
    """A decoded chunk message: the header's serialized bytes (or None), a view of data,
    and field 3's serialized message (or None), which only PushThenPull's messages carry."""

    header: memoryview | None
    data: memoryview
    attached: memoryview | None = None


def decode_chunk(raw: bytes) -> Chunk:
    """Parse a chunk message without copying its data. Unknown fields are skipped, as
    protobuf does; a malformed message raises InvalidArgument."""
    view = memoryview(raw)
    header, data, attached = None, view[0:0], None
    pos = 0
    while pos < len(view):
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise InvalidArgument("malformed chunk message: field number 0")
        if wire_type == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise InvalidArgument("malformed chunk message: a field runs past its end")
            value = view[pos:pos + length]
            pos += length
            if field == 1:
                if header is not None:  # protobuf would merge the two: nobody sends this
                    raise InvalidArgument("malformed chunk message: two headers in one chunk")
                header = value
            elif field == 2:
                data = value
            elif field == 3:
                if attached is not None:
                    raise InvalidArgument("malformed chunk message: field 3 twice")
                attached = value
        elif wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise InvalidArgument(f"malformed chunk message: wire type {wire_type}")
    if pos != len(view):
        raise InvalidArgument("malformed chunk message: truncated field")
    return Chunk(header, data, attached)
