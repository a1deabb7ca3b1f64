"""What real training scripts need: alternating per-group runs, batch-norm
updates under the gate, callable losses and the register's hygiene.
References are unscaled twins and hand counts."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import (SKIPPED_STEPS, ops_not_after, partition_nodes_not_after,
                      snapshot_globals)
from models import add_gan_groups, two_group_gan
from models import batch_norm as _batch_norm

SCALE = 2.0 ** 10  # a power of two: scaling and unscaling are exact


def _alternating_ours(steps, poison_at=None):
    with tf.Graph().as_default():
        model = two_group_gan()
        gs = tf.train.get_or_create_global_step()
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE),
                                            backend="is_finite")
        add_gan_groups(scaler, model)
        train = scaler.build(global_step=gs, per_group_ops=True)
        applied = []
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(steps):
                for name in ("d", "g"):
                    feed = dict(model.feed)
                    if (step, name) == poison_at:
                        feed[model.poison_g] = np.inf
                    sess.run(train.per_group[name], feed)
                    applied.append(sess.run(gs))
            state = snapshot_globals(sess)
            return state, applied


def _alternating_reference(steps, skip=None):
    """Unscaled: run D's update, then G's, each with its own global step +1."""
    with tf.Graph().as_default():
        model = two_group_gan()
        gs = tf.train.get_or_create_global_step()

        def update(loss, var_list, name):
            # The twin multiplies its loss by a unit scale, as every scaled
            # step does: on this model TF's backprop of `loss` and of
            # `loss * 1.0` differ by one ulp in one gradient (measured), so
            # the bare loss would not be a bit-exact reference for any
            # loss-scaling scheme.
            grads = tf.gradients(loss * tf.constant(1.0), var_list, gate_gradients=True)
            return tf.train.AdamOptimizer(0.01).apply_gradients(zip(grads, var_list), gs,
                                                                name=name)

        d_train = update(model.d_loss, model.d_vars, "d")
        g_train = update(model.g_loss, model.g_vars, "g")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(steps):
                for name, op in (("d", d_train), ("g", g_train)):
                    if (step, name) != skip:
                        sess.run(op, model.feed)
            return snapshot_globals(sess)


def test_alternating_per_group_runs_match_an_unscaled_twin_bit_for_bit():
    ours, _ = _alternating_ours(5)
    assert ours.pop(SKIPPED_STEPS) == 0
    # The per-run claims (claims.py) live in no collection: not global state.
    assert not any(name.startswith("loss_scale/claims") for name in ours)
    ref = _alternating_reference(5)
    assert set(ours) == set(ref)
    for name in ref:
        assert np.array_equal(ours[name], ref[name]), name


def test_an_overflowing_alternating_run_skips_only_that_group_once():
    ours, steps = _alternating_ours(4, poison_at=(2, "g"))
    assert ours.pop(SKIPPED_STEPS) == 1
    # global_step counts applied group runs: the poisoned G run did not move it.
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7]
    ref = _alternating_reference(4, skip=(2, "g"))
    for name in ref:
        assert np.array_equal(ours[name], ref[name]), name


def test_joint_loop_still_works_beside_per_group_ops(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(per_group_ops=True)
    assert sorted(train.per_group) == ["d", "g"]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]


# -- batch normalization -------------------------------------------------------


def _bn_model():
    x = tf.placeholder(tf.float32, [8, 4], name="x")
    poison = tf.placeholder_with_default(tf.constant(1.0), [], name="poison")
    w = tf.get_variable("w", [4, 4], initializer=tf.constant_initializer(0.3))
    h = _batch_norm(tf.matmul(x * poison, w), name="bn")
    loss = tf.reduce_mean(tf.square(h - 1.0)) + tf.reduce_mean(tf.square(w))
    feed = {x: np.random.RandomState(0).normal(size=[8, 4]).astype(np.float32)}
    return x, poison, loss, feed


def _bn_run(use_builder, poison_steps=(), pass_update_ops=True):
    with tf.Graph().as_default():
        tf.set_random_seed(0)
        _, poison, loss, feed = _bn_model()
        updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
        assert updates
        opt = tf.train.GradientDescentOptimizer(0.1)
        if use_builder:
            scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE),
                                                backend="is_finite")
            scaler.add(loss, opt, var_list=tf.trainable_variables(), name="net")
            if pass_update_ops:
                train = scaler.build(update_ops=updates).update_op
            else:  # what a port that keeps the TF1 idiom does
                with tf.control_dependencies(updates):
                    train = tf.group(scaler.build().update_op)
        else:
            with tf.control_dependencies(updates):
                train = opt.minimize(loss)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(4):
                run_feed = dict(feed)
                if step in poison_steps:
                    if not use_builder:
                        continue  # the reference simply does not run the step
                    run_feed[poison] = np.inf
                sess.run(train, run_feed)
            return dict((v.op.name, sess.run(v)) for v in tf.global_variables()
                        if "moving_" in v.op.name or v.op.name in ("w", "bn/gamma", "bn/beta"))


def test_update_ops_under_the_gate_match_an_unscaled_twin():
    ours, ref = _bn_run(True), _bn_run(False)
    for name in ref:
        assert np.array_equal(ours[name], ref[name]), name


def test_update_ops_under_the_gate_are_untouched_by_a_skipped_step():
    ours, ref = _bn_run(True, poison_steps=(2,)), _bn_run(False, poison_steps=(2,))
    for name in ref:
        assert np.all(np.isfinite(ours[name])), name
        assert np.array_equal(ours[name], ref[name]), name


def test_without_update_ops_a_skip_poisons_the_moving_statistics():
    """Why the argument exists: the TF1 idiom runs them on skipped steps too."""
    ours = _bn_run(True, poison_steps=(2,), pass_update_ops=False)
    assert not np.all(np.isfinite(ours["bn/moving_mean"]))


def test_update_ops_by_group_with_per_group_ops(graph):
    _, _, loss, _ = _bn_model()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.1), name="net")
    with pytest.raises(ValueError, match="dict"):
        scaler.build(update_ops=tf.get_collection(tf.GraphKeys.UPDATE_OPS), per_group_ops=True)
    with pytest.raises(ValueError, match="'other'"):
        scaler.build(update_ops={"other": []}, per_group_ops=True)
    train = scaler.build(update_ops={"net": tf.get_collection(tf.GraphKeys.UPDATE_OPS)},
                         per_group_ops=True)
    assert "net" in train.per_group


# -- callables, the counter --------------------------------------------------------

def test_add_takes_a_callable_loss(graph):
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    scaler.add(lambda: model.d_loss, tf.train.AdamOptimizer(), var_list=model.d_vars)
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run([train.update_op, train.is_finite], model.feed)[1]


# -- the register's hygiene (saturation mode) ----------------------------------------

def test_an_eval_overflow_never_reaches_the_next_step(graph, saturation_mode):
    """An overflow in a run that reads no status stays in the register (the
    real register is sticky until cleared, tf_adapter
    ops/aicore/npu_mixed_precesion_ops.cc: only NpuClearFloatStatus[V2] sets
    it to 0). The next step clears it before its first op, unasked."""
    from npu_bridge import _emulation
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8), backend="npu")
    add_gan_groups(scaler, model)
    gs = tf.train.get_or_create_global_step()
    train = scaler.build(global_step=gs)
    peek = _emulation.register_tensor(graph)
    evaluation = model.g_loss  # an eval fetch: float16 ops, no status read
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    [clear] = [op.name for op in graph.get_operations()
               if _emulation.shim_op_type(op) in _emulation.CLEAR_OP_TYPES]
    traced = tf.RunOptions(output_partition_graphs=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(3):
            metadata = tf.RunMetadata()
            sess.run(evaluation, poison, options=traced, run_metadata=metadata)
            # The eval run ran the clear first too (grappler kept the order).
            assert partition_nodes_not_after(metadata, clear) == []
            assert sess.run(peek)[0] == 1  # its overflow is left in the register
            assert sess.run([train.update_op, train.is_finite], model.feed)[1]
        assert sess.run(gs) == 3


def _fetched_together(make_steps, runs=12):
    """Runs every step of ``make_steps(model)`` in each of ``runs`` runs of
    one session.run, with the generator's loss overflowing (call it under
    the ``saturation_mode`` fixture). Returns whether G's and D's weights ever changed, and the graph's
    register clears and reads."""
    from npu_bridge import _emulation
    model = two_group_gan(compute_dtype=tf.float16)
    steps = make_steps(model)
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    graph = tf.get_default_graph()
    reads = [op for op in graph.get_operations()
             if _emulation.shim_op_type(op) in _emulation.READ_OP_TYPES]
    clears = [op for op in graph.get_operations()
              if _emulation.shim_op_type(op) in _emulation.CLEAR_OP_TYPES]
    read_names = set(op.name for op in reads)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run(model.g_vars + model.d_vars)
        metadata = tf.RunMetadata()
        sess.run(steps, poison, options=tf.RunOptions(output_partition_graphs=True),
                 run_metadata=metadata)
        # As run, after grappler: the clear precedes every read's computation.
        assert partition_nodes_not_after(metadata, clears[0].name, read_names.__contains__) == []
        for _ in range(runs - 1):
            sess.run(steps, poison)
        end = sess.run(model.g_vars + model.d_vars)
        # The same runs without the overflow do train G: the skips above are
        # the overflow's, not a step that never applies.
        sess.run(steps, model.feed)
        clean = sess.run(model.g_vars)
    changed = [not np.array_equal(a, b) for a, b in zip(start, end)]
    assert all(not np.array_equal(a, b) for a, b in zip(end[:2], clean))
    return changed[:2], reads, clears


def _one_step_twin(fetch_name, feed_poison=False):
    """The weights after one run of ``per_group[fetch_name]`` from the start."""
    with tf.Graph().as_default():
        model = two_group_gan()
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE),
                                            backend="is_finite")
        add_gan_groups(scaler, model)
        train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                             per_group_ops=True)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            start = sess.run(model.g_vars + model.d_vars)
            sess.run(train.per_group[fetch_name] if fetch_name else train.update_op,
                     model.feed)
            return start, sess.run(model.g_vars + model.d_vars)


@pytest.mark.parametrize("fetch", [("g", None), ("d", "g"), ("d", "g", None)])
def test_step_ops_fetched_together_fail_the_run_and_never_apply_twice(graph, fetch):
    """per_group["g"] with update_op (or two per-group ops) in one
    session.run would apply G twice. The run fails with the message, whatever
    order the executor picks; at most one of the fetched steps applied (the
    weights equal the start or a one-step twin); the next run with one step
    op trains normally."""
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(global_step=gs, per_group_ops=True)
    fetches = [train.per_group[name] if name else train.update_op for name in fetch]
    once = dict((name, _one_step_twin(name)[1]) for name in fetch)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run(model.g_vars + model.d_vars)
        for _ in range(3):
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="ran two step ops that both update"):
                sess.run(fetches, model.feed)
            after = sess.run(model.g_vars + model.d_vars)
            same = [np.array_equal(a, b) for a, b in zip(after, start)]
            if not all(same):  # one step op got through before the other failed
                assert any(all(np.array_equal(a, b) for a, b in zip(after, twin))
                           for twin in once.values())
                assert sess.run(gs) == 1
                break
        else:
            assert sess.run(gs) == 0
        # One step op per run works again, and applies once.
        before = sess.run(gs)
        sess.run(train.per_group["g"], model.feed)
        assert sess.run(gs) == before + 1


def test_step_ops_fetched_together_on_the_register_fail_and_never_miss_an_overflow(
        graph, saturation_mode):
    """The same misuse on the float-status register with G overflowing: the
    run fails, G never moves, and the graph still has one clear that every
    read's computation follows (no read clears)."""
    model = two_group_gan(compute_dtype=tf.float16)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="npu")
    add_gan_groups(scaler, model)
    train = scaler.build(global_step=tf.train.get_or_create_global_step(),
                         per_group_ops=True)
    from npu_bridge import _emulation
    reads = [op for op in graph.get_operations()
             if _emulation.shim_op_type(op) in _emulation.READ_OP_TYPES]
    assert len(reads) == 3
    assert [ops_not_after(read, train.clear_status) for read in reads] == [[], [], []]
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = sess.run(model.g_vars)
        for _ in range(5):
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="Fetch one of them per session.run"):
                sess.run([train.per_group["d"], train.per_group["g"], train.update_op],
                         poison)
        assert all(np.array_equal(a, b) for a, b in zip(sess.run(model.g_vars), start))
        sess.run(train.per_group["g"], poison)  # alone: skips
        assert all(np.array_equal(a, b) for a, b in zip(sess.run(model.g_vars), start))


