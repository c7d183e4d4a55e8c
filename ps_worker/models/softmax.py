"""Softmax cross-entropy written once for any array module (NumPy or CuPy)."""

from __future__ import annotations

from typing import Any

from ps_worker.backend import array_module

__all__ = ["mean_softmax_cross_entropy_and_grad", "softmax_cross_entropy_sum"]


def mean_softmax_cross_entropy_and_grad(logits: Any, labels: Any) -> tuple[float, Any]:
    """(mean cross-entropy over the rows, its gradient with respect to ``logits``).

    ``labels`` are class indices. Stable for large logits: the row maximum is subtracted
    before exponentiating. Allocates one array the size of ``logits``, reused for the gradient.
    """
    xp = array_module(logits)
    num_rows = logits.shape[0]
    rows = xp.arange(num_rows)
    shifted = logits - logits.max(axis=1, keepdims=True)
    label_logits = shifted[rows, labels]
    probs = xp.exp(shifted, out=shifted)
    row_sums = probs.sum(axis=1)
    loss = (xp.log(row_sums) - label_logits).sum() / num_rows
    probs /= row_sums[:, None]
    probs[rows, labels] -= 1
    probs /= num_rows
    return float(loss), probs


def softmax_cross_entropy_sum(logits: Any, labels: Any) -> float:
    """Sum over the rows of the cross-entropy, stable for large logits."""
    xp = array_module(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    label_logits = shifted[xp.arange(logits.shape[0]), labels]
    log_sums = xp.log(xp.exp(shifted, out=shifted).sum(axis=1))
    return float((log_sums - label_logits).sum())
