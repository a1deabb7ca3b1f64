"""A build or apply that fails in a user hook (a manager's
``get_loss_scale`` or ``update_loss_scale``) leaves the graph's
collections, the optimizers' slots, the claims and the builder as they
were, because the step calls those hooks before it makes any state
(npu_lossscale/core/step.py); a retry trains, and names its variables as a
build that never failed."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import raises_with as _raises
from models import ManagerReturning as _ManagerReturning
from models import two_nets as _two_nets


def test_failed_build_leaves_the_builder_usable(gan):
    """A failure only TF can find (inside the build) still leaves no stuck
    builder: the retry runs, rather than saying build() was already called."""
    manager = _ManagerReturning(None)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(gan.g_loss, tf.train.AdamOptimizer(), var_list=gan.g_vars)
    with _raises(TypeError, "returned None"):
        scaler.build()
    manager.value = tf.constant(8.0)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], gan.feed)[1]


class _UpdatesNothing(nl.FixedLossScaleManager):
    """A custom manager whose update returns None: refused after the applies
    were made, so the build fails half-way."""

    def update_loss_scale(self, finite_grads):
        return None


def _collections(graph):
    return dict((key, list(graph.get_collection(key)))
                for key in graph.get_all_collection_keys())


@pytest.mark.parametrize("api", ["builder", "optimizer"])
def test_a_failed_build_leaves_the_graphs_variables_as_they_were(graph, gan, api, tmp_path):
    """The build makes ops before the manager's update fails: its variables
    (skipped_steps, Adam's slots and beta powers) leave every collection, so
    no initializer or Saver sees them; a retry makes them again."""
    gs = tf.train.get_or_create_global_step()
    before = _collections(graph)
    opt = tf.train.AdamOptimizer(0.01)
    if api == "builder":
        scaler = nl.MultiOptimizerLossScale(_UpdatesNothing(8.0), backend="is_finite")
        scaler.add(gan.g_loss, opt, var_list=gan.g_vars, name="g")
        with pytest.raises(TypeError, match="not an op"):
            scaler.build(global_step=gs)
    else:
        lso = nl.LossScaleOptimizer(opt, _UpdatesNothing(8.0), backend="is_finite")
        with pytest.raises(TypeError, match="not an op"):
            lso.minimize(gan.g_loss, var_list=gan.g_vars, global_step=gs)
    assert _collections(graph) == before
    assert opt.get_slot(gan.g_vars[0], "m") is None
    # The retry (with a manager that works) trains and saves only live state.
    if api == "builder":
        scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
        scaler.add(gan.g_loss, opt, var_list=gan.g_vars, name="g")
        train = scaler.build(global_step=gs).update_op
    else:
        lso = nl.LossScaleOptimizer(opt, nl.DynamicLossScaleManager(), backend="is_finite")
        train = lso.minimize(gan.g_loss, var_list=gan.g_vars, global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train, gan.feed)
        assert sess.run(gs) == 1
        path = tf.train.Saver().save(sess, str(tmp_path / "gan"))
    saved = sorted(name for name, _ in tf.train.list_variables(path))
    assert len([name for name in saved if "skipped_steps" in name]) == (api == "builder")
    # m and v of each variable, once: none left over from the failed build
    # (TF never reuses an op name, so the retry's slots carry a suffix).
    assert len([name for name in saved if "/Adam" in name]) == 2 * len(gan.g_vars), saved
    assert len([name for name in saved if "beta1_power" in name]) == 1, saved


class _FailingOnceManager(nl.FixedLossScaleManager):
    """A manager whose first update fails while the step is being built."""

    def __init__(self):
        super(_FailingOnceManager, self).__init__(8.0)
        self.failures = 1

    def update_loss_scale(self, finite_grads):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("update failed")
        return super(_FailingOnceManager, self).update_loss_scale(finite_grads)


def test_a_failed_apply_leaves_no_claim(gan):
    """An apply that fails after claiming its manager drops the claim: the
    retry on the same optimizer, or another updater, is not refused."""
    manager = _FailingOnceManager()
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
    with pytest.raises(RuntimeError, match="update failed"):
        opt.minimize(gan.g_loss, var_list=gan.g_vars)
    manager.failures = 1
    other = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), manager, backend="is_finite")
    with pytest.raises(RuntimeError, match="update failed"):
        other.minimize(gan.g_loss, var_list=gan.g_vars)
    train = opt.minimize(gan.g_loss, var_list=gan.g_vars)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(gan.g_vars[0])
        sess.run(train, gan.feed)
        assert not np.array_equal(before, sess.run(gan.g_vars[0]))


def test_one_builder_reusing_its_manager_across_groups_and_per_group_steps_is_fine(graph):
    """The same owner may use one manager for its default and a group's own,
    and again in its per-group steps: one update per run of each step op.
    A builder whose build() failed leaves no claim behind."""
    x, y, loss_x, loss_y = _two_nets()
    manager = nl.DynamicLossScaleManager()
    failed = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    failed.add(loss_x, tf.train.GradientDescentOptimizer(0.1), var_list=[x], name="x")
    with pytest.raises(TypeError):
        failed.build(global_step="not a variable")
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss_x, tf.train.GradientDescentOptimizer(0.1), var_list=[x], name="x")
    scaler.add(loss_y, tf.train.GradientDescentOptimizer(0.1), var_list=[y], name="y",
               loss_scale_manager=manager)
    train = scaler.build(per_group_ops=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.per_group["x"])
        sess.run(train.update_op)
        np.testing.assert_array_equal(sess.run(y), np.float32([0.8, 0.8]))


@pytest.mark.parametrize("api", ["builder", "optimizer"])
def test_a_retry_after_a_failed_build_names_its_variables_as_a_first_build(api, tmp_path):
    """Issue 32: the retry's checkpoint holds the names a build that never
    failed writes (no ``beta1_power_1``, no ``skipped_steps_1``), so a
    normal build's checkpoint restores into it."""
    from models import two_group_gan  # pylint: disable=import-outside-toplevel

    def build(gan, manager):
        gs = tf.train.get_or_create_global_step()
        opt = tf.train.AdamOptimizer(0.01)
        if api == "builder":
            scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
            scaler.add(gan.g_loss, opt, var_list=gan.g_vars, name="g")
            return scaler.build(global_step=gs).update_op
        lso = nl.LossScaleOptimizer(opt, manager, backend="is_finite")
        return lso.minimize(gan.g_loss, var_list=gan.g_vars, global_step=gs)

    def saved_names(train, gan, path):
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(train, gan.feed)
            saved = tf.train.Saver().save(sess, str(path))
        return sorted(name for name, _ in tf.train.list_variables(saved))

    with tf.Graph().as_default():
        gan = two_group_gan()
        want = saved_names(build(gan, nl.DynamicLossScaleManager()), gan, tmp_path / "normal")
    with tf.Graph().as_default():
        gan = two_group_gan()
        with pytest.raises(TypeError, match="not an op"):
            build(gan, _UpdatesNothing(8.0))
        got = saved_names(build(gan, nl.DynamicLossScaleManager()), gan, tmp_path / "retried")
    assert got == want
    assert any(name.rsplit("/", 1)[-1] == "beta1_power" for name in got), got
