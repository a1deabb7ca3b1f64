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
from conftest import op_ancestors


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


# -- nothing applied escapes the check (issue 32, item 7) -----------------------

def test_clipping_finite_gradients_whose_norm_overflows_float32_stays_finite(graph):
    """Finite float32 gradients of about 1e30: tf.clip_by_global_norm's sum
    of squares overflows float32 and clips every gradient to NaN (checked
    below, TF itself); the clip_norm transform rescales first, so the
    applied step writes finite weights, clipped to the norm by hand."""
    w = tf.Variable(np.zeros([2], np.float32))
    loss = tf.reduce_sum(w * np.array([3e30, 4e30], np.float32))  # gradient [3e30, 4e30]
    reference, _ = tf.clip_by_global_norm([tf.constant([3e30, 4e30], tf.float32)], 1.0)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], clip_norm=1.0)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert np.all(np.isnan(sess.run(reference)))
        assert sess.run([train.update_op, train.applied])[1]
        np.testing.assert_allclose(sess.run(w), [-0.6, -0.8], rtol=1e-6)


def test_unscaling_float16_by_more_than_one_cannot_write_an_inf(graph):
    """At a scale of 0.5 the float16 backprop of w * a * b holds 0.5 * b,
    then 0.5 * a * b = 45000 for a = b = 300 (finite); unscaling doubles it
    to 90000, inf in float16. The check covers the unscaled float16
    gradients then, so the step skips and the weight stays finite; a
    gradient that fits applies."""
    w = tf.Variable(np.zeros([1], np.float16))
    a = tf.placeholder(tf.float16, [])
    b = tf.placeholder(tf.float16, [])
    loss = tf.reduce_sum(w * a * b)
    manager = nl.DynamicLossScaleManager(initial_scale=0.5, min_loss_scale=0.5,
                                         growth_steps=1000)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w])
    train = scaler.build()
    scaled = [tf.gradients(loss, [w], grad_ys=tf.constant(0.5, tf.float16))[0]]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert np.isfinite(sess.run(scaled, {a: 300.0, b: 300.0})[0]).all()  # 45000
        assert not sess.run([train.update_op, train.applied], {a: 300.0, b: 300.0})[1]
        assert np.all(np.isfinite(sess.run(w))) and sess.run(w)[0] == 0.0
        assert sess.run([train.update_op, train.applied], {a: 10.0, b: 10.0})[1]
        assert sess.run(w)[0] == -100.0


def test_float16_indexed_slices_with_duplicate_indices_cannot_write_an_inf(graph):
    """Two float16 rows of 40000 for one index: each finite, their sum
    (80000) is inf in float16, and the apply would add them after the
    check. They are summed (in float32) before the check: the step skips,
    the table stays finite; duplicates that fit apply their sum."""
    table = tf.Variable(np.zeros([3, 1], np.float16))
    ids = tf.placeholder(tf.int32, [2])
    value = tf.placeholder(tf.float16, [])
    loss = tf.reduce_sum(tf.gather(table, ids)) * value
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[table])
    train = scaler.build()
    assert isinstance(train.grads_and_vars["group_0"][0][0], tf.IndexedSlices)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert not sess.run([train.update_op, train.applied], {ids: [1, 1], value: 40000.0})[1]
        np.testing.assert_array_equal(sess.run(table), np.zeros([3, 1]))
        assert sess.run([train.update_op, train.applied], {ids: [1, 1], value: 3.0})[1]
        np.testing.assert_array_equal(sess.run(table), [[0.0], [-6.0], [0.0]])


def test_unscale_and_clip_are_one_multiply(graph):
    """Issue 34: with clip_norm (and nothing else to transform, no window,
    no reduction) each applied gradient is the scaled gradient times one
    scalar, 1/scale and the clip factor together; the numbers are those of
    tf.clip_by_global_norm on the unscaled gradients within float32
    rounding. Issue 44: ``grads_and_vars`` (what the hooks see) holds the
    unclipped gradients, a multiply of its own that an applied step does
    not run."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.randn(200, 100).astype(np.float32), name="w")
    x = tf.constant(rng.randn(8, 200).astype(np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16))))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="g",
               clip_norm=0.5)
    train = scaler.build()
    (seen, _), = train.grads_and_vars["g"]
    assert seen.op.type == "Mul"
    scaled = seen.op.inputs[0]
    assert scaled.op.type != "Mul"
    runs = op_ancestors(train.update_op)
    # Of the multiplies of the gradient's size, the applied step runs one,
    # by a scalar: the fused one; the norm reads the gradient too.
    multiplies = [op for op in scaled.consumers() if op.type == "Mul" and op in runs]
    assert len(multiplies) == 1 and seen.op not in runs
    applied, factor = multiplies[0].outputs[0], multiplies[0].inputs[1]
    assert multiplies[0].inputs[0] is scaled and factor.shape.ndims == 0
    plain = tf.gradients(tf.cast(loss, tf.float32), [w])
    reference, _ = tf.clip_by_global_norm(plain, 0.5)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        ours, want, unclipped, plain = sess.run([applied, reference[0], seen, plain[0]])
    assert np.linalg.norm(ours) == pytest.approx(0.5, rel=1e-5)
    np.testing.assert_allclose(ours, want, rtol=2e-3, atol=1e-6)
    assert np.linalg.norm(plain) > 1.0
    np.testing.assert_allclose(unclipped, plain, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_unscale_is_exact_for_narrow_variables_above_a_scale_of_2_24(graph, dtype):
    """Issue 44: 1 / 2**25 is 0 in float16 (below its smallest subnormal),
    so a float16 unscale applied nothing on a step reported "applied". The
    unscale multiplies in float32 and casts back: the applied gradient is
    the plain one, cast to the variable's dtype (2**-20 fits both)."""
    w = tf.Variable(np.ones([3]), dtype=dtype)
    tiny = tf.constant([2.0 ** -20, 2.0 ** -21, 3 * 2.0 ** -22], tf.float32)
    loss = tf.reduce_sum(tf.cast(w, tf.float32) * tiny)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 25), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="g")
    train = scaler.build()
    (grad, _), = train.grads_and_vars["g"]
    plain = tf.cast(tf.gradients(loss, [w])[0], dtype)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        ours, want = sess.run([tf.cast(grad, tf.float32), tf.cast(plain, tf.float32)])
        assert sess.run([train.update_op, train.applied])[1]
    assert np.all(want != 0.0)
    np.testing.assert_array_equal(ours, want)


def test_loss_scale_optimizer_unscales_float16_variables_above_2_24_exactly(graph):
    """The same unscale serves ``LossScaleOptimizer.compute_gradients``."""
    w = tf.Variable(np.ones([2]), dtype=tf.float16)
    loss = tf.reduce_sum(tf.cast(w, tf.float32) * tf.constant([2.0 ** -20, 2.0 ** -21]))
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0),
                                nl.FixedLossScaleManager(2.0 ** 25), backend="is_finite")
    (grad, _), = opt.compute_gradients(loss, var_list=[w])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        np.testing.assert_array_equal(sess.run(tf.cast(grad, tf.float32)),
                                      [2.0 ** -20, 2.0 ** -21])
