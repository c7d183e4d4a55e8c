"""What a model is to the worker: a list of variables and a loss with its gradients.

Built-in and user models alike satisfy ``Model``; ``evaluate`` is optional
(``EvaluableModel``). Models are written against the array module of the parameters they
are given (``ps_worker.backend.array_module``), so one implementation runs on NumPy and CuPy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["INITIALIZER_KNOBS", "EvaluableModel", "Model", "VariableDef"]

# The initializers the parameter server understands, with the knobs each accepts.
INITIALIZER_KNOBS: Mapping[str, frozenset[str]] = {
    "zeros": frozenset(),
    "constant": frozenset({"value"}),
    "uniform": frozenset({"minval", "maxval"}),
    "normal": frozenset({"mean", "stddev"}),
    "glorot_uniform": frozenset(),
}


@dataclass(frozen=True)
class VariableDef:
    """One trainable variable: its name on the parameter servers, shape and initializer.

    ``init`` is an initializer name (``"zeros"``) or a dict with ``"name"`` and its knobs
    (``{"name": "uniform", "minval": -0.1, "maxval": 0.1}``). ``seed`` is an offset added to
    the run's seed so that variables of the same shape start differently.
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
        spec = self.init_spec()
        unknown_knobs = set(spec) - {"name"} - INITIALIZER_KNOBS[spec["name"]]
        if unknown_knobs:
            raise ValueError(
                f"variable {self.name!r}: initializer {spec['name']!r} takes no "
                f"{sorted(unknown_knobs)}"
            )
        # The servers reject these too; failing here names the model's mistake sooner.
        if spec["name"] == "uniform" and not spec.get("minval", -0.05) < spec.get("maxval", 0.05):
            raise ValueError(f"variable {self.name!r}: uniform needs minval < maxval")
        if spec["name"] == "normal" and spec.get("stddev", 0.05) < 0:
            raise ValueError(f"variable {self.name!r}: normal needs stddev >= 0")
        if self.seed < 0:
            raise ValueError(f"variable {self.name!r}: seed must be >= 0, got {self.seed}")

    def init_spec(self) -> dict[str, Any]:
        """The initializer as a dict ``{"name": ..., knob: value, ...}``."""
        spec = {"name": self.init} if isinstance(self.init, str) else dict(self.init)
        if spec.get("name") not in INITIALIZER_KNOBS:
            raise ValueError(
                f"variable {self.name!r}: initializer {spec.get('name')!r} is not one of "
                f"{sorted(INITIALIZER_KNOBS)}"
            )
        return spec

    @property
    def size(self) -> int:
        return math.prod(self.shape)


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
