"""Run-time claims (npu_lossscale/core/claims.py): state shared by several step
ops moves once per session.run.

The pattern of Huawei's ModelZoo GAN samples and of TF's and Keras's own
loss-scale tests: several step ops share one manager (two
LossScaleOptimizers, two minimize() calls on one, a builder and a
LossScaleOptimizer, two builders), and each session.run fetches one of them.
That is accepted at build time, and each run moves the shared scale once. A
run that fetches two of them fails before the second one writes anything.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import add_gan_groups, two_group_gan

INITIAL = 1024.0


def _manager():
    # Grows after every finite step: 1024, 2048, 4096... one doubling per run.
    return nl.DynamicLossScaleManager(initial_scale=INITIAL, growth_steps=1)


def _two_lsos(model, manager):
    d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager, backend="is_finite")
    g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager, backend="is_finite")
    return (d_opt.minimize(model.d_loss, var_list=model.d_vars),
            g_opt.minimize(model.g_loss, var_list=model.g_vars))


def _one_lso_twice(model, manager):
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1), manager,
                                backend="is_finite")
    return (opt.minimize(model.d_loss, var_list=model.d_vars),
            opt.minimize(model.g_loss, var_list=model.g_vars))


def _builder_and_lso(model, manager):
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(model.d_loss, tf.train.AdamOptimizer(0.01), var_list=model.d_vars, name="d")
    d_train = scaler.build().update_op
    g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager, backend="is_finite")
    return d_train, g_opt.minimize(model.g_loss, var_list=model.g_vars)


def _two_builders(model, manager):
    steps = []
    for name, loss, var_list in (("d", model.d_loss, model.d_vars),
                                 ("g", model.g_loss, model.g_vars)):
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(loss, tf.train.AdamOptimizer(0.01), var_list=var_list, name=name)
        steps.append(scaler.build().update_op)
    return tuple(steps)


SHARING = {"two LossScaleOptimizers": _two_lsos,
           "one LossScaleOptimizer, two minimize calls": _one_lso_twice,
           "a builder and a LossScaleOptimizer": _builder_and_lso,
           "two builders": _two_builders}


def _changed(before, after):
    return [not np.array_equal(a, b) for a, b in zip(before, after)]


@pytest.mark.parametrize("sharing", sorted(SHARING))
def test_alternating_runs_each_apply_their_own_variables_and_move_the_shared_scale_once(
        graph, sharing):
    model = two_group_gan()
    manager = _manager()
    d_train, g_train = SHARING[sharing](model, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scales = [sess.run(manager.get_loss_scale())]
        for step, (train, mine, other) in enumerate([(d_train, model.d_vars, model.g_vars),
                                                     (g_train, model.g_vars, model.d_vars)] * 2):
            before = sess.run(mine + other)
            sess.run(train, model.feed)
            after = sess.run(mine + other)
            assert _changed(before, after) == [True] * len(mine) + [False] * len(other), step
            scales.append(sess.run(manager.get_loss_scale()))
    assert scales == [1024.0, 2048.0, 4096.0, 8192.0, 16384.0]


@pytest.mark.parametrize("sharing", sorted(SHARING))
def test_a_run_fetching_two_step_ops_of_one_manager_fails_before_a_second_update(
        graph, sharing):
    """Whichever step the executor runs first, the run fails with a message
    naming the manager, the two step ops and the fix, and the scale moves at
    most once; a run with one step op afterwards trains normally."""
    model = two_group_gan()
    manager = _manager()
    d_train, g_train = SHARING[sharing](model, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(5):
            scale = sess.run(manager.get_loss_scale())
            with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                sess.run([d_train, g_train], model.feed)
            message = raised.value.message
            assert "two step ops that both update loss-scale manager DynamicLossScaleManager" \
                in message
            assert "Fetch one of them per session.run" in message
            ran = message.split("Step ops that ran:] [", 1)[1].split("]", 1)[0]
            assert ran.count("; ") == 2, ran
            assert sess.run(manager.get_loss_scale()) in (scale, 2 * scale)
        scale = sess.run(manager.get_loss_scale())
        sess.run(g_train, model.feed)
        assert sess.run(manager.get_loss_scale()) == 2 * scale


def test_the_message_names_both_step_ops(graph):
    model = two_group_gan()
    d_train, g_train = _builder_and_lso(model, _manager())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            sess.run([g_train, d_train], model.feed)
    message = raised.value.message
    assert "update_op of MultiOptimizerLossScale (groups d)" in message
    assert "LossScaleOptimizer LossScaleAdam, step loss_scale_apply" in message


def test_a_fixed_scale_shared_by_two_step_ops_may_be_fetched_together(graph):
    """A manager whose scale never moves (static_loss_scale) is claimed by
    nobody: the seed's loop fetches both minimize ops in one run."""
    model = two_group_gan()
    manager = nl.FixedLossScaleManager(8.0)
    d_train, g_train = _two_lsos(model, manager)
    assert not [op for op in graph.get_operations() if op.name.startswith("loss_scale/claims")]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(model.d_vars + model.g_vars)
        sess.run([d_train, g_train], model.feed)
        assert all(_changed(before, sess.run(model.d_vars + model.g_vars)))


