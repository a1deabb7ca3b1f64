"""Misuses a real script makes of the builder, each refused at build time
with a sentence or made to do what the user meant (issue #20). References
are TF's own ops and unscaled twins."""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import models
import npu_lossscale as nl
from npu_lossscale.builder import CLIP_NORM_RANGE


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


def _bn_net(resource, collection_entries):
    """A linear layer and training-mode batch norm whose moving-average
    updates go to UPDATE_OPS as tf.layers puts them: under resource
    variables ``var.assign_sub`` returns a variable-like object (its ``op``
    the AssignSubVariableOp), under ref variables a tensor. Returns the
    loss, the poison placeholder, the moving statistics and the entries."""
    x = tf.constant(np.random.RandomState(0).normal(size=[8, 3]).astype(np.float32))
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    w = tf.get_variable("w", [3, 3], initializer=tf.constant_initializer(0.3),
                        use_resource=resource)
    h = tf.matmul(x * poison, w)
    mean, variance = tf.nn.moments(h, [0])
    moving = []
    for name, value, init in (("moving_mean", mean, tf.zeros_initializer()),
                              ("moving_variance", variance, tf.ones_initializer())):
        var = tf.get_variable(name, [3], trainable=False, initializer=init,
                              use_resource=resource)
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, var.assign_sub((var - value) * 0.1))
        moving.append(var)
    loss = tf.reduce_mean(tf.square(tf.nn.batch_normalization(h, mean, variance, None, None,
                                                              1e-3) - 1.0))
    entries = collection_entries(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
    return loss, poison, moving, entries


def _train_bn(resource, collection_entries, poison_value):
    """Two runs of update_op (the first clean); returns the moving stats
    after the first and the second, and the global step."""
    loss, poison, moving, entries = _bn_net(resource, collection_entries)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs, update_ops=entries)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op)
        first = sess.run(moving)
        sess.run(train.update_op, {poison: poison_value})
        return first, sess.run(moving), sess.run(gs)


WRAPS = {
    "collection": lambda ops: ops,
    "group": lambda ops: tf.group(*[getattr(op, "op", op) for op in ops]),
    "identities": lambda ops: [tf.identity(op) for op in ops],
    "group_of_groups": lambda ops: [tf.group(tf.group(getattr(ops[0], "op", ops[0])),
                                             getattr(ops[1], "op", ops[1]))],
}


@pytest.mark.parametrize("resource", [True, False])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_update_ops_wrapped_or_variable_like_are_gated(resource, wrap):
    """What the user meant: tf.group/tf.identity of the batch-norm updates,
    or the variable-like entries UPDATE_OPS holds under resource variables,
    run on applied steps (the same statistics as the bare updates) and not on
    a skipped one (an inf in the forward pass)."""
    with tf.Graph().as_default():
        reference = _train_bn(resource, WRAPS["collection"] if resource is False
                              else (lambda ops: [op.op for op in ops]), 1.0)
    with tf.Graph().as_default():
        first, second, steps = _train_bn(resource, WRAPS[wrap], 1.0)
    for ours, theirs in zip(first + second, reference[0] + reference[1]):
        np.testing.assert_array_equal(ours, theirs)
    assert steps == 2
    with tf.Graph().as_default():
        first, skipped, steps = _train_bn(resource, WRAPS[wrap], np.inf)
    for before, after in zip(first, skipped):
        np.testing.assert_array_equal(before, after)
    assert steps == 1


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


def test_tf_layers_batch_norm_update_ops_are_accepted_and_gated(graph):
    """The real thing where it exists (TF 2.15's tf.compat.v1.layers; Keras 3
    removed it in 2.16+): build() takes exactly what UPDATE_OPS holds, and a
    skipped step leaves the moving statistics alone."""
    try:
        batch_norm = tf.layers.batch_normalization
    except AttributeError:
        pytest.skip("tf.compat.v1.layers.batch_normalization needs Keras 2 (TF <= 2.15)")
    x = tf.constant(np.random.RandomState(0).normal(size=[8, 3]).astype(np.float32))
    poison = tf.placeholder_with_default(tf.constant(1.0), [])
    w = tf.get_variable("w", [3, 3], initializer=tf.constant_initializer(0.3))
    h = batch_norm(tf.matmul(x * poison, w), training=True)
    loss = tf.reduce_mean(tf.square(h - 1.0))
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    assert len(updates) == 2
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    train = scaler.build(update_ops=updates)
    moving = [v for v in tf.global_variables() if "moving_" in v.op.name]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run(moving)
        sess.run(train.update_op, {poison: np.inf})
        assert all(np.array_equal(a, b) for a, b in zip(sess.run(moving), start))
        sess.run(train.update_op)
        assert not np.array_equal(sess.run(moving)[0], start[0])


# -- update_ops wrappers and what they stand for (issue #24) ------------------------

