"""LossScaleOptimizer: the Optimizer API over the builder's machinery."""

import importlib.util
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from conftest import GRAPH_MODE, snapshot_globals
from models import two_group_gan


def _train(make_train_op, steps, poison_at=()):
    with tf.Graph().as_default():
        model = two_group_gan()
        gs = tf.train.get_or_create_global_step()
        train = make_train_op(model, gs)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for step in range(steps):
                feed = dict(model.feed)
                if step in poison_at:
                    feed[model.poison_g] = np.inf
                sess.run(train, feed)
            return snapshot_globals(sess)


def _lso(model, gs, scale=2.0 ** 6):
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.02), nl.FixedLossScaleManager(scale),
                                backend="is_finite")
    return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)


def _builder(model, gs, scale=2.0 ** 6):
    scaler = nl.MultiOptimizerLossScale(nl.FixedLossScaleManager(scale), backend="is_finite")
    scaler.add(model.g_loss, tf.train.AdamOptimizer(0.02), var_list=model.g_vars,
               name="Adam")
    return scaler.build(global_step=gs).update_op


def _plain(model, gs):
    return tf.train.AdamOptimizer(0.02).minimize(model.g_loss, global_step=gs,
                                                 var_list=model.g_vars)


def _weights(state):
    return {k: v for k, v in state.items() if "loss_scale" not in k}


def test_minimize_equals_builder_and_plain_training_bit_for_bit():
    ours = _weights(_train(_lso, 6))
    for other in (_train(_builder, 6), _train(_plain, 6)):
        other = _weights(other)
        assert sorted(ours) == sorted(other)
        for name in ours:
            assert np.array_equal(ours[name], other[name]), name


def test_minimize_skips_like_the_builder():
    poison = (1, 2, 4)
    ours, theirs = _train(_lso, 6, poison), _train(_builder, 6, poison)
    assert ours["global_step"] == theirs["global_step"] == 3
    for name in _weights(ours):
        assert np.array_equal(ours[name], theirs[name]), name


def test_matches_tf_mixed_precision_loss_scale_optimizer():
    """Same dynamic rule, same skips: TF's own wrapper as the reference."""
    def ours(model, gs):
        opt = nl.LossScaleOptimizer(
            tf.train.AdamOptimizer(0.02),
            nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=2),
            backend="is_finite")
        return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)

    def theirs(model, gs):
        loss_scale = tf.mixed_precision.DynamicLossScale(
            initial_loss_scale=2.0 ** 10, increment_period=2)
        opt = tf.mixed_precision.MixedPrecisionLossScaleOptimizer(
            tf.train.AdamOptimizer(0.02), loss_scale)
        return opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)

    poison = (2, 3, 6)
    a, b = _train(ours, 9, poison), _train(theirs, 9, poison)
    for name in ("generator/w", "generator/b", "generator/w/Adam", "generator/w/Adam_1"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=0)
    assert a["global_step"] == 6  # TF's wrapper also counts only applied steps
    assert b["global_step"] == 6


def test_compute_gradients_returns_unscaled_gradients(graph):
    model = two_group_gan()
    opt = nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(0.1),
                                nl.FixedLossScaleManager(2.0 ** 9), backend="is_finite")
    extra = tf.get_variable("extra", [2])
    ours = opt.compute_gradients(model.g_loss, var_list=model.g_vars + [extra])
    assert ours[-1] == (None, extra)  # kept as None, as the base class does
    plain = tf.gradients(model.g_loss, model.g_vars)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        a, b = sess.run([[g for g, _ in ours[:-1]], plain], model.feed)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_slots_are_the_inner_optimizers(graph):
    model = two_group_gan()
    inner = tf.train.AdamOptimizer(0.02)
    opt = nl.LossScaleOptimizer(inner, nl.DynamicLossScaleManager(), backend="is_finite")
    opt.minimize(model.g_loss, var_list=model.g_vars)
    assert opt.get_slot_names() == ["m", "v"]
    assert opt.get_slot(model.g_vars[0], "m") is inner.get_slot(model.g_vars[0], "m")
    assert opt.inner_optimizer is inner
    with pytest.raises(AttributeError):
        opt.no_such_attribute  # no blanket forwarding that would hide typos


