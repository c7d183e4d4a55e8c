"""Variables, shards and the shard map: which rows of which variable live on which server.

Pure data and pure functions, shared by the coordinator (which builds maps), the servers
(which hold shards) and clients (which route by them), in the way ps-lite's Slicer is one
function for both sides. No grpc, no protobuf.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ps_common.errors import InvalidArgument, UnknownVariable
from ps_common.rows import hash_ids

STORED_DTYPES = ("float32", "float64", "float16")


# Every knob of each optimizer and initializer, with its default. A spec holds them all
# (VariableSpec fills in those not given): `optimizer="adam"` and the same with its default
# `lr` spelled out are one spec, to a second declaration and to a restore from a checkpoint.
OPTIMIZER_KNOBS: dict[str, dict[str, float]] = {
    "sgd": {"lr": 0.01, "weight_decay": 0.0},
    "momentum": {"lr": 0.01, "momentum": 0.9, "nesterov": 0.0, "weight_decay": 0.0},
    "adagrad": {"lr": 0.01, "initial_accumulator": 0.1, "eps": 1e-7, "weight_decay": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
}
INITIALIZER_KNOBS: dict[str, dict[str, float]] = {
    "zeros": {},
    "constant": {"value": 0.0},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "normal": {"mean": 0.0, "stddev": 0.05},
    "glorot_uniform": {},
}


@dataclass(frozen=True)
class Component:
    """An initializer or optimizer: a name and numeric knobs (booleans as 0.0 / 1.0)."""

    name: str
    params: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, value: "str | dict | Component") -> "Component":
        """From "adam", {"name": "adam", "lr": 1e-3} or a Component."""
        if isinstance(value, Component):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            knobs = dict(value)
            name = knobs.pop("name", None)
            if not isinstance(name, str):
                raise InvalidArgument(f"{value!r} has no string 'name'")
            params = []
            for key, knob in sorted(knobs.items()):
                if isinstance(knob, (bool, np.bool_)):
                    knob = float(knob)
                # numbers.Real takes NumPy's scalars too (a learning rate read from a float32
                # array), which are no int or float.
                if not isinstance(knob, numbers.Real):
                    raise InvalidArgument(f"{name}: knob {key!r} must be a number, got {knob!r}")
                params.append((str(key), float(knob)))
            return cls(name, tuple(params))
        raise InvalidArgument(f"expected a name or a dict with 'name', got {value!r}")

    def get(self, key: str, default: float) -> float:
        return dict(self.params).get(key, default)

    def with_defaults(self, knobs: dict[str, dict[str, float]]) -> "Component":
        """This component with every knob `knobs` gives its name, defaults filled in; as it
        is when the name or a knob is unknown (refused where components are checked)."""
        defaults = knobs.get(self.name)
        given = dict(self.params)
        if defaults is None or not set(given) <= set(defaults):
            return self
        return Component(self.name, tuple(sorted({**defaults, **given}.items())))

    def without_defaults(self, knobs: dict[str, dict[str, float]]) -> "Component":
        """This component with only the knobs that differ from their defaults: how it goes
        on the wire, into checkpoints and into messages (as older peers and files wrote it,
        and shorter to read)."""
        defaults = knobs.get(self.name, {})
        return Component(self.name, tuple((k, v) for k, v in self.params
                                          if k not in defaults or defaults[k] != v))

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{self.name}({knobs})"


DENSE, EMBEDDING = "dense", "embedding"
KINDS = (DENSE, EMBEDDING)


@dataclass(frozen=True)
class VariableSpec:
    """Everything that defines a variable; two declarations agree iff their specs are equal.

    `kind` "embedding" is a table of rows addressed by int64 id, pulled and pushed a few
    rows at a time (PSClient.pull_rows / push_rows): shape (num_rows, dim), or (0, dim) for
    a dynamic table whose ids may be any int64 and whose rows are made on first use.
    `capacity` (rows, 0 = unlimited) and `ttl_seconds` (0 = never) bound a dynamic table:
    the least recently used rows, and rows untouched for that long, are evicted.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    initializer: Component = field(default_factory=lambda: Component("zeros"))
    optimizer: Component = field(default_factory=lambda: Component("sgd", (("lr", 0.01),)))
    seed: int = 0
    kind: str = DENSE
    capacity: int = 0
    ttl_seconds: float = 0.0
    # The initializer and optimizer as given (not compared): how the spec is written on the
    # wire and in checkpoints, as older versions, which compare knob for knob, wrote it.
    written_initializer: Component = field(init=False, compare=False, repr=False)
    written_optimizer: Component = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise InvalidArgument(f"variable name must be a str, got {type(self.name).__name__} "
                                  f"{self.name!r}")
        for attribute, knobs in (("initializer", INITIALIZER_KNOBS),
                                 ("optimizer", OPTIMIZER_KNOBS)):
            component = getattr(self, attribute)
            object.__setattr__(self, f"written_{attribute}", component)
            if isinstance(component, Component):
                object.__setattr__(self, attribute, component.with_defaults(knobs))
        if not self.name:
            raise InvalidArgument("variable name must not be empty")
        if not 0 <= self.seed < 2**63:  # an int64 on the wire
            raise InvalidArgument(f"variable {self.name!r}: seed {self.seed} must be >= 0 and "
                                  "below 2**63")
        for what, sizes in (("shape", self.shape), ("capacity", (self.capacity,))):
            if any(size >= 2**63 for size in sizes):  # int64s on the wire
                raise InvalidArgument(f"variable {self.name!r}: {what} "
                                      f"{sizes if what == 'shape' else sizes[0]} has a size of "
                                      "2**63 or more")
        if self.kind not in KINDS:
            raise InvalidArgument(f"variable {self.name!r}: kind {self.kind!r} is not one of "
                                  f"{KINDS}")
        if self.kind == EMBEDDING:
            self._check_table()
        elif not self.shape or any(int(d) < 1 for d in self.shape):
            raise InvalidArgument(
                f"variable {self.name!r}: shape must have at least one dimension, all >= 1; "
                f"got {self.shape}"
            )
        elif self.capacity or self.ttl_seconds:
            raise InvalidArgument(f"variable {self.name!r}: capacity and ttl_seconds are "
                                  "settings of dynamic embedding tables only")
        if self.dtype not in STORED_DTYPES:
            raise InvalidArgument(
                f"variable {self.name!r}: dtype {self.dtype!r} is not one of {STORED_DTYPES}"
            )

    def _check_table(self) -> None:
        if len(self.shape) != 2 or self.shape[0] < 0 or self.shape[1] < 1:
            raise InvalidArgument(
                f"embedding table {self.name!r}: shape must be (num_rows, dim) with dim >= 1 "
                f"(num_rows 0 for a dynamic table); got {self.shape}")
        if self.capacity < 0:
            raise InvalidArgument(f"embedding table {self.name!r}: capacity must be >= 0 "
                                  f"(0 = unlimited), got {self.capacity}")
        if not (self.ttl_seconds >= 0 and math.isfinite(self.ttl_seconds)):
            raise InvalidArgument(f"embedding table {self.name!r}: ttl_seconds must be >= 0 "
                                  f"(0 = never), got {self.ttl_seconds}")
        if not self.dynamic and (self.capacity or self.ttl_seconds):
            raise InvalidArgument(
                f"embedding table {self.name!r}: capacity and ttl_seconds bound dynamic tables "
                "(num_rows=None) only; a fixed table holds all its num_rows rows")

    @property
    def is_table(self) -> bool:
        return self.kind == EMBEDDING

    @property
    def dynamic(self) -> bool:
        """A hash table: any int64 id, rows made on first use (num_rows None)."""
        return self.kind == EMBEDDING and self.shape[0] == 0

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        table = ""
        if self.is_table:
            table = " embedding" + (f" dynamic capacity={self.capacity} "
                                    f"ttl_seconds={self.ttl_seconds:g}" if self.dynamic else "")
        return (
            f"{self.name}: shape={list(self.shape)} dtype={self.dtype}{table} "
            f"init={self.initializer.without_defaults(INITIALIZER_KNOBS).describe()} "
            f"optimizer={self.optimizer.without_defaults(OPTIMIZER_KNOBS).describe()} "
            f"seed={self.seed}"
        )


