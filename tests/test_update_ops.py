"""The ``update_ops`` argument of ``build()`` (npu_lossscale/core/update_ops.py):
what an entry stands for (the variable updates behind any wrapper, a
variable-like, a tf.function's call) runs on applied steps only. Its
refusals are in test_misuse.py."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import models
import npu_lossscale as nl
from models import bn_net as _bn_net
from models import counter_model as _counter_model
from models import sgd_group as _sgd_step


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


def test_an_update_op_of_two_groups_runs_with_each_applied_per_group_step(gan):
    """ModelZoo's DCGAN runs every batch-norm update with both networks' runs:
    with per_group_ops an op may be listed for both groups. Each group's step
    runs a copy of it when it applies, none when it skips, and update_op
    runs it once; without per_group_ops the repeat is still refused."""
    counter = tf.Variable(0.0, trainable=False, name="bn_counter")
    bump = tf.assign_add(counter, 1.0).op
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    models.add_gan_groups(scaler, gan)
    train = scaler.build(per_group_ops=True, update_ops={"d": [bump], "g": [bump]})
    poisoned = dict(gan.feed)
    poisoned[gan.poison_g] = np.inf
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for fetch, feed in ((train.per_group["d"], gan.feed), (train.per_group["g"], gan.feed),
                            (train.per_group["g"], poisoned), (train.update_op, gan.feed)):
            sess.run(fetch, feed)
            seen.append(sess.run(counter))
    assert seen == [1.0, 2.0, 2.0, 3.0]


def test_an_update_op_of_two_groups_needs_per_group_ops(gan):
    counter = tf.Variable(0.0, trainable=False, name="bn_counter")
    bump = tf.assign_add(counter, 1.0).op
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(1.0), backend="is_finite")
    models.add_gan_groups(scaler, gan)
    with pytest.raises(ValueError, match="listed for two groups.*per_group_ops=True"):
        scaler.build(update_ops={"d": [bump], "g": [bump]})