def _checkpointed_step():
    """A LossScaleOptimizer step on the generator, and a tf.train.Checkpoint
    of the optimizer with the variables it trains (ours, in the default graph).

    Returns:
      (model, train op, checkpoint, the variables the checkpoint holds).
    """
    model = two_group_gan()
    gs = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager(2.0 ** 10, growth_steps=2)
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.02), manager, backend="is_finite")
    train = opt.minimize(model.g_loss, global_step=gs, var_list=model.g_vars)
    checkpoint = tf.train.Checkpoint(optimizer=opt, w=model.g_vars[0], b=model.g_vars[1],
                                     step=gs)
    held = (list(model.g_vars) + [gs] + list(manager.variables)
            + [opt.get_slot(v, n) for v in model.g_vars for n in opt.get_slot_names()]
            + [v for v in opt.inner_optimizer.variables() if "power" in v.name])
    return model, train, checkpoint, held


def test_object_checkpoint_with_variables_saves_and_restores_slots(tmp_path):
    """tf.train.Checkpoint(optimizer=LossScaleOptimizer, w=var) (was:
    NotImplementedError, each slot reached through both optimizers) saves
    weights, Adam's slots and beta powers, global_step and the manager's
    state; a restore into a second, identically built graph reads each back
    bit for bit, and its next step equals the first graph's next step."""
    with tf.Graph().as_default():
        model, train, checkpoint, held = _checkpointed_step()
        # weights, global_step, the manager's state, Adam's m and v, beta powers
        assert len(set(h.name for h in held)) == len(held) == 2 + 1 + 1 + 4 + 2
        poison = dict(model.feed)
        poison[model.poison_g] = np.inf
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for feed in (model.feed, poison, model.feed, model.feed, model.feed):
                sess.run(train, feed)
            saved = dict(zip([h.name for h in held], sess.run(held)))
            path = checkpoint.save(str(tmp_path / "ckpt"), session=sess)
            sess.run(train, model.feed)
            after_one_more = dict(zip([h.name for h in held], sess.run(held)))
    with tf.Graph().as_default():
        model, train, checkpoint, held = _checkpointed_step()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            fresh = dict(zip([h.name for h in held], sess.run(held)))
            assert any(not np.array_equal(fresh[k], saved[k]) for k in saved)
            status = checkpoint.restore(path)
            status.assert_existing_objects_matched()
            status.run_restore_ops(session=sess)
            restored = dict(zip([h.name for h in held], sess.run(held)))
            sess.run(train, model.feed)
            continued = dict(zip([h.name for h in held], sess.run(held)))
    assert sorted(restored) == sorted(saved)
    for name in saved:
        assert np.asarray(restored[name]).tobytes() == np.asarray(saved[name]).tobytes(), name
        assert (np.asarray(continued[name]).tobytes()
                == np.asarray(after_one_more[name]).tobytes()), name


#: Object checkpoints written by the release before commit c050077 (keys
#: ``optimizer/base_optimizer/...``), one per graph mode, and the script and
#: model that wrote them (tests/data/make_prev_release_checkpoint.py).
_PREV_RELEASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                 "prev_release_checkpoint")


def _prev_release_script():
    """tests/data/make_prev_release_checkpoint.py, as a module."""
    path = os.path.join(os.path.dirname(_PREV_RELEASE_DIR), "make_prev_release_checkpoint.py")
    spec = importlib.util.spec_from_file_location("make_prev_release_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _restore_adam_step(path, with_w, before_minimize):
    """Restores ``path`` into a new graph's LossScaleOptimizer(Adam) step on a
    zero ``w`` (shape of the script's), before or after ``minimize``.

    Returns:
      The restored values by checkpoint key, and the graph's checkpoint.
    """
    w = tf.get_variable("w", initializer=np.zeros((3, 2), np.float32))
    gs = tf.train.get_or_create_global_step()
    manager = nl.DynamicLossScaleManager(1024.0, growth_steps=2)
    opt = nl.LossScaleOptimizer(tf.train.AdamOptimizer(0.1), manager, backend="is_finite")
    objects = dict(optimizer=opt, step=gs)
    if with_w:
        objects["w"] = w
    checkpoint = tf.train.Checkpoint(**objects)
    status = checkpoint.restore(path) if before_minimize else None
    opt.minimize(tf.reduce_sum(tf.square(w)), global_step=gs, var_list=[w])
    if status is None:
        status = checkpoint.restore(path)
    beta1, beta2 = sorted((v for v in opt.inner_optimizer.variables() if "power" in v.name),
                          key=lambda v: v.name)
    held = {"beta1_power": beta1, "beta2_power": beta2,
            "loss_scale_state_0": manager.variables[0], "step": gs,
            "save_counter": checkpoint.save_counter}
    if with_w:
        held.update(w=w, m=opt.get_slot(w, "m"), v=opt.get_slot(w, "v"))
    sess = tf.get_default_session()
    sess.run(tf.global_variables_initializer())
    status.assert_consumed()  # every value in the checkpoint found its variable
    status.run_restore_ops(session=sess)
    return dict(zip(held, sess.run(list(held.values())))), checkpoint


def _previous_release_key(name):
    prefix = {"beta1_power": "optimizer/base_optimizer/",
              "beta2_power": "optimizer/base_optimizer/",
              "loss_scale_state_0": "optimizer/"}.get(name, "")
    return prefix + name + "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.mark.parametrize("before_minimize", [False, True],
                         ids=["restore_after_minimize", "restore_before_minimize"])