@dataclass(frozen=True)
class Shard:
    """Rows range(row_start, row_stop, stride) of `variable`, held by `server_id`.

    A dense variable's shards are contiguous (stride 1). An embedding table is cut into
    `stride` shards by id, so that the hot ids of a skewed (Zipf) distribution, which are
    the small ones, spread over every server: shard i of a fixed table holds the ids
    i, i + stride, i + 2 * stride, ... below row_stop (row_start = i); shard i of a dynamic
    table holds the ids whose hash is i modulo stride, however many (see owners_of).
    """

    variable: str
    index: int
    row_start: int
    row_stop: int
    server_id: str
    stride: int = 1

    @property
    def key(self) -> tuple[str, int]:
        return (self.variable, self.index)

    @property
    def num_rows(self) -> int:
        return len(range(self.row_start, self.row_stop, self.stride))

    def shape(self, spec: VariableSpec) -> tuple[int, ...]:
        return (self.num_rows, *spec.shape[1:])

    def nbytes(self, spec: VariableSpec) -> int:
        return self.num_rows * spec.row_elements * np.dtype(spec.dtype).itemsize

    def describe(self) -> str:
        if self.stride == 1:
            return f"shard {self.index} of {self.variable!r} (rows {self.row_start}:{self.row_stop})"
        return f"shard {self.index} of {self.stride} of table {self.variable!r}"


