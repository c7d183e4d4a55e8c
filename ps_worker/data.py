"""Data sets and how an epoch is cut into tasks; pure NumPy, no I/O beyond loading.

Every worker that loads the same spec gets the same arrays, so a task is fully described
by (epoch, task index, tasks per epoch, seed) and ``task_indices`` turns it into rows.

Data sets with categorical fields (``synthetic_ctr``) carry int64 ids beside the dense
features; their batches are ``(Features(dense, ids), y)`` instead of ``(x, y)``.
"""

from __future__ import annotations

import dataclasses
import functools
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = [
    "DIGITS",
    "SYNTHETIC",
    "SYNTHETIC_CTR",
    "TEST_FRACTION",
    "Dataset",
    "Features",
    "iter_batches",
    "load_dataset",
    "task_indices",
]

DIGITS = "digits"
SYNTHETIC = "synthetic"
SYNTHETIC_CTR = "synthetic_ctr"
TEST_FRACTION = 0.2
# The held-out split does not depend on the run's seed, so that test accuracy is
# comparable across runs.
_SPLIT_SEED = 20240601
_SYNTHETIC_DEFAULT_EXAMPLES = 4096
_SYNTHETIC_FEATURES = 20
_SYNTHETIC_CLASSES = 4
# synthetic_ctr: see _make_synthetic_ctr.
_CTR_DEFAULT_EXAMPLES = 500_000
_CTR_STREAM = 0xC7  # the random streams of synthetic_ctr (beside the seed)
_CTR_FIELD_SIZES = (1000, 1000, 2000, 3000, 5000, 8000,
                    10_000, 20_000, 30_000, 50_000, 80_000, 100_000)
_CTR_ZIPF_EXPONENT = 1.1
_CTR_EFFECT_STDDEV = 0.5
_CTR_DENSE_FEATURES = 4
_CTR_DENSE_WEIGHT_STDDEV = 0.5
_CTR_BASE_RATE = 0.25


class Features(NamedTuple):
    """The ``x`` of a batch of a data set with categorical fields."""

    dense: Any  # float32 (B, num_features)
    ids: Any  # int64 (B, num_fields): field f's ids in [0, field_sizes[f])


@dataclass(frozen=True, eq=False)
class Dataset:
    """Training and held-out examples. Arrays are read-only, so a Dataset is safe to share
    between threads. ``x_*`` are float32 (N, F); ``y_*`` are int64 (N,) in [0, num_classes).

    A data set with categorical fields also has ``c_*``, int64 (N, len(field_sizes)), field
    f's ids in ``[0, field_sizes[f])``; without them ``c_*`` are None and ``field_sizes``
    is empty.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_features: int
    num_classes: int
    c_train: np.ndarray | None = None
    c_test: np.ndarray | None = None
    field_sizes: tuple[int, ...] = ()

    @property
    def categorical(self) -> bool:
        return bool(self.field_sizes)

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])


def load_dataset(spec: str, seed: int = 0) -> Dataset:
    """``"digits"``, ``"synthetic"``, ``"synthetic:N"``, ``"synthetic_ctr"``,
    ``"synthetic_ctr:N"`` or the path of a ``.npz`` file.

    ``seed`` only changes generated data (``synthetic``, ``synthetic_ctr``); held-out splits
    are fixed. Raises ``ValueError`` naming the spec or path when it cannot be loaded.
    """
    if spec == DIGITS:
        return _load_digits()
    if spec == SYNTHETIC_CTR or spec.startswith(SYNTHETIC_CTR + ":"):
        return _make_synthetic_ctr(spec, seed)
    if spec == SYNTHETIC or spec.startswith(SYNTHETIC + ":"):
        return _make_synthetic(spec, seed)
    if spec.endswith(".npz") or "/" in spec or Path(spec).exists():
        return _load_npz(Path(spec))
    raise ValueError(
        f"data set {spec!r} is not 'digits', 'synthetic[:N]', 'synthetic_ctr[:N]' nor a path "
        "to an .npz file"
    )


def task_indices(
    num_examples: int, *, epoch: int, task_index: int, tasks_per_epoch: int, seed: int
) -> np.ndarray:
    """The rows of task ``task_index``: part ``task_index`` of ``tasks_per_epoch`` near-equal
    contiguous parts of a permutation of ``range(num_examples)`` seeded by (seed, epoch).

    The tasks of one epoch partition the rows exactly; sizes differ by at most one. The
    result is a read-only int64 array. Pure and thread-safe.
    """
    for what, value in (("num_examples", num_examples), ("epoch", epoch), ("seed", seed)):
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")
    if tasks_per_epoch < 1:
        raise ValueError(f"tasks_per_epoch must be >= 1, got {tasks_per_epoch}")
    if not 0 <= task_index < tasks_per_epoch:
        raise ValueError(f"task_index {task_index} is outside 0..{tasks_per_epoch - 1}")
    permutation = _epoch_permutation(num_examples, epoch, seed)
    start = task_index * num_examples // tasks_per_epoch
    stop = (task_index + 1) * num_examples // tasks_per_epoch
    return permutation[start:stop]


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_examples: int, epoch: int, seed: int) -> np.ndarray:
    # Cached because every task of an epoch needs the same permutation.
    permutation = np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)
    permutation.setflags(write=False)
    return permutation


def iter_batches(
    dataset: Dataset,
    indices: np.ndarray,
    batch_size: int,
    *,
    split: Literal["train", "test"] = "train",
) -> Iterator[tuple[Any, np.ndarray]]:
    """(x, y) batches of the ``split`` rows ``indices``, in order; the last may be shorter.
    For a data set with categorical fields ``x`` is ``Features(dense, ids)``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if split == "train":
        x, y, c = dataset.x_train, dataset.y_train, dataset.c_train
    elif split == "test":
        x, y, c = dataset.x_test, dataset.y_test, dataset.c_test
    else:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    for start in range(0, len(indices), batch_size):
        rows = indices[start : start + batch_size]
        if c is None:
            yield x[rows], y[rows]
        else:
            yield Features(x[rows], c[rows]), y[rows]


