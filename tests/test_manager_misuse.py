"""Managers misused the way real scripts misuse them (issue 20): each gets a
clear error that names the argument or the manager's class, shows the value
and says the fix, at build time where the mistake is visible then, else at the
first run that meets it, before any weight moves.

* ``check_floor`` with a session of another graph, or no session.
* a custom ``update_loss_scale`` that returns no op (None, a number...).
* a custom scale of 0 (NaN weights before) or NaN (every step skipped, no
  word): the run fails and no weight, slot, statistic or step moves.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl
from models import two_group_gan

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _message_has(error, *fragments):
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# -- check_floor with the wrong session ----------------------------------------

def test_check_floor_with_a_session_of_another_graph_names_the_fix():
    with tf.Graph().as_default():
        manager = nl.DynamicLossScaleManager()
    other = tf.Graph()
    with other.as_default():
        tf.constant(1.0)  # not empty: TF's own error would then blame a tensor
        with tf.Session() as sess:
            with pytest.raises(ValueError) as error:
                manager.check_floor(sess)
    _message_has(error, "session", "DynamicLossScaleManager", "another graph",
                 repr(sess), "tf.Session(graph=")


@pytest.mark.parametrize("session", [None, "sess", 3])
def test_check_floor_without_a_session_names_the_argument(graph, session):
    manager = nl.ExponentialUpdateLossScaleManager(8, 10)
    with pytest.raises(TypeError) as error:
        manager.check_floor(session)
    _message_has(error, "session must be a tf.Session", repr(session))


def test_check_floor_still_reads_its_own_graph(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=1, floor_warning_after=1)
    update = manager.update_loss_scale(tf.constant(False))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert manager.check_floor(sess) is False
        sess.run(update)  # one overflow at the floor of 1
        with pytest.warns(RuntimeWarning):
            assert manager.check_floor(sess) is True


# -- update_loss_scale that returns no op ---------------------------------------

class _ReturnsWhatItIsGiven(object):
    """A custom manager whose update returns ``returned``."""

    def __init__(self, returned):
        self.returned = returned

    def get_loss_scale(self):
        return tf.constant(4.0)

    def update_loss_scale(self, finite_grads):
        del finite_grads
        return self.returned


def _build(manager, path, optimizer=None):
    """One group on the GAN's generator: ``(update op, model)``."""
    model = two_group_gan()
    optimizer = optimizer or tf.train.AdamOptimizer(0.1)
    global_step = tf.train.get_or_create_global_step()
    if path == "builder":
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(model.g_loss, optimizer, var_list=model.g_vars, name="g")
        return scaler.build(global_step=global_step).update_op, model
    wrapped = nl.LossScaleOptimizer(optimizer, manager, backend="is_finite")
    return wrapped.minimize(model.g_loss, global_step=global_step,
                            var_list=model.g_vars), model


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("returned", [None, 3, "assign", [1.0]])
def test_update_returning_no_op_is_a_type_error_naming_the_class(graph, path, returned):
    with pytest.raises(TypeError) as error:
        _build(_ReturnsWhatItIsGiven(returned), path)
    _message_has(error, "_ReturnsWhatItIsGiven.update_loss_scale", repr(returned),
                 "return the assign op", "tf.no_op()")


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("form", ["operation", "tensor", "assign"])
def test_update_returning_an_op_a_tensor_or_an_assign_runs(graph, path, form):
    """What contrib's and npu_bridge's tf.group accept stays accepted; the
    update runs once per step."""
    counter = tf.Variable(0.0, trainable=False, name="updates")

    class Counting(_ReturnsWhatItIsGiven):
        def update_loss_scale(self, finite_grads):
            added = tf.assign_add(counter, tf.cast(finite_grads, tf.float32))
            if form == "operation":
                return tf.group(added)
            if form == "tensor":
                return tf.convert_to_tensor(added)
            return added  # a tensor (ref variable) or an unread variable (resource)

    update, model = _build(Counting(None), path)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            sess.run(update, model.feed)
        assert sess.run(counter) == 2.0


