"""DynamicLossScaleManager's ``hysteresis`` and scales below 1, against the
peers' rules (issue 27, item 5).

Hysteresis, quoted from the peers (both default to 2):

* DeepSpeed, ``deepspeed/runtime/fp16/loss_scaler.py``,
  ``DynamicLossScaler.update_scale`` (``delayed_shift`` is the
  ``hysteresis`` setting, ``consecutive_hysteresis`` False by default)::

    if overflow:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter
    else:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor
    self.cur_iter += 1

* Megatron, ``megatron/core/optimizer/grad_scaler.py``,
  ``DynamicGradScaler.update``::

    if found_inf:
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker <= 0:
            self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
    else:
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

Both: finite steps between overflows do not restore the count (only growth
does), and once exhausted every overflow backs off until the scale grows.

Floors: Keras floors the back-off at 1 (``max(scale / multiplier, 1)``,
our default); jmp's ``DynamicLossScale`` at its ``min_loss_scale``
(``jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)``,
default 1); PyTorch's GradScaler has none (``_amp_update_scale_``
multiplies by ``backoff_factor``): ours stops at SCALE_RANGE's 2**-126.
"""

import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl


def _stepper(manager):
    """step(finite) -> (scale, good, bad, streak) after the update."""
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    sess = tf.Session()
    sess.run(tf.global_variables_initializer())

    def step(value):
        sess.run(update, {finite: value})
        return tuple(float(x) for x in sess.run(manager.state))
    step.session = sess
    return step


class _DeepSpeed(object):
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed (module
    docstring), without its logging; ``consecutive_hysteresis`` False."""

    def __init__(self, init_scale, scale_window, delayed_shift, min_scale, scale_factor=2.0):
        self.cur_scale, self.scale_window = init_scale, scale_window
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.min_scale, self.scale_factor = min_scale, scale_factor
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return self.cur_scale


class _Megatron(object):
    """Megatron's DynamicGradScaler.update, transcribed (module docstring)."""

    def __init__(self, initial_scale, growth_interval, hysteresis, min_scale,
                 growth_factor=2.0, backoff_factor=0.5):
        self.scale, self.growth_interval, self.hysteresis = initial_scale, growth_interval, hysteresis
        self.min_scale, self.growth_factor, self.backoff_factor = (
            min_scale, growth_factor, backoff_factor)
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor
        return self.scale


def test_hysteresis_two_by_hand(graph):
    """hysteresis=2, growth_steps=3, from 8 (good, bad = DeepSpeed's
    hysteresis - cur_hysteresis):"""
    step = _stepper(nl.DynamicLossScaleManager(initial_scale=8, growth_steps=3,
                                               hysteresis=2))
    walk = [
        (False, (8, 0, 1, 1)),  # 1st overflow: no back-off (hysteresis 2 -> 1)
        (True, (8, 1, 1, 0)),   # a finite step keeps the count (not consecutive)
        (False, (4, 0, 1, 1)),  # 2nd overflow since growth: 8 -> 4
        (False, (2, 0, 1, 2)),  # exhausted: every overflow backs off
        (False, (1, 0, 1, 3)),  # the floor, 1 by default (Keras')
        (False, (1, 0, 1, 4)),
        (True, (1, 1, 1, 0)),
        (True, (1, 2, 1, 0)),
        (True, (2, 0, 0, 0)),   # growth restores the hysteresis
        (False, (2, 0, 1, 1)),  # so the next overflow is forgiven again
        (False, (1, 0, 1, 2)),
    ]
    for i, (finite, expected) in enumerate(walk):
        assert step(finite) == expected, "step %d" % i


def test_hysteresis_one_is_the_rule_without_it(graph):
    """The default, 1: every overflow halves and bad_steps stays 0 (the
    state the manager wrote before hysteresis existed)."""
    manager = nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=2)
    assert manager.hysteresis == 1
    step = _stepper(manager)
    assert [step(f)[:3] for f in (True, True, False, False, True)] == [
        (1024, 1, 0), (2048, 0, 0), (1024, 0, 0), (512, 0, 0), (512, 1, 0)]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("min_scale", [1.0, 2.0 ** -6])
