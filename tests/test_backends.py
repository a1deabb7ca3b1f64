"""The is_finite check, including its grouping of small same-shape gradients."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from npu_lossscale import backends


def _flag(arrays, dtype=tf.float32):
    with tf.Graph().as_default():
        tensors = [tf.constant(a, dtype) for a in arrays]
        flag = backends.IsFiniteBackend().overflow_flag(tensors)
        with tf.Session() as sess:
            return sess.run(flag)


SMALL = [np.ones([3, 4]) for _ in range(6)] + [np.ones([5])]
LARGE = [np.ones([backends.SMALL_GRADIENT_ELEMENTS + 1])]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", range(len(SMALL + LARGE)))
def test_any_non_finite_value_anywhere_is_caught(bad, where):
    arrays = [a.copy() for a in SMALL + LARGE]
    arrays[where].flat[-1] = bad
    assert _flag(arrays) == 1.0
    assert _flag([a.copy() for a in SMALL + LARGE]) == 0.0


def test_opposite_infinities_in_one_group_are_caught():
    arrays = [a.copy() for a in SMALL]
    arrays[0][1, 2], arrays[1][1, 2] = np.inf, -np.inf  # elementwise sum is nan
    assert _flag(arrays) == 1.0


def test_float16_group_is_summed_in_float32():
    # Each value is finite in float16, but six of them add up past 65504.
    arrays = [np.full([3, 4], 60000.0) for _ in range(6)]
    assert _flag(arrays, tf.float16) == 0.0
    arrays[3][0, 0] = np.inf
    assert _flag(arrays, tf.float16) == 1.0


def test_indexed_slices_are_checked_by_their_values():
    with tf.Graph().as_default():
        values = tf.constant([[1.0, np.nan]])
        grad = tf.IndexedSlices(values, tf.constant([0]), tf.constant([4, 2]))
        flag = backends.IsFiniteBackend().overflow_flag([grad, tf.ones([2])])
        with tf.Session() as sess:
            assert sess.run(flag) == 1.0