# -- a custom scale of 0 or NaN ---------------------------------------------------

class _StoredScale(object):
    """A custom manager whose scale is a variable the test sets."""

    def __init__(self, value):
        self.scale = tf.Variable(value, trainable=False, name="custom_scale")

    def get_loss_scale(self):
        return self.scale.read_value()

    def update_loss_scale(self, finite_grads):
        return tf.no_op()


def _state(sess, model, optimizer):
    """Every value a step may change: weights, Adam's slots and beta powers,
    the global step."""
    variables = list(model.g_vars)
    variables += [optimizer.get_slot(v, name) for v in model.g_vars
                  for name in optimizer.get_slot_names()]
    variables += list(optimizer._get_beta_accumulators())  # pylint: disable=protected-access
    variables.append(tf.train.get_global_step())
    return [np.array(value) for value in sess.run(variables)]


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_custom_scale_of_zero_or_nan_fails_the_run_and_moves_nothing(graph, path, bad):
    """Before: the builder applied NaN weights at 0 and advanced global_step;
    LossScaleOptimizer and NaN skipped every step without a word."""
    manager = _StoredScale(4.0)
    optimizer = tf.train.AdamOptimizer(0.1)
    update, model = _build(manager, path, optimizer)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update, model.feed)  # a good step: the check lets 4 through
        before = _state(sess, model, optimizer)
        assert before[-1] == 1
        sess.run(manager.scale.assign(bad))
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            sess.run(update, model.feed)
        after = _state(sess, model, optimizer)
    _message_has(error, "_StoredScale", "not > 0", "tf.maximum(new_scale, 1.0)",
                 "[%s]" % ("0" if bad == 0 else "nan"))
    for old, new in zip(before, after):
        assert old.tobytes() == new.tobytes()


def _check_ops(graph):
    return [op for op in graph.get_operations() if op.type == "Assert"]


@pytest.mark.parametrize("path", ["builder", "optimizer"])
@pytest.mark.parametrize("make", [
    lambda: nl.FixedLossScaleManager(8),
    lambda: nl.DynamicLossScaleManager(),
    lambda: nl.ExponentialUpdateLossScaleManager(2.0 ** 32, 1000),
])
def test_own_managers_get_no_scale_check(graph, path, make):
    _build(make(), path)
    assert _check_ops(graph) == []


@pytest.mark.parametrize("path", ["builder", "optimizer"])
def test_subclasses_and_custom_managers_get_the_check(path):
    class Subclass(nl.DynamicLossScaleManager):
        pass

    for make in [Subclass, lambda: _StoredScale(4.0)]:
        with tf.Graph().as_default() as graph:
            _build(make(), path)
            checks = _check_ops(graph)
            assert [op.name.split("/")[-1] for op in checks] == ["check_scale"], checks


@pytest.mark.parametrize("kind", ["dynamic", "exponential"])
def test_own_managers_keep_the_scale_in_range_at_the_extremes(graph, kind):
    """Why our managers need no check: from any state they can reach, the
    scale stays finite and within [min_loss_scale, float32 max], at the
    ceiling with a huge growth factor and at the floor with a tiny back-off."""
    if kind == "dynamic":
        manager = nl.DynamicLossScaleManager(initial_scale=FLOAT32_MAX / 2,
                                             growth_steps=1, multiplier=2.0 ** 100)
    else:
        manager = nl.ExponentialUpdateLossScaleManager(
            FLOAT32_MAX / 2, 1, decr_every_n_nan_or_inf=1, incr_ratio=2.0 ** 100,
            decr_ratio=1e-30)
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    pattern = [True] * 3 + [False] * 5 + [True] * 4 + [False] * 3
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for value in pattern:
            sess.run(update, {finite: value})
            scale = float(sess.run(manager.loss_scale))
            assert np.isfinite(scale) and 1.0 <= scale <= FLOAT32_MAX, (value, scale)
        # The floor was reached, and the ceiling held off growth past float32.
        assert scale == 1.0
