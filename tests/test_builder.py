"""MultiOptimizerLossScale against unscaled references and skip atomicity."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import LAST_SKIP, SKIPPED_STEPS, snapshot_globals
from graph_walk import gated_ops
from models import build_gan_step as _build
from models import two_group_gan


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
