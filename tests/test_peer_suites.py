"""The peers' own loss-scale tests, ported onto our classes (TF1 graph mode).

Each test reproduces one scenario of a peer's test file with
``LossScaleOptimizer`` over a ``tf.compat.v1.train`` optimizer (or with our
managers, or ``MultiOptimizerLossScale`` where it fits) and asserts the
peer's numbers. A test is named after its source: ``test_tf_*`` from
TF's ``tensorflow/python/training/experimental/loss_scale_optimizer_test.py``
(``MixedPrecisionLossScaleOptimizer``), ``test_keras2_*`` from Keras 2's
``keras/mixed_precision/loss_scale_optimizer_test.py``, ``test_keras3_*``
from Keras 3's ``keras/src/optimizers/loss_scale_optimizer_test.py`` and
``test_contrib_*`` from TF 1.15 contrib's
``tensorflow/contrib/mixed_precision/python/loss_scale_optimizer_test.py``
and ``loss_scale_manager_test.py``.

The peers call ``minimize()`` on one optimizer once per step (eager, or
``strategy.experimental_run`` in graph mode) and run each op in its own
``session.run``: each run updates the scale once. Where we differ by
design, the test says so and asserts our documented behaviour:

* a skipped step does not advance ``global_step`` (Keras counts it in
  ``iterations``); ``MultiOptimizerLossScale.build(count_skipped_steps=True)``
  counts it;
* our managers never grow past 2**126 (above it the inverse the step
  unscales with is subnormal and flushed to 0), where contrib and TF grow up
  to float32's max and npu_bridge while ``scale < 3.4e38 / incr_ratio``;
  below the cap ``ExponentialUpdateLossScaleManager`` keeps npu_bridge's
  ceiling and ``DynamicLossScaleManager`` TF's exact test;
* a ``None`` manager is a ValueError with our wording, not TF's.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _lso(opt, manager):
    return nl.LossScaleOptimizer(opt, manager, backend="is_finite")


def _dynamic(initial_scale, growth_steps, multiplier=2.0):
    return nl.DynamicLossScaleManager(initial_scale=initial_scale, growth_steps=growth_steps,
                                      multiplier=multiplier)


def _identity_checking_gradient(expected):
    """An identity whose backprop fails the run unless the gradient reaching
    it (the scaled one) equals ``expected`` (a number or a variable, read at
    run time); the check of TF's and Keras' ``mp_test_util.
    create_identity_with_grad_check_fn``, written here."""
    @tf.custom_gradient
    def identity(x):
        def grad(dy):
            want = tf.cast(expected, dy.dtype) * tf.ones_like(dy)
            check = tf.debugging.assert_equal(dy, want, message="scaled gradient")
            with tf.control_dependencies([check]):
                return tf.identity(dy)
        return tf.identity(x), grad
    return identity


def _run_each(sess, ops, read):
    """Runs each op in its own session.run; returns ``read`` after each."""
    values = []
    for op in ops:
        sess.run(op)
        values.append(sess.run(read))
    return values


# -- TF: tensorflow/python/training/experimental/loss_scale_optimizer_test.py --


def _fixed_scale_applied_with_minimize():
    var = tf.Variable([5.0])
    opt = _lso(tf.train.GradientDescentOptimizer(2.0), nl.FixedLossScaleManager(10.0))
    train = opt.minimize(_identity_checking_gradient(10.0)(var), var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train)
        # loss = identity(var): gradient 1, so 5 - 1 * 2 = 3
        np.testing.assert_allclose(sess.run(var), [3.0])


def test_tf_testFixedLossScaleAppliedToLossWithMinimize(graph):
    _fixed_scale_applied_with_minimize()


def _fixed_scale_applied_with_get_gradients():
    var = tf.Variable([2.0])
    opt = _lso(tf.train.GradientDescentOptimizer(1.0), nl.FixedLossScaleManager(10.0))
    grads = [g for g, _ in opt.compute_gradients(_identity_checking_gradient(10.0)(var), [var])]
    wrong = [g for g, _ in opt.compute_gradients(_identity_checking_gradient(1.0)(var), [var])]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        # The check passes (the loss was scaled by 10 before backprop) and
        # the returned gradient is unscaled.
        np.testing.assert_array_equal(sess.run(grads), [[1.0]])
        with pytest.raises(tf.errors.InvalidArgumentError, match="scaled gradient"):
            sess.run(wrong)  # the check itself bites


def test_tf_testFixedLossScaleAppliedToLossWithGetGradients(graph):
    _fixed_scale_applied_with_get_gradients()


def _dynamic_loss_scale():
    """Two minimize() calls on one optimizer, one run each: the second run's
    scaled gradient is twice the first's (scale 2 -> 4), the weight moves
    by the same unscaled 2 each time."""
    learning_rate = 2.0
    expected_gradient = tf.Variable(learning_rate)
    var = tf.Variable([5.0])
    manager = _dynamic(2.0, 1)
    opt = _lso(tf.train.GradientDescentOptimizer(learning_rate), manager)
    loss = lambda: _identity_checking_gradient(expected_gradient)(var)
    first = opt.minimize(loss, var_list=[var])
    second = opt.minimize(loss, var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(first)
        np.testing.assert_allclose(sess.run(var), [3.0])
        assert sess.run(manager.loss_scale) == 4.0
        sess.run(expected_gradient.assign(2 * learning_rate))
        sess.run(second)
        np.testing.assert_allclose(sess.run(var), [1.0])
        assert sess.run(manager.loss_scale) == 8.0


def test_tf_testDynamicLossScale(graph):
    _dynamic_loss_scale()


def _dynamic_update():
    """A finite minimize() then a NaN one on the same optimizer, one run each."""
    var = tf.Variable([1.0, 2.0])
    manager = _dynamic(2.0, 1)
    opt = _lso(tf.train.GradientDescentOptimizer(1.0), manager)
    finite = opt.minimize(lambda: var * 2.0, var_list=[var])
    nan = opt.minimize(lambda: var * float("nan"), var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(finite)
        np.testing.assert_allclose(sess.run(var), [-1.0, 0.0])  # gradient 2
        assert sess.run(manager.loss_scale) == 4.0  # 2 -> 4
        sess.run(nan)
        np.testing.assert_allclose(sess.run(var), [-1.0, 0.0])  # unchanged
        assert sess.run(manager.loss_scale) == 2.0  # halved


def test_tf_testDynamicUpdate(graph):
    _dynamic_update()


def test_tf_testDynamicUpdate_with_builders_sharing_the_manager(graph):
    """TF's testDynamicUpdate with each minimize() replaced by a
    MultiOptimizerLossScale of its own, the two sharing one manager."""
    var = tf.Variable([1.0, 2.0])
    manager = _dynamic(2.0, 1)
    steps = []
    for multiplier in (2.0, float("nan")):
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(tf.reduce_sum(var * multiplier), tf.train.GradientDescentOptimizer(1.0),
                   var_list=[var])
        steps.append(scaler.build().update_op)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = _run_each(sess, steps, [var, manager.loss_scale])
    np.testing.assert_allclose(values[0][0], [-1.0, 0.0])
    np.testing.assert_allclose(values[1][0], [-1.0, 0.0])
    assert [v[1] for v in values] == [4.0, 2.0]


def _dynamic_scale_with_slots(multiplier):
    """Momentum(1, momentum=1) minimised twice, one run each. TF1's
    momentum accumulates ``accum = accum * m + g`` and subtracts
    ``lr * accum``: 1 then 2 (Keras' SGD keeps the negated velocity)."""
    var = tf.Variable([1.0, 2.0])
    initial_scale = 2.0
    manager = _dynamic(initial_scale, 1, multiplier)
    opt = _lso(tf.train.MomentumOptimizer(1.0, momentum=1.0), manager)
    steps = [opt.minimize(lambda: var, var_list=[var]) for _ in range(2)]
    accum = opt.get_slot(var, "momentum")
    assert opt.get_slot_names() == ["momentum"]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = _run_each(sess, steps, [var, accum, manager.loss_scale])
    np.testing.assert_allclose(values[0][0], [0.0, 1.0])
    np.testing.assert_allclose(values[0][1], [1.0, 1.0])
    assert values[0][2] == initial_scale * multiplier
    np.testing.assert_allclose(values[1][0], [-2.0, -1.0])
    np.testing.assert_allclose(values[1][1], [2.0, 2.0])
    assert values[1][2] == initial_scale * multiplier ** 2


def test_tf_testDynamicLossScaleWithSlots(graph):
    _dynamic_scale_with_slots(multiplier=4.0)


def test_tf_testCheckpoint(graph, tmp_path):
    """The manager's state is saved with tf.train.Checkpoint(optimizer=opt)
    and restored, after a second minimize() moved it."""
    var = tf.Variable([2.0])
    manager = _dynamic(1.0, 2)
    opt = _lso(tf.train.MomentumOptimizer(1.0, momentum=1.0), manager)
    first = opt.minimize(lambda: var + 1.0, var_list=[var])
    checkpoint = tf.train.Checkpoint(optimizer=opt)
    second = opt.minimize(lambda: var + 1.0, var_list=[var])
    state = [manager.loss_scale, manager.good_steps]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(first)
        assert sess.run(state) == [1.0, 1.0]
        save_path = checkpoint.save(str(tmp_path / "ckpt"), session=sess)
        sess.run(second)
        assert sess.run(state) == [2.0, 0.0]
        status = checkpoint.restore(save_path)
        status.assert_consumed()
        status.run_restore_ops(session=sess)
        assert sess.run(state) == [1.0, 1.0]


def test_tf_testPassingNoneToLossScale():
    # TF: ValueError 'loss_scale cannot be None'; ours names our argument.
    with pytest.raises(ValueError, match="loss_scale_manager must be a loss-scale manager, "
                                         "got None"):
        nl.LossScaleOptimizer(tf.train.GradientDescentOptimizer(1.0), None)


# -- Keras 2: keras/mixed_precision/loss_scale_optimizer_test.py --------------


def test_keras2_testFixedLossScaleAppliedToLossWithMinimize(graph):
    _fixed_scale_applied_with_minimize()


def test_keras2_testFixedLossScaleAppliedToLossWithGetGradients(graph):
    _fixed_scale_applied_with_get_gradients()


def test_keras2_testDynamicLossScale(graph):
    _dynamic_loss_scale()


def test_keras2_testDynamicLossScaleDefaultValues(graph):
    manager = nl.DynamicLossScaleManager()
    assert manager.initial_loss_scale == 2 ** 15
    assert manager.growth_steps == 2000
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run(manager.loss_scale) == 2 ** 15


def test_keras2_testDynamicUpdate(graph):
    _dynamic_update()


def test_keras2_testDynamicLossScaleWithFloat16Loss(graph):
    var = tf.Variable([5.0])
    opt = _lso(tf.train.GradientDescentOptimizer(2.0), _dynamic(2.0, 1))
    train = opt.minimize(lambda: tf.cast(var, tf.float16), var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train)
        np.testing.assert_allclose(sess.run(var), [3.0])  # 5 - 1 * 2


def test_keras2_testDynamicLossScaleWithSlots(graph):
    _dynamic_scale_with_slots(multiplier=2.0)


def test_keras2_testClipping_with_builders_sharing_the_manager(graph):
    """Keras clips with the wrapped optimizer's clipnorm; TF1 optimizers have
    none, so the builder's ``clip_norm`` stands in (one variable of one
    element: the global norm is the gradient's own). Changing the clip
    amount means a new builder, on the same manager, run in turn."""
    var = tf.Variable([5.0])
    manager = _dynamic(2.0, 1)
    opt = tf.train.GradientDescentOptimizer(2.0)
    steps = []
    for factor, clip in ((4.0, 2.0), (4.0, 3.0), (float("inf"), 3.0)):
        scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
        scaler.add(tf.reduce_sum(var * factor), opt, var_list=[var], clip_norm=clip)
        steps.append(scaler.build().update_op)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = _run_each(sess, steps, [var, manager.loss_scale])
    # gradient 4 clipped to 2: 5 - 2 * 2 = 1; clipped to 3: 1 - 3 * 2 = -5;
    # an inf gradient is skipped, not clipped.
    assert [(float(v[0][0]), float(v[1])) for v in values] == [(1.0, 4.0), (-5.0, 8.0),
                                                               (-5.0, 4.0)]


def test_keras2_testIterationsIncremented(graph):
    """Keras counts a NaN step in ``iterations`` (1, then 2). We do not
    advance ``global_step`` on a skipped step (1, then 1); with
    ``count_skipped_steps=True`` the builder does (1, then 2)."""
    var = tf.Variable([5.0])
    gs = tf.train.get_or_create_global_step()
    opt = _lso(tf.train.GradientDescentOptimizer(1.0), nl.DynamicLossScaleManager())
    finite = opt.minimize(lambda: var * 2.0, gs, var_list=[var])
    nan = opt.minimize(lambda: var * float("nan"), gs, var_list=[var])

    counted = tf.Variable(0, dtype=tf.int64, trainable=False, name="counted_step")
    factor = tf.placeholder(tf.float32, [])
    scaler = nl.MultiOptimizerLossScale(nl.DynamicLossScaleManager(), backend="is_finite")
    scaler.add(tf.reduce_sum(var * factor), tf.train.GradientDescentOptimizer(1.0),
               var_list=[var])
    counting = scaler.build(global_step=counted, count_skipped_steps=True).update_op
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert _run_each(sess, [finite, nan], [var, gs]) == [[[3.0], 1], [[3.0], 1]]
        sess.run(counting, {factor: 2.0})
        sess.run(counting, {factor: float("nan")})
        assert sess.run([var, counted]) == [[1.0], 2]


def test_keras2_testErrorWhenNesting():
    inner = _lso(tf.train.GradientDescentOptimizer(1.0), nl.FixedLossScaleManager(8))
    with pytest.raises(TypeError):
        nl.LossScaleOptimizer(inner, nl.FixedLossScaleManager(8))


class _MomentumWithExtraVariable(tf.train.MomentumOptimizer):
    """Keras' MySGD: an optimizer that tracks an extra variable of its own."""

    def __init__(self, *args, **kwargs):
        super(_MomentumWithExtraVariable, self).__init__(*args, **kwargs)
        self.my_var = tf.Variable(0.0, trainable=False, name="my_var")
        self._track_trackable(self.my_var, "my_var")


def _keras2_model(with_loss_scale, optimizer_class=tf.train.MomentumOptimizer):
    var = tf.Variable([2.0])
    inner = optimizer_class(1.0, momentum=1.0)
    manager = _dynamic(1.0, 2) if with_loss_scale else None
    opt = _lso(inner, manager) if with_loss_scale else inner
    return var, inner, manager, opt


def _check_status(status, save_with_ls, restore_with_ls, slots_exist):
    """Keras' checks of a restore status: complete when both sides use the
    wrapper and every slot exists, else every object of ours matched (saved
    with the wrapper) or some (saved without it)."""
    if save_with_ls and restore_with_ls and slots_exist:
        status.assert_consumed()
    elif save_with_ls:
        status.assert_existing_objects_matched()
    else:
        status.assert_nontrivial_match()


@pytest.mark.parametrize("save_with_ls,restore_with_ls",
                         [(True, True), (True, False), (False, True)])
def test_keras2_testCheckpoint(graph, tmp_path, save_with_ls, restore_with_ls):
    """Weights, slots and the scale go through tf.train.Checkpoint(optimizer=
    ..., var=...), with or without the loss-scale wrapper on either side:
    the wrapper saves a plain optimizer's layout plus the manager's state.
    TF1's momentum slot holds +1, +2 where Keras' holds -1, -2. Keras' extra
    tracked optimizer variable is the next test."""
    var, _, manager, opt = _keras2_model(save_with_ls)
    # A tensor loss: TF's own minimize() of a callable goes through a
    # GradientTape, which cannot watch v1's ref variables.
    train = opt.minimize(var + 1.0, var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train)
        assert sess.run(var) == [1.0]
        assert sess.run(opt.get_slot(var, "momentum")) == [1.0]
        if save_with_ls:
            assert sess.run([manager.loss_scale, manager.good_steps]) == [1.0, 1.0]
        save_path = tf.train.Checkpoint(optimizer=opt, var=var).save(
            str(tmp_path / "ckpt"), session=sess)

        var, _, manager, opt = _keras2_model(restore_with_ls)
        checkpoint = tf.train.Checkpoint(optimizer=opt, var=var)
        status = checkpoint.restore(save_path)
        _check_status(status, save_with_ls, restore_with_ls, slots_exist=False)
        train = opt.minimize(var + 1.0, var_list=[var])  # restores the slots it makes
        slot = opt.get_slot(var, "momentum")
        sess.run(tf.global_variables_initializer())
        status.run_restore_ops(session=sess)
        if restore_with_ls:
            # Saved without the wrapper: the fresh manager's state.
            assert sess.run([manager.loss_scale, manager.good_steps]) == [
                1.0, 1.0 if save_with_ls else 0.0]
        sess.run(train)
        assert sess.run(var) == [-1.0]  # 1 - (1 * 1 + 1)
        assert sess.run(slot) == [2.0]

        status = checkpoint.restore(save_path)  # again, now that the slots exist
        _check_status(status, save_with_ls, restore_with_ls, slots_exist=True)
        status.run_restore_ops(session=sess)
        assert sess.run(var) == [1.0]
        assert sess.run(slot) == [1.0]


@pytest.mark.parametrize("save_with_ls,restore_with_ls",
                         [(True, True), (True, False), (False, True)])
def test_keras2_testCheckpoint_extra_optimizer_variable(graph, tmp_path, save_with_ls,
                                                        restore_with_ls):
    """Keras' testCheckpoint also checks that a variable the wrapped optimizer
    tracks itself (MySGD.my_var) is saved and restored through the wrapper."""
    var, inner, _, opt = _keras2_model(save_with_ls, _MomentumWithExtraVariable)
    opt.minimize(var + 1.0, var_list=[var])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(inner.my_var.assign(1.0))
        save_path = tf.train.Checkpoint(optimizer=opt, var=var).save(
            str(tmp_path / "ckpt"), session=sess)
        var, inner, _, opt = _keras2_model(restore_with_ls, _MomentumWithExtraVariable)
        status = tf.train.Checkpoint(optimizer=opt, var=var).restore(save_path)
        _check_status(status, save_with_ls, restore_with_ls, slots_exist=False)
        sess.run(tf.global_variables_initializer())
        status.run_restore_ops(session=sess)
        assert sess.run(inner.my_var) == 1.0


# -- Keras 3: keras/src/optimizers/loss_scale_optimizer_test.py ---------------
#
# "stateful": Keras calls optimizer.apply() once per step; here each step is
# its own minimize() on the one optimizer, run once. "stateless": Keras threads
# the optimizer's state through stateless_apply(); the TF1 counterpart is one
# step op, built once and run every step, its state in the manager's variable.
# Keras 3's apply() takes scaled gradients; our apply_gradients() takes the
# unscaled ones compute_gradients() returns, so the gradients here come from a
# loss, sum(var * gradient), scaled and unscaled by minimize().

_KERAS3_VAR = [1.0, 2.0, 3.0, 4.0]
_KERAS3_GRAD = [1.0, 6.0, 7.0, 2.0]
_INF4 = [np.inf] * 4


def _keras3_steps(stateful, steps, gradient, manager, global_step=None):
    """A GradientDescent(0.5) LossScaleOptimizer over [1, 2, 3, 4], whose
    loss has the (unscaled) gradient ``gradient``, and its step ops."""
    var = tf.Variable(_KERAS3_VAR)
    opt = _lso(tf.train.GradientDescentOptimizer(0.5), manager)
    loss = lambda: tf.reduce_sum(var * tf.constant(gradient, tf.float32))
    if stateful:
        ops = [opt.minimize(loss, global_step, var_list=[var]) for _ in range(steps)]
    else:
        ops = [opt.minimize(loss, global_step, var_list=[var])] * steps
    return var, ops


STATEFUL = pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])


