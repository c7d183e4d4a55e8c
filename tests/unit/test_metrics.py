"""roc_auc: exact, rank-based with ties averaged, against a brute-force pairwise count; and an
evaluation's AUC when its scores hold NaN."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from ps_worker.metrics import CHANCE_AUC, held_out_auc, roc_auc


def pairwise_auc(scores, labels) -> Fraction:
    """P(score of a positive > score of a negative) + P(tie) / 2, by counting every pair."""
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    wins = sum(Fraction(1) if p > n else Fraction(1, 2) if p == n else Fraction(0)
               for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize("seed", range(8))
def test_matches_the_pairwise_count_exactly_with_and_without_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 60))
    labels = rng.integers(0, 2, size)
    labels[:2] = [0, 1]  # both classes
    # Even seeds: a few distinct values (many ties); odd seeds: continuous scores.
    scores = rng.integers(0, 4, size).astype(np.float32) if seed % 2 == 0 else rng.random(size)
    assert roc_auc(scores, labels) == float(pairwise_auc(scores.tolist(), labels.tolist()))


def test_perfect_reversed_and_uninformative_scores() -> None:
    labels = np.array([0, 0, 1, 1, 0, 1])
    assert roc_auc(labels * 2.0 + 1, labels) == 1.0
    assert roc_auc(-labels.astype(float), labels) == 0.0
    assert roc_auc(np.full(6, 0.3), labels) == CHANCE_AUC == 0.5


def test_order_of_examples_and_monotone_transforms_do_not_matter() -> None:
    rng = np.random.default_rng(3)
    scores, labels = rng.normal(size=500), rng.integers(0, 2, 500)
    order = rng.permutation(500)
    expected = roc_auc(scores, labels)
    assert roc_auc(scores[order], labels[order]) == expected
    assert roc_auc(1 / (1 + np.exp(-scores)), labels) == expected


def test_bool_labels_and_integer_scores() -> None:
    assert roc_auc(np.array([1, 2, 3]), np.array([False, True, True])) == 1.0


def test_one_class_has_no_auc() -> None:
    assert roc_auc(np.array([0.1, 0.9]), np.array([1, 1])) is None
    assert roc_auc(np.array([0.1, 0.9]), np.array([0, 0])) is None
    assert roc_auc(np.array([]), np.array([], np.int64)) is None


@pytest.mark.parametrize("scores, labels", [
    (np.array([0.1, 0.2]), np.array([0, 2])),  # not binary
    (np.array([0.1, np.nan]), np.array([0, 1])),  # NaN score
    (np.array([0.1, 0.2, 0.3]), np.array([0, 1])),  # lengths differ
    (np.zeros((2, 2)), np.zeros((2, 2))),  # not vectors
])
def test_bad_input_is_refused(scores, labels) -> None:
    with pytest.raises(ValueError):
        roc_auc(scores, labels)


def test_large_inputs_stay_exact() -> None:
    # 2 million examples with heavy ties: the doubled rank sum is far beyond float32's range
    # of exact integers, and the result still equals the count from per-value tallies.
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 1000, 2_000_000)
    labels = rng.random(2_000_000) < 0.3
    positives = np.bincount(scores[labels], minlength=1000)
    negatives = np.bincount(scores[~labels], minlength=1000)
    below = np.concatenate([[0], np.cumsum(negatives)[:-1]])
    wins = 2 * int((positives * below).sum()) + int((positives * negatives).sum())
    expected = Fraction(wins, 2 * int(positives.sum()) * int(negatives.sum()))
    assert roc_auc(scores, labels) == float(expected)


def test_an_evaluation_whose_scores_hold_nan_has_no_auc_instead_of_failing():
    """A model whose held-out scores overflowed to NaN: roc_auc refuses NaN scores, and the
    worker took that for the model breaking its contract, reported a job error and exited
    after the job's tasks were done (the job then waited for workers that never came). The
    evaluation's AUC is none instead, as any figure that is not a number is reported."""
    labels = np.array([0, 1, 1, 0])
    assert held_out_auc(np.array([0.1, np.nan, 0.8, 0.2]), labels) is None
    assert held_out_auc(np.array([0.1, 0.9, 0.8, 0.2]), labels) == 1.0
    assert held_out_auc(np.array([0.1, np.inf, 0.8, -np.inf]), labels) == 1.0