def _held_out_split(num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows), both sorted; TEST_FRACTION of the rows, at least one each."""
    num_test = min(max(1, round(num_examples * TEST_FRACTION)), num_examples - 1)
    permutation = np.random.default_rng(_SPLIT_SEED).permutation(num_examples)
    return np.sort(permutation[num_test:]), np.sort(permutation[:num_test])


def _make_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int | None = None,
) -> Dataset:
    arrays = [
        np.ascontiguousarray(x_train, dtype=np.float32),
        np.ascontiguousarray(y_train, dtype=np.int64),
        np.ascontiguousarray(x_test, dtype=np.float32),
        np.ascontiguousarray(y_test, dtype=np.int64),
    ]
    for array in arrays:
        array.setflags(write=False)
    if num_classes is None:
        num_classes = int(max(arrays[1].max(initial=0), arrays[3].max(initial=0))) + 1
    return Dataset(name, *arrays, num_features=int(arrays[0].shape[1]), num_classes=num_classes)


def _examples_in(spec: str, default: int) -> int:
    """N of a generated data set's ``name:N`` spec (``default`` for the bare name)."""
    _, _, count = spec.partition(":")
    if not count:
        return default
    try:
        num_examples = int(count)
    except ValueError:
        raise ValueError(f"data set {spec!r}: {count!r} is not a number of examples") from None
    if num_examples < 2:
        raise ValueError(f"data set {spec!r}: needs at least 2 examples to hold some out")
    return num_examples


def _split_and_make(
    name: str, x: np.ndarray, y: np.ndarray, num_classes: int | None = None
) -> Dataset:
    train, test = _held_out_split(len(x))
    return _make_dataset(name, x[train], y[train], x[test], y[test], num_classes)


def _load_digits() -> Dataset:
    resource = resources.files("ps_worker").joinpath("datasets").joinpath("digits.npz")
    with resource.open("rb") as file, np.load(file) as archive:
        pixels, labels = archive["x"], archive["y"]
    # Pixels are counts of set bits in 4x4 blocks, 0..16.
    return _split_and_make(DIGITS, pixels.astype(np.float32) / 16.0, labels, num_classes=10)


