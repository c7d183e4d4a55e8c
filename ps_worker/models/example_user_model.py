"""An example user model, named on the command line as
``--model ps_worker.models.example_user_model:SoftmaxRegression``.

A user model is any object with ``variables()`` and ``loss_and_grads(params, batch)``; a
class is constructed with the keyword arguments it accepts among ``num_features``,
``num_classes`` and ``hidden``. Writing it against ``array_module(params[...])`` lets the
same code run on NumPy and CuPy.
"""

from __future__ import annotations

from ps_worker.backend import array_module
from ps_worker.models.base import VariableDef


class SoftmaxRegression:
    """Linear softmax regression: ``logits = x @ weights + bias``."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        self.num_features = num_features
        self.num_classes = num_classes

    def variables(self) -> list[VariableDef]:
        return [
            VariableDef(
                "weights",
                (self.num_features, self.num_classes),
                {"name": "normal", "stddev": 0.01},
            ),
            VariableDef("bias", (self.num_classes,), "zeros"),
        ]

    def loss_and_grads(self, params, batch):
        weights, bias = params["weights"], params["bias"]
        xp = array_module(weights)
        x = xp.asarray(batch[0], dtype=weights.dtype)
        y = xp.asarray(batch[1])
        rows = xp.arange(x.shape[0])
        logits = x @ weights + bias
        logits -= logits.max(axis=1, keepdims=True)
        probs = xp.exp(logits)
        sums = probs.sum(axis=1, keepdims=True)
        loss = (xp.log(sums[:, 0]) - logits[rows, y]).mean()
        probs /= sums
        probs[rows, y] -= 1  # d(mean loss)/d(logits) = (softmax - one_hot) / batch size
        probs /= x.shape[0]
        return float(loss), {"weights": x.T @ probs, "bias": probs.sum(axis=0)}

    def evaluate(self, params, batch):
        xp = array_module(params["weights"])
        x = xp.asarray(batch[0], dtype=params["weights"].dtype)
        y = xp.asarray(batch[1])
        logits = x @ params["weights"] + params["bias"]
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - xp.log(xp.exp(logits).sum(axis=1, keepdims=True))
        loss_sum = -log_probs[xp.arange(x.shape[0]), y].sum()
        return float(loss_sum), int((logits.argmax(axis=1) == y).sum())
