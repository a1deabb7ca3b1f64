"""Phase 2 of the step, the overflow check (npu_lossscale/core/overflow.py): a
manager that disables the check gets no flag, and every step applies."""

import numpy as np
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import build_gan_step as _build


def test_disabled_overflow_check_applies_every_step(gan):
    train, gs = _build(gan, nl.FixedLossScaleManager(1, enable_overflow_check=False))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(gan.feed)
        feed[gan.poison_g] = np.inf
        assert sess.run([train.is_finite, train.update_op], feed)[0]
        assert sess.run(gs) == 1
        assert np.isnan(sess.run(gan.g_vars[0])).any()  # unguarded, as asked


def test_a_fixed_scale_without_the_check_builds_no_check_and_no_gate(graph):
    """Issue 34: FixedLossScaleManager(enable_overflow_check=False) builds
    no check op and no gate (no Switch, Merge, If, IsFinite, and no count
    of skips), and applies as plain TF does on the unscaled loss: the
    scale is a power of two, so the numbers are the same bit for bit."""
    def model():
        x = tf.constant(np.linspace(-1.0, 1.0, 32).reshape([8, 4]), tf.float32)
        w = tf.Variable(np.full([4, 1], 0.1, np.float32), name="w")
        return w, tf.reduce_mean(tf.square(tf.matmul(tf.cast(x, tf.float16),
                                                     tf.cast(w, tf.float16))))

    w, loss = model()
    gs = tf.train.get_or_create_global_step()
    before = set(graph.get_operations())
    manager = nl.FixedLossScaleManager(128, enable_overflow_check=False)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w])
    train = scaler.build(global_step=gs)
    made = [op for op in graph.get_operations() if op not in before  # fetched reads only:
            and not op.name.startswith(("loss_scale/last_skip_read/",
                                        "loss_scale/recent_skips_read/"))]
    kinds = set(op.type for op in made)
    assert not kinds & {"Switch", "Merge", "If", "StatelessIf", "IsFinite", "IsInf", "IsNan"}
    assert not [op.name for op in made if "skipped_steps" in op.name and op.type.startswith(
        "AssignAdd")]
    with tf.Graph().as_default():
        w_ref, loss_ref = model()
        step = tf.train.GradientDescentOptimizer(0.1).minimize(loss_ref)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(3):
                sess.run(step)
            reference = sess.run(w_ref)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            assert sess.run([train.update_op, train.applied])[1]
        np.testing.assert_array_equal(sess.run(w), reference)
        assert sess.run([gs, train.skipped_steps]) == [3, 0]