def test_two_loss_scale_optimizers_fetched_together_never_miss_an_overflow(graph,
                                                                          saturation_mode):
    """Seed 003 with this library's wrapper: two LossScaleOptimizers in one
    session.run on the register (warned about at build time). They share
    the graph's one clear, so G's overflow is never missed."""
    def make_steps(model):
        d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01),
                                      nl.FixedLossScaleManager(8.0), backend="npu")
        g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01),
                                      nl.FixedLossScaleManager(8.0), backend="npu")
        d_train = d_opt.minimize(model.d_loss, var_list=model.d_vars)
        with pytest.warns(UserWarning, match="cannot tell their overflows apart"):
            g_train = g_opt.minimize(model.g_loss, var_list=model.g_vars)
        return [d_train, g_train]

    g_changed, reads, clears = _fetched_together(make_steps)
    assert g_changed == [False, False]
    assert len(reads) == 2 and len(clears) == 1
    [clear] = [op for op in tf.get_default_graph().get_operations()
               if op.name == "loss_scale/clear_status"]
    assert [ops_not_after(read, clear) for read in reads] == [[], []]


def test_per_group_ops_run_their_own_update_ops_and_the_joint_op_all(graph):
    """With per_group_ops the joint step holds the original update ops and
    each per-group step runs copies of its own: each runs alone, with only
    its own feed, and each moves its own statistics once per applied run."""
    a = tf.placeholder(tf.float32, [4, 2], name="a")
    b = tf.placeholder(tf.float32, [4, 2], name="b")
    with tf.variable_scope("net_a"):
        ha = _batch_norm(a * tf.get_variable("w", [], initializer=tf.ones_initializer()), "bn")
    with tf.variable_scope("net_b"):
        hb = _batch_norm(b * tf.get_variable("w", [], initializer=tf.ones_initializer()), "bn")
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(SCALE), backend="is_finite")
    scaler.add(tf.reduce_mean(ha ** 2), tf.train.GradientDescentOptimizer(0.1),
               var_list=tf.trainable_variables("net_a"), name="a")
    scaler.add(tf.reduce_mean(hb ** 2), tf.train.GradientDescentOptimizer(0.1),
               var_list=tf.trainable_variables("net_b"), name="b")
    train = scaler.build(per_group_ops=True,
                         update_ops={"a": [op for op in updates if "net_a" in op.name],
                                     "b": [op for op in updates if "net_b" in op.name]})
    mean_a = [v for v in tf.global_variables() if v.op.name == "net_a/bn/moving_mean"][0]
    mean_b = [v for v in tf.global_variables() if v.op.name == "net_b/bn/moving_mean"][0]
    data = np.arange(8, dtype=np.float32).reshape(4, 2)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.per_group["a"], {a: data})  # b's placeholder is not needed
        assert np.any(sess.run(mean_a) != 0) and not np.any(sess.run(mean_b) != 0)
        first = sess.run(mean_a)
        sess.run(train.per_group["b"], {b: data})
        assert np.array_equal(sess.run(mean_a), first) and np.any(sess.run(mean_b) != 0)
        sess.run(train.update_op, {a: data, b: data})
        assert not np.array_equal(sess.run(mean_a), first)
