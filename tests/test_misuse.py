"""Misuses a real script makes of the builder, each refused at build time
with a sentence or made to do what the user meant (issue #20). References
are TF's own ops and unscaled twins."""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from npu_lossscale.builder import CLIP_NORM_RANGE
from models import bn_net as _bn_net
from models import counter_model as _counter_model
from models import sgd_group as _sgd_step
from models import two_nets as _two_nets


def _clip_in_tf(clip_norm):
    """TF's own clip_by_global_norm of a gradient of norm 5 (float32)."""
    with tf.Graph().as_default():
        grad = tf.constant([3.0, 4.0])
        clipped, _ = tf.clip_by_global_norm([grad], clip_norm)
        with tf.Session() as sess:
            return sess.run(clipped[0])


def test_clip_norm_range_is_where_tfs_clip_works():
    """The bounds are float32's normal range for clip_norm and its
    reciprocal. At the top TF's clip leaves a norm-5 gradient unchanged; one
    binade higher 1 / clip_norm is subnormal, flushed to 0, and the gradient
    comes out 0. Below the bottom clip_norm itself is subnormal (the issue's
    1e-40) and TF zeroes the gradient."""
    low, high = CLIP_NORM_RANGE
    assert low == np.finfo(np.float32).tiny and high == 1 / low
    assert np.array_equal(_clip_in_tf(high), [3.0, 4.0])
    assert not np.any(_clip_in_tf(high * 2))
    assert not np.any(_clip_in_tf(1e-40))


@pytest.mark.parametrize("clip_norm", [1e39, 3e38, 1e38, 1e-40, 2.0 ** 127, 2.0 ** -127])
def test_clip_norm_outside_float32s_normal_range_is_refused(graph, clip_norm):
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    loss = tf.reduce_sum(x * x)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"clip_norm must be in \[.*got %s\. .*normal float32"
                       % re.escape(repr(clip_norm))):
        scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=[x],
                   clip_norm=clip_norm)
    assert len(graph.get_operations()) == before


def test_clip_norm_at_the_top_of_the_range_trains_as_unclipped(graph):
    """A huge but representable clip_norm clips nothing: the weights equal
    an unclipped twin's (hand-computed SGD step on x*x: x - 0.1 * 2x)."""
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(tf.reduce_sum(x * x), tf.train.GradientDescentOptimizer(0.1), var_list=[x],
               clip_norm=CLIP_NORM_RANGE[1])
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        np.testing.assert_array_equal(sess.run(x), np.float32([0.8, 0.8]))
        assert sess.run(gs) == 1


def test_update_ops_from_a_cond_are_refused(graph):
    """A tf.cond around the updates hides them from the gate: refused, no op
    made."""
    loss, _, _, updates = _bn_net(True, lambda ops: [op.op for op in ops])
    training = tf.placeholder_with_default(True, [])
    wrapped = tf.cond(training, lambda: tf.group(*updates), tf.no_op)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match="tf.cond or tf.while_loop.*without the cond"):
        scaler.build(update_ops=[wrapped])
    assert len(graph.get_operations()) == before


def test_update_ops_that_update_nothing_are_refused(graph):
    loss, _, moving, _ = _bn_net(True, lambda ops: ops)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    with pytest.raises(ValueError, match="updates no variable"):
        scaler.build(update_ops=[tf.identity(moving[0])])
    with pytest.raises(ValueError, match="updates no variable"):
        scaler.build(update_ops=[tf.no_op()])


# -- update_ops wrappers and what they stand for (issue #24) ------------------------


def test_updates_made_inside_a_cond_are_refused(graph):
    """The update is made in the cond's branch (a Switch/Merge frame under
    v1, the If's branch function under v2): refused, naming the cond."""
    loss, w, _, counter, _ = _counter_model()
    training = tf.placeholder_with_default(True, [])
    entry = tf.cond(training, lambda: tf.identity(tf.assign_add(counter, 1.0)),
                    lambda: tf.constant(0.0))
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(scaler, loss, [w])
    before = len(graph.get_operations())
    with pytest.raises(ValueError, match=r"through a tf.cond or tf.while_loop \(op 'cond.*"
                                         r"without the cond"):
        scaler.build(update_ops=[entry])
    assert len(graph.get_operations()) == before


def test_another_steps_update_op_is_refused_as_such(graph):
    """Another builder's update_op, or a LossScaleOptimizer's train op, given
    as update_ops: the message says what it is (not a tf.cond the user never
    wrote) and the fix; no op is made."""
    x, y, loss_x, loss_y = _two_nets()
    z = tf.get_variable("z", [2], initializer=tf.ones_initializer())
    first = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(first, loss_x, [x], name="x")
    other_builder = first.build().update_op
    other_optimizer = nl.LossScaleOptimizer(
        tf.train.GradientDescentOptimizer(0.1), nl.FixedLossScaleManager(8.0),
        backend="is_finite").minimize(tf.reduce_sum(z * z), var_list=[z])
    for other in (other_builder, other_optimizer, tf.group(other_builder)):
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0),
                                            backend="is_finite")
        _sgd_step(scaler, loss_y, [y], name="y")
        before = len(graph.get_operations())
        with pytest.raises(ValueError, match=r"update_ops entry %r runs another training "
                                             r"step .*in its own session.run" % other.name):
            scaler.build(update_ops=[other])
        assert len(graph.get_operations()) == before


@pytest.mark.parametrize("form", ["argument", "entry", "group_entry"])
def test_update_ops_given_by_name_are_a_type_error(graph, form):
    """An op name (a string) is no op: named in full, with the two fixes (it
    used to be iterated and echoed as its first character)."""
    loss, w, _, _, update = _counter_model()
    name = update.op.name
    value = {"argument": name, "entry": [name], "group_entry": {"net": [name]}}[form]
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(scaler, loss, [w])
    before = len(graph.get_operations())
    with pytest.raises(TypeError, match=r"not names, got the string %s\. Pass "
                                        r"tf.get_default_graph\(\).get_operation_by_name"
                                        % re.escape(repr(name))):
        scaler.build(update_ops=value)
    assert len(graph.get_operations()) == before
