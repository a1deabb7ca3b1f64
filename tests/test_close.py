"""Phase 4 of the step, closing it (npu_lossscale/core/close.py): the skip
decision per policy, the per-group managers' updates, and the step counters
the commit moves (global_step, skipped_steps)."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import add_gan_groups, two_group_gan
from models import build_gan_step as _build

SCALE = 2.0 ** 10  # a power of two: scaling and unscaling are exact


def _per_group_run(policy, backend="is_finite"):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 8),
                                        backend=backend, skip_policy=policy)
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(model.d_vars + model.g_vars)
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf  # only the generator's gradients break
        out = sess.run({"u": train.update_op, "finite": train.is_finite,
                        "groups": _finite(train), "applied": train.applied}, feed)
        after = sess.run(model.d_vars + model.g_vars)
        moved = [not np.array_equal(x, y) for x, y in zip(before, after)]
        return out, moved[:2], moved[2:], sess.run(gs)


def test_per_group_policy_skips_only_the_broken_group(graph):
    out, d_moved, g_moved, step = _per_group_run("per_group")
    assert out["groups"] == {"d": True, "g": False}
    assert not out["finite"] and out["applied"]
    assert all(d_moved) and not any(g_moved)
    assert step == 1  # a step where any group applied counts


def test_all_policy_skips_both(graph):
    out, d_moved, g_moved, step = _per_group_run("all")
    assert not out["finite"] and not out["applied"]
    assert not any(d_moved) and not any(g_moved)
    assert step == 0


def test_per_group_managers_move_independently(gan):
    d_manager = nl.DynamicLossScaleManager(2.0 ** 8, growth_steps=1)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12, growth_steps=1)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="is_finite", skip_policy="per_group")
    add_gan_groups(scaler, gan, g_manager=g_manager)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scales = dict((name, group.loss_scale) for name, group in train.groups.items())
        used = sess.run([train.update_op, scales], gan.feed)[1]
        assert used == {"d": 2.0 ** 8, "g": 2.0 ** 12}
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 9, 2.0 ** 13]
        feed = dict(gan.feed)
        feed[gan.poison_g] = np.inf
        sess.run(train.update_op, feed)  # g overflows: g shrinks, d still grows
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 10, 2.0 ** 12]


def test_per_group_manager_under_all_policy_updates_on_its_own_group(gan):
    d_manager = nl.DynamicLossScaleManager(2.0 ** 8, growth_steps=1)
    g_manager = nl.DynamicLossScaleManager(2.0 ** 12, growth_steps=1)
    scaler = nl.MultiOptimizerLossScale(d_manager, backend="is_finite")
    add_gan_groups(scaler, gan, g_manager=g_manager)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(gan.feed)
        feed[gan.poison_g] = np.inf
        assert not sess.run([train.is_finite, train.update_op], feed)[0]  # both skip
        assert sess.run([d_manager.get_loss_scale(), g_manager.get_loss_scale()]) == [2.0 ** 9, 2.0 ** 11]


@pytest.mark.parametrize("count", [False, True])
def test_count_skipped_steps(gan, count):
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(2.0 ** 8), backend="is_finite")
    scaler.add(gan.d_loss, tf.train.AdamOptimizer(0.01), var_list=gan.d_vars, name="d")
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs, count_skipped_steps=count)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for ok in [True, False, True]:
            feed = dict(gan.feed)
            if not ok:
                feed[gan.x] = np.full_like(feed[gan.x], np.inf)
            sess.run(train.update_op, feed)
        assert sess.run(gs) == (3 if count else 2)


def test_global_step_counts_applied_steps_only(gan):
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 8)
    train, gs = _build(gan, manager)
    pattern = [True, False, True, True, False, False, True]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for ok in pattern:
            feed = dict(gan.feed)
            if not ok:
                feed[gan.poison_g] = np.inf
            assert sess.run([train.update_op, train.is_finite], feed)[1] == ok
        assert sess.run(gs) == sum(pattern)


def test_skipped_steps_counts_each_skip_and_is_checkpointed(gan, tmp_path):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    add_gan_groups(scaler, gan)
    train = scaler.build(global_step=tf.train.get_or_create_global_step())
    saver = tf.train.Saver()
    poison = dict(gan.feed)
    poison[gan.poison_g] = np.nan
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        counts = [sess.run([train.update_op, train.skipped_steps], feed)[1]
                  for feed in (gan.feed, poison, poison, gan.feed)]
        assert counts == [0, 0, 1, 2]  # each read precedes its own run's count
        assert sess.run(train.skipped_steps) == 2  # alone: a read, no step
        path = saver.save(sess, str(tmp_path / "ckpt"))
        sess.run(tf.global_variables_initializer())
        saver.restore(sess, path)
        assert sess.run(train.skipped_steps) == 2


def _finite(train):
    """Each group's decision of the run, by group name."""
    return dict((name, group.is_finite) for name, group in train.groups.items())