def test_hysteresis_matches_deepspeed_and_megatron(graph, hysteresis, min_scale):
    """A random finite/overflow sequence through ours and both transcribed
    peers: the same scale after every step."""
    rng = np.random.RandomState(hysteresis)
    flags = rng.rand(120) < 0.45  # True: overflow
    step = _stepper(nl.DynamicLossScaleManager(
        initial_scale=2.0 ** 4, growth_steps=3, hysteresis=hysteresis,
        min_loss_scale=min_scale))
    deepspeed = _DeepSpeed(2.0 ** 4, 3, hysteresis, min_scale)
    megatron = _Megatron(2.0 ** 4, 3, hysteresis, min_scale)
    for i, overflow in enumerate(flags):
        ours = step(not overflow)[0]
        expected = deepspeed.update_scale(overflow)
        assert megatron.update(overflow) == expected, "the peers differ at step %d" % i
        assert ours == expected, "step %d" % i


def test_hysteresis_through_the_builder(graph):
    """hysteresis=2 in a real step: the first overflow is skipped (weights
    untouched) without a back-off, the second halves the scale."""
    w = tf.Variable([1.0], name="w")
    poison = tf.placeholder_with_default(tf.constant(1.0), [])
    loss = tf.reduce_sum(w * w) * poison
    manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=100,
                                         hysteresis=2)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(0.25), var_list=[w], name="w")
    train = scaler.build()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        seen = []
        for value in (float("inf"), 1.0, float("nan")):
            result = sess.run({"finite": train.is_finite, "update": train.update_op},
                              {poison: value})
            seen.append((bool(result["finite"]), float(sess.run(manager.loss_scale)),
                         float(sess.run(w)[0])))
    # inf: skipped, scale kept; finite: w = 1 - 0.25 * 2 = 0.5; nan: 2nd
    # overflow since growth, 1024 -> 512, w kept.
    assert seen == [(False, 1024.0, 1.0), (True, 1024.0, 0.5), (False, 512.0, 0.5)]


def test_checkpoint_of_the_current_layout_restores_into_hysteresis(graph, tmp_path):
    """A manager without hysteresis writes float32[4] ``[scale, good, 0,
    streak]``; restored into hysteresis=2 it starts with the full count (bad
    0), and saved again it restores into hysteresis=1."""
    path = str(tmp_path / "ckpt")
    with tf.Graph().as_default():
        step = _stepper(nl.DynamicLossScaleManager(initial_scale=2.0 ** 10, growth_steps=5))
        step(False)
        assert step(True) == (512, 1, 0, 0)
        tf.train.Saver().save(step.session, path)
    with tf.Graph().as_default():
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 15, growth_steps=5,
                                             hysteresis=2)
        finite = tf.placeholder(tf.bool, [])
        update = manager.update_loss_scale(finite)
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, path)
            assert list(sess.run(manager.state)) == [512, 1, 0, 0]
            sess.run(update, {finite: False})
            assert list(sess.run(manager.state)) == [512, 0, 1, 1]  # forgiven
            sess.run(update, {finite: False})
            assert list(sess.run(manager.state)) == [256, 0, 1, 2]
            tf.train.Saver().save(sess, path + "-2")
    with tf.Graph().as_default():
        manager = nl.DynamicLossScaleManager(initial_scale=2.0 ** 15, growth_steps=5)
        finite = tf.placeholder(tf.bool, [])
        update = manager.update_loss_scale(finite)
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, path + "-2")
            sess.run(update, {finite: False})  # hysteresis 1: min(1 + 1, 0) = 0
            assert list(sess.run(manager.state)) == [128, 0, 0, 3]


def test_floor_warning_with_hysteresis(graph):
    """The streak counts every overflow, forgiven or not: at the floor of
    0.5 after floor_warning_after=4 consecutive overflows the warning is due."""
    manager = nl.DynamicLossScaleManager(initial_scale=2, growth_steps=100, hysteresis=2,
                                         min_loss_scale=0.5, floor_warning_after=4)
    step = _stepper(manager)
    assert [step(False)[0] for _ in range(3)] == [2, 1, 0.5]  # forgiven, then halves
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not manager.check_floor(step.session)  # streak 3 < 4
        step(False)
        assert manager.check_floor(step.session)


def test_scales_below_one_follow_jmps_floor(graph):
    """jmp: ``jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)``;
    with min_loss_scale=2**-3 from 1: 0.5, 0.25, 0.125, 0.125. Growth from
    below 1 doubles as above it."""
    step = _stepper(nl.DynamicLossScaleManager(initial_scale=1, growth_steps=2,
                                               min_loss_scale=2.0 ** -3))
    assert [step(False)[0] for _ in range(4)] == [0.5, 0.25, 0.125, 0.125]
    assert [step(True)[0] for _ in range(4)] == [0.125, 0.25, 0.25, 0.5]


