"""add(transform_grads_fn=...): TF-GAN's gradient hook, inside the decision.

The hook takes a group's list of unscaled (gradient, variable) pairs and
returns the list to apply (TF-GAN's and slim's signature). The references:
a float32 twin's gradients (tf.gradients), hand-computed weights, and the
bit-for-bit state before a skipped step.
"""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import SKIPPED_STEPS, snapshot_globals
from npu_lossscale import diagnostics
from npu_lossscale import seams
from models import two_group_gan


def _linear(name="w", w0=(1.0, 2.0), c0=(3.0, 4.0)):
    """A float16 loss ``w . c`` over a float32 ``w``: its gradient is ``c``
    (fed, default ``c0``), exact in float16 and at any power-of-two scale."""
    c = tf.placeholder_with_default(np.array(c0, np.float32), [2], name="c_" + name)
    w = tf.get_variable(name, initializer=np.array(w0, np.float32))
    loss = tf.cast(tf.reduce_sum(tf.cast(w, tf.float16) * tf.cast(c, tf.float16)), tf.float32)
    return c, w, loss


def _session():
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())
    return sess


# -- what the hook receives: TF-GAN's signature, the unscaled gradients --

def _twin_gradients():
    """The float32 twin's gradients of both losses (its own graph, same
    initial weights): dict from variable name to value."""
    with tf.Graph().as_default():
        model = two_group_gan(compute_dtype=tf.float32)
        variables = model.d_vars + model.g_vars
        grads = (tf.gradients(model.d_loss, model.d_vars)
                 + tf.gradients(model.g_loss, model.g_vars))
        with _session() as sess:
            values = sess.run(grads, model.feed)
        return dict((v.op.name, value) for v, value in zip(variables, values))


def test_the_fn_takes_and_returns_a_list_of_pairs_of_unscaled_gradients(graph):
    model = two_group_gan(compute_dtype=tf.float16)
    seen = {}

    def record(grads_and_vars):
        seen[grads_and_vars[0][1].op.name.split("/")[0]] = grads_and_vars
        return grads_and_vars

    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars, name="d",
               transform_grads_fn=record)
    scaler.add(model.g_loss, tf.train.AdamOptimizer(0.01), var_list=model.g_vars, name="g",
               transform_grads_fn=record)
    train = scaler.build()
    assert sorted(seen) == ["discriminator", "generator"]
    for name, variables in (("discriminator", model.d_vars), ("generator", model.g_vars)):
        pairs = seen[name]
        assert type(pairs) is list and all(type(pair) is tuple and len(pair) == 2
                                           for pair in pairs)
        assert [v for _, v in pairs] == variables
        assert all(isinstance(g, tf.Tensor) and g.dtype == tf.float32 for g, _ in pairs)
    fetched = [g for name in sorted(seen) for g, _ in seen[name]]
    names = [v.op.name for name in sorted(seen) for _, v in seen[name]]
    with _session() as sess:
        values = sess.run([train.update_op, fetched], model.feed)[1]
    twin = _twin_gradients()
    for name, value in zip(names, values):
        # float16 compute against float32: a few float16 ulps. The scaled
        # gradients would be 1024 times these.
        np.testing.assert_allclose(value, twin[name], rtol=2e-2, atol=1e-3, err_msg=name)
        assert np.abs(value).max() > 1e-2, name


# -- the check covers what it returns --

@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_output_for_finite_input_skips_the_step(graph, bad):
    """The fn's own inf or NaN, from finite gradients and loss, skips the
    step, the diagnosis names the fn (issue 44: it was
    ``gradients_overflowed``, the float16 gradients' reason), and the
    loss scale holds (issue 44: it backed off, as for an overflow)."""
    c, w, loss = _linear()
    factor = tf.placeholder_with_default(1.0, [], name="factor")
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10)
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager)
    scaler.add(loss, tf.train.AdamOptimizer(0.1), var_list=[w], name="net",
               transform_grads_fn=lambda pairs: [(g * factor, v) for g, v in pairs])
    train = scaler.build(global_step=gs)
    fetches = [train.update_op, train.is_finite, train.applied, train.diagnosis.skip_reason]
    with _session() as sess:
        assert sess.run(fetches)[1:] == [True, True, 0]  # Adam's slots now hold values
        before = snapshot_globals(sess)
        assert sess.run(fetches, {factor: bad})[1:] == [
            False, False, diagnostics.reasons_of(train).code("transform_grads_fn_not_finite")]
        after = snapshot_globals(sess)
        assert after.pop(SKIPPED_STEPS) == before.pop(SKIPPED_STEPS) + 1
        # The fn failed, not the scale: the manager's scale and counts stay.
        assert manager.state.op.name in before
        assert sorted(after) == sorted(before)
        assert {"w", "w/Adam", "w/Adam_1", "beta1_power", "beta2_power",
                "global_step"} <= set(before)
        for name in before:  # the weight, Adam's slots and powers, global_step
            assert np.array_equal(after[name], before[name]), name
        assert int(after["global_step"]) == 1
        skip = diagnostics.read_last_skip(sess, train)
        assert (skip.reason, skip.global_step) == ("transform_grads_fn_not_finite", 1)
        assert tuple(skip.groups) == ("net",) and not skip.variables
        assert "transform_grads_fn returned inf or NaN" in diagnostics.describe(skip)
        assert sess.run(fetches)[1:] == [True, True, 0]
        assert sess.run(gs) == 2