def shard_capacity(spec: VariableSpec, shard: Shard) -> int:
    """A dynamic table shard's share of the table's capacity (0: unlimited). The shares sum
    to the capacity, so that the table as a whole never holds more rows than that."""
    if not spec.capacity:
        return 0
    base, extra = divmod(spec.capacity, shard.stride)
    return base + (1 if shard.index < extra else 0)


def owners_of(spec: VariableSpec, ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard index (0 .. num_shards - 1) of each id of an embedding table: the id
    modulo the shard count for a fixed table (its local row is then id // num_shards), a
    hash of it for a dynamic one (ids there may be anything, strided or clustered)."""
    if spec.dynamic:
        return (hash_ids(ids) % np.uint64(num_shards)).astype(np.int64)
    return ids % num_shards


def rows_by_server(spec: VariableSpec, shards: tuple[Shard, ...],
                   ids: np.ndarray) -> dict[str, list[tuple[Shard, np.ndarray]]]:
    """Where the rows of `ids` (an embedding table's, `shards` its shards by index) live:
    per server, each shard holding some of them with their positions in `ids` (ascending)."""
    owners = owners_of(spec, ids, shards[0].stride)
    order = np.argsort(owners, kind="stable")
    groups: dict[str, list[tuple[Shard, np.ndarray]]] = defaultdict(list)
    start = 0
    for shard, count in zip(shards, np.bincount(owners, minlength=len(shards)).tolist()):
        if count:
            groups[shard.server_id].append((shard, order[start:start + count]))
        start += count
    return dict(groups)


@dataclass(frozen=True)
class ShardMap:
    """An immutable snapshot of placement. `epoch` increases with every change."""

    epoch: int
    servers: dict[str, str]  # server_id -> address
    variables: dict[str, VariableSpec]
    shards: dict[str, tuple[Shard, ...]]  # variable -> shards ordered by row

    def spec(self, name: str) -> VariableSpec:
        try:
            return self.variables[name]
        except KeyError:
            raise UnknownVariable(f"variable {name!r} has not been declared") from None

    def shards_of(self, name: str) -> tuple[Shard, ...]:
        self.spec(name)
        return self.shards[name]

    def group_by_server(self, names) -> dict[str, list[Shard]]:
        """Every shard of `names`, grouped by the server that holds it, in a stable order."""
        groups: dict[str, list[Shard]] = defaultdict(list)
        for name in names:
            for shard in self.shards_of(name):
                groups[shard.server_id].append(shard)
        return dict(groups)

    def shards_on(self, server_id: str) -> list[Shard]:
        return [s for shards in self.shards.values() for s in shards if s.server_id == server_id]


EMPTY_MAP = ShardMap(epoch=0, servers={}, variables={}, shards={})


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Cut range(rows) into `parts` contiguous near-equal ranges (the first ones larger)."""
    parts = max(1, min(parts, rows))
    base, extra = divmod(rows, parts)
    ranges, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
