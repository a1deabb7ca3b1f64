"""The step's own cost (issue 25): what the cuts left out changes no number.

The backprop is seeded with the scale instead of differentiating
``loss * scale``; the skip branch inspects the unscaled gradients, so that
nothing but the check and the unscale reads a scaled gradient (the unscale
then runs in place); the dynamic managers' update has no growth-ceiling row
where the ceiling lies above the cap. Each test holds the new graph against
an independent reference: the gradients of the float32 product, TF's own
``DynamicLossScale``, the graph's consumers.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale import diagnostics
from npu_lossscale.core import gradients as nl_gradients

SCALE = 2.0 ** 12


def _model(dtype, width=160):
    """A float32 master weight of ``width**2`` elements (large: unscaled on
    its own, not packed) used in ``dtype``, and a scalar loss in ``dtype``."""
    rng = np.random.RandomState(3)
    w = tf.Variable(rng.normal(size=[width, width]).astype(np.float32) / width, name="w")
    b = tf.Variable(np.zeros([width], np.float32), name="b")
    x = tf.constant(rng.uniform(-1, 1, size=[8, width]).astype(np.float32))
    h = tf.tanh(tf.matmul(tf.cast(x, dtype), tf.cast(w, dtype)) + tf.cast(b, dtype))
    return tf.reduce_mean(tf.square(h)), [w, b]


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32])
def test_seeded_backprop_equals_the_gradients_of_the_scaled_loss(graph, dtype):
    """Bit for bit: the gradients the step applies are those of
    ``float32(loss) * scale``, times ``1 / scale``, computed by hand."""
    loss, var_list = _model(dtype)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=var_list, name="g")
    train = scaler.build()
    scale = tf.constant(SCALE, tf.float32)
    product = tf.cast(loss, tf.float32) * scale
    inverse = tf.reciprocal(scale)
    reference = [grad * inverse for grad in tf.gradients(product, var_list)]
    ours = [grad for grad, _ in train.grads_and_vars["g"]]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got, want = sess.run([ours, reference])
    for a, r in zip(got, want):
        assert np.any(a != 0.0)
        np.testing.assert_array_equal(a, r)


def test_no_scaled_loss_product_on_the_stock_path(graph):
    """The stock backprop differentiates the loss itself (seeded); a group
    with its own ``compute_gradients`` still gets the product."""
    loss, var_list = _model(tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
    scaler.add(loss, tf.train.AdamOptimizer(1e-3), var_list=var_list, name="g")
    scaler.build()
    names = [op.name for op in tf.get_default_graph().get_operations()]
    assert not [name for name in names if "scaled_loss" in name]
    assert [name for name in names if name.endswith("/seed")]


def test_only_the_check_and_the_unscale_read_a_scaled_gradient(graph):
    """A tensor a skip branch reads is held until the gate decides; a
    scaled gradient held so could not be unscaled in place. On is_finite the
    branch reads the unscaled gradients; the diagnosis still names the
    variable that overflowed."""
    loss, var_list = _model(tf.float16)
    # A finite loss whose scaled gradients overflow float16 when fed 60000.
    poison = tf.placeholder_with_default(tf.constant(1.0, tf.float16), [])
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
    scaler.add(loss * poison, tf.train.AdamOptimizer(1e-3), var_list=var_list, name="g")
    train = scaler.build()
    (kernel, w), = [(grad, var) for grad, var in train.grads_and_vars["g"]
                    if var is var_list[0]]
    assert kernel.op.type == "Mul"
    scaled = [t for t in kernel.op.inputs if t.dtype == tf.float32 and t.shape.ndims == 2]
    assert len(scaled) == 1
    readers = sorted(op.type for op in scaled[0].consumers())
    assert readers == ["Mul", "Sum"], readers
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run(train.applied)
        sess.run(train.update_op, {poison: np.float16(60000.0)})
        skip = diagnostics.read_last_skip(sess, train)
    assert skip.reason == "gradients_overflowed"
    assert w.op.name in skip.variables


@pytest.mark.parametrize("multiplier, binds", [(2.0, False), (1000.0, True)])
def test_the_ceiling_row_is_left_out_only_where_it_cannot_bind(graph, multiplier, binds):
    """Above the 2**126 cap the ceiling changes no update, and the update
    has two ops fewer (a Less and a Select); below it (multiplier 1000) it
    keeps a scale whose growth would overflow, as TF's DynamicLossScale.
    Both against TF's rule from the largest scales up to the cap."""
    ours = nl.DynamicLossScaleManager(initial_scale=2.0 ** 125, growth_steps=1,
                                      multiplier=multiplier)
    theirs = tf.mixed_precision.DynamicLossScale(initial_loss_scale=2.0 ** 125,
                                                 increment_period=1, multiplier=multiplier)
    update = ours.update_loss_scale(tf.constant(True))
    grown = theirs.update([tf.constant([1.0])])[0]
    scope = update.name.rsplit("/", 1)[0]
    types = [op.type for op in tf.get_default_graph().get_operations()
             if op.name.startswith(scope + "/")]
    assert sum(t.startswith("Select") for t in types) == (3 if binds else 2)
    assert types.count("Less") == (2 if binds else 1)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run([update, grown])
        got, tf_scale = sess.run([ours.loss_scale, theirs()])
    if binds:  # 2**125 * 1000 overflows float32: both keep the scale
        assert float(got) == float(tf_scale) == 2.0 ** 125
    else:  # TF grows to 2**126; so do we, at the cap
        assert float(got) == float(tf_scale) == 2.0 ** 126


def test_seed_casts_only_a_non_float32_loss(graph):
    scale = nl_gradients.Scale(tf.constant(SCALE), None, False)
    assert nl_gradients.seed(tf.constant(1.0), scale) is scale.value
    half = nl_gradients.seed(tf.constant(1.0, tf.float16), scale)
    assert half.dtype == tf.float16 and half.op.type == "Cast"
