"""Evaluation metrics computed on the worker; pure NumPy, no I/O."""

from __future__ import annotations

import numpy as np

__all__ = ["CHANCE_AUC", "held_out_auc", "roc_auc"]

# The AUC of scores that carry no information (random, or all equal).
CHANCE_AUC = 0.5


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (0/1 or bool): the
    probability that a random positive scores above a random negative, a tie counting one
    half (the Mann-Whitney U statistic over ``n_pos * n_neg``).

    Exact: ranks are taken with ties averaged, and the rank sum is kept as an integer (twice
    the ranks) until the one final division. O(n log n) time, O(n) memory. Returns ``None``
    when ``labels`` hold only one class (the AUC is undefined). Raises ``ValueError`` for
    mismatched shapes, labels other than 0/1, or NaN scores.
    """
    scores = np.asarray(scores)
    labels = np.asarray(labels)
    if scores.ndim != 1 or labels.shape != scores.shape:
        raise ValueError(
            f"roc_auc needs two vectors of one length, got scores {scores.shape} and "
            f"labels {labels.shape}"
        )
    if labels.dtype != np.bool_:
        if labels.size and not np.isin(labels, (0, 1)).all():
            raise ValueError("roc_auc needs binary labels (0 or 1)")
        labels = labels.astype(np.bool_)
    if np.issubdtype(scores.dtype, np.floating) and np.isnan(scores).any():
        raise ValueError("roc_auc: scores contain NaN")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Runs of equal scores: each gets the average of the ranks it spans. A run starting at
    # sorted position s (0-based) of length c spans ranks s+1 .. s+c, average (2s + c + 1) / 2.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    lengths = np.diff(np.r_[starts, scores.size])
    twice_rank_of_run = 2 * starts + lengths + 1
    twice_ranks = np.repeat(twice_rank_of_run, lengths)
    twice_rank_sum = int(twice_ranks[labels[order]].sum(dtype=np.int64))
    # U = (sum of positive ranks) - n_pos (n_pos + 1) / 2, all doubled to stay integral.
    twice_u = twice_rank_sum - positives * (positives + 1)
    return twice_u / (2 * positives * negatives)


def held_out_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """`roc_auc` of an evaluation, or None where a score is NaN (a model's outputs that
    overflowed): a figure that is not a number is reported as none, as the job's other
    figures are, instead of failing the evaluation (and with it the worker)."""
    scores = np.asarray(scores)
    if np.issubdtype(scores.dtype, np.floating) and np.isnan(scores).any():
        return None
    return roc_auc(scores, labels)
