"""Issue 14's manager surface: read-only properties, float32's range, bad
input, the fixed scale's float16 warning and the base class's optional hooks."""

import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import npu_lossscale as nl

FLOAT32_MAX = float(np.finfo(np.float32).max)


def test_dynamic_properties(graph):
    manager = nl.DynamicLossScaleManager(initial_scale=1024, growth_steps=2)
    assert manager.initial_loss_scale == 1024.0
    assert manager.growth_steps == 2 and manager.multiplier == 2.0
    assert manager.min_loss_scale == 1.0 and manager.max_loss_scale is None
    assert isinstance(manager.good_steps, tf.Tensor)
    assert manager.good_steps.dtype == tf.float32
    update = manager.update_loss_scale(tf.constant(True))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(update)
        assert sess.run([manager.loss_scale, manager.good_steps, manager.bad_steps]) == [
            1024.0, 1.0, 0.0]
        sess.run(update)  # the 2nd finite step grows and resets
        assert sess.run([manager.loss_scale, manager.good_steps]) == [2048.0, 0.0]
    for name in ("good_steps", "initial_loss_scale", "growth_steps", "state"):
        with pytest.raises(AttributeError):
            setattr(manager, name, 1)


def test_exponential_properties(graph):
    manager = nl.ExponentialUpdateLossScaleManager(2 ** 32, 1000)
    assert manager.initial_loss_scale == 2.0 ** 32
    assert manager.incr_every_n_steps == 1000
    assert manager.decr_every_n_nan_or_inf == 2
    assert manager.incr_ratio == 2.0 and manager.decr_ratio == 0.8
    assert isinstance(manager.good_steps, tf.Tensor)
    with pytest.raises(AttributeError):
        manager.incr_every_n_steps = 3


def test_counters_are_exact_at_the_top_of_the_float32_range(graph):
    """float32 counts exactly to 2**24, the largest allowed period."""
    manager = nl.DynamicLossScaleManager(initial_scale=8, growth_steps=2 ** 24)
    update = manager.update_loss_scale(tf.constant(True))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(manager.state.assign([8.0, 2.0 ** 24 - 3, 0.0, 0.0]))
        sess.run(update)
        assert sess.run(manager.state).tolist() == [8.0, 2.0 ** 24 - 2, 0.0, 0.0]
        sess.run(update)
        assert sess.run(manager.state).tolist() == [8.0, 2.0 ** 24 - 1, 0.0, 0.0]
        sess.run(update)  # good + 1 == 2**24: grow
        assert sess.run(manager.state).tolist() == [16.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"growth_steps.*16777217.*2\*\*24"):
        nl.DynamicLossScaleManager(growth_steps=2 ** 24 + 1)


@pytest.mark.parametrize("multiplier", [8.0, 10.0, 1000.0])
def test_growth_ceiling_matches_tf_is_finite(graph, multiplier):
    """Keras/TF grow only if scale * m is finite; ours tests scale < c, c
    computed at build time. Around c (below the 2**126 cap for these
    multipliers) both grow on the same scales; ours grows to the cap."""
    m = np.float32(multiplier)
    edge = np.float32(FLOAT32_MAX) / m  # near the first overflowing scale
    candidates = [np.nextafter(edge, np.float32(0)), edge,
                  np.nextafter(edge, np.float32(np.inf))]
    assert max(candidates) < 2.0 ** 126
    ours, theirs = [], []
    for scale in candidates:
        ours.append(nl.DynamicLossScaleManager(initial_scale=float(scale), growth_steps=1,
                                               multiplier=multiplier))
        theirs.append(tf.mixed_precision.DynamicLossScale(
            initial_loss_scale=float(scale), increment_period=1, multiplier=multiplier))
    grad = tf.constant([1.0])
    ups = [o.update_loss_scale(tf.constant(True)) for o in ours]
    ups += [t.update([grad])[0] for t in theirs]
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(ups)
        a = sess.run([o.get_loss_scale() for o in ours])
        b = sess.run([t() for t in theirs])
    grows = [bool(np.isfinite(c * m)) for c in candidates]
    assert True in grows and False in grows
    assert [float(x) for x in b] == [float(c * m) if g else float(c)
                                     for c, g in zip(candidates, grows)]
    assert [float(x) for x in a] == [2.0 ** 126 if g else float(c)
                                     for c, g in zip(candidates, grows)]