def test_a_checkpoint_of_the_previous_release_restores(tmp_path, before_minimize):
    """tf.train.Checkpoint(optimizer=LossScaleOptimizer(Adam), step=gs) as the
    release before c050077 wrote it (the wrapped optimizer under
    ``optimizer/base_optimizer/``; weights and slots it could not save) restores
    Adam's beta powers, the manager's state and the step bit for bit; those
    equal what today's code computes for the script's four steps; a new save
    has today's keys."""
    script = _prev_release_script()
    path = os.path.join(_PREV_RELEASE_DIR, GRAPH_MODE, "ckpt-1")
    with tf.Graph().as_default():
        train, poison, opt, manager, _, gs = script.build_and_train_graph(nl)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for value in script.POISONS:
                sess.run(train, {poison: value})
            beta1, beta2 = sorted((v for v in opt.inner_optimizer.variables()
                                   if "power" in v.name), key=lambda v: v.name)
            today = dict(zip(["beta1_power", "beta2_power", "loss_scale_state_0", "step"],
                             sess.run([beta1, beta2, manager.variables[0], gs])))
    with tf.Graph().as_default(), tf.Session().as_default():
        restored, checkpoint = _restore_adam_step(path, False, before_minimize)
        resaved = checkpoint.save(str(tmp_path / "ckpt"))
    assert restored["loss_scale_state_0"].tolist() == [1024.0, 1.0, 0.0, 0.0]
    assert restored["step"] == 3
    for name, value in restored.items():
        stored = tf.train.load_variable(path, _previous_release_key(name))
        assert np.asarray(value).tobytes() == np.asarray(stored).tobytes(), name
        if name in today:
            assert np.asarray(value).tobytes() == np.asarray(today[name]).tobytes(), name
    keys = [name for name, _ in tf.train.list_variables(resaved)]
    assert "optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert not [key for key in keys if "base_optimizer" in key]


def test_todays_checkpoint_restores_before_minimize(tmp_path):
    """A restore made before ``minimize`` (the beta powers and slots do not exist
    yet) restores them when they are made: weights, Adam's slots and beta powers,
    the manager's state and the step, bit for bit (was: beta powers left at
    their initial values)."""
    script = _prev_release_script()
    with tf.Graph().as_default():
        train, poison, opt, manager, w, gs = script.build_and_train_graph(nl)
        checkpoint = tf.train.Checkpoint(optimizer=opt, step=gs, w=w)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for value in script.POISONS:
                sess.run(train, {poison: value})
            path = checkpoint.save(str(tmp_path / "ckpt"), session=sess)
    with tf.Graph().as_default(), tf.Session().as_default():
        restored, _ = _restore_adam_step(path, True, True)
    slot = "w/.OPTIMIZER_SLOT/optimizer/%s/.ATTRIBUTES/VARIABLE_VALUE"
    keys = {"beta1_power": "optimizer/beta1_power", "beta2_power": "optimizer/beta2_power",
            "loss_scale_state_0": "optimizer/loss_scale_state_0", "step": "step",
            "save_counter": "save_counter", "w": "w"}
    for name, value in restored.items():
        key = slot % name if name in ("m", "v") else keys[name] + "/.ATTRIBUTES/VARIABLE_VALUE"
        assert np.asarray(value).tobytes() == np.asarray(
            tf.train.load_variable(path, key)).tobytes(), name
    assert restored["beta1_power"] != np.float32(0.9)  # trained four steps
