"""What a model is to the worker: a list of variables and a loss with its gradients.

Built-in and user models alike satisfy ``Model``; ``evaluate`` is optional
(``EvaluableModel``). Models are written against the array module of the parameters they
are given (``ps_worker.backend.array_module``), so one implementation runs on NumPy and CuPy.

Embedding tables (``EmbeddingModel``): a model may also hold tables of rows addressed by
int64 id, of which each batch uses a few. It lists them in ``tables()`` (``EmbeddingDef``)
and says which rows a batch needs in ``row_ids(batch) -> {table name: int64 ids}``. The
contract with the trainer, for every table:

* ``params[table]`` is an array of shape ``(len(ids), dim)``: row ``i`` is the current value
  of the row ``ids[i]``, in the order ``row_ids`` gave them. Ids may repeat (the same id in
  several examples or fields); each occurrence gets its own copy of the row.
* ``grads[table]`` has that same shape: row ``i`` is the gradient of the loss with respect
  to occurrence ``i`` only. The system sums the gradients of repeated ids before the
  optimizer applies them, so a model never de-duplicates nor scatters.
* ``row_ids`` depends on the batch alone (never on parameters) and is called once per batch,
  usually a step ahead (the trainer prefetches the next batch's rows).

Dense variables (``variables()``) are unchanged: whole arrays in ``params`` and ``grads``.
Names are unique across variables and tables. A model that also offers
``scores(params, batch)`` (``ScoringModel``: a probability per example of binary labels)
gets held-out AUC reported beside accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ps_common.job import MAX_SEED_OFFSET, OPTIMIZER_NAMES

__all__ = [
    "INITIALIZER_KNOBS",
    "EmbeddingDef",
    "EmbeddingModel",
    "EvaluableModel",
    "Model",
    "ScoringModel",
    "VariableDef",
    "class_labels",
]

# The initializers the parameter server understands, with the knobs each accepts.
INITIALIZER_KNOBS: Mapping[str, frozenset[str]] = {
    "zeros": frozenset(),
    "constant": frozenset({"value"}),
    "uniform": frozenset({"minval", "maxval"}),
    "normal": frozenset({"mean", "stddev"}),
    "glorot_uniform": frozenset(),
}


def _checked_init_spec(what: str, init: str | Mapping[str, Any]) -> dict[str, Any]:
    """``init`` as ``{"name": ..., knob: value}``, or ValueError naming ``what``."""
    spec = {"name": init} if isinstance(init, str) else dict(init)
    if spec.get("name") not in INITIALIZER_KNOBS:
        raise ValueError(
            f"{what}: initializer {spec.get('name')!r} is not one of {sorted(INITIALIZER_KNOBS)}"
        )
    unknown_knobs = set(spec) - {"name"} - INITIALIZER_KNOBS[spec["name"]]
    if unknown_knobs:
        raise ValueError(f"{what}: initializer {spec['name']!r} takes no {sorted(unknown_knobs)}")
    # The servers reject these too; failing here names the model's mistake sooner.
    if spec["name"] == "uniform" and not spec.get("minval", -0.05) < spec.get("maxval", 0.05):
        raise ValueError(f"{what}: uniform needs minval < maxval")
    if spec["name"] == "normal" and spec.get("stddev", 0.05) < 0:
        raise ValueError(f"{what}: normal needs stddev >= 0")
    return spec


@dataclass(frozen=True)
class VariableDef:
    """One trainable variable: its name on the parameter servers, shape and initializer.

    ``init`` is an initializer name (``"zeros"``) or a dict with ``"name"`` and its knobs
    (``{"name": "uniform", "minval": -0.1, "maxval": 0.1}``). ``seed`` is an offset added to
    the run's seed so that variables of the same shape start differently (0 to 2**32 - 1).
    """

    name: str
    shape: tuple[int, ...]
    init: str | Mapping[str, Any] = field(default="zeros", hash=False)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"variable name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(int(dim) for dim in self.shape)
        except (TypeError, ValueError):
            raise ValueError(
                f"variable {self.name!r}: shape {self.shape!r} is not a tuple of ints"
            ) from None
        if any(dim <= 0 for dim in shape):
            raise ValueError(f"variable {self.name!r}: shape {shape} has a non-positive dimension")
        object.__setattr__(self, "shape", shape)
        self.init_spec()
        if not 0 <= self.seed <= MAX_SEED_OFFSET:
            # The job's seed plus this offset must fit the wire's int64 (ps_common.job).
            raise ValueError(f"variable {self.name!r}: seed must be an integer from 0 to "
                             f"{MAX_SEED_OFFSET}, got {self.seed!r}")

    def init_spec(self) -> dict[str, Any]:
        """The initializer as a dict ``{"name": ..., knob: value, ...}``."""
        return _checked_init_spec(f"variable {self.name!r}", self.init)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class EmbeddingDef:
    """One embedding table: rows of ``dim`` floats addressed by int64 id.

    ``num_rows`` fixes the ids to ``0 .. num_rows - 1``; ``None`` makes a dynamic (hash)
    table that takes any int64 id and makes a row, from ``init``, on its first use.
    ``capacity`` (rows, 0 = unlimited) and ``ttl_seconds`` (0 = never) bound a dynamic table:
    past them the servers evict the least recently used rows, or rows untouched that long.
    ``init`` and ``seed`` are as for ``VariableDef``. ``optimizer`` (``{"name": "adagrad",
    "lr": 0.05}``) replaces the job's optimizer for this table; ``None`` keeps the job's.
    """

    name: str
    dim: int
    num_rows: int | None = None
    init: str | Mapping[str, Any] = field(
        default_factory=lambda: {"name": "uniform", "minval": -0.05, "maxval": 0.05}, hash=False
    )
    seed: int = 0
    optimizer: Mapping[str, Any] | None = field(default=None, hash=False)
    capacity: int = 0
    ttl_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"embedding table name must be a non-empty string, got {self.name!r}")
        what = f"embedding table {self.name!r}"
        if not _is_int(self.dim) or self.dim <= 0:
            raise ValueError(f"{what}: dim must be a positive integer, got {self.dim!r}")
        if self.num_rows is not None and (not _is_int(self.num_rows) or self.num_rows <= 0):
            raise ValueError(
                f"{what}: num_rows must be a positive integer, or None for a dynamic table; "
                f"got {self.num_rows!r}"
            )
        if _checked_init_spec(what, self.init)["name"] == "glorot_uniform" and self.dynamic:
            # Its scale comes from the row count, which a dynamic table does not have.
            raise ValueError(f"{what}: glorot_uniform needs num_rows (a fixed table)")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED_OFFSET:
            # As for VariableDef: the job's seed plus this offset is an int64 on the wire.
            raise ValueError(
                f"{what}: seed must be an integer from 0 to {MAX_SEED_OFFSET}, got {self.seed!r}"
            )
        if self.optimizer is not None:
            if not isinstance(self.optimizer, Mapping):
                raise ValueError(
                    f"{what}: optimizer must be a dict like {{'name': 'adagrad', 'lr': 0.05}} "
                    f"or None, got {self.optimizer!r}"
                )
            if self.optimizer.get("name") not in OPTIMIZER_NAMES:
                raise ValueError(
                    f"{what}: optimizer {self.optimizer.get('name')!r} is not one of "
                    f"{list(OPTIMIZER_NAMES)}"
                )
            for knob, value in self.optimizer.items():
                if knob != "name" and (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                ):
                    raise ValueError(
                        f"{what}: optimizer knob {knob!r} must be a finite number, got {value!r}"
                    )
        if not _is_int(self.capacity) or self.capacity < 0:
            raise ValueError(
                f"{what}: capacity must be an integer >= 0 (0 = unlimited), got {self.capacity!r}"
            )
        if (
            isinstance(self.ttl_seconds, bool)
            or not isinstance(self.ttl_seconds, (int, float))
            or not math.isfinite(self.ttl_seconds)
            or self.ttl_seconds < 0
        ):
            raise ValueError(
                f"{what}: ttl_seconds must be a finite number >= 0 (0 = never), "
                f"got {self.ttl_seconds!r}"
            )
        if self.num_rows is not None and (self.capacity or self.ttl_seconds):
            raise ValueError(
                f"{what}: capacity and ttl_seconds bound dynamic tables (num_rows=None) only; "
                f"a table of {self.num_rows} rows holds all of them"
            )

    @property
    def dynamic(self) -> bool:
        return self.num_rows is None

    @property
    def shape(self) -> tuple[int, int]:
        """``(num_rows, dim)``, or ``(0, dim)`` for a dynamic table (as the servers hold it)."""
        return (self.num_rows or 0, self.dim)

    def init_spec(self) -> dict[str, Any]:
        """The initializer as a dict ``{"name": ..., knob: value, ...}``."""
        return _checked_init_spec(f"embedding table {self.name!r}", self.init)

    def optimizer_spec(self) -> dict[str, Any] | None:
        """The optimizer override as a plain dict, or None (the job's optimizer)."""
        return None if self.optimizer is None else dict(self.optimizer)


def class_labels(y: Any, num_classes: int) -> Any:
    """`y` as class labels 0..num_classes-1, one per example: bool ones as 0 and 1, float
    ones of whole values as those; a ValueError naming them for any other dtype, shape or
    value (NumPy would read -1 as the
    last class, and a bool vector as a mask). Host arrays and lists are checked; an array on
    a device is taken as it is (checking it would wait for the device)."""
    if not isinstance(y, (np.ndarray, list, tuple)) and hasattr(y, "__cuda_array_interface__"):
        return y
    labels = np.asarray(y)
    if labels.dtype == np.bool_:
        labels = labels.astype(np.int64)
    elif labels.dtype.kind == "f" and labels.ndim == 1 and bool(
            np.all(np.isfinite(labels) & (labels == np.round(labels)))):
        labels = labels.astype(np.int64)  # 0.0 and 1.0, as a data set's loader takes them
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be a 1-D array of integer classes 0..{num_classes - 1}, "
                         f"got {labels.dtype} of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must be classes 0..{num_classes - 1}, got values from "
                         f"{labels.min()} to {labels.max()}")
    return labels


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@runtime_checkable
class Model(Protocol):
    """A trainable model. Implementations must not keep state between calls that depends
    on ``params`` (several steps may be computed with different parameter versions)."""

    def variables(self) -> list[VariableDef]:
        """The variables, in a stable order; names are unique."""
        ...

    def loss_and_grads(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, dict[str, Any]]:
        """Mean loss over ``batch = (x, y)`` and its gradient for every variable.

        Gradients are arrays of the variable's shape, with the dtype and array module of
        ``params`` (float32 in training).
        """
        ...


@runtime_checkable
class EvaluableModel(Model, Protocol):
    def evaluate(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> tuple[float, int]:
        """(sum of the per-example loss, number of correct predictions) over ``batch``."""
        ...


@runtime_checkable
class ScoringModel(EvaluableModel, Protocol):
    def scores(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> Any:
        """The predicted probability of label 1 for every example of ``batch`` (binary
        labels), as an array of ``params``' array module; used for held-out AUC."""
        ...


@runtime_checkable
class EmbeddingModel(Model, Protocol):
    """A model with embedding tables; see the module docstring for the contract."""

    def tables(self) -> list[EmbeddingDef]:
        """The tables, in a stable order; names are unique and differ from variables'."""
        ...

    def row_ids(self, batch: tuple[Any, Any]) -> dict[str, Any]:
        """For each table, the int64 ids (a NumPy vector, repeats allowed) of the rows the
        batch needs, in the order ``params[table]`` rows will be given and gradients taken."""
        ...