@STATEFUL
def test_keras3_test_finite_step(graph, stateful):
    # Default initial scale 2**15: the scaled gradient is 2**15 * [1, 6, 7, 2].
    var, ops = _keras3_steps(stateful, 1, _KERAS3_GRAD, nl.DynamicLossScaleManager())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        [value] = _run_each(sess, ops, var)
    np.testing.assert_allclose(value, [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)


@STATEFUL
def test_keras3_test_infinite_step(graph, stateful):
    manager = nl.DynamicLossScaleManager()
    var, ops = _keras3_steps(stateful, 1, _INF4, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        [value] = _run_each(sess, ops, var)
        assert sess.run(manager.loss_scale) == 2 ** 14
    np.testing.assert_array_equal(value, _KERAS3_VAR)


@STATEFUL
def test_keras3_test_downscaling(graph, stateful):
    manager = _dynamic(400.0, 2000)
    var, ops = _keras3_steps(stateful, 4, _INF4, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert _run_each(sess, ops, manager.loss_scale) == [200.0, 100.0, 50.0, 25.0]
        np.testing.assert_array_equal(sess.run(var), _KERAS3_VAR)


@STATEFUL
def test_keras3_test_upscaling(graph, stateful):
    manager = _dynamic(2.0, 2)
    _, ops = _keras3_steps(stateful, 8, _KERAS3_GRAD, manager)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scales = _run_each(sess, ops, manager.loss_scale)
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


@STATEFUL
def test_keras3_test_iterations_update(graph, stateful):
    gs = tf.train.get_or_create_global_step()
    _, ops = _keras3_steps(stateful, 3, _KERAS3_GRAD, nl.DynamicLossScaleManager(), gs)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        assert sess.run(gs) == 0
        assert _run_each(sess, ops, gs) == [1, 2, 3]


# -- contrib: tensorflow/contrib/mixed_precision/python/loss_scale_optimizer_test.py


def _contrib_graph(loss_scale_manager=None):
    """contrib's _build_graph: x = 1 and a float16 loss x * 1e4 * 1e-4 * 1e-4
    whose backprop underflows (1e-4 * 1e-4 in float16) without a scale."""
    x = tf.get_variable("x", initializer=1.0, dtype=tf.float32)
    c1, c2, c3 = (tf.constant(c, tf.float16) for c in (1e4, 1e-4, 1e-4))
    loss = tf.cast(x, tf.float16) * c1 * c2 * c3
    opt = tf.train.GradientDescentOptimizer(1.0)
    if loss_scale_manager is not None:
        opt = _lso(opt, loss_scale_manager)
    return x, loss, opt


def test_contrib_test_float16_with_loss_scale(graph):
    """With a fixed scale of 1e4 the update is the symbolic 1e-4; the
    unscaled twin (contrib's test_float16_underflow_without_loss_scale)
    does not move."""
    x, loss, opt = _contrib_graph(nl.FixedLossScaleManager(1e4))
    train = opt.minimize(loss, var_list=[x])
    with tf.variable_scope("twin"):
        x_plain, loss_plain, opt_plain = _contrib_graph()
    train_plain = opt_plain.minimize(loss_plain, var_list=[x_plain])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run([train, train_plain])
        np.testing.assert_allclose(sess.run(x), 1.0 - 1e-4, rtol=0, atol=1e-6)
        np.testing.assert_allclose(sess.run(x_plain), 1.0, rtol=0, atol=1e-6)


def test_contrib_test_compute_gradients_with_loss_scale(graph):
    x, loss, opt = _contrib_graph(nl.FixedLossScaleManager(1e4))
    grads_and_vars = opt.compute_gradients(loss, var_list=[x])
    assert len(grads_and_vars) == 1 and grads_and_vars[0][1] is x
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        np.testing.assert_allclose(sess.run(grads_and_vars[0][0]), 1e-4, rtol=1e-3)
        assert sess.run(x) == 1.0  # not applied


def _gradients_from_a_dataset():
    """nan, inf, then 0.1: one gradient per run, as contrib feeds them."""
    dataset = tf.data.Dataset.from_tensor_slices(np.array([np.nan, np.inf, 0.1], np.float32))
    return tf.data.make_one_shot_iterator(dataset).get_next()


def test_contrib_test_apply_gradients(graph):
    x = tf.get_variable("x", initializer=1.0, dtype=tf.float32)
    opt = _lso(tf.train.GradientDescentOptimizer(1.0), nl.FixedLossScaleManager(1e4))
    train = opt.apply_gradients([(_gradients_from_a_dataset(), x)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = _run_each(sess, [train] * 3, x)
    np.testing.assert_allclose(values, [1.0, 1.0, 0.9])


class _SimpleLossScaleManager(nl.LossScaleManager):
    """contrib's test manager: the scale goes up by 1 on a finite step and
    down by 1 otherwise."""

    def __init__(self, loss_scale):
        self.loss_scale = tf.Variable(float(loss_scale), trainable=False, name="loss_scale")

    def get_loss_scale(self):
        return self.loss_scale

    def update_loss_scale(self, finite_grads):
        return tf.cond(finite_grads, lambda: tf.assign_add(self.loss_scale, 1.0).op,
                       lambda: tf.assign_sub(self.loss_scale, 1.0).op)


def test_contrib_test_apply_gradients_loss_scale_is_updated(graph):
    x = tf.get_variable("x", initializer=1.0, dtype=tf.float32)
    manager = _SimpleLossScaleManager(8)
    opt = _lso(tf.train.GradientDescentOptimizer(1.0), manager)
    train = opt.apply_gradients([(_gradients_from_a_dataset(), x)])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = _run_each(sess, [train] * 3, [x, manager.loss_scale])
    np.testing.assert_allclose(values, [[1.0, 7.0], [1.0, 6.0], [0.9, 7.0]])


# -- contrib: tensorflow/contrib/mixed_precision/python/loss_scale_manager_test.py


def _update_sequence(manager, inputs):
    """Feeds each finiteness to the manager's update op, one run each, as
    contrib's _test_helper does; returns the scale after each."""
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    scale = manager.get_loss_scale()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        scales = []
        for value in inputs:
            sess.run(update, {finite: value})
            scales.append(float(sess.run(scale)))
    return scales


def test_contrib_FixedLossScaleManagerTest_test_basic(graph):
    manager = nl.FixedLossScaleManager(1000)
    assert _update_sequence(manager, [True] * 10 + [False] * 10) == [1000.0] * 20


# contrib's ExponentialUpdateLossScaleManagerTest cases, ratio 2 (decr_ratio
# 1/2): (name, inputs, expected scales, init, incr_every, decr_every).
_CONTRIB_SEQUENCES = [
    ("test_increase_every_n_steps", [True] * 6, [1, 2, 2, 4, 4, 8], 1, 2, 2),
    ("test_decrease_every_n_steps", [False] * 6, [1024, 512, 512, 256, 256, 128], 1024, 2, 2),
    ("test_keep_decreasing_until_one", [False] * 10, [16, 8, 8, 4, 4, 2, 2, 1, 1, 1], 16, 2,
     2),
    ("test_incr_bad_step_clear_good_step", [True, True, True, False, True], [1, 2, 2, 2, 2],
     1, 2, 2),
    ("test_incr_good_step_does_not_clear_bad_step", [True, True, True, False, True, False],
     [1, 2, 2, 2, 2, 1], 1, 2, 2),
    ("test_trigger_loss_scale_update_each_step", [True] * 3 + [False, True, True],
     [2, 4, 8, 4, 8, 16], 1, 1, 1),
    ("test_alternating_good_and_bad_gradients_trigger_each_step", [True, False] * 4 + [True],
     [2, 1, 2, 1, 2, 1, 2, 1, 2], 1, 1, 1),
    ("test_alternating_good_and_bad_gradients_trigger_incr_every_2steps",
     [True, False] * 3 + [True], [32, 16, 16, 8, 8, 4, 4], 32, 2, 1),
    ("test_random_mix_good_and_bad_gradients",
     [False, False, True, True, True, False, True, False, True, True, True, False],
     [4, 2, 2, 4, 4, 4, 4, 2, 2, 4, 4, 4], 4, 2, 2),
]


@pytest.mark.parametrize("name,inputs,expected,init,incr_every,decr_every",
                         _CONTRIB_SEQUENCES, ids=[case[0] for case in _CONTRIB_SEQUENCES])
def test_contrib_ExponentialUpdateLossScaleManagerTest(graph, name, inputs, expected, init,
                                                      incr_every, decr_every):
    del name  # the test id
    manager = nl.ExponentialUpdateLossScaleManager(
        init_loss_scale=init, incr_every_n_steps=incr_every,
        decr_every_n_nan_or_inf=decr_every, incr_ratio=2, decr_ratio=0.5)
    assert _update_sequence(manager, inputs) == expected
    if decr_every == 1:
        # Shrinking on every bad step by 1/2 is also DynamicLossScaleManager's rule.
        with tf.Graph().as_default():
            dynamic = nl.DynamicLossScaleManager(initial_scale=init, growth_steps=incr_every)
            assert _update_sequence(dynamic, inputs) == expected


def test_contrib_test_keep_increasing_until_capped(graph):
    """contrib doubles while ``scale * 2`` is finite and so reaches float32's
    max (its test starts at max / 4 + 10, which we refuse: above 2**126).
    Documented deviation: both our managers stop at 2**126, where contrib's
    rule gives ``contrib`` below (every second step grows, from 3 * 2**123)."""
    init = 3.0 * 2.0 ** 123
    inputs = [True] * 8
    contrib = [init, init * 2, init * 2, init * 4, init * 4, init * 8, init * 8, init * 8]
    assert init * 8 * 2 > _FLOAT32_MAX  # contrib stops at init * 8 (2.55e38)
    ours = [min(scale, 2.0 ** 126) for scale in contrib]
    assert ours[3:] == [2.0 ** 126] * 5
    dynamic = nl.DynamicLossScaleManager(initial_scale=init, growth_steps=2)
    assert _update_sequence(dynamic, inputs) == ours
    with tf.Graph().as_default():
        exponential = nl.ExponentialUpdateLossScaleManager(
            init_loss_scale=init, incr_every_n_steps=2, decr_every_n_nan_or_inf=2,
            incr_ratio=2, decr_ratio=0.5)
        assert _update_sequence(exponential, inputs) == ours