def _sgd_step(scaler, loss, variables, name="net"):
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), var_list=variables, name=name)


def _counter_model():
    """A one-variable model whose loss a fed ``poison`` can make inf, and a
    counter update (``tf.assign_add``'s result). Returns (loss, w, poison,
    counter, update)."""
    w = tf.get_variable("w", [2], initializer=tf.ones_initializer())
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    loss = tf.reduce_sum(w * w) * poison
    counter = tf.get_variable("counter", [], initializer=tf.zeros_initializer(),
                              trainable=False)
    return loss, w, poison, counter, tf.assign_add(counter, 1.0)


def _applied_skipped_applied(train, poison, watched):
    """Runs update_op three times (the second with an inf loss); returns the
    values of ``watched`` after each run."""
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = []
        for factor in (1.0, np.inf, 1.0):
            sess.run(train.update_op, {poison: factor})
            values.append(sess.run(watched))
        return values


@pytest.mark.parametrize("gate", ["pivot", "cond"])
@pytest.mark.parametrize("wrap", sorted(models.UPDATE_WRAPPERS))
def test_updates_behind_any_wrapper_run_only_on_applied_steps(graph, wrap, gate):
    """tf.tuple (a RefIdentity under v1), check_numerics, stop_gradient, a
    tf.print or a constant under control_dependencies, and nestings of
    them: the counter they wrap moves on applied steps only (1, 1, 2 over
    applied, skipped, applied; it went 1, 2, 3 when the wrapper alone was
    gated), and the global step with it."""
    loss, w, poison, counter, update = _counter_model()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite",
                                        gate=gate)
    _sgd_step(scaler, loss, [w])
    step = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=step, update_ops=[models.UPDATE_WRAPPERS[wrap](update)])
    values = _applied_skipped_applied(train, poison, [counter, step])
    assert [list(v) for v in values] == [[1.0, 1], [1.0, 1], [2.0, 2]]


@pytest.mark.parametrize("gate", ["pivot", "cond"])
def test_an_update_around_the_forward_pass_gates_only_the_update(graph, gate):
    """The wrapper is an identity of a forward-pass value that reads the data
    pipeline's get-next op, a random op and a cond (no update in it), under a
    control dependency on the counter update. Only the update is gated: the
    iterator still advances on the skipped step (0, 1, 2), the random op and
    the cond still run, and the counter goes 1, 1, 2. No existing op but the
    update gets a control input."""
    x = tf.data.make_one_shot_iterator(
        tf.data.Dataset.range(10).map(lambda i: tf.cast(i, tf.float32))).get_next()
    noise = tf.random_uniform([], 0.0, 0.5)
    w = tf.get_variable("w", [2], initializer=tf.ones_initializer())
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    loss = tf.reduce_sum(w * w) * (x + 1.0) * poison
    counter = tf.get_variable("counter", [], initializer=tf.zeros_initializer(),
                              trainable=False)
    update = tf.assign_add(counter, 1.0)
    forward = tf.cond(noise < 1.0, lambda: x * 2.0, lambda: x) + noise
    with tf.control_dependencies([update]):
        entry = tf.identity(forward)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite",
                                        gate=gate)
    _sgd_step(scaler, loss, [w])
    existing = dict((op, list(op.control_inputs)) for op in graph.get_operations())
    train = scaler.build(update_ops=[entry])
    changed = [op for op, inputs in existing.items() if list(op.control_inputs) != inputs]
    assert changed == ([update.op] if gate == "pivot" else [])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for factor in (1.0, np.inf, 1.0):
            _, data, sample, finite = sess.run([train.update_op, x, noise, train.is_finite],
                                               {poison: factor})
            seen.append((data, finite, sess.run(counter)))
            assert 0.0 <= sample < 0.5
    assert seen == [(0.0, True, 1.0), (1.0, False, 1.0), (2.0, True, 2.0)]


def test_a_tf_function_that_updates_is_gated_whole(graph):
    """A graph-mode tf.function whose body updates the counter: its call op
    is the update (its whole body waits for the gate), 1, 1, 2. A resource
    variable: a function cannot assign a ref one."""
    loss, w, poison, _, _ = _counter_model()
    counter = tf.get_variable("calls", [], initializer=tf.zeros_initializer(),
                              trainable=False, use_resource=True)

    @tf.function(autograph=False)
    def count():
        counter.assign_add(1.0)
        return tf.constant(True)

    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    _sgd_step(scaler, loss, [w])
    train = scaler.build(update_ops=[tf.identity(count())])
    assert _applied_skipped_applied(train, poison, counter) == [1.0, 1.0, 2.0]


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


def _two_nets():
    x = tf.get_variable("x", [2], initializer=tf.ones_initializer())
    y = tf.get_variable("y", [2], initializer=tf.ones_initializer())
    return x, y, tf.reduce_sum(x * x), tf.reduce_sum(y * y)


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
