"""bfloat16 training through NoOpLossScaleManager (issue 27, item 4): scale
1 with no scale ops, and the one-decision skip.

bfloat16 keeps float32's exponent range, so its gradients need no loss
scale (Ascend A2/A3 and current GPUs train in it unscaled); a non-finite
step must still change nothing. The model is tests/models.py's two-group GAN
computed in bfloat16 (MatMul, Tanh, Softplus and their gradients have
bfloat16 CPU kernels in TF 2.21), with float32 master weights.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import snapshot_globals
from models import add_gan_groups, two_group_gan

_LEARNING_RATE = 0.01
_STEPS = 3


def _with(feed, key, value):
    """``feed`` plus ``key: value``."""
    feed = dict(feed)
    feed[key] = value
    return feed


def _model_state(sess):
    """Every global variable but the builder's own records under
    ``loss_scale/`` (``skipped_steps`` moves on a skip by design)."""
    return dict((name, value) for name, value in snapshot_globals(sess).items()
                if not name.startswith("loss_scale/"))


def _builder_run(feeds):
    """Builds the GAN with the builder and NoOpLossScaleManager, runs one
    step per feed dict update; returns (TrainOps, final variables)."""
    model = two_group_gan(compute_dtype=tf.bfloat16)
    scaler = add_gan_groups(nl.MultiOptimizerLossScale(nl.NoOpLossScaleManager(),
                                                       backend="is_finite"),
                            model, _LEARNING_RATE)
    train = scaler.build(global_step=tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        results = [sess.run({"update": train.update_op, "finite": train.is_finite,
                             "scale": train.loss_scale}, dict(list(model.feed.items()) + list(extra.items())))
                   for extra in feeds]
        return results, snapshot_globals(sess)


def _twin_run(steps):
    """The same GAN trained without the library: both gradients, then both
    Adam applies, in one run."""
    model = two_group_gan(compute_dtype=tf.bfloat16)
    d_grads = tf.gradients(model.d_loss, model.d_vars)
    g_grads = tf.gradients(model.g_loss, model.g_vars)
    with tf.control_dependencies(d_grads + g_grads):
        train = tf.group(
            tf.train.AdamOptimizer(_LEARNING_RATE).apply_gradients(
                list(zip(d_grads, model.d_vars))),
            tf.train.AdamOptimizer(_LEARNING_RATE).apply_gradients(
                list(zip(g_grads, model.g_vars))))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(steps):
            sess.run(train, model.feed)
        return snapshot_globals(sess)


def test_the_model_computes_in_bfloat16(graph):
    model = two_group_gan(compute_dtype=tf.bfloat16)
    assert model.d_loss.dtype == tf.bfloat16 and model.g_loss.dtype == tf.bfloat16
    grads = tf.gradients(model.d_loss, model.d_vars)
    assert all(grad.dtype == tf.float32 for grad in grads)  # master weights


def test_no_scale_ops(graph):
    """The loss is differentiated as it is: no cast to float32, no multiply
    by the scale, no reciprocal, no unscale; the overflow check is there."""
    model = two_group_gan(compute_dtype=tf.bfloat16)
    train = add_gan_groups(nl.MultiOptimizerLossScale(nl.NoOpLossScaleManager(),
                                                      backend="is_finite"), model).build()
    names = [op.name for op in tf.get_default_graph().get_operations()]
    assert not [n for n in names if "scaled_loss" in n or "inv_scale" in n]
    assert not [op for op in tf.get_default_graph().get_operations()
                if op.name.startswith("loss_scale/") and op.type == "Reciprocal"]
    assert train.grads_and_vars["d"][0][0].op.type != "Mul"
    assert any(n.startswith("loss_scale/") and "check" in n for n in names)


def test_applied_steps_match_a_bfloat16_twin(graph):
    """Three finite steps: every weight and Adam slot equals the twin's, bit
    for bit; the scale reads 1."""
    results, ours = _builder_run([{}] * _STEPS)
    assert [(bool(r["finite"]), float(r["scale"])) for r in results] == [(True, 1.0)] * _STEPS
    with tf.Graph().as_default():
        theirs = _twin_run(_STEPS)
    with tf.Graph().as_default():
        initial = _twin_run(0)
    for name in ("discriminator/w", "discriminator/b", "generator/w", "generator/b"):
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        assert not np.array_equal(ours[name], initial[name]), name
    slots = sorted(name for name in theirs if "Adam" in name)
    ours_slots = sorted(name for name in ours if "Adam" in name)
    assert len(slots) == len(ours_slots) == 8
    for mine, twin in zip(ours_slots, slots):
        np.testing.assert_array_equal(ours[mine], theirs[twin], err_msg=mine)
    assert ours["global_step"] == _STEPS


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_a_non_finite_step_changes_nothing(graph, poison):
    """A poisoned generator loss (inf or nan in bfloat16) skips the whole
    step: every weight, slot, beta power and the global step stay as they
    were, for both groups; the scale stays 1."""
    model = two_group_gan(compute_dtype=tf.bfloat16)
    train = add_gan_groups(nl.MultiOptimizerLossScale(nl.NoOpLossScaleManager(),
                                                      backend="is_finite"),
                           model).build(global_step=tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, model.feed)
        before = _model_state(sess)
        result = sess.run({"update": train.update_op, "finite": train.is_finite,
                           "scale": train.loss_scale, "skipped": train.skipped_steps},
                          _with(model.feed, model.poison_g, poison))
        after = _model_state(sess)
        skipped = sess.run(train.skipped_steps)
    assert not result["finite"] and float(result["scale"]) == 1.0
    assert sorted(before) == sorted(after)
    assert len(before) == 4 + 8 + 4 + 1  # weights, Adam slots, beta powers, step
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert skipped == result["skipped"] + 1


def _one_optimizer_run(wrap):
    """The discriminator alone, trained for _STEPS steps by ``wrap(Adam)``'s
    minimize in a fresh graph; returns its weights."""
    with tf.Graph().as_default():
        model = two_group_gan(compute_dtype=tf.bfloat16)
        train = wrap(tf.train.AdamOptimizer(_LEARNING_RATE)).minimize(
            model.d_loss, var_list=model.d_vars)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(_STEPS):
                sess.run(train, model.feed)
            return sess.run(model.d_vars)


def test_loss_scale_optimizer_matches_a_twin():
    """One optimizer through LossScaleOptimizer: the same numbers as plain
    minimize on the bfloat16 loss."""
    ours = _one_optimizer_run(lambda opt: nl.LossScaleOptimizer(
        opt, nl.NoOpLossScaleManager(), backend="is_finite"))
    theirs = _one_optimizer_run(lambda opt: opt)
    for mine, their in zip(ours, theirs):
        np.testing.assert_array_equal(mine, their)


def test_without_the_check_every_step_applies(graph):
    """enable_overflow_check=False: plain unscaled training (the poisoned
    step applies its NaN), through the same builder."""
    model = two_group_gan(compute_dtype=tf.bfloat16)
    manager = nl.NoOpLossScaleManager(enable_overflow_check=False)
    assert manager.static_loss_scale == 1.0 and not manager.get_enable_overflow_check()
    train = add_gan_groups(nl.MultiOptimizerLossScale(manager, backend="is_finite"),
                           model).build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, _with(model.feed, model.poison_g, float("nan")))
        assert np.isnan(sess.run(model.g_vars[0])).all()


def test_flag_must_be_a_bool(graph):
    with pytest.raises(TypeError, match="enable_overflow_check"):
        nl.NoOpLossScaleManager(enable_overflow_check="yes")
