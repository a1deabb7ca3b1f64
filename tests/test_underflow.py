"""Seed 000: float16 gradients underflow to zero unless the loss is scaled."""

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

# The loss is multiplied by this, so that every upstream gradient element
# (TINY / 2048 ~ 5e-9) lies below float16's smallest subnormal (6e-8).
TINY = 1e-5


def _conv3d_net(dtype):
    """A small 3-D conv net on a ones volume, like the seed's reproducer."""
    rng = np.random.RandomState(0)
    volume = tf.ones([1, 8, 8, 8, 1], dtype)
    weights = []
    x = volume
    for i, (cin, cout) in enumerate([(1, 4), (4, 4)]):
        w = tf.get_variable("conv%d" % i, initializer=rng.normal(
            0, 0.3, [3, 3, 3, cin, cout]).astype(np.float32))
        weights.append(w)
        x = tf.nn.relu(tf.nn.conv3d(x, tf.cast(w, dtype), [1, 1, 1, 1, 1], "SAME"))
    loss = tf.reduce_mean(x) * tf.cast(TINY, dtype)
    return loss, weights


def test_float16_gradients_underflow_without_scaling_and_match_float32_with_it():
    with tf.Graph().as_default():
        loss16, w16 = _conv3d_net(tf.float16)
        raw16 = tf.gradients(loss16, w16)
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(loss16, tf.train.GradientDescentOptimizer(0.0), var_list=w16, name="net")
        train = scaler.build()
        scaled16 = [g for g, _ in train.grads_and_vars["net"]]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            raw, scaled, finite = sess.run([raw16, scaled16, train.is_finite])
    with tf.Graph().as_default():
        loss32, w32 = _conv3d_net(tf.float32)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            ref = sess.run(tf.gradients(loss32, w32))

    assert finite
    for g in raw:
        assert not np.any(g), "unscaled float16 gradients should underflow to exactly zero"
    for g, r in zip(scaled, ref):
        assert np.abs(r).max() > 1e-9  # the float32 reference is not zero
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=1e-3 * np.abs(r).max())