@pytest.mark.parametrize("make, fragments", [
    (lambda: nl.FixedLossScaleManager(None), ["loss_scale", "None"]),
    (lambda: nl.FixedLossScaleManager(float("inf")), ["loss_scale", "inf", "finite"]),
    (lambda: nl.FixedLossScaleManager(float("nan")), ["loss_scale", "nan", "finite"]),
    (lambda: nl.FixedLossScaleManager(1e39), ["loss_scale", "1e+39"]),
    (lambda: nl.DynamicLossScaleManager(initial_scale=None), ["initial_scale", "None"]),
    (lambda: nl.DynamicLossScaleManager(initial_scale=float("inf")), ["initial_scale", "inf"]),
    (lambda: nl.DynamicLossScaleManager(max_loss_scale=float("inf")), ["max_loss_scale", "inf"]),
    (lambda: nl.DynamicLossScaleManager(max_loss_scale=1e39), ["max_loss_scale", "1e+39"]),
    (lambda: nl.DynamicLossScaleManager(multiplier=float("nan")), ["multiplier", "nan"]),
    (lambda: nl.DynamicLossScaleManager(multiplier=1 + 1e-9), ["multiplier", "float32"]),
    (lambda: nl.ExponentialUpdateLossScaleManager(None, 10), ["init_loss_scale", "None"]),
    (lambda: nl.ExponentialUpdateLossScaleManager(1e39, 10), ["init_loss_scale", "1e+39"]),
    (lambda: nl.ExponentialUpdateLossScaleManager(8, 10, decr_ratio=float("nan")),
     ["decr_ratio", "nan"]),
    (lambda: nl.ExponentialUpdateLossScaleManager(8, 2 ** 25), ["incr_every_n_steps", "2**24"]),
])
def test_bad_numbers_raise_value_error_naming_the_argument(graph, make, fragments):
    with pytest.raises(ValueError) as error:
        make()
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_scales_up_to_2_126_are_accepted(graph):
    """2**126 is the top of SCALE_RANGE; max_loss_scale may be larger (the
    cap stays 2**126)."""
    nl.FixedLossScaleManager(2.0 ** 126)
    nl.DynamicLossScaleManager(initial_scale=2.0 ** 126)
    nl.ExponentialUpdateLossScaleManager(2.0 ** 126, 1, max_loss_scale=FLOAT32_MAX)


_ABOVE_2_126 = 2.0 ** 126 * (1 + 2.0 ** -23)  # the next float32 above 2**126


@pytest.mark.parametrize("make, name", [
    (lambda: nl.FixedLossScaleManager(_ABOVE_2_126), "loss_scale"),
    (lambda: nl.DynamicLossScaleManager(initial_scale=FLOAT32_MAX), "initial_scale"),
    (lambda: nl.ExponentialUpdateLossScaleManager(_ABOVE_2_126, 1), "init_loss_scale"),
    (lambda: nl.DynamicLossScaleManager(min_loss_scale=2.0 ** 127), "min_loss_scale"),
])
def test_scales_above_2_126_are_refused(graph, make, name):
    """Above 2**126 the inverse is subnormal, flushed to 0 by TF's CPU kernels."""
    with pytest.raises(ValueError) as error:
        make()
    message = str(error.value)
    assert message.startswith(name + " must be ") and "2**126" in message, message


@pytest.mark.parametrize("scale, warns", [(32768, False), (65504, False), (65536, True),
                                          (2.0 ** 32, True)])
def test_fixed_scale_beyond_float16_warns(scale, warns):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nl.FixedLossScaleManager(scale)
    given = [w for w in record if issubclass(w.category, UserWarning)]
    assert bool(given) == warns, [str(w.message) for w in given]
    if warns:
        assert "65504" in str(given[0].message) and repr(scale) in str(given[0].message)


def test_every_manager_returns_tensors_and_ops(graph):
    finite = tf.placeholder(tf.bool, [])
    for manager in [nl.FixedLossScaleManager(8), nl.DynamicLossScaleManager(),
                    nl.ExponentialUpdateLossScaleManager(8, 10)]:
        scale = manager.get_loss_scale()
        assert isinstance(scale, tf.Tensor) and scale.dtype == tf.float32
        assert isinstance(manager.update_loss_scale(finite), tf.Operation)


def test_base_class_optional_hooks_have_the_builders_defaults():
    class Foreign(nl.LossScaleManager):
        def get_loss_scale(self):
            return tf.constant(4.0)

        def update_loss_scale(self, finite_grads):
            return tf.no_op()

    manager = Foreign()
    assert manager.get_enable_overflow_check() is True
    assert manager.static_loss_scale is None
    assert nl.DynamicLossScaleManager.static_loss_scale.fget(None) is None
    fixed = nl.FixedLossScaleManager(1, enable_overflow_check=False)
    assert fixed.static_loss_scale == 1.0 and fixed.get_enable_overflow_check() is False


