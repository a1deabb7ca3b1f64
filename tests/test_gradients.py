"""Phase 1 of the step, the gradients (npu_lossscale/core/gradients.py): scaled,
backpropagated once per distinct loss, unscaled, cast to the variables'
dtype, and clipped."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import BIG_X, BIG_Y
from models import accumulating as _accumulating
from models import big_batch_reference as _big_batch_reference
from models import build_gan_step as _build
from models import micro_feeds as _micro_feeds
from models import two_group_gan


@pytest.mark.parametrize("accumulation_steps", [1, 4])
def test_clipping_equals_clip_by_global_norm_on_unscaled_gradients(graph, accumulation_steps):
    make_opt = lambda: tf.train.GradientDescentOptimizer(0.1)
    train, (x, y, _, w, b), _ = _accumulating(make_opt, n=accumulation_steps, clip_norm=0.05)
    feeds = [{x: BIG_X, y: BIG_Y}] if accumulation_steps == 1 else _micro_feeds(x, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for feed in feeds:
            sess.run(train.update_op, feed)
        ours = sess.run([w, b])
    reference = _big_batch_reference(make_opt, clip_norm=0.05)
    unclipped = _big_batch_reference(make_opt)
    assert not np.allclose(reference[0], unclipped[0])  # the clip did bite
    for a, r in zip(ours, reference):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)


def test_clipping_float16_variables_with_a_large_norm_stays_finite(graph):
    """float16 squares overflow past a norm of ~256; the clip norm is taken
    in float32, so a finite step never writes NaN (a float16 and a float32
    variable in one group also works)."""
    w16 = tf.Variable(np.full([4], 100.0, np.float16))
    w32 = tf.Variable(np.full([2], 1.0, np.float32))
    loss = tf.reduce_sum(tf.cast(w16, tf.float32) ** 2) + tf.reduce_sum(w32)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w16, w32],
               clip_norm=1.0)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        finite = sess.run([train.update_op, train.is_finite])[1]
        values = sess.run(w16)
    assert finite and np.all(np.isfinite(values))
    # gradient 200 per element, norm 400 (plus w32's): clipped to a norm of 1.
    assert np.all(values < 100.0) and np.all(values > 99.0)


def test_float16_compute_float32_master_weights(graph):
    model = two_group_gan(compute_dtype=tf.float16)
    assert model.g_loss.dtype == tf.float16
    train, gs = _build(model, nl.DynamicLossScaleManager())
    for pairs in train.grads_and_vars.values():
        for grad, var in pairs:
            assert grad.dtype == var.dtype.base_dtype == tf.float32
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        assert sess.run(gs) == 3


def test_grads_and_vars_are_the_unscaled_gradients(gan):
    train, _ = _build(gan, nl.FixedLossScaleManager(2.0 ** 12))
    plain = tf.gradients(gan.d_loss, gan.d_vars) + tf.gradients(gan.g_loss, gan.g_vars)
    ours = [g for g, _ in train.grads_and_vars["discriminator"]] + \
           [g for g, _ in train.grads_and_vars["generator"]]
    assert [v for _, v in train.grads_and_vars["generator"]] == gan.g_vars
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        a, b = sess.run([ours, plain], gan.feed)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_variable_the_loss_does_not_reach_is_left_out(gan):
    unused = tf.get_variable("unused", [3], initializer=tf.zeros_initializer())
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")
    scaler.add(gan.d_loss, tf.train.GradientDescentOptimizer(0.1),
               var_list=gan.d_vars + [unused], name="d")
    train = scaler.build()
    assert [v for _, v in train.grads_and_vars["d"]] == gan.d_vars
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, gan.feed)
        assert np.array_equal(sess.run(unused), np.zeros(3))


def test_embedding_indexed_slices_are_scaled_checked_and_applied(graph):
    """The recommender pattern (seed 004): sparse embedding + dense groups."""
    table = tf.get_variable("emb", [10, 3], initializer=tf.ones_initializer())
    dense = tf.get_variable("dense", [3, 1], initializer=tf.ones_initializer())
    ids = tf.placeholder(tf.int32, [4])
    bad = tf.placeholder_with_default(1.0, [])
    rows = tf.cast(tf.gather(table, ids), tf.float16)
    loss = tf.reduce_mean(tf.matmul(rows, tf.cast(dense, tf.float16))) * tf.cast(bad, tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[table], name="embedding")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[dense], name="dense")
    train = scaler.build()
    emb_grad = train.grads_and_vars["embedding"][0][0]
    assert isinstance(emb_grad, tf.IndexedSlices)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, {ids: [1, 2, 2, 5]})
        emb = sess.run(table)
        # d loss / d row = dense^T / 4 = 0.25 per element, row 2 twice.
        np.testing.assert_array_equal(emb[[0, 3]], np.ones((2, 3)))
        np.testing.assert_array_equal(emb[1], np.full(3, 0.75))
        np.testing.assert_array_equal(emb[2], np.full(3, 0.5))
        before = sess.run([table, dense])
        assert not sess.run([train.is_finite, train.update_op], {ids: [1, 2, 3, 4], bad: np.inf})[0]
        for x, y in zip(before, sess.run([table, dense])):
            np.testing.assert_array_equal(x, y)


def test_shared_loss_backprops_once(graph):
    """Two groups on one loss build one gradient graph, not two."""
    def count_grad_ops(shared):
        with tf.Graph().as_default():
            model = two_group_gan()
            scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(4), backend="is_finite")
            scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1),
                       var_list=model.d_vars[:1], name="a")
            other = model.d_loss if shared else tf.identity(model.d_loss)
            scaler.add(other, tf.train.GradientDescentOptimizer(0.1),
                       var_list=model.d_vars[1:], name="b")
            scaler.build()
            return len([op for op in tf.get_default_graph().get_operations()
                        if "gradients" in op.name])
    assert count_grad_ops(shared=True) < count_grad_ops(shared=False)