def _make_synthetic(spec: str, seed: int) -> Dataset:
    num_examples = _examples_in(spec, _SYNTHETIC_DEFAULT_EXAMPLES)
    if seed < 0:
        raise ValueError(f"data set {spec!r}: seed must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    # Unit-variance clusters around centers about 2.5 apart per axis: learnable by a linear
    # model, not separable enough to be trivial.
    centers = rng.normal(0.0, 1.25, size=(_SYNTHETIC_CLASSES, _SYNTHETIC_FEATURES))
    labels = rng.integers(0, _SYNTHETIC_CLASSES, size=num_examples)
    features = centers[labels] + rng.normal(0.0, 1.0, size=(num_examples, _SYNTHETIC_FEATURES))
    return _split_and_make(spec, features, labels, num_classes=_SYNTHETIC_CLASSES)


def _make_synthetic_ctr(spec: str, seed: int) -> Dataset:
    """A click log drawn from a known logistic model (no download; about 0.15 s per 100,000
    examples, 500,000 by default). Every example has one id in each of 12 categorical
    fields (field f's vocabulary is ``_CTR_FIELD_SIZES[f]``, 1,000 to 100,000 ids; ids are
    Zipf-distributed with exponent 1.1, id 0 the most frequent) and 4 standard-normal dense
    features. The click probability is ``sigmoid(bias + sum_f effect_f[id_f] + dense . w)``:
    a hidden effect per id, N(0, 0.5), dense weights N(0, 0.5), and the bias set so that 25%
    of the examples are clicks. The Bayes-optimal held-out AUC (the true probabilities as
    scores) is 0.84 to 0.87 depending on the seed; rare ids are seen too seldom to learn, so
    a model reaches less (embedding_mlp: 0.835, 0.818 and 0.797 with seeds 0, 1 and 2).

    ``seed`` draws the hidden model (from a stream of its own, so ``synthetic_ctr:N`` of any
    N shares it) and the examples; the held-out 20% are the same rows for every seed
    (``_held_out_split``). Labels are 0 / 1 (``num_classes`` 2).
    """
    num_examples = _examples_in(spec, _CTR_DEFAULT_EXAMPLES)
    if seed < 0:
        raise ValueError(f"data set {spec!r}: seed must be >= 0, got {seed}")
    # The hidden model comes from a stream of its own, so that every N shares it.
    world = np.random.default_rng([seed, _CTR_STREAM, 0])
    effects = [world.normal(0.0, _CTR_EFFECT_STDDEV, size) for size in _CTR_FIELD_SIZES]
    weights = world.normal(0.0, _CTR_DENSE_WEIGHT_STDDEV, _CTR_DENSE_FEATURES)
    rng = np.random.default_rng([seed, _CTR_STREAM, 1])
    ids = np.empty((num_examples, len(_CTR_FIELD_SIZES)), np.int64)
    logits = np.zeros(num_examples)
    for field_index, vocabulary in enumerate(_CTR_FIELD_SIZES):
        # Inverse-CDF sampling of P(id = k) proportional to (k + 1) ** -exponent.
        cdf = np.cumsum(np.arange(1, vocabulary + 1, dtype=np.float64) ** -_CTR_ZIPF_EXPONENT)
        cdf /= cdf[-1]
        field_ids = np.searchsorted(cdf, rng.random(num_examples), side="right")
        np.minimum(field_ids, vocabulary - 1, out=ids[:, field_index])
        logits += effects[field_index][ids[:, field_index]]
    dense = rng.normal(0.0, 1.0, (num_examples, _CTR_DENSE_FEATURES))
    logits += dense @ weights
    logits += _bias_for_rate(logits, _CTR_BASE_RATE)
    labels = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    train, test = _held_out_split(num_examples)
    base = _make_dataset(spec, dense[train], labels[train], dense[test], labels[test], 2)
    c_train, c_test = np.ascontiguousarray(ids[train]), np.ascontiguousarray(ids[test])
    c_train.setflags(write=False)
    c_test.setflags(write=False)
    return dataclasses.replace(base, c_train=c_train, c_test=c_test,
                               field_sizes=_CTR_FIELD_SIZES)


def _bias_for_rate(logits: np.ndarray, rate: float) -> float:
    """The b for which the mean of sigmoid(logits + b) is ``rate`` (bisection)."""
    low, high = -30.0, 30.0
    for _ in range(40):  # to within 60 / 2**40
        middle = (low + high) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(logits + middle)))) > rate:
            high = middle
        else:
            low = middle
    return (low + high) / 2