def test_a_nan_in_the_input_skips_before_the_fn_can_hide_it(graph):
    """A fn that maps NaN to 0 (tf.where) cannot make an overflowing step
    apply: the check of the gradients themselves still holds."""
    c, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net",
               transform_grads_fn=lambda pairs: [
                   (tf.where(tf.is_finite(g), g, tf.zeros_like(g)), v) for g, v in pairs])
    train = scaler.build()
    with _session() as sess:
        assert sess.run([train.update_op, train.is_finite], {c: [np.nan, 1.0]})[1] == False  # noqa: E712
        assert sess.run(w).tolist() == [1.0, 2.0]


def test_sparse_gradients_reach_the_fn_as_indexed_slices_and_are_checked(graph):
    # Rows 0 and 2 of the table are looked up: their gradient is 1 each;
    # SGD(0.5) takes them from 1 to 0.5.
    table = tf.get_variable("table", initializer=np.ones([4, 2], np.float32))
    loss = tf.reduce_sum(tf.nn.embedding_lookup(table, [0, 2]))
    factor = tf.placeholder_with_default(1.0, [], name="factor")
    seen = []

    def scale_rows(pairs):
        seen.extend(type(g) for g, _ in pairs)
        return [(tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape), v)
                for g, v in pairs]

    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[table],
               transform_grads_fn=scale_rows)
    train = scaler.build()
    assert seen == [tf.IndexedSlices]
    expected = [[0.5, 0.5], [1.0, 1.0], [0.5, 0.5], [1.0, 1.0]]
    with _session() as sess:
        assert sess.run([train.update_op, train.applied])[1]
        assert sess.run(table).tolist() == expected
        assert not sess.run([train.update_op, train.applied], {factor: np.nan})[1]
        assert sess.run(table).tolist() == expected


def test_per_group_policy_a_non_finite_output_skips_its_group_alone(graph):
    _, w_a, loss_a = _linear("w_a")
    _, w_b, loss_b = _linear("w_b")
    factor = tf.placeholder_with_default(1.0, [], name="factor")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10),
                                        skip_policy="per_group")
    scaler.add(loss_a, tf.train.GradientDescentOptimizer(0.5), var_list=[w_a], name="a",
               transform_grads_fn=lambda pairs: [(g * factor, v) for g, v in pairs])
    scaler.add(loss_b, tf.train.GradientDescentOptimizer(0.5), var_list=[w_b], name="b")
    train = scaler.build()
    with _session() as sess:
        decisions = dict((name, group.is_finite) for name, group in train.groups.items())
        applied, finite = sess.run([train.update_op, train.applied, decisions],
                                   {factor: np.inf})[1:]
        assert applied and finite == {"a": False, "b": True}
        assert np.array_equal(sess.run([w_a, w_b]), [[1.0, 2.0], [-0.5, 0.0]])


def test_on_the_register_with_accumulation(graph, saturation_mode):
    """The check of a transform's output is read from the values, so it
    builds inside the accumulation window's cond on the register too."""
    c, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10), backend="npu")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w],
               transform_grads_fn=lambda pairs: [(2.0 * g, v) for g, v in pairs])
    train = scaler.build(accumulation_steps=2)
    with _session() as sess:
        sess.run(train.update_op)
        assert sess.run([train.update_op, train.applied])[1]
        assert sess.run(w).tolist() == [-2.0, -2.0]


# -- clip_norm clips what the fn returns --

def test_clip_norm_clips_after_the_fn(graph):
    # The gradient is c = [3, 4]; the fn doubles it to [6, 8] (norm 10),
    # clip_norm=1 gives [0.6, 0.8], and SGD(1.0) subtracts it from [1, 2].
    # Clipping first would give [1.2, 1.6].
    c, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss, tf.train.GradientDescentOptimizer(1.0), var_list=[w], name="net",
               clip_norm=1.0, transform_grads_fn=lambda pairs: [(2.0 * g, v) for g, v in pairs])
    train = scaler.build()
    with _session() as sess:
        sess.run(train.update_op)
        np.testing.assert_allclose(sess.run(w), [0.4, 1.2], rtol=1e-6)


# -- with accumulation and with per-group ops --