# -- issue 20: integral floats for counts, as TF's own tests pass them -------------
# TF's suite passes step counts as floats: tensorflow/python/training/
# experimental/loss_scale_optimizer_test.py (testCheckpoint) builds
# DynamicLossScale(initial_loss_scale=1., increment_period=2., multiplier=2.),
# and Keras' mixed_precision keras_test.py LossScaleOptimizer(...,
# dynamic_growth_steps=2.). Our counts (growth_steps, incr_every_n_steps,
# decr_every_n_nan_or_inf, floor_warning_after, every_n_steps) take them too.

COUNT_MAKERS = {
    "growth_steps": lambda value: nl.DynamicLossScaleManager(
        initial_scale=8, growth_steps=value, floor_warning_after=2),
    "incr_every_n_steps": lambda value: nl.ExponentialUpdateLossScaleManager(
        8, value, decr_every_n_nan_or_inf=2, decr_ratio=0.5, floor_warning_after=2),
    "decr_every_n_nan_or_inf": lambda value: nl.ExponentialUpdateLossScaleManager(
        8, 2, decr_every_n_nan_or_inf=value, decr_ratio=0.5, floor_warning_after=2),
    "floor_warning_after": lambda value: nl.DynamicLossScaleManager(
        initial_scale=8, growth_steps=2, floor_warning_after=value),
    "every_n_steps": lambda value: nl.DynamicLossScaleManager(
        initial_scale=8, growth_steps=2).floor_warning_hook(every_n_steps=value),
}


def _run_counts(manager, steps):
    """The state after each step, and check_floor's verdicts."""
    finite = tf.placeholder(tf.bool, [])
    update = manager.update_loss_scale(finite)
    states, due = [], []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for value in steps:
                sess.run(update, {finite: value})
                states.append(sess.run(manager.state).tobytes())
                due.append(manager.check_floor(sess))
    return states, due


@pytest.mark.parametrize("name", sorted(COUNT_MAKERS))
@pytest.mark.parametrize("value", [2.0, np.float64(2.0), np.float32(2.0)])
def test_integral_float_counts_behave_as_their_int(name, value):
    steps = [True, True, False, True, False, False, False, False, True, True, True]
    with tf.Graph().as_default():
        twin = COUNT_MAKERS[name](2)
        made = COUNT_MAKERS[name](value)
        if name == "every_n_steps":
            # The hook reads the state on every second run, as with 2.
            for hook in (twin, made):
                hook.begin()
            runs = [(made.before_run(None) is None, twin.before_run(None) is None)
                    for _ in range(4)]
            assert [a for a, _ in runs] == [b for _, b in runs] == [True, False] * 2
            return
        assert getattr(made, name) == 2 and type(getattr(made, name)) is int
        assert _run_counts(made, steps) == _run_counts(twin, steps)


BAD_COUNTS = [(2.5, TypeError), (True, TypeError), ("2", TypeError),
              (float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError)]
# Periods count in the float32 state, exact up to 2**24; the other two count
# runs and have no upper bound.
PERIODS = ["growth_steps", "incr_every_n_steps", "decr_every_n_nan_or_inf"]


@pytest.mark.parametrize("name, value, error", [
    (name, value, error) for name in sorted(COUNT_MAKERS) for value, error in BAD_COUNTS
] + [(name, 2.0 ** 24 + 1.0, ValueError) for name in PERIODS])
def test_non_integral_counts_are_refused_naming_the_argument(graph, name, value, error):
    with pytest.raises(error) as raised:
        COUNT_MAKERS[name](value)
    message = str(raised.value)
    assert name in message and repr(value) in message, message


@pytest.mark.parametrize("value, expected", [(3, 3), (3.0, 3), (np.float32(3.0), 3),
                                             (np.int64(3), 3), (2 ** 40, 2 ** 40)])
def test_check_count_returns_the_int(value, expected):
    """checks.check_count, the boundary's one count policy the managers use."""
    got = nl.core.checks.check_count("steps", value, hint="Pass e.g. 4.")
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value, error, minimum", [
    (value, error, 1) for value, error in BAD_COUNTS + [(None, TypeError), (11.0, ValueError)]
] + [(2, ValueError, 3), (2.0, ValueError, 3)])
def test_check_count_refuses_with_argument_value_and_fix(value, error, minimum):
    with pytest.raises(error) as raised:
        nl.core.checks.check_count("steps", value, hint="Pass e.g. 4.", minimum=minimum,
                              maximum=10)
    message = str(raised.value)
    assert message.startswith("steps must be ") and repr(value) in message, message
    assert message.endswith("Pass e.g. 4."), message
