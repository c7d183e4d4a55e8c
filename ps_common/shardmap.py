"""Variables, shards and the shard map: which rows of which variable live on which server.

Pure data and pure functions, shared by the coordinator (which builds maps), the servers
(which hold shards) and clients (which route by them), in the way ps-lite's Slicer is one
function for both sides. No grpc, no protobuf.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ps_common.errors import InvalidArgument, UnknownVariable

STORED_DTYPES = ("float32", "float64", "float16")


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
                if isinstance(knob, bool):
                    knob = float(knob)
                if not isinstance(knob, (int, float)):
                    raise InvalidArgument(f"{name}: knob {key!r} must be a number, got {knob!r}")
                params.append((str(key), float(knob)))
            return cls(name, tuple(params))
        raise InvalidArgument(f"expected a name or a dict with 'name', got {value!r}")

    def get(self, key: str, default: float) -> float:
        return dict(self.params).get(key, default)

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{self.name}({knobs})"


@dataclass(frozen=True)
class VariableSpec:
    """Everything that defines a variable; two declarations agree iff their specs are equal."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    initializer: Component = field(default_factory=lambda: Component("zeros"))
    optimizer: Component = field(default_factory=lambda: Component("sgd", (("lr", 0.01),)))
    seed: int = 0

    def __post_init__(self):
        if not self.name:
            raise InvalidArgument("variable name must not be empty")
        if not self.shape or any(int(d) < 1 for d in self.shape):
            raise InvalidArgument(
                f"variable {self.name!r}: shape must have at least one dimension, all >= 1; "
                f"got {self.shape}"
            )
        if self.dtype not in STORED_DTYPES:
            raise InvalidArgument(
                f"variable {self.name!r}: dtype {self.dtype!r} is not one of {STORED_DTYPES}"
            )

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
        return (
            f"{self.name}: shape={list(self.shape)} dtype={self.dtype} "
            f"init={self.initializer.describe()} optimizer={self.optimizer.describe()} "
            f"seed={self.seed}"
        )


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_stop) of `variable`, held by `server_id`."""

    variable: str
    index: int
    row_start: int
    row_stop: int
    server_id: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.variable, self.index)

    def shape(self, spec: VariableSpec) -> tuple[int, ...]:
        return (self.row_stop - self.row_start, *spec.shape[1:])

    def nbytes(self, spec: VariableSpec) -> int:
        return (self.row_stop - self.row_start) * spec.row_elements * np.dtype(spec.dtype).itemsize


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
