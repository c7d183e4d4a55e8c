"""Row ids of embedding tables: validation, deduplication, hashing and per-id random numbers.

Shared by clients (which deduplicate ids and sum their gradients before a push, and hash ids
to pick a shard) and servers (which generate the initial row of an id on first touch). Pure
NumPy: no grpc, no protobuf.

Random numbers here are counter-based: the value for (seed, id, column) is a fixed function of
those three numbers alone, so the same id gets the same initial row on any server, in any
batch, in any order, whatever the number of servers.
"""

from __future__ import annotations

import math

import numpy as np

from ps_common.errors import InvalidArgument

_MASK64 = (1 << 64) - 1
# splitmix64's constants (Steele, Lea and Flood 2014; Stafford's "Mix13" finalizer).
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = np.uint64(0x94D049BB133111EB)
# Separates the two streams Box-Muller draws from (any odd constant unrelated to the above).
_STREAM_SALT = 0xD1B54A32D192ED03
_TO_UNIT = 2.0 ** -53
# Rows per scatter-add block of sum_duplicates are chosen to keep its index buffer this size.
_SUM_BLOCK_ELEMENTS = 1 << 16


def check_ids(ids, *, what: str) -> np.ndarray:
    """`ids` as a 1-D C-contiguous int64 array (the caller's array itself when it already is).

    Accepts a 1-D NumPy array of dtype int64 (any strides, any byte order) or a list/tuple of
    Python ints; an empty one gives an empty array. Raises InvalidArgument, naming `what`,
    for any other dtype (int32, uint64, float, bool: ids must be int64, and silently
    converting would hide a caller's bug such as float ids), for arrays that are not 1-D, for
    ints outside int64 and for any other type.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind != "i" or ids.dtype.itemsize != 8:
            raise InvalidArgument(
                f"{what}: ids must be int64, got an array of dtype {ids.dtype} "
                f"and shape {ids.shape}"
            )
        if ids.ndim != 1:
            raise InvalidArgument(
                f"{what}: ids must be a 1-D int64 array, got shape {ids.shape}"
            )
        return np.ascontiguousarray(ids, dtype=np.int64)
    if isinstance(ids, (list, tuple)):
        return _ids_from_sequence(ids, what)
    raise InvalidArgument(
        f"{what}: ids must be a 1-D int64 numpy array or a list of ints, "
        f"got {type(ids).__name__}"
    )


def _ids_from_sequence(ids: list | tuple, what: str) -> np.ndarray:
    # Checked element by element (a Python loop: lists are for convenience, large batches
    # come as arrays) because NumPy would silently turn True into 1 and 1.5 into 1 when
    # converting to int64, and turns [-1, 2**63] into float64.
    for position, value in enumerate(ids):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise InvalidArgument(
                f"{what}: ids must be ints (int64), got {type(value).__name__} {value!r} "
                f"at position {position}"
            )
    try:
        return np.array(ids, dtype=np.int64)
    except OverflowError:
        raise InvalidArgument(f"{what}: ids must fit in int64, got values outside it") from None


def dedup(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique, inverse): the distinct ids in increasing order, and for every position of
    `ids` the index of its id in `unique`, so that `unique[inverse] == ids`.

    `ids` is expected to have been through check_ids. np.unique measured as fast as a
    hand-written argsort version (about 40 us for 4096 ids).
    """
    unique, inverse = np.unique(np.asarray(ids), return_inverse=True)
    # NumPy 2.0.0 gave inverse the input's shape; flatten so every version agrees.
    return unique, inverse.reshape(-1)


def sum_duplicates(grads: np.ndarray, inverse: np.ndarray, n_unique: int,
                   dtype=None) -> np.ndarray:
    """Row i of the result is the sum of the rows of `grads` whose `inverse` is i (zeros for
    an i that no row maps to); shape (n_unique, *grads.shape[1:]), in `dtype` (default:
    grads' dtype).

    float16 gradients are summed in float32 and rounded to `dtype` once at the end, so that
    many small contributions to one id are not lost to float16 rounding. Other dtypes are
    summed in their own dtype. `grads` is not modified. Raises ValueError when `inverse`
    does not match `grads` or holds an index outside [0, n_unique).

    How: without duplicates the rows are only reordered. Otherwise the rows are added with
    np.add.at on the flattened result, one index per element, a block of rows at a time so
    the index buffer stays small. Measured on 4096 x 64 float32 with Zipf-distributed ids
    (NumPy 2.4): ~0.3 ms, against ~0.35-0.7 ms for sort-by-inverse + np.add.reduceat
    (whose axis-0 loop is not vectorized) and ~1.7 ms for np.add.at with row indices.
    np.add.at is only fast from NumPy 1.25 on.
    """
    grads = np.asarray(grads)
    inverse = np.asarray(inverse)
    if inverse.ndim != 1 or grads.ndim < 1 or len(inverse) != len(grads):
        raise ValueError(
            f"inverse of shape {inverse.shape} does not match grads of shape {grads.shape}"
        )
    row_shape = grads.shape[1:]
    counts = np.bincount(inverse.astype(np.intp, copy=False), minlength=n_unique)
    if len(counts) > n_unique:
        raise ValueError(f"inverse holds index {int(inverse.max())} >= n_unique {n_unique}")
    if len(inverse) == 0 or counts.max() <= 1:
        # No duplicates: a permutation (or a scatter into zeros when some ids are missing).
        out = (np.empty if len(inverse) == n_unique else np.zeros)(
            (n_unique, *row_shape), dtype=dtype or grads.dtype)
        out[inverse] = grads
        return out

    sum_dtype = np.dtype(np.float32) if grads.dtype == np.float16 else grads.dtype
    row_elements = math.prod(row_shape)
    out = np.zeros((n_unique, row_elements), dtype=sum_dtype)
    if row_elements:
        _scatter_add_rows(out.reshape(-1), grads.reshape(len(grads), row_elements), inverse)
    return out.reshape(n_unique, *row_shape).astype(dtype or grads.dtype, copy=False)


