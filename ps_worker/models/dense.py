"""Built-in dense models: multinomial logistic regression and a ReLU MLP.

Forward and backward passes are written by hand against the parameters' array module, so
the same code runs on NumPy and CuPy and in whatever float dtype the parameters have.
Models hold only their shape; they are immutable and safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ps_worker.backend import array_module
from ps_worker.models.base import VariableDef, class_labels
from ps_worker.models.softmax import mean_softmax_cross_entropy_and_grad, softmax_cross_entropy_sum

__all__ = ["MLP", "LogisticRegression"]


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


class MLP:
    """Dense layers ``dense0 .. denseL`` with ReLU between them and softmax cross-entropy.

    Variables are ``dense{i}/kernel`` (fan_in, fan_out; glorot_uniform) and
    ``dense{i}/bias`` (fan_out; zeros).
    """

    def __init__(
        self, num_features: int, num_classes: int, hidden: Sequence[int] = (128, 64)
    ) -> None:
        self.num_features = _positive_int("num_features", num_features)
        self.num_classes = _positive_int("num_classes", num_classes)
        self.hidden = tuple(_positive_int("hidden layer width", width) for width in hidden)
        widths = (self.num_features, *self.hidden, self.num_classes)
        self._layer_shapes = list(zip(widths[:-1], widths[1:]))

    def variables(self) -> list[VariableDef]:
        variables = []
        for layer, (fan_in, fan_out) in enumerate(self._layer_shapes):
            kernel_shape = (fan_in, fan_out)
            variables.append(
                VariableDef(f"dense{layer}/kernel", kernel_shape, "glorot_uniform", seed=2 * layer)
            )
            variables.append(
                VariableDef(f"dense{layer}/bias", (fan_out,), "zeros", seed=2 * layer + 1)
            )
        return variables

    def loss_and_grads(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, dict[str, Any]]:
        loss, grads, _ = self.loss_grads_and_correct(params, batch)
        return loss, grads

    def loss_grads_and_correct(
        self, params: Mapping[str, Any], batch: tuple[Any, Any]
    ) -> tuple[float, dict[str, Any], int]:
        """``loss_and_grads`` plus how many rows the forward pass classified right, so the
        training loop gets accuracy without a second forward pass."""
        x, labels = self._inputs(params, batch)
        if x.shape[0] == 0:
            raise ValueError("loss_and_grads needs a non-empty batch")
        layer_inputs, logits = self._forward(params, x)
        correct = int((logits.argmax(axis=1) == labels).sum())
        loss, grad_out = mean_softmax_cross_entropy_and_grad(logits, labels)
        grads: dict[str, Any] = {}
        for layer in reversed(range(len(self._layer_shapes))):
            layer_input = layer_inputs[layer]
            grads[f"dense{layer}/kernel"] = layer_input.T @ grad_out
            grads[f"dense{layer}/bias"] = grad_out.sum(axis=0)
            if layer > 0:
                grad_in = grad_out @ params[f"dense{layer}/kernel"].T
                # The input is a ReLU output, positive exactly where the ReLU was active.
                grad_in *= layer_input > 0
                grad_out = grad_in
        return loss, grads, correct

    def evaluate(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> tuple[float, int]:
        x, labels = self._inputs(params, batch)
        if x.shape[0] == 0:
            return 0.0, 0
        _, logits = self._forward(params, x)
        correct = int((logits.argmax(axis=1) == labels).sum())
        return softmax_cross_entropy_sum(logits, labels), correct

    def _inputs(self, params: Mapping[str, Any], batch: tuple[Any, Any]) -> tuple[Any, Any]:
        """The batch in the parameters' array module, features in the parameters' dtype."""
        first_kernel = params["dense0/kernel"]
        xp = array_module(first_kernel)
        x, labels = batch
        x = xp.asarray(x, dtype=first_kernel.dtype)
        labels = xp.asarray(class_labels(labels, self.num_classes))
        if x.ndim != 2 or x.shape[1] != self.num_features or labels.shape != (x.shape[0],):
            raise ValueError(
                f"batch shapes x={tuple(x.shape)}, y={tuple(labels.shape)} do not fit a model "
                f"of {self.num_features} features"
            )
        return x, labels

    def _forward(self, params: Mapping[str, Any], x: Any) -> tuple[list[Any], Any]:
        """(the input of every layer, the logits)."""
        return relu_layers_forward(params, x, len(self._layer_shapes))

    def __repr__(self) -> str:
        return (
            f"MLP(num_features={self.num_features}, num_classes={self.num_classes}, "
            f"hidden={self.hidden})"
        )


class LogisticRegression(MLP):
    """Multinomial logistic regression: an ``MLP`` without hidden layers (``dense0/*``)."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__(num_features, num_classes, hidden=())

    def __repr__(self) -> str:
        return f"LogisticRegression(num_features={self.num_features}, num_classes={self.num_classes})"


def relu_layers_forward(params: Mapping[str, Any], x: Any, layers: int) -> tuple[list[Any], Any]:
    """Layers `dense0` .. `dense{layers-1}` (kernel, bias; ReLU between them) applied to
    `x`: (the input of every layer, the last layer's output)."""
    xp = array_module(x)
    layer_inputs = [x]
    activations = x
    for layer in range(layers):
        activations = activations @ params[f"dense{layer}/kernel"]
        activations += params[f"dense{layer}/bias"]
        if layer < layers - 1:
            xp.maximum(activations, 0, out=activations)
            layer_inputs.append(activations)
    return layer_inputs, activations