def test_one_step_op_per_manager_makes_no_claim(graph):
    """The common graph pays nothing: no claim op, no claim variable."""
    model = two_group_gan()
    scaler = nl.MultiOptimizerLossScale(_manager(), backend="is_finite")
    add_gan_groups(scaler, model)
    scaler.build()
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(), _manager(), backend="is_finite")
    opt.minimize(model.g_loss, var_list=model.g_vars)
    assert not [op for op in graph.get_operations() if "claims" in op.name]


def test_update_op_with_accumulate_op_is_refused_every_time(graph):
    """Both add the run's micro-batch; together they raced on the window's
    counter (global step 0 in one run, 1 in another)."""
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(global_step=gs, accumulation_steps=2)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(10):
            with pytest.raises(tf.errors.InvalidArgumentError) as raised:
                sess.run([train.update_op, train.accumulate_op], model.feed)
            assert "accumulate_op of MultiOptimizerLossScale (groups d, g)" in \
                raised.value.message
        # Alone, each works: a window of two micro-batches applies once. (The
        # refused runs may have moved the window: the first claimer ran.)
        sess.run(tf.global_variables_initializer())
        sess.run(train.accumulate_op, model.feed)
        sess.run(train.update_op, model.feed)
        assert sess.run(gs) == 1


def test_claim_state_is_out_of_collections_and_checkpoints(graph, tmp_path):
    """The counters only matter within one run: no initializer, no Saver, no
    checkpoint; a script that runs only global_variables_initializer() in a
    plain Session works, and so does a MonitoredTrainingSession."""
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    scaler = nl.MultiOptimizerLossScale(_manager(), backend="is_finite")
    add_gan_groups(scaler, model)
    train = scaler.build(global_step=gs, per_group_ops=True)
    assert [op for op in graph.get_operations() if op.name.startswith("loss_scale/claims")]
    names = [v.op.name for v in tf.global_variables() + tf.local_variables()]
    assert not [name for name in names if "claims" in name]
    saver = tf.train.Saver()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train.per_group["d"], model.feed)
        sess.run(train.per_group["g"], model.feed)
        sess.run(train.update_op, model.feed)
        assert sess.run(gs) == 3
        path = saver.save(sess, str(tmp_path / "model"))
    saved = [name for name, _ in tf.train.list_variables(path)]
    assert not [name for name in saved if "claim" in name]
    with tf.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path / "mts")) as sess:
        sess.run(train.per_group["d"], model.feed)


def test_a_checkpoint_with_the_old_step_claims_variable_restores_with_a_default_saver(
        tmp_path):
    """Checkpoints of per_group_ops builds before this change hold
    loss_scale/step_claims; a default Saver ignores the extra entry."""
    with tf.Graph().as_default():
        model = two_group_gan()
        with tf.name_scope("loss_scale/"):
            tf.Variable(7, dtype=tf.int64, trainable=False, name="step_claims")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            path = tf.train.Saver().save(sess, str(tmp_path / "old"))
            expected = sess.run(model.d_vars)
    assert "loss_scale/step_claims" in [name for name, _ in tf.train.list_variables(path)]
    with tf.Graph().as_default():
        model = two_group_gan(seed=2)
        scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(8.0), backend="is_finite")
        add_gan_groups(scaler, model)
        train = scaler.build(per_group_ops=True)
        saver = tf.train.Saver(tf.trainable_variables())
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            saver.restore(sess, path)
            assert all(np.array_equal(a, b) for a, b in zip(sess.run(model.d_vars), expected))
            sess.run(train.per_group["d"], model.feed)


def test_shared_manager_on_the_register_alternates_and_refuses_a_joint_run(graph,
                                                                          saturation_mode):
    """The same on Ascend's float-status register (saturation mode): each
    LossScaleOptimizer reads after the graph's one clear."""
    model = two_group_gan(compute_dtype=tf.float16)
    manager = _manager()
    d_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager, backend="npu")
    g_opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.01), manager, backend="npu")
    d_train = d_opt.minimize(model.d_loss, var_list=model.d_vars)
    with pytest.warns(UserWarning, match="cannot tell their overflows apart"):
        g_train = g_opt.minimize(model.g_loss, var_list=model.g_vars)
    poison = dict(model.feed)
    poison[model.poison_g] = np.inf
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(d_train, model.feed)
        assert sess.run(manager.get_loss_scale()) == 2048.0
        start = sess.run(model.g_vars)
        sess.run(g_train, poison)  # G overflows: skipped, the scale backs off once
        assert all(not changed for changed in _changed(start, sess.run(model.g_vars)))
        assert sess.run(manager.get_loss_scale()) == 1024.0
        with pytest.raises(tf.errors.InvalidArgumentError, match="Fetch one of them"):
            sess.run([d_train, g_train], model.feed)