def _scatter_add_rows(flat_out: np.ndarray, rows: np.ndarray, inverse: np.ndarray) -> None:
    """flat_out viewed as (n_unique, width): add rows[k] to row inverse[k], for every k."""
    width = rows.shape[1]
    block_rows = max(1, _SUM_BLOCK_ELEMENTS // width)
    columns = np.arange(width, dtype=np.intp)
    first_elements = inverse.astype(np.intp) * width
    index = np.empty((min(block_rows, len(rows)), width), dtype=np.intp)
    for start in range(0, len(rows), block_rows):
        stop = min(start + block_rows, len(rows))
        block_index = index[:stop - start]
        np.add(first_elements[start:stop, None], columns, out=block_index)
        block = rows[start:stop].astype(flat_out.dtype, copy=False).reshape(-1)
        np.add.at(flat_out, block_index.reshape(-1), block)


def _mix64_scalar(x: int) -> int:
    """splitmix64's finalizer on a Python int (wrapping at 64 bits)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_inplace(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array, in place. uint64 arithmetic on arrays wraps
    modulo 2**64 without warnings; the errstate covers NumPy versions and 0-d inputs that
    would warn about the (intended) overflow."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _MIX_MUL_1
        z ^= z >> np.uint64(27)
        z *= _MIX_MUL_2
        z ^= z >> np.uint64(31)
    return z


def hash_ids(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each id's 64 bits, as uint64: consecutive ids, and ids that
    share a stride, come out well spread, so `hash_ids(ids) % n` balances n shards.

    The finalizer is a bijection of 64-bit words (0 hashes to 0); it is a fixed function
    (no seed), so every client and server agrees on it. Raises InvalidArgument for ids that
    check_ids refuses.
    """
    ids = check_ids(ids, what="hash_ids")
    return _mix64_inplace(ids.view(np.uint64).copy())


def _id_bits(seed: int, stream: int, ids: np.ndarray, columns: int) -> np.ndarray:
    """(len(ids), columns) uint64 words; word (i, j) depends only on (seed, stream, ids[i], j).

    key = mix(seed_key ^ id), word = mix(key + (j + 1) * gamma): column j of an id is step
    j + 1 of a splitmix64 sequence started at the id's key.
    """
    seed_key = _mix64_scalar(_mix64_scalar(seed + _GOLDEN_GAMMA) ^ (stream * _STREAM_SALT))
    keys = _mix64_inplace(ids.view(np.uint64) ^ np.uint64(seed_key))
    with np.errstate(over="ignore"):
        steps = np.arange(1, columns + 1, dtype=np.uint64) * np.uint64(_GOLDEN_GAMMA)
        words = np.add(keys[:, None], steps[None, :])
    return _mix64_inplace(words)


def _unit_floats(words: np.ndarray) -> np.ndarray:
    """The top 53 bits of each word as a float64 in [0, 1), written over `words`' memory
    (element-wise with identical input and output memory is safe)."""
    words >>= np.uint64(11)
    out = words.view(np.float64)
    np.multiply(words, _TO_UNIT, out=out)  # exact: < 2**53 times a power of two
    return out


def id_uniform(seed: int, ids: np.ndarray, dim: int) -> np.ndarray:
    """float64 array (len(ids), dim) of uniform numbers in [0, 1) (multiples of 2**-53).

    Element (i, j) depends only on (seed, ids[i], j): not on the position of the id, on the
    other ids or on their number. Different seeds give unrelated numbers. Memory: two
    arrays of len(ids) x dim words, so callers generate large batches in blocks.
    """
    ids = check_ids(ids, what="id_uniform")
    return _unit_floats(_id_bits(seed, 0, ids, dim))


def id_normal(seed: int, ids: np.ndarray, dim: int) -> np.ndarray:
    """float64 array (len(ids), dim) of standard normal numbers, by Box-Muller, with the same
    property as id_uniform: element (i, j) depends only on (seed, ids[i], j).

    Columns 2k and 2k + 1 are the cosine and sine halves of the pair drawn from the words
    at counter k of two independent streams (stream 0 for the radius, 1 for the angle);
    since the pairing goes by column index, not by dim, dim may be odd.

    The transcendental functions (log1p, cos, sin) come from NumPy, which picks a SIMD
    implementation at run time: machines with different CPU features may differ in the
    last bit of a float64 value (the values are the same on any one machine, whatever the
    batch; float32 rounding hides such differences all but always).
    """
    ids = check_ids(ids, what="id_normal")
    pairs = (dim + 1) // 2
    radius = _unit_floats(_id_bits(seed, 0, ids, pairs))
    # sqrt(-2 ln(1 - u)): 1 - u lies in (0, 1], so the log is finite.
    np.negative(radius, out=radius)
    np.log1p(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle = _unit_floats(_id_bits(seed, 1, ids, pairs))
    angle *= 2.0 * math.pi
    out = np.empty((len(ids), dim), dtype=np.float64)
    out[:, 0::2] = radius * np.cos(angle)
    out[:, 1::2] = (radius * np.sin(angle))[:, :dim // 2]
    return out