def _load_npz(path: Path) -> Dataset:
    if path.is_dir():
        raise ValueError(f"data set file {str(path)!r} is a directory, not an .npz file")
    if not path.is_file():
        raise ValueError(f"data set file {str(path)!r} does not exist")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: empty
        raise ValueError(f"data set file {str(path)!r} is not a readable .npz file: {exc}") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"data set file {str(path)!r} is a single array, not an .npz archive")
    with archive:
        try:
            names = [name for name in ("x", "y", "x_test", "y_test") if name in archive.files]
            arrays = {name: archive[name] for name in names}
        except Exception as exc:  # noqa: BLE001 - a damaged member raises zlib.error, numpy's
            # header parser tokenize.TokenError, and more: any of them is a file that
            # cannot be read, which the worker reports (a ValueError)
            raise ValueError(f"data set file {str(path)!r}: an array cannot be read: {exc}") from exc
    for required in ("x", "y"):
        if required not in arrays:
            raise ValueError(
                f"data set file {str(path)!r} has no array {required!r} "
                f"(it has {sorted(archive.files)})"
            )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ValueError(f"data set file {str(path)!r} must have both 'x_test' and 'y_test' or neither")
    x, y = _checked_pair(path, arrays["x"], arrays["y"], "x", "y")
    if "x_test" not in arrays:
        if len(x) < 2:
            raise ValueError(f"data set file {str(path)!r} has {len(x)} example(s) and no "
                             "'x_test': it needs at least 2 examples to hold some out")
        return _split_and_make(str(path), x, y)
    x_test, y_test = _checked_pair(path, arrays["x_test"], arrays["y_test"], "x_test", "y_test")
    if x_test.shape[1] != x.shape[1]:
        raise ValueError(
            f"data set file {str(path)!r}: 'x_test' has {x_test.shape[1]} features "
            f"but 'x' has {x.shape[1]}"
        )
    return _make_dataset(str(path), x, y, x_test, y_test)


def _checked_pair(
    path: Path, x: np.ndarray, y: np.ndarray, x_name: str, y_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """(x as float32 (N, F), y as int64 (N,)), or ValueError naming the file and the array.

    The checks are on the arrays training uses, after the cast: a float64 feature beyond
    float32's range would be inf there, and a label beyond int64's would wrap negative."""
    where = f"data set file {str(path)!r}"
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"{where}: {x_name!r} has no examples")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_) or np.iscomplexobj(x):
        raise ValueError(f"{where}: {x_name!r} has non-numeric dtype {x.dtype}")
    if x.ndim > 1 and not all(x.shape[1:]):
        raise ValueError(f"{where}: {x_name!r} has no features (shape {x.shape})")
    # Images and other multi-axis examples become flat feature vectors.
    x = x.reshape(x.shape[0], -1) if x.ndim != 2 else x
    with np.errstate(over="ignore"):  # an overflow is found just below, and named
        x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: {x_name!r} contains NaN or infinite values, or values "
                         f"beyond float32's range (about 3.4e38 in magnitude)")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"{where}: {y_name!r} must be a vector of class labels, got shape {y.shape}")
    if len(y) != len(x):
        raise ValueError(f"{where}: {x_name!r} has {len(x)} examples but {y_name!r} has {len(y)} labels")
    if np.issubdtype(y.dtype, np.floating):
        if not (np.isfinite(y).all() and (y == np.round(y)).all()):
            raise ValueError(f"{where}: {y_name!r} has non-integer labels")
    elif not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise ValueError(f"{where}: {y_name!r} has non-integer labels (dtype {y.dtype})")
    if y.min() < 0:
        raise ValueError(f"{where}: {y_name!r} has negative labels; classes must be 0..C-1")
    # int64 labels: larger ones (uint64 from 2**63, floats like 1e19) would wrap negative.
    if y.dtype != np.bool_ and y.max() >= 2**63:
        raise ValueError(f"{where}: {y_name!r} has labels beyond int64 (up to {y.max()}); "
                         f"classes must be 0..C-1")
    return x, y.astype(np.int64)