def test_with_accumulation_the_fn_transforms_the_windows_mean(graph):
    # Micro-batch gradients [1, 2] and [3, 2]: their mean [2, 2], squared by
    # the fn, is [4, 4]; SGD(0.5) takes [1, 2] to [-1, 0]. Squaring each
    # micro-batch's gradient before the mean would give [5, 4].
    c, w, loss = _linear()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w], name="net",
               transform_grads_fn=lambda pairs: [(g * g, v) for g, v in pairs])
    train = scaler.build(global_step=gs, accumulation_steps=2)
    fetches = [train.update_op, train.applied, train.window_end]
    with _session() as sess:
        assert sess.run(fetches, {c: [1.0, 2.0]})[1:] == [False, False]
        assert sess.run(w).tolist() == [1.0, 2.0]
        assert sess.run(fetches, {c: [3.0, 2.0]})[1:] == [True, True]
        np.testing.assert_allclose(sess.run(w), [-1.0, 0.0], rtol=1e-6)
        assert sess.run(gs) == 1


def test_a_non_finite_output_at_the_windows_close_skips_the_window(graph):
    c, w, loss = _linear()
    factor = tf.placeholder_with_default(1.0, [], name="factor")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.5), var_list=[w], name="net",
               transform_grads_fn=lambda pairs: [(g * factor, v) for g, v in pairs])
    train = scaler.build(accumulation_steps=2)
    with _session() as sess:
        sess.run(train.update_op)
        assert sess.run([train.update_op, train.applied, train.diagnosis.skip_reason],
                        {factor: np.inf})[1:] == [
                            False, diagnostics.REASONS.index("gradients_overflowed")]
        assert sess.run(w).tolist() == [1.0, 2.0]


def test_per_group_ops_apply_each_groups_fn(graph):
    # Gradients [3, 4] for both; "a" doubles them, "b" negates them; SGD(0.5).
    _, w_a, loss_a = _linear("w_a")
    _, w_b, loss_b = _linear("w_b")
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(2.0 ** 10))
    scaler.add(loss_a, tf.train.GradientDescentOptimizer(0.5), var_list=[w_a], name="a",
               transform_grads_fn=lambda pairs: [(2.0 * g, v) for g, v in pairs])
    scaler.add(loss_b, tf.train.GradientDescentOptimizer(0.5), var_list=[w_b], name="b",
               transform_grads_fn=lambda pairs: [(-g, v) for g, v in pairs])
    train = scaler.build(per_group_ops=True)
    with _session() as sess:
        sess.run(train.per_group["a"])
        assert np.array_equal(sess.run([w_a, w_b]), [[-2.0, -2.0], [1.0, 2.0]])
        sess.run(train.per_group["b"])
        assert sess.run(w_b).tolist() == [2.5, 4.0]
        sess.run(train.update_op)
        assert np.array_equal(sess.run([w_a, w_b]), [[-5.0, -6.0], [4.0, 6.0]])


# -- refusals: at add() for what is no function, at build() for what it returns --

class _Halve(seams.GradientTransform):
    keeps_finite = True

    def transform(self, group, grads_and_vars):
        return [(0.5 * g, v) for g, v in grads_and_vars]


@pytest.mark.parametrize("value", [3, "clip", [lambda pairs: pairs]])
def test_refuses_what_is_not_callable(graph, value):
    _, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    with pytest.raises(TypeError, match=r"transform_grads_fn must be a function .* got %s\. "
                                        r"Pass e\.g\." % _escaped(value)):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                   transform_grads_fn=value)


def _escaped(value):
    return re.escape(repr(value))


@pytest.mark.parametrize("cls", [_Halve, dict])
def test_refuses_a_class(graph, cls):
    _, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    with pytest.raises(TypeError, match=r"transform_grads_fn=%s is a class; pass an instance"
                                        % _escaped(cls)):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w],
                   transform_grads_fn=cls)


def _other_variable_pairs(pairs):
    other = tf.get_variable("other", [2])
    return [(g, other) for g, _ in pairs]


@pytest.mark.parametrize("fn", [
    lambda pairs: None,
    lambda pairs: [g for g, _ in pairs],
    lambda pairs: [(None, v) for _, v in pairs],
    lambda pairs: [(g, v, 1) for g, v in pairs],
    _other_variable_pairs,
], ids=["none", "gradients_only", "none_gradient", "triples", "other_variable"])
def test_refuses_a_fn_that_returns_no_pairs_over_its_variables(graph, fn):
    _, w, loss = _linear()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0))
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[w], name="net",
               transform_grads_fn=fn)
    with pytest.raises(TypeError, match=r"^group 'net': transform_grads_fn returned .*, not a "
                                        r"list of \(gradient, variable\) pairs over the "
                                        r"variables it was given\. Return e\.g\. "):
        scaler.build()
