"""MultiOptimizerLossScale against unscaled references and skip atomicity."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import LAST_SKIP, SKIPPED_STEPS, snapshot_globals
from graph_walk import gated_ops
from models import two_group_gan


def _build(model, manager, backend="is_finite", g_opt=None, d_opt=None):
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(manager, backend=backend)
    scaler.add(model.d_loss, d_opt or tf.train.AdamOptimizer(0.01), var_list=model.d_vars,
               name="discriminator")
    scaler.add(model.g_loss, g_opt or tf.train.AdamOptimizer(0.02), var_list=model.g_vars,
               name="generator")
    return scaler.build(global_step=gs), gs


def _run_builder(steps, scale):
    with tf.Graph().as_default():
        model = two_group_gan()
        train, gs = _build(model, nl.FixedLossScaleManager(scale))
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(steps):
                assert sess.run([train.update_op, train.is_finite], model.feed)[1]
            return snapshot_globals(sess)


def _run_reference(steps):
    """Unscaled: every group's gradients first, then both applies."""
    with tf.Graph().as_default():
        model = two_group_gan()
        gs = tf.train.get_or_create_global_step()
        d_opt, g_opt = tf.train.AdamOptimizer(0.01), tf.train.AdamOptimizer(0.02)
        d_gv = d_opt.compute_gradients(model.d_loss, var_list=model.d_vars)
        g_gv = g_opt.compute_gradients(model.g_loss, var_list=model.g_vars)
        with tf.control_dependencies([g for g, _ in d_gv + g_gv]):
            apply_d = d_opt.apply_gradients(d_gv, name="discriminator")
            apply_g = g_opt.apply_gradients(g_gv, name="generator")
        with tf.control_dependencies([apply_d, apply_g]):
            train = tf.assign_add(gs, 1)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(steps):
                sess.run(train, model.feed)
            return snapshot_globals(sess)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 10])
def test_bit_identical_to_unscaled_reference_over_10_adam_steps(scale):
    ours = _run_builder(10, scale)
    assert ours.pop(SKIPPED_STEPS) == 0  # the builder's own counter: no skip
    ref = _run_reference(10)
    assert set(ours) == set(ref)  # same weights, Adam slots, beta powers, step
    for name in ref:
        assert np.array_equal(ours[name], ref[name]), name
    assert ours["global_step"] == 10
    moved = _run_builder(0, scale)
    assert not np.array_equal(moved["generator/w"], ours["generator/w"])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["input", "generator_only"])
def test_skipped_step_changes_nothing_but_the_manager(graph, bad, where):
    model = two_group_gan()
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 8, growth_steps=100)
    train, gs = _build(model, manager)
    manager_state = {v.op.name for v in manager.variables} | {SKIPPED_STEPS}
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, model.feed)  # one good step creates Adam state
        before = snapshot_globals(sess)
        feed = dict(model.feed)
        if where == "input":
            x = feed[model.x].copy()
            x[0, 0] = bad
            feed[model.x] = x
        else:
            feed[model.poison_g] = bad  # only the generator's gradients break
        finite, used = sess.run([train.is_finite, train.loss_scale, train.update_op], feed)[:2]
        after = snapshot_globals(sess)
    assert not finite
    assert used == 2.0 ** 8
    for name in before:
        if name in manager_state:
            continue
        assert np.array_equal(before[name], after[name], equal_nan=True), name
    state_name = manager.state.op.name
    assert after[state_name][0] == 2.0 ** 7  # only the manager moved, by its rule
    assert after["global_step"] == 1
    assert (before[SKIPPED_STEPS], after[SKIPPED_STEPS]) == (0, 1)  # and the skip count


# Ops that change state: apply kernels, assigns (ref and resource), and the
# increments.
_MUTATING = ("Apply", "Assign", "ScatterAdd", "ScatterSub", "ScatterUpdate")


