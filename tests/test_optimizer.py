"""LossScaleOptimizer: the Optimizer API over the builder's machinery."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import snapshot_globals
from models import two_group_gan


def _train(make_train_op, steps, poison_at=()):
    with tf.Graph().as_default():
        model = two_group_gan()
        gs = tf.train.get_or_create_global_step()
        train = make_train_op(model, gs)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(steps):
                feed = dict(model.feed)
                if step in poison_at:
                    feed[model.poison_g] = np.inf
                sess.run(train, feed)
            return snapshot_globals(sess)


def _lso(model, gs, scale=2.0 ** 6):
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.02), nl.FixedLossScaleManager(scale),
                                backend="is_finite")
    return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)


def _builder(model, gs, scale=2.0 ** 6):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(scale), backend="is_finite")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(0.02), var_list=model.g_vars,
               name="Adam")
    return scaler.build(global_step=gs).update_op


def _plain(model, gs):
    return tf.train.AdamOptimizer(0.02).minimize(model.g_loss, global_step=gs,
                                                 var_list=model.g_vars)


def _weights(state):
    return {k: v for k, v in state.items() if "loss_scale" not in k}


def test_minimize_equals_builder_and_plain_training_bit_for_bit():
    ours = _weights(_train(_lso, 6))
    for other in (_train(_builder, 6), _train(_plain, 6)):
        other = _weights(other)
        assert sorted(ours) == sorted(other)
        for name in ours:
            assert np.array_equal(ours[name], other[name]), name


def test_minimize_skips_like_the_builder():
    poison = (1, 2, 4)
    ours, theirs = _train(_lso, 6, poison), _train(_builder, 6, poison)
    assert ours["global_step"] == theirs["global_step"] == 3
    for name in _weights(ours):
        assert np.array_equal(ours[name], theirs[name]), name


def test_matches_tf_mixed_precision_loss_scale_optimizer():
    """Same dynamic rule, same skips: TF's own wrapper as the reference."""
    def ours(model, gs):
        opt = nl.LossScaleOptimizer(
            tf.train.AdamOptimizer(0.02),
            nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=2),
            backend="is_finite")
        return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)

    def theirs(model, gs):
        loss_scale = tf.mixed_precision.DynamicLossScale(
            initial_loss_scale=2.0 ** 10, increment_period=2)
        opt = tf.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf.train.AdamOptimizer(0.02), loss_scale)
        return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)

    poison = (2, 3, 6)
    a, b = _train(ours, 9, poison), _train(theirs, 9, poison)
    for name in ("generator/w", "generator/b", "generator/w/Adam", "generator/w/Adam_1"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=0)
    assert a["global_step"] == 6  # TF's wrapper also counts only applied steps
    assert b["global_step"] == 6


def test_compute_gradients_returns_unscaled_gradients(graph):
    model = two_group_gan()
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                nl.FixedLossScaleManager(2.0 ** 9), backend="is_finite")
    extra = tf.get_variable("extra", [2])
    ours = opt.compute_gradients(model.g_loss, var_list=model.g_vars + [extra])
    assert ours[-1] == (None, extra)  # kept as None, as the base class does
    plain = tf.gradients(model.g_loss, model.g_vars)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        a, b = sess.run([[g for g, _ in ours[:-1]], plain], model.feed)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_slots_are_the_inner_optimizers(graph):
    model = two_group_gan()
    inner = tf.train.AdamOptimizer(0.02)
    opt = nl.LossScaleOptimizer(inner, nl.DynamicLossScaleManager(), backend="is_finite")
    opt.minimize(model.g_loss, var_list=model.g_vars)
    assert opt.get_slot_names() == ["m", "v"]
    assert opt.get_slot(model.g_vars[0], "m") is inner.get_slot(model.g_vars[0], "m")
    assert opt.inner_optimizer is inner
    with pytest.raises(AttributeError):
        opt.no_such_attribute  # no blanket forwarding that would hide typos


def test_apply_gradients_with_no_gradient(graph):
    model = two_group_gan()
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), nl.FixedLossScaleManager(8),
                                backend="is_finite")
    with pytest.raises(ValueError, match="no gradients"):
        opt.apply_gradients([(None, model.g_vars[0])])


def test_wrong_optimizer_type(graph):
    with pytest.raises(TypeError, match="opt must be a tf.compat.v1.train.Optimizer"):
        nl.LossScaleOptimizer("adam", nl.FixedLossScaleManager(8))
