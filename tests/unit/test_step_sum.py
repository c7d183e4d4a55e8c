"""StepSum, a sync step's sum of one shard's gradients kept from overflowing
(ps_server.consistency): the plain sum for ordinary gradients, a finite average for finite
ones whose sum would overflow, and bounded work for non-finite ones."""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.consistency import StepSum

# A sound StepSum never halves its sum more often than the dtype has binades (float64: about
# 2,100 counting subnormals); past this, it is looping.
MOST_HALVINGS = 5000


class BoundedStepSum(StepSum):
    """StepSum whose `scale` refuses to pass MOST_HALVINGS: a loop that never ends fails
    the test instead of hanging it."""

    @property
    def scale(self) -> int:
        return self._scale

    @scale.setter
    def scale(self, value: int) -> None:
        assert value <= MOST_HALVINGS, "StepSum.add halves its sum without end"
        self._scale = value


def test_ordinary_gradients_average_to_the_plain_sum_over_the_count():
    grads = [np.array([1.5, -2.0, 3e-3], np.float32), np.array([0.25, 4.0, 7.0], np.float32),
             np.array([-1.0, 0.5, 1e-30], np.float32)]
    total = StepSum(None, grads[0])
    for grad in grads[1:]:
        total.add(grad)
    plain = (grads[0] + grads[1] + grads[2]) / np.float32(3)
    np.testing.assert_array_equal(total.average(), plain)
    assert total.scale == 0


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_a_step_with_a_non_finite_gradient_is_summed_in_bounded_time(dtype):
    """A server run with --allow-non-finite takes non-finite gradients from a
    PSClient(allow_non_finite=True); their step is averaged plainly (an Inf makes the
    average Inf). A bound of inf was halved forever, under the step gate's lock: every
    later push to that server hung."""
    total = BoundedStepSum(None, np.array([np.inf, 1.0], dtype))
    total.add(np.array([1.0, 1.0], dtype))
    average = total.average()
    assert np.isinf(average[0]) and average[1] == 1.0


def test_a_float16_step_whose_sum_would_round_past_the_largest_value_stays_finite():
    """32800 + 16 + 32688 is exactly 65504 (float16's largest), but 32800 + 16 rounds to
    32832 and the next add to inf: the sum is scaled while its bound is within half the
    range, a margin for the adds' rounding."""
    total = StepSum(None, np.array([32800.0], np.float16))
    total.add(np.array([16.0], np.float16))
    total.add(np.array([32688.0], np.float16))
    average = total.average()
    assert np.isfinite(average).all(), average
    assert abs(float(average[0]) - (32800 + 16 + 32688) / 3) < 32