@pytest.mark.parametrize("policy", ["all", "per_group"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_every_state_change_is_behind_the_gate(graph, policy, clip):
    """The apply gate is a Switch, not a cond: every op apply_gradients makes
    must depend on its true pivot, or it would run on a skipped step. Outside
    the gate there may only be variable initialisers (slots and beta powers
    are made under init_scope, as a cond would lift them) and the manager."""
    model = two_group_gan()
    manager = nl.DynamicLossScaleManager()
    scaler = nl.MultiOptimizerLossScale(manager, skip_policy=policy)
    scaler.add(model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars, name="d",
               clip_norm=clip)
    scaler.add(model.g_loss, tf.train.MomentumOptimizer(0.1, 0.9), var_list=model.g_vars,
               name="g", clip_norm=clip)
    step = tf.train.get_or_create_global_step()
    scaler.build(global_step=step)
    inside = gated_ops(graph)
    initialisers = {v.initializer for v in tf.global_variables()}
    # Library state that must move on skipped steps too: the manager's
    # state, the skipped-steps counter and the last-skip record (written
    # behind the gate's false side).
    ungated = [v.op for v in manager.variables] + [
        op for op in graph.get_operations() if op.name in (SKIPPED_STEPS, LAST_SKIP)]
    outside = [op for op in graph.get_operations()
               if any(m in op.type for m in _MUTATING) and op not in inside
               and op not in initialisers and op.inputs[0].op not in ungated]
    if policy == "per_group":
        # One gate per group; the step advances by "any group applied", after them.
        assert [op.inputs[0].op for op in outside] == [step.op]
    else:
        assert [op.name for op in outside] == []
    gated_types = {op.type for op in inside}
    assert any("Adam" in t for t in gated_types) and any("Momentum" in t for t in gated_types)
    # Nothing the initialisers need is gated: they run without the decision.
    assert not any(op in inside for op in initialisers)


def test_global_step_counts_applied_steps_only(graph):
    model = two_group_gan()
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 8)
    train, gs = _build(model, manager)
    pattern = [True, False, True, True, False, False, True]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for ok in pattern:
            feed = dict(model.feed)
            if not ok:
                feed[model.poison_g] = np.inf
            assert sess.run([train.update_op, train.is_finite], feed)[1] == ok
        assert sess.run(gs) == sum(pattern)


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


def test_grads_and_vars_are_the_unscaled_gradients(graph):
    model = two_group_gan()
    train, _ = _build(model, nl.FixedLossScaleManager(2.0 ** 12))
    plain = tf.gradients(model.d_loss, model.d_vars) + tf.gradients(model.g_loss, model.g_vars)
    ours = [g for g, _ in train.grads_and_vars["discriminator"]] + \
           [g for g, _ in train.grads_and_vars["generator"]]
    assert [v for _, v in train.grads_and_vars["generator"]] == model.g_vars
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        a, b = sess.run([ours, plain], model.feed)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_variable_the_loss_does_not_reach_is_left_out(graph):
    model = two_group_gan()
    unused = tf.get_variable("unused", [3], initializer=tf.zeros_initializer())
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="is_finite")
    scaler.add(model.d_loss, tf.train.GradientDescentOptimizer(0.1),
               var_list=model.d_vars + [unused], name="d")
    train = scaler.build()
    assert [v for _, v in train.grads_and_vars["d"]] == model.d_vars
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.update_op, model.feed)
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


def test_disabled_overflow_check_applies_every_step(graph):
    model = two_group_gan()
    train, gs = _build(model, nl.FixedLossScaleManager(1, enable_overflow_check=False))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = dict(model.feed)
        feed[model.poison_g] = np.inf
        assert sess.run([train.is_finite, train.update_op], feed)[0]
        assert sess.run(gs) == 1
        assert np.isnan(sess.run(model.g_vars[0])).any()  # unguarded, as asked


class _ProtocolOnlyManager(object):
    """The bare protocol: no base class, a scale of 4, counts its updates."""

    def __init__(self):
        self.updates = tf.Variable(0, trainable=False, name="updates")

    def get_loss_scale(self):
        return tf.constant(4.0)

    def update_loss_scale(self, finite_grads):
        return tf.assign_add(self.updates, tf.cast(finite_grads, tf.int32))


def test_any_object_with_the_protocol_is_accepted(graph):
    model = two_group_gan()
    manager = _ProtocolOnlyManager()
    train, gs = _build(model, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            sess.run(train.update_op, model.feed)
        assert sess.run([manager.updates, gs, train.loss_scale], model.feed) == [2, 2, 4.0]


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
