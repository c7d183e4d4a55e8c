"""Built-in click-through model: categorical fields through an embedding table, an MLP.

``EmbeddingMLP`` (``--model embedding_mlp``) embeds every categorical field of an example,
concatenates the embeddings with the dense features and feeds them to a ReLU MLP with one
logit; the loss is the logistic loss of binary labels (``y`` in {0, 1}).

All fields share one table, ``embedding``: field ``f``'s id ``i`` is row
``offsets[f] + i`` (offsets are the running sums of the field sizes), so a step pulls and
pushes the rows of all its fields in one ``pull_rows`` / ``push_rows`` call each. A table
per field (``table_per_field=True``) costs a call per field and ran 4-5 times fewer steps/s
(README, "Click-through model").

Forward and backward passes are written by hand against the parameters' array module, like
the dense models (``ps_worker.models.dense``), so the same code runs on NumPy and CuPy; the
gather of the batch's rows is done by the system (``params["embedding"]`` holds exactly the
rows of ``row_ids(batch)``, see ``ps_worker.models.base``) and the table's gradient is one
row per id occurrence, so nothing here de-duplicates or scatters. Immutable and safe to
share between threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ps_worker.backend import array_module
from ps_worker.models.base import EmbeddingDef, VariableDef, class_labels
from ps_worker.models.dense import relu_layers_forward

__all__ = ["TABLE", "EmbeddingMLP"]

TABLE = "embedding"


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


class EmbeddingMLP:
    """Embeddings of ``len(field_sizes)`` categorical fields (``dim`` each) and
    ``num_features`` dense features into ReLU layers ``hidden`` and one logit.

    Variables: the table ``embedding`` (``sum(field_sizes)`` rows of ``dim``, uniform
    +-0.05), ``dense{i}/kernel`` (glorot_uniform) and ``dense{i}/bias`` (zeros), the last
    layer of width 1.
    ``table_optimizer`` is the table's optimizer override (None: the job's optimizer).
    ``table_per_field`` gives each field a table of its own, ``embedding/field{f}``, and
    costs a ``pull_rows`` and a ``push_rows`` per field and step: on 2 cores with 12 fields
    it ran 44-58 steps/s against 242-263 for the shared table, at the same AUC.
    """

    def __init__(
        self,
        num_features: int,
        field_sizes: Sequence[int],
        *,
        dim: int = 8,
        hidden: Sequence[int] = (64, 32),
        table_optimizer: Mapping[str, Any] | None = None,
        table_per_field: bool = False,
    ) -> None:
        if (isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer))
                or num_features < 0):
            raise ValueError(f"num_features (dense) must be an integer >= 0, got {num_features!r}")
        self.num_features = int(num_features)
        self.field_sizes = tuple(_positive_int("field size", size) for size in field_sizes)
        if not self.field_sizes:
            raise ValueError("embedding_mlp needs at least one categorical field")
        self.dim = _positive_int("dim", dim)
        self.hidden = tuple(_positive_int("hidden layer width", width) for width in hidden)
        self.table_optimizer = None if table_optimizer is None else dict(table_optimizer)
        self.num_fields = len(self.field_sizes)
        self.table_per_field = bool(table_per_field)
        # Row of field f's id i in the shared table: offsets[f] + i.
        self.offsets = np.concatenate([[0], np.cumsum(self.field_sizes)[:-1]]).astype(np.int64)
        self.offsets.setflags(write=False)
        self._field_limits = np.array(self.field_sizes, np.int64)
        self.num_rows = int(sum(self.field_sizes))
        self.embedded_width = self.num_fields * self.dim
        widths = (self.embedded_width + self.num_features, *self.hidden, 1)
        self._layer_shapes = list(zip(widths[:-1], widths[1:]))

    # ---- what lives on the servers -----------------------------------------------------

    def variables(self) -> list[VariableDef]:
        variables = []
        for layer, (fan_in, fan_out) in enumerate(self._layer_shapes):
            variables.append(VariableDef(f"dense{layer}/kernel", (fan_in, fan_out),
                                         "glorot_uniform", seed=2 * layer))
            variables.append(VariableDef(f"dense{layer}/bias", (fan_out,), "zeros",
                                         seed=2 * layer + 1))
        return variables

    def tables(self) -> list[EmbeddingDef]:
        seed = 2 * len(self._layer_shapes)
        if self.table_per_field:
            return [
                EmbeddingDef(f"{TABLE}/field{f}", self.dim, size, seed=seed + f,
                             optimizer=self.table_optimizer)
                for f, size in enumerate(self.field_sizes)
            ]
        return [
            EmbeddingDef(TABLE, self.dim, self.num_rows, seed=seed, optimizer=self.table_optimizer)
        ]

    def row_ids(self, batch: tuple[Any, Any]) -> dict[str, np.ndarray]:
        """The table rows of every field of every example, example-major: row
        ``b * num_fields + f`` of ``params["embedding"]`` is example b's field f (with a
        table per field, row b of ``params["embedding/field{f}"]``)."""
        ids = self._host_ids(batch)
        if self.table_per_field:
            return {f"{TABLE}/field{f}": np.ascontiguousarray(ids[:, f])
                    for f in range(self.num_fields)}
        return {TABLE: (ids + self.offsets).reshape(-1)}

    # ---- training and evaluation -------------------------------------------------------

    def loss_and_grads(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, dict[str, Any]]:
        loss, grads, _ = self.loss_grads_and_correct(params, batch)
        return loss, grads

    def loss_grads_and_correct(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, dict[str, Any], int]:
        """Mean logistic loss, its gradients (the table's: one row per id occurrence), and
        how many examples the 0.5 threshold classifies right."""
        inputs, labels = self._inputs(params, batch)
        num_examples = inputs.shape[0]
        if num_examples == 0:
            raise ValueError("loss_and_grads needs a non-empty batch")
        xp = array_module(inputs)
        layer_inputs, logits = self._forward(params, inputs)
        correct = int(((logits > 0) == (labels > 0.5)).sum())
        loss = float(_logistic_loss_sum(logits, labels)) / num_examples
        # d(mean loss)/d(logit) = (sigmoid(logit) - y) / B
        grad_out = ((_sigmoid(logits) - labels) / num_examples)[:, None]
        grads: dict[str, Any] = {}
        for layer in reversed(range(len(self._layer_shapes))):
            layer_input = layer_inputs[layer]
            kernel = params[f"dense{layer}/kernel"]
            grads[f"dense{layer}/kernel"] = layer_input.T @ grad_out
            grads[f"dense{layer}/bias"] = grad_out.sum(axis=0)
            grad_in = grad_out @ kernel.T
            if layer > 0:
                grad_in *= layer_input > 0  # the input is a ReLU output
            grad_out = grad_in
        # grad_out is now the gradient of the concatenated input: its first columns are the
        # embeddings, example-major, i.e. one row of `dim` per id occurrence.
        if self.table_per_field:
            for f in range(self.num_fields):
                columns = grad_out[:, f * self.dim : (f + 1) * self.dim]
                grads[f"{TABLE}/field{f}"] = xp.ascontiguousarray(columns)
        else:
            grads[TABLE] = xp.ascontiguousarray(grad_out[:, : self.embedded_width]).reshape(
                num_examples * self.num_fields, self.dim
            )
        return loss, grads, correct

    def evaluate(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> tuple[float, int]:
        """(sum of the logistic loss, examples classified right at threshold 0.5)."""
        loss_sum, correct, _ = self.evaluate_and_scores(params, batch)
        return loss_sum, correct

    def scores(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> Any:
        """The predicted click probability of every example (for AUC)."""
        return self.evaluate_and_scores(params, batch)[2]

    def evaluate_and_scores(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, int, Any]:
        """``evaluate`` and ``scores`` from one forward pass."""
        inputs, labels = self._inputs(params, batch)
        if inputs.shape[0] == 0:
            return 0.0, 0, array_module(inputs).zeros(0, inputs.dtype)
        _, logits = self._forward(params, inputs)
        correct = int(((logits > 0) == (labels > 0.5)).sum())
        return float(_logistic_loss_sum(logits, labels)), correct, _sigmoid(logits)

    # ---- internals ---------------------------------------------------------------------

    def _host_ids(self, batch: tuple[Any, Any]) -> np.ndarray:
        x, _ = batch
        ids = np.asarray(getattr(x, "ids", None))
        if (ids.ndim != 2 or ids.shape[1] != self.num_fields
                or not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(
                f"embedding_mlp needs batches of Features(dense, ids) with integer ids of "
                f"{self.num_fields} fields, got ids of shape {ids.shape} dtype {ids.dtype}"
            )
        ids = ids.astype(np.int64, copy=False)
        if ids.size and ((ids < 0).any() or (ids >= self._field_limits).any()):
            field = int(np.flatnonzero(((ids < 0) | (ids >= self._field_limits)).any(axis=0))[0])
            raise ValueError(
                f"embedding_mlp: field {field} has an id outside 0..{self.field_sizes[field] - 1}"
            )
        return ids

    def _inputs(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> tuple[Any, Any]:
        """(the concatenated [embeddings, dense features] of shape (B, width), labels as
        floats), in the parameters' array module and dtype. ``batch`` is
        ``(ps_worker.data.Features(dense, ids), y)``."""
        first_kernel = params["dense0/kernel"]
        xp = array_module(first_kernel)
        x, y = batch
        dense = getattr(x, "dense", None)
        if dense is None:
            raise ValueError("embedding_mlp needs batches of Features(dense, ids)")
        dense = xp.asarray(dense, dtype=first_kernel.dtype)
        labels = xp.asarray(class_labels(y, 2)).astype(first_kernel.dtype)
        num_examples = labels.shape[0]
        if self.table_per_field:
            parts = [params[f"{TABLE}/field{f}"] for f in range(self.num_fields)]
            rows_fit = all(tuple(p.shape) == (num_examples, self.dim) for p in parts)
            rows_shape = tuple(parts[0].shape)
        else:
            rows_shape = tuple(params[TABLE].shape)
            rows_fit = rows_shape == (num_examples * self.num_fields, self.dim)
        if dense.ndim != 2 or dense.shape != (num_examples, self.num_features) or not rows_fit:
            raise ValueError(
                f"batch shapes dense={tuple(dense.shape)}, y={tuple(labels.shape)}, "
                f"{TABLE} rows={rows_shape} do not fit a model of {self.num_features} dense "
                f"features and {self.num_fields} fields of dim {self.dim}"
            )
        if self.table_per_field:
            embedded = xp.concatenate(parts, axis=1)
        else:
            embedded = params[TABLE].reshape(num_examples, self.embedded_width)
        inputs = xp.concatenate([embedded.astype(first_kernel.dtype, copy=False), dense], axis=1)
        return inputs, labels

    def _forward(self, params: Mapping[str, Any], inputs: Any) -> tuple[list[Any], Any]:
        """(the input of every layer, the logits as a vector)."""
        layer_inputs, logits = relu_layers_forward(params, inputs, len(self._layer_shapes))
        return layer_inputs, logits[:, 0]

    def __repr__(self) -> str:
        return (
            f"EmbeddingMLP(num_features={self.num_features}, fields={self.num_fields}, "
            f"rows={self.num_rows}, dim={self.dim}, hidden={self.hidden})"
        )


def _sigmoid(logits: Any) -> Any:
    """1 / (1 + exp(-z)) without overflow for large |z|."""
    xp = array_module(logits)
    e = xp.exp(-xp.abs(logits))
    return xp.where(logits >= 0, 1 / (1 + e), e / (1 + e))


def _logistic_loss_sum(logits: Any, labels: Any) -> float:
    """Sum of log(1 + exp(z)) - y z, stable for large |z|."""
    xp = array_module(logits)
    losses = xp.maximum(logits, 0) - logits * labels + xp.log1p(xp.exp(-xp.abs(logits)))
    return float(losses.sum())