def test_keras_floor_is_the_default(graph):
    """Keras: ``max(scale / multiplier, 1)``: the default floor."""
    manager = nl.DynamicLossScaleManager(initial_scale=4)
    assert manager.min_loss_scale == 1.0
    step = _stepper(manager)
    assert [step(False)[0] for _ in range(4)] == [2, 1, 1, 1]


def test_gradscaler_without_floor_stops_at_2_to_the_minus_126(graph):
    """GradScaler has no floor: 2**-124 halves to 2**-125, 2**-126, 2**-127.
    Ours, with the lowest floor allowed, stops at 2**-126 (SCALE_RANGE: below
    it the scale is subnormal and flushed to 0)."""
    step = _stepper(nl.DynamicLossScaleManager(initial_scale=2.0 ** -124,
                                               min_loss_scale=2.0 ** -126))
    assert [step(False)[0] for _ in range(3)] == [2.0 ** -125, 2.0 ** -126, 2.0 ** -126]


def test_exponential_manager_below_one(graph):
    """contrib's rule with a floor below 1: decr_ratio 0.5 every 2nd overflow."""
    step = _stepper(nl.ExponentialUpdateLossScaleManager(
        1, 10, decr_every_n_nan_or_inf=2, decr_ratio=0.5, min_loss_scale=0.25))
    assert [step(False)[0] for _ in range(6)] == [1, 0.5, 0.5, 0.25, 0.25, 0.25]


def test_a_floor_that_is_not_a_float32_still_warns(graph):
    """min_loss_scale=0.1 is held as float32(0.1); the floor warning compares
    the scale read with that, so it is due."""
    manager = nl.DynamicLossScaleManager(initial_scale=0.2, min_loss_scale=0.1,
                                         floor_warning_after=2)
    assert manager.min_loss_scale == float(np.float32(0.1))
    step = _stepper(manager)
    step(False)
    step(False)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert manager.check_floor(step.session)


def _float16_sum_model():
    """w (float32 [2, 1]) used in float16: loss = sum(x @ w) with both rows
    of x 60000, so dL/dw = x^T 1 = 120000 per element: inf in float16 at
    scale 1, 60000 (finite) at scale 0.5. The forward pass (x @ w = 60 for
    w = 0.0005) is finite."""
    x = tf.constant(np.full([2, 2], 60000.0, np.float16))
    w = tf.Variable(np.full([2, 1], 0.0005, np.float32), name="w")
    loss = tf.reduce_sum(tf.cast(tf.matmul(x, tf.cast(w, tf.float16)), tf.float32))
    return w, loss


@pytest.mark.parametrize("min_loss_scale", [1.0, 0.25])
def test_a_scale_below_one_rescues_a_float16_backward_overflow(graph, min_loss_scale):
    """With the floor at 1 (Keras') every step overflows and is skipped; with
    a floor of 0.25 the scale backs off to 0.5, where the float16 gradient
    fits, and the applied step equals a float32 twin's (120000 exactly)."""
    w, loss = _float16_sum_model()
    manager = nl.DynamicLossScaleManager(initial_scale=1, min_loss_scale=min_loss_scale)
    scaler = nl.MultiOptimizerLossScale(manager, backend="is_finite")
    scaler.add(loss, tf.train.GradientDescentOptimizer(1e-6), var_list=[w], name="w")
    train = scaler.build()
    twin_w = tf.Variable(np.full([2, 1], 0.0005, np.float32), name="twin_w")
    twin_loss = tf.reduce_sum(tf.matmul(tf.constant(np.full([2, 2], 60000.0, np.float32)),
                                        twin_w))
    twin = tf.train.GradientDescentOptimizer(1e-6).minimize(twin_loss, var_list=[twin_w])
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        runs = [sess.run({"update": train.update_op, "finite": train.is_finite,
                          "scale": train.loss_scale}) for _ in range(2)]
        sess.run(twin)
        ours, theirs = sess.run([w, twin_w])
    seen = [(bool(run["finite"]), float(run["scale"])) for run in runs]
    if min_loss_scale == 1.0:
        assert seen == [(False, 1.0), (False, 1.0)]
        np.testing.assert_array_equal(ours, np.full([2, 1], 0.0005, np.float32))
    else:
        assert seen == [(False, 1.0), (True, 0.5)]
        np.testing.assert_array_equal(ours, theirs)
        assert theirs[0, 0] == np.float32(0.0005) - np.float32(1e-6 * 120000.0)
