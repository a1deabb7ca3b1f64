"""Misuses a real script makes of the builder, each refused at build time
with a sentence or made to do what the user meant (issue #20). References
are TF's own ops and unscaled twins."""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale.builder import CLIP_NORM_RANGE


def _clip_in_tf(clip_norm):
    """TF's own clip_by_global_norm of a gradient of norm 5 (float32)."""
    with tf.Graph().as_default():
        grad = tf.constant([3.0, 4.0])
        clipped, _ = tf.clip_by_global_norm([grad], clip_norm)
        with tf.Session() as sess:
            return sess.run(clipped[0])


def test_clip_norm_range_is_where_tfs_clip_works():
    """The bounds are float32's normal range for clip_norm and its
    reciprocal. At the top TF's clip leaves a norm-5 gradient unchanged; one
    binade higher 1 / clip_norm is subnormal, flushed to 0, and the gradient
    comes out 0. Below the bottom clip_norm itself is subnormal (the issue's
    1e-40) and TF zeroes the gradient."""
    low, high = CLIP_NORM_RANGE
    assert low == np.finfo(np.float32).tiny and high == 1 / low
    assert np.array_equal(_clip_in_tf(high), [3.0, 4.0])
    assert not np.any(_clip_in_tf(high * 2))
    assert not np.any(_clip_in_tf(1e-40))


@pytest.mark.parametrize("clip_norm", [1e39, 3e38, 1e38, 1e-40, 2.0 ** 127, 2.0 ** -127])
def test_clip_norm_outside_float32s_normal_range_is_refused(graph, clip_norm):
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    loss = tf.reduce_sum(x * x)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"clip_norm must be in \[.*got %s\. .*normal float32"
                       % re.escape(repr(clip_norm))):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[x],
                   clip_norm=clip_norm)
    assert len(graph.get_operations()) == before


def test_clip_norm_at_the_top_of_the_range_trains_as_unclipped(graph):
    """A huge but representable clip_norm clips nothing: the weights equal
    an unclipped twin's (hand-computed SGD step on x*x: x - 0.1 * 2x)."""
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(tf.reduce_sum(x * x), tf.train.GradientDescentOptimizer(0.1), var_list=[x],
               clip_norm=CLIP_NORM_RANGE[1])
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        np.testing.assert_array_equal(sess.run(x), np.float32([0.8, 0.8]))
        assert sess.run(gs) == 1
