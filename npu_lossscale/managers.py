"""Loss-scale managers: where the loss scale lives and how it moves.

Every manager follows the protocol of TF 1.15 contrib's ``LossScaleManager``
and npu_bridge's managers, so the builder accepts any of them:

* ``get_loss_scale()`` returns a float32 scalar tensor;
* ``update_loss_scale(finite_grads)`` takes a bool scalar tensor and returns an
  op that moves the scale according to the manager's rule.

The dynamic managers keep all their state in ONE non-trainable float32
variable of four elements, ``[loss_scale, good_steps, bad_steps,
overflow_streak]``, updated by one assign per step:

* float32, not int32: TensorFlow keeps int32 tensors in host memory on a GPU,
  so int32 counters cost host/device copies and host ops in the middle of
  every step. A float32 vector stays on the device.
* float32 counts integers exactly up to 2**24. ``good_steps`` and
  ``bad_steps`` reset whenever they reach their period, and the periods are
  limited to 2**24, so they never leave that range. ``overflow_streak`` only
  grows on consecutive overflows and saturates at 2**24 (``x + 1 == x`` in
  float32 there), which is harmless: it is read only by the floor warning.
* The update is a dozen elementwise ops and selects: no cond, no Switch or
  Merge, no ``IsFinite`` (Ascend's saturation mode does not support it).

``tf.train.Saver`` checkpoints the state with the model. Checkpoints written by
npu_lossscale 0.1 (separate int32 counters) or by npu_bridge's
``ExponentialUpdateLossScaleManager`` restore after ``convert_checkpoint``.
"""

from __future__ import absolute_import, division, print_function

import collections
import math
import numbers
import os
import re
import struct
import warnings

import tensorflow.compat.v1 as tf

from npu_lossscale import checks as _checks
from npu_lossscale import checks as _checks

# TF's DynamicLossScale and Keras' LossScaleOptimizer start at 2**15: the
# largest power of two whose product with a unit loss still fits float16.
_DEFAULT_INITIAL_SCALE = 2.0 ** 15
# Keras' default: grow after 2000 consecutive finite steps.
_DEFAULT_GROWTH_STEPS = 2000
# Keras' default growth and back-off factor.
_DEFAULT_MULTIPLIER = 2.0
# npu_bridge's ExponentialUpdateLossScaleManager defaults, the same as TF 1.15
# contrib's (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py:
# decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.8).
_DEFAULT_DECR_EVERY_N_NAN_OR_INF = 2
_DEFAULT_INCR_RATIO = 2.0
_DEFAULT_DECR_RATIO = 0.8
# The floor of 1 is contrib's, npu_bridge's (`maximum(1., loss_scale *
# decr_ratio)` in npu_loss_scale_manager.py) and Keras' (`max(scale / m, 1)`).
_DEFAULT_MIN_LOSS_SCALE = 1.0
# No ceiling by default: npu_bridge and contrib have none besides float32's
# range, and npu_bridge examples start at 2**32. Pass a number to cap growth.
_DEFAULT_MAX_LOSS_SCALE = None
# The largest finite float32, (2 - 2**-23) * 2**127 (IEEE 754 binary32).
_FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127
# npu_bridge grows the scale only while `loss_scale < 3.4e+38 / incr_ratio`
# (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py,
# ExponentialUpdateLossScaleManager.update_loss_scale): this constant, not
# float32's exact maximum, and a `less`, not contrib's `is_finite`.
_NPU_BRIDGE_FLOAT_MAX = 3.4e+38
# float32 represents every integer up to 2**24 exactly (24-bit significand);
# the step counters must stay below it, so the periods are capped there.
_MAX_PERIOD = 2 ** 24
# The largest finite float16 (65504): a fixed scale above it turns a unit
# float16 loss gradient into inf (values from 65520 round to inf).
_FLOAT16_MAX = 65504.0
# A scale stuck at its floor while steps keep overflowing is the "loss scale
# collapses" report users file (apex #834, fairseq #1529): no scale can help,
# the overflow is in the forward pass or the data. Warn after this many
# consecutive overflowing steps, once the scale sits at its floor.
_DEFAULT_FLOOR_WARNING_AFTER = 20
# How often FloorWarningHook reads the state: one 16-byte device-to-host copy
# every this many runs, instead of a check on every step.
_DEFAULT_WARNING_EVERY_N_STEPS = 100

# Positions in the state vector.
_SCALE, _GOOD, _BAD, _STREAK = 0, 1, 2, 3
_STATE_SIZE = 4
_INF = float("inf")


def _float32(value):
    """Rounds a Python float to the nearest float32, as TF's constants do.

    Raises:
      OverflowError: if the value rounds to infinity.
    """
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _float32_step(value, steps):
    """The float32 ``steps`` representable values above a positive finite
    float32 (below, for negative ``steps``); may be inf."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.unpack("<f", struct.pack("<I", bits + steps))[0]


def _product_is_finite(scale, factor):
    """Whether float32 ``scale * factor`` is finite (both are float32 values,
    so their exact product fits a double and is rounded once)."""
    try:
        return not math.isinf(_float32(scale * factor))
    except OverflowError:
        return False


def _finite_growth_ceiling(factor):
    """The smallest float32 ``s`` with ``s * factor`` overflowing float32.

    ``s < ceiling`` is then exactly ``is_finite(s * factor)`` for every
    float32 ``s > 0``, the test of TF's DynamicLossScale and contrib, without
    an ``IsFinite`` op.
    """
    candidate = _float32(_FLOAT32_MAX / factor)
    while not _product_is_finite(candidate, factor):
        candidate = _float32_step(candidate, -1)
    while _product_is_finite(_float32_step(candidate, 1), factor):
        candidate = _float32_step(candidate, 1)
    return _float32_step(candidate, 1)


class LossScaleManager(object):
    """The protocol every manager follows (TF 1.15 contrib / npu_bridge).

    Subclasses implement ``get_loss_scale`` and ``update_loss_scale``. The
    builder never requires this base class: any object with those two methods
    works, including ``tf.contrib.mixed_precision`` and npu_bridge managers.
    The two optional hooks below have the defaults the builder assumes for an
    object that lacks them.
    """

    def get_loss_scale(self):
        """Returns the current loss scale as a float32 scalar tensor."""
        raise NotImplementedError

    def update_loss_scale(self, finite_grads):
        """Returns an op that updates the scale given this step's finiteness.

        Args:
          finite_grads: bool scalar tensor, True when every gradient was finite.

        Returns:
          An op.
        """
        raise NotImplementedError

    def get_enable_overflow_check(self):
        """Returns whether steps with non-finite gradients are skipped.

        Optional (npu_bridge's FixedLossScaleManager has it). A manager without
        it is treated as returning True.

        Returns:
          A Python bool, fixed at graph-build time.
        """
        return True

    @property
    def static_loss_scale(self):
        """The scale as a Python float when it is a build-time constant.

        Optional. None (the default, and what the builder assumes for a manager
        without it) means the scale is a run-time value; a constant 1.0 lets
        the builder skip unscaling.
        """
        return None


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale.

    With ``enable_overflow_check=False`` the builder skips the overflow check
    entirely (every step applies), through the same code path as the dynamic
    managers. ``FixedLossScaleManager(1, enable_overflow_check=False)`` is
    therefore plain, unscaled training.

    A scale above 65504, float16's largest finite value, draws a
    ``UserWarning``: the gradient of a loss computed in float16 is then
    infinite on every step, so (with the check on) every step is skipped.
    Such a scale only works when the loss and the ops next to it run in
    float32.

    Args:
      loss_scale: the scale, a finite number in [1, float32 max].
      enable_overflow_check: whether steps with non-finite gradients are skipped.

    Raises:
      TypeError: if ``loss_scale`` is not a number or the flag is not a bool.
      ValueError: if ``loss_scale`` is None, NaN, infinite, < 1 or beyond
        float32's range.
    """

    def __init__(self, loss_scale, enable_overflow_check=True):
        if loss_scale is None:
            # contrib, npu_bridge and TF's FixedLossScale raise ValueError here.
            raise ValueError(
                "loss_scale must be a number, got None. Pass a power of two "
                "such as 1024, or 1 for no scaling.")
        _checks.check_number(
            "loss_scale", loss_scale, minimum=1, maximum=_FLOAT32_MAX,
            hint="A loss scale below 1 shrinks gradients towards underflow, and "
                 "one beyond float32's range cannot be represented; pass a power "
                 "of two such as 1024, or 1 for no scaling.")
        if not isinstance(enable_overflow_check, bool):
            raise TypeError(
                "enable_overflow_check must be a bool, got %r. Pass True to skip "
                "steps with inf/nan gradients, False to apply every step."
                % (enable_overflow_check,))
        if loss_scale > _FLOAT16_MAX:
            warnings.warn(
                "FixedLossScaleManager: loss_scale=%r exceeds 65504, float16's "
                "largest value: the gradient of a float16 loss overflows on every "
                "step. Keep the loss in float32, or pass a scale <= 32768."
                % (loss_scale,), UserWarning, stacklevel=2)
        self._loss_scale_value = float(loss_scale)
        self._enable_overflow_check = enable_overflow_check

    def get_loss_scale(self):
        return tf.constant(self._loss_scale_value, dtype=tf.float32, name="loss_scale")

    def update_loss_scale(self, finite_grads):
        del finite_grads  # A fixed scale never moves.
        return tf.no_op(name="fixed_loss_scale_update")

    def get_enable_overflow_check(self):
        """Returns whether steps with non-finite gradients are skipped.

        The name matches npu_bridge's FixedLossScaleManager
        (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py),
        so the builder reads this flag the same way from either class.
        """
        return self._enable_overflow_check

    @property
    def static_loss_scale(self):
        """The scale as a Python float (the builder skips unscaling at 1)."""
        return self._loss_scale_value


class _CountingLossScaleManager(LossScaleManager):
    """A scale that grows after N finite steps and shrinks after M bad ones.

    One rule covers both public dynamic managers. With ``good`` and ``bad`` the
    step counters::

      if finite:
        if good + 1 >= grow_every:  scale = grown(scale); good = bad = 0
        else:                       good += 1
      else:
        if bad + 1 >= shrink_every: scale = shrunk(scale); good = bad = 0
        else:                       bad += 1; good = 0

    where ``grown(s) = min(s * incr, max_loss_scale)`` if ``s`` is below the
    growth ceiling, else ``s``; and ``shrunk(s)`` is set by the subclass,
    floored at ``min_loss_scale``.

    The state is one float32 vector ``[scale, good, bad, streak]``; ``streak``
    counts consecutive overflowing steps (for the floor warning). The update
    computes both branches as vectors and selects: each branch is described by
    a constant table, and the step's ``finite`` picks one table (one Select).
    """

    def __init__(self, init_loss_scale, grow_every, shrink_every, incr_ratio,
                 min_loss_scale, max_loss_scale, floor_warning_after,
                 growth_ceiling, name, scale_name_in_scope):
        self._init_loss_scale = float(init_loss_scale)
        # Checked by the subclass (_check_initial_scale) before any variable.
        self._floor_warning_after = (None if floor_warning_after is None
                                     else int(floor_warning_after))
        self._floor_warned = False
        self._grow_every = int(grow_every)
        self._shrink_every = int(shrink_every)
        self._incr_ratio = float(incr_ratio)
        self._min_loss_scale = float(min_loss_scale)
        self._max_loss_scale = None if max_loss_scale is None else float(max_loss_scale)
        self._growth_ceiling = growth_ceiling
        with tf.name_scope(None, default_name=name):
            self._state = tf.Variable(
                [self._init_loss_scale, 0.0, 0.0, 0.0], dtype=tf.float32,
                trainable=False, name="state")
            if scale_name_in_scope:
                self._values = self._named_values()
        if not scale_name_in_scope:
            self._values = self._named_values()

    def _named_values(self):
        # One Unpack named "loss_scale": "loss_scale:0" is the scale (as
        # npu_bridge's variable is), :1 good_steps, :2 bad_steps, :3 streak.
        # Built once; it reads the state whenever it is fetched.
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE, name="loss_scale")

    def _shrink_factor(self):
        """The factor the shrinking branch multiplies the scale by."""
        raise NotImplementedError

    # -- public, read-only -------------------------------------------------

    @property
    def state(self):
        """The float32[4] state variable ``[scale, good, bad, streak]``."""
        return self._state

    @property
    def variables(self):
        """The state variables (one: ``state``), for savers and initialisers."""
        return [self._state]

    @property
    def loss_scale(self):
        """float32 scalar tensor: the current scale (the ``loss_scale:0``
        tensor, read whenever it is fetched)."""
        return self._values[_SCALE]

    @property
    def good_steps(self):
        """float32 scalar tensor: consecutive finite steps since the scale last
        changed or a step overflowed (resets at growth)."""
        return self._values[_GOOD]

    @property
    def bad_steps(self):
        """float32 scalar tensor: overflowing steps since the scale last
        changed (not reset by finite steps, as in contrib)."""
        return self._values[_BAD]

    @property
    def overflow_streak(self):
        """float32 scalar tensor: consecutive overflowing steps (saturates at
        2**24)."""
        return self._values[_STREAK]

    @property
    def initial_loss_scale(self):
        """The starting scale, a Python float."""
        return self._init_loss_scale

    @property
    def min_loss_scale(self):
        """The floor of the scale, a Python float."""
        return self._min_loss_scale

    @property
    def max_loss_scale(self):
        """The cap on growth, a Python float, or None for none."""
        return self._max_loss_scale

    @property
    def floor_warning_after(self):
        """Consecutive overflows at the floor before the warning, or None."""
        return self._floor_warning_after

    # -- the protocol --------------------------------------------------------

    def get_loss_scale(self):
        # A fresh read for each caller; Unpack, not a strided slice (no index
        # constants, one op).
        return tf.unstack(self._state.read_value(), num=_STATE_SIZE)[_SCALE]

    def _tables(self):
        """The finite and the non-finite branch as float32 [rows, 4] tables."""
        shrink_factor = self._shrink_factor()
        keep = [1.0, 0.0, 0.0, 1.0]  # scale kept, counters reset, streak kept
        floor = [self._min_loss_scale, 0.0, 0.0, 0.0]
        finite = [
            [1.0, 1.0, 1.0, 0.0],                      # mul: streak resets
            [0.0, 1.0, 0.0, 0.0],                      # add: good + 1
            [_INF, float(self._grow_every), _INF, _INF],     # event limit
            [self._growth_ceiling, _INF, _INF, _INF],  # grow only below this
            [self._incr_ratio, 0.0, 0.0, 1.0],         # event factor
            keep, floor,
        ]
        overflow = [
            [1.0, 0.0, 1.0, 1.0],                      # mul: good resets
            [0.0, 0.0, 1.0, 1.0],                      # add: bad + 1, streak + 1
            [_INF, _INF, float(self._shrink_every), _INF],   # event limit
            [_INF, _INF, _INF, _INF],                  # shrinking has no ceiling
            [shrink_factor, 0.0, 0.0, 1.0],            # event factor
            keep, floor,
        ]
        if self._max_loss_scale is not None:
            cap = [self._max_loss_scale, _INF, _INF, _INF]
            finite.append(cap)
            overflow.append(cap)
        return finite, overflow

    def update_loss_scale(self, finite_grads):
        """Returns the op that moves the state by this step's finiteness.

        Both branches are computed as float32 vectors from
        ``candidate = state * mul + add`` (finite: ``[s, good+1, bad, 0]``;
        overflow: ``[s, 0, bad+1, streak+1]``); an event (growth or back-off
        due) is ``candidate >= limit`` anywhere, and then the state becomes
        ``max(candidate * factor, floor)`` (capped at
        ``max_loss_scale``), with the factor falling back to ``keep`` where the
        scale is at its growth ceiling. One read, one assign.

        Args:
          finite_grads: bool scalar tensor (or Python bool).

        Returns:
          An op.
        """
        with tf.name_scope("update_loss_scale"):
            finite = tf.convert_to_tensor(finite_grads, dtype=tf.bool)
            finite_table, overflow_table = self._tables()
            rows = tf.unstack(tf.where(
                finite, tf.constant(finite_table, tf.float32),
                tf.constant(overflow_table, tf.float32)), num=len(finite_table))
            mul, add, limit, ceiling, factor, keep, floor = rows[:7]
            state = self._state.read_value()
            candidate = state * mul + add
            no_event = tf.reduce_all(tf.less(candidate, limit))
            factor = tf.where(tf.less(candidate, ceiling), factor, keep)
            changed = tf.maximum(candidate * factor, floor)
            if self._max_loss_scale is not None:
                changed = tf.minimum(changed, rows[7])
            new_state = tf.where(no_event, candidate, changed)
            # The read above happens before the write below.
            with tf.control_dependencies([new_state]):
                return tf.assign(self._state, new_state, name="assign_state").op

    # -- the floor warning --------------------------------------------------

    def _floor_message(self, streak):
        return (
            "npu_lossscale WARNING: the loss scale sits at its floor (%g) after "
            "%d consecutive overflowing steps. No loss scale can fix this: a "
            "float16 op overflows in the forward pass, or the data holds inf/nan."
            " Keep softmax and losses in float32, lower the learning rate, or "
            "check the input." % (self._min_loss_scale, streak))

    def _check_floor_values(self, values):
        """Warns once when ``values`` (a fetched state) show a collapse."""
        scale, streak = float(values[_SCALE]), float(values[_STREAK])
        due = (self._floor_warning_after is not None
               and scale <= self._min_loss_scale
               and streak >= self._floor_warning_after)
        if due and not self._floor_warned:
            self._floor_warned = True
            message = self._floor_message(streak)
            tf.logging.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return due

    def check_floor(self, session):
        """Reads the state once and warns, once per manager, of a collapse.

        The warning is due when the scale sits at ``min_loss_scale`` and the
        last ``floor_warning_after`` steps all overflowed. It is given with
        ``warnings.warn`` (RuntimeWarning) and ``tf.logging.warning``. Nothing
        in the training step checks this: call it every few hundred steps, or
        use ``floor_warning_hook`` with a MonitoredSession.

        Args:
          session: a ``tf.Session`` (or ``MonitoredSession``) of the
            manager's graph.

        Returns:
          Whether the warning is due (True on every call while it is).

        Raises:
          TypeError: if ``session`` is not a session.
          ValueError: if it runs another graph than the manager's.
        """
        graph = getattr(session, "graph", None)
        if not isinstance(graph, tf.Graph) or not callable(getattr(session, "run", None)):
            raise TypeError(
                "session must be a tf.Session (or MonitoredSession) of the "
                "manager's graph, got %r (%s). Pass the session that runs the "
                "training step." % (session, type(session).__name__))
        if graph is not self._state.graph:
            raise ValueError(
                "session must run the graph %s was built in, got %r, which runs "
                "another graph (%r; the manager's is %r). Pass the session that "
                "runs the training step, e.g. tf.Session(graph=<the manager's "
                "graph>), or build the manager inside `with graph.as_default():` "
                "of the session's graph." % (type(self).__name__, session, graph,
                                             self._state.graph))
        # The tensors built with the manager: no op is added (finalized graphs).
        return self._check_floor_values(session.run(self._values))

    def floor_warning_hook(self, every_n_steps=_DEFAULT_WARNING_EVERY_N_STEPS):
        """A ``SessionRunHook`` that runs ``check_floor`` every N runs.

        Args:
          every_n_steps: how often to read the state (one 16-byte copy), >= 1.

        Returns:
          A ``FloorWarningHook``.
        """
        return FloorWarningHook([self], every_n_steps)


class FloorWarningHook(tf.train.SessionRunHook):
    """Warns once per manager when its scale collapses (see ``check_floor``).

    Every ``every_n_steps`` runs it fetches the managers' state vectors along
    with the run's own fetches, so the check costs nothing on the other runs.

    Args:
      managers: dynamic managers of this package.
      every_n_steps: how often to read the state, >= 1.

    Raises:
      TypeError: if a manager is not one of this package's dynamic managers.
      ValueError: if ``every_n_steps`` < 1.
    """

    def __init__(self, managers, every_n_steps=_DEFAULT_WARNING_EVERY_N_STEPS):
        every_n_steps = _count("every_n_steps", every_n_steps,
                               hint="Pass how many runs apart to check, e.g. 100.")
        managers = list(managers)
        for manager in managers:
            if not isinstance(manager, _CountingLossScaleManager):
                raise TypeError(
                    "managers must be DynamicLossScaleManager or "
                    "ExponentialUpdateLossScaleManager instances, got %r. Pass "
                    "this package's dynamic managers." % (manager,))
        self._managers = managers
        self._every = every_n_steps
        self._runs = 0
        self._reads = None

    def begin(self):
        self._reads = [list(manager._values) for manager in self._managers]  # pylint: disable=protected-access

    def before_run(self, run_context):
        self._runs += 1
        if self._runs % self._every:
            return None
        return tf.train.SessionRunArgs(self._reads)

    def after_run(self, run_context, run_values):
        if run_values.results is None:
            return
        for manager, values in zip(self._managers, run_values.results):
            manager._check_floor_values(values)  # pylint: disable=protected-access


def _check_bounds(init_name, init_value, min_loss_scale, max_loss_scale):
    _checks.check_number(
        "min_loss_scale", min_loss_scale, minimum=1, maximum=_FLOAT32_MAX,
        hint="The floor must be a finite number of at least 1; the default is 1.")
    if max_loss_scale is not None:
        _checks.check_number(
            "max_loss_scale", max_loss_scale, minimum=min_loss_scale,
            maximum=_FLOAT32_MAX,
            hint="The ceiling must lie in [min_loss_scale, float32 max] = [%r, %r]; "
                 "pass None (the default) for no ceiling but float32's range."
                 % (min_loss_scale, _FLOAT32_MAX))
    high = _FLOAT32_MAX if max_loss_scale is None else max_loss_scale
    _checks.check_number(
        init_name, init_value, minimum=min_loss_scale, maximum=high,
        hint="It must lie within [min_loss_scale, max_loss_scale] = [%r, %r]; "
             "lower it, or raise max_loss_scale." % (min_loss_scale, high))


def _count(name, value, hint, maximum=None):
    """Checks a count of steps or runs, and returns it as an int.

    An integral float counts as its int: TF's own tests pass step counts as
    floats (``DynamicLossScale(initial_loss_scale=1., increment_period=2.,
    multiplier=2.)`` in tensorflow/python/training/experimental/
    loss_scale_optimizer_test.py, ``dynamic_growth_steps=2.`` in Keras'
    mixed_precision tests), and peers take them.

    Args:
      name: the argument's name, for the message.
      value: the value to check.
      hint: a sentence saying what to pass instead.
      maximum: the largest count allowed, or None.

    Returns:
      The count, an int >= 1.

    Raises:
      TypeError: if the value is not a number, is a bool, or is a float with
        a fractional part (2.5).
      ValueError: if it is NaN, infinite, below 1 or above ``maximum``.
    """
    whole = ("%s must be a whole number (an int, or an integral float such as 2.0), "
             "got %r (%s). %s" % (name, value, type(value).__name__, hint))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(whole)
    # NaN, inf and the bounds, reported with the value as given.
    _checks.check_number(name, value, minimum=1, maximum=maximum, hint=hint)
    if not isinstance(value, numbers.Integral) and not float(value).is_integer():
        raise TypeError(whole)
    return int(value)


def _check_floor_warning(floor_warning_after):
    """``floor_warning_after`` as an int, or None (never warn)."""
    if floor_warning_after is None:
        return None
    return _count("floor_warning_after", floor_warning_after,
                  hint="Pass a number of consecutive overflowing steps such as 20, "
                       "or None never to warn.")


def _check_period(name, value, example):
    """A growth or back-off period as an int in [1, 2**24]."""
    return _count(name, value, maximum=_MAX_PERIOD,
                  hint="Pass a number of steps such as %d; the state counts in "
                       "float32, exact up to 2**24." % example)


def _check_ratio(name, value, example):
    _checks.check_number(
        name, value, minimum=1, min_open=True, maximum=_FLOAT32_MAX,
        hint="The scale must grow when it grows; pass e.g. %r." % example)
    if _float32(float(value)) <= 1.0:
        raise ValueError(
            "%s must exceed 1 in float32, got %r (it rounds to 1.0). Pass e.g. %r."
            % (name, value, example))


def _check_initial_scale(name, value, min_loss_scale, max_loss_scale, floor_warning_after):
    """The checks both dynamic managers make of their starting scale and bounds."""
    if value is None:
        raise ValueError(
            "%s must be a number, got None. Start at a power of two such as 2**15."
            % name)
    _check_floor_warning(floor_warning_after)
    _checks.check_number(
        name, value, minimum=1, maximum=_FLOAT32_MAX,
        hint="Start at a power of two such as 2**15.")
    _check_bounds(name, value, min_loss_scale, max_loss_scale)


class ExponentialUpdateLossScaleManager(_CountingLossScaleManager):
    """npu_bridge's exponential-update rule (TF 1.15 contrib's, with
    npu_bridge's growth ceiling).

    On a finite step, if ``good + 1 >= incr_every_n_steps`` the scale is
    multiplied by ``incr_ratio`` (only while ``scale < 3.4e38 / incr_ratio``,
    npu_bridge's test, which replaced contrib's ``is_finite(scale *
    incr_ratio)``) and both counters reset; otherwise ``good += 1``. On a
    non-finite step, if ``bad + 1 >= decr_every_n_nan_or_inf`` the scale
    becomes ``max(min_loss_scale, scale * decr_ratio)`` and both counters
    reset; otherwise ``bad += 1`` and ``good = 0``.
    (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py.)
    The two ceilings differ only for scales within a factor ``incr_ratio`` of
    float32's maximum.

    Example: ``init_loss_scale=1024, decr_ratio=0.5,
    decr_every_n_nan_or_inf=2`` gives 512 after two bad steps.

    As in npu_bridge, ``tf.get_default_graph().get_tensor_by_name(
    "loss_scale:0")`` is the scale for a single manager built at the root
    name scope (a second one gets ``loss_scale_1:0``). The state itself is the
    variable ``exponential_loss_scale/state``.

    Args:
      init_loss_scale: the starting scale, up to float32's maximum (npu_bridge
        examples use 2**32).
      incr_every_n_steps: finite steps needed before the scale grows, in
        [1, 2**24].
      decr_every_n_nan_or_inf: non-finite steps needed before it shrinks, in
        [1, 2**24].
      incr_ratio: growth factor, > 1.
      decr_ratio: back-off factor, in (0, 1).
      min_loss_scale: floor of the scale (npu_bridge's is 1).
      max_loss_scale: cap on growth, or None (npu_bridge's: no cap).
      floor_warning_after: warn, once, when the scale sits at
        ``min_loss_scale`` after this many consecutive overflowing steps
        (see ``check_floor``); None never warns.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    def __init__(self, init_loss_scale, incr_every_n_steps,
                 decr_every_n_nan_or_inf=_DEFAULT_DECR_EVERY_N_NAN_OR_INF,
                 incr_ratio=_DEFAULT_INCR_RATIO, decr_ratio=_DEFAULT_DECR_RATIO,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER):
        _checks.require_graph_mode("ExponentialUpdateLossScaleManager")
        _check_initial_scale("init_loss_scale", init_loss_scale, min_loss_scale,
                             max_loss_scale, floor_warning_after)
        _check_period("incr_every_n_steps", incr_every_n_steps, 1000)
        _check_period("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf, 2)
        _check_ratio("incr_ratio", incr_ratio, 2)
        _checks.check_number(
            "decr_ratio", decr_ratio, minimum=0, maximum=1, min_open=True, max_open=True,
            hint="The scale must shrink when it shrinks; pass e.g. 0.5.")
        self._decr_every = int(decr_every_n_nan_or_inf)
        self._decr_ratio = float(decr_ratio)
        super(ExponentialUpdateLossScaleManager, self).__init__(
            init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio,
            min_loss_scale, max_loss_scale, floor_warning_after,
            growth_ceiling=_float32(_NPU_BRIDGE_FLOAT_MAX / float(incr_ratio)),
            name="exponential_loss_scale", scale_name_in_scope=False)

    def _shrink_factor(self):
        return self._decr_ratio  # contrib and npu_bridge multiply

    @property
    def incr_every_n_steps(self):
        """Finite steps needed before the scale grows."""
        return self._grow_every

    @property
    def decr_every_n_nan_or_inf(self):
        """Non-finite steps needed before the scale shrinks."""
        return self._decr_every

    @property
    def incr_ratio(self):
        """The growth factor."""
        return self._incr_ratio

    @property
    def decr_ratio(self):
        """The back-off factor."""
        return self._decr_ratio


class DynamicLossScaleManager(_CountingLossScaleManager):
    """The rule of TF's ``DynamicLossScale`` (Keras defaults).

    After ``growth_steps`` consecutive finite steps the scale is multiplied by
    ``multiplier`` if the result is finite; on any non-finite step it becomes
    ``max(scale / multiplier, min_loss_scale)`` and the count restarts. The
    finiteness test is done without ``IsFinite``: ``scale < ceiling``, with
    the ceiling computed at build time as the smallest float32 whose product
    with the multiplier overflows, which is the same test bit for bit.

    The state is the variable ``dynamic_loss_scale/state``; the scale is also
    the tensor ``dynamic_loss_scale/loss_scale:0``.

    Args:
      initial_scale: the starting scale, 2**15 by default, up to float32's max.
      growth_steps: finite steps needed before the scale grows, in [1, 2**24].
      multiplier: growth and back-off factor, > 1.
      min_loss_scale: floor of the scale, 1 by default (Keras' floor).
      max_loss_scale: cap on growth, None (no cap, as Keras) by default.
      floor_warning_after: warn, once, when the scale sits at
        ``min_loss_scale`` after this many consecutive overflowing steps
        (see ``check_floor``); None never warns.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    def __init__(self, initial_scale=_DEFAULT_INITIAL_SCALE,
                 growth_steps=_DEFAULT_GROWTH_STEPS, multiplier=_DEFAULT_MULTIPLIER,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER):
        _checks.require_graph_mode("DynamicLossScaleManager")
        _check_initial_scale("initial_scale", initial_scale, min_loss_scale,
                             max_loss_scale, floor_warning_after)
        _check_period("growth_steps", growth_steps, 2000)
        _check_ratio("multiplier", multiplier, 2)
        self._multiplier = _float32(float(multiplier))
        super(DynamicLossScaleManager, self).__init__(
            initial_scale, growth_steps, 1, multiplier,
            min_loss_scale, max_loss_scale, floor_warning_after,
            growth_ceiling=_finite_growth_ceiling(self._multiplier),
            name="dynamic_loss_scale", scale_name_in_scope=True)

    def _shrink_factor(self):
        # TF's DynamicLossScale writes `scale / multiplier`, and a Session's
        # grappler (constant folding, ReduceDivToReciprocalMul) runs it as
        # `scale * float32(1 / multiplier)`: this is what TF computes, bit for
        # bit (tests/test_managers.py cross-checks it with multiplier 3). For
        # a power of two both spellings are the same number.
        return 1.0 / self._multiplier

    @property
    def growth_steps(self):
        """Finite steps needed before the scale grows."""
        return self._grow_every

    @property
    def multiplier(self):
        """The growth and back-off factor."""
        return self._multiplier


def keeps_scale_positive(manager):
    """Whether ``manager``'s scale provably stays finite and >= 1.

    True only for this package's own three classes, not subclasses (which may
    override the rule): ``FixedLossScaleManager``'s scale is a constant checked
    to lie in [1, float32 max]; the dynamic managers start in [min_loss_scale,
    max_loss_scale] with ``min_loss_scale >= 1``, grow only below the growth
    ceiling (so the product is finite), and floor every change at
    ``min_loss_scale`` (``update_loss_scale``). Only a write from outside
    (restoring a foreign checkpoint, assigning to ``state``) could break this.
    The step adds no run-time check of the scale for these managers.

    Args:
      manager: any loss-scale manager.

    Returns:
      A Python bool.
    """
    return type(manager) in (FixedLossScaleManager, DynamicLossScaleManager,
                             ExponentialUpdateLossScaleManager)


def scale_moves(manager):
    """Whether ``manager``'s update can change its state.

    False for a manager that declares a constant scale
    (``static_loss_scale``, as ``FixedLossScaleManager`` does): its update is
    a no-op, so any number of steps may update it in one run.

    Args:
      manager: any loss-scale manager.

    Returns:
      A Python bool.
    """
    return getattr(manager, "static_loss_scale", None) is None


def describe(manager):
    """A short description of ``manager`` for messages: its class and the
    name of its first state variable, e.g. "loss-scale manager
    DynamicLossScaleManager (state loss_scale/state)"; no quotes, which
    run-time messages would print escaped."""
    variables = _checks.manager_variables(manager)
    if not variables:
        return "loss-scale manager %s" % type(manager).__name__
    return "loss-scale manager %s (state %s)" % (type(manager).__name__, variables[0].op.name)


# ---------------------------------------------------------------------------
# Checkpoint conversion.
# ---------------------------------------------------------------------------

# npu_lossscale 0.1: float32 scale, int32 counters and a bool under the scope.
_OLD_FIELD = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<kind>dynamic|exponential)_loss_scale(?P<suffix>_\d+)?/"
    r"(?P<field>loss_scale|good_steps|bad_steps|overflows_at_floor|floor_warned)$")
# npu_bridge / contrib: variables "loss_scale" (float32), "good_steps" and
# "bad_steps" (int32) in the current name scope, TF-uniquified with _N
# (tf_adapter/python/npu_bridge/estimator/npu/npu_loss_scale_manager.py).
_NPU_BRIDGE_SCALE = re.compile(r"^(?P<prefix>(?:.*/)?)loss_scale(?P<suffix>_\d+)?$")
_STATE = re.compile(
    r"^(?P<prefix>(?:.*/)?)(?P<kind>dynamic|exponential)_loss_scale(?P<suffix>_\d+)?/state$")
_FORMATS = ("npu_lossscale", "npu_bridge")


class _Tensor(collections.namedtuple("_Tensor", ["value", "dtype"])):
    """One tensor of a checkpoint: its value (as read) and its dtype."""


class _Layout(collections.namedtuple("_Layout", ["dtype", "shape"])):
    """The dtype and shape a manager saves one of its variables with."""

    def holds(self, tensor):
        """Whether the ``_Tensor`` has exactly this dtype and shape."""
        return (tensor.dtype == self.dtype
                and tuple(getattr(tensor.value, "shape", ())) == self.shape)


# The exact layouts the managers write: a tensor is converted only when it and
# its siblings match one of them, so a user's own "model/loss_scale" or
# "good_steps" is copied unchanged.
# npu_lossscale 0.1: scalars; the first release had the three counters, the
# floor warning added "overflows_at_floor" and "floor_warned".
_OLD_LAYOUT = {
    "loss_scale": _Layout(tf.float32, ()),
    "good_steps": _Layout(tf.int32, ()),
    "bad_steps": _Layout(tf.int32, ()),
    "overflows_at_floor": _Layout(tf.int32, ()),
    "floor_warned": _Layout(tf.bool, ()),
}
_OLD_FIELD_SETS = (frozenset(["loss_scale", "good_steps", "bad_steps"]),
                   frozenset(_OLD_LAYOUT))
# npu_bridge / contrib: float32 and int32 scalars (contrib's
# tensorflow/contrib/mixed_precision/python/loss_scale_manager.py, which
# npu_bridge's ExponentialUpdateLossScaleManager subclasses).
_NPU_BRIDGE_LAYOUT = collections.OrderedDict([
    ("loss_scale", _Layout(tf.float32, ())),
    ("good_steps", _Layout(tf.int32, ())),
    ("bad_steps", _Layout(tf.int32, ())),
])
# This version: one float32[4] vector.
_STATE_LAYOUT = _Layout(tf.float32, (_STATE_SIZE,))


class _Converted(collections.namedtuple("_Converted", ["new", "consumed"])):
    """One conversion pass: tensors to write (name -> ``_Tensor``) and the
    names of the tensors they replace."""


def _state_from_old(tensors):
    """npu_lossscale 0.1's groups -> state vectors, as a ``_Converted``.

    A group converts only if its fields are one of ``_OLD_FIELD_SETS``, each
    with its exact layout, and its state name is not already taken.
    """
    groups = collections.OrderedDict()  # state name -> {field: tensor name}
    for name in sorted(tensors):
        match = _OLD_FIELD.match(name)
        if match:
            target = "%s%s_loss_scale%s/state" % (
                match.group("prefix"), match.group("kind"), match.group("suffix") or "")
            groups.setdefault(target, {})[match.group("field")] = name
    new, consumed = {}, set()
    for target, fields in groups.items():
        if (frozenset(fields) not in _OLD_FIELD_SETS or target in tensors
                or not all(_OLD_LAYOUT[field].holds(tensors[name])
                           for field, name in fields.items())):
            continue
        values = dict((field, tensors[name].value) for field, name in fields.items())
        state = [float(values["loss_scale"]), float(values["good_steps"]),
                 float(values["bad_steps"]), float(values.get("overflows_at_floor", 0))]
        new[target] = _Tensor(state, tf.float32)
        consumed.update(fields.values())
    return _Converted(new, consumed)


def _state_from_npu_bridge(tensors, taken):
    """npu_bridge's triples -> exponential state vectors, as a ``_Converted``.

    A triple converts only if all three exist with npu_bridge's exact layout,
    and its state name is neither in the checkpoint (the checkpoint already
    holds this version's state there: the triple is someone else's) nor in
    ``taken`` (names the 0.1 pass writes).
    """
    new, consumed = {}, set()
    for name in sorted(tensors):
        match = _NPU_BRIDGE_SCALE.match(name)
        if not match or _OLD_FIELD.match(name):
            continue
        prefix, suffix = match.group("prefix"), match.group("suffix") or ""
        names = collections.OrderedDict(
            (field, prefix + field + suffix) for field in _NPU_BRIDGE_LAYOUT)
        target = "%sexponential_loss_scale%s/state" % (prefix, suffix)
        if (target in tensors or target in taken
                or not all(other in tensors and _NPU_BRIDGE_LAYOUT[field].holds(tensors[other])
                           for field, other in names.items())):
            continue
        state = [float(tensors[other].value) for other in names.values()] + [0.0]
        new[target] = _Tensor(state, tf.float32)
        consumed.update(names.values())
    return _Converted(new, consumed)


def _npu_bridge_from_state(tensors):
    """Exponential state vectors -> npu_bridge's triples, as a ``_Converted``.

    Raises:
      ValueError: if a name the triple needs is taken by another tensor.
    """
    new, consumed = {}, set()
    for name in sorted(tensors):
        match = _STATE.match(name)
        if (not match or match.group("kind") != "exponential"
                or not _STATE_LAYOUT.holds(tensors[name])):
            continue
        prefix, suffix = match.group("prefix"), match.group("suffix") or ""
        names = collections.OrderedDict(
            (field, prefix + field + suffix) for field in _NPU_BRIDGE_LAYOUT)
        taken = [other for other in names.values() if other in tensors]
        if taken:
            raise ValueError(
                "to=\"npu_bridge\": the state %r would become %s, but the checkpoint "
                "already holds %s (%s), which is not a loss-scale manager's; "
                "converting would overwrite it. Rename that variable (or build the "
                "manager under its own name scope) and save again, or restore this "
                "checkpoint into npu_lossscale's managers (to=\"npu_lossscale\")."
                % (name, ", ".join(names.values()), ", ".join(taken),
                   ", ".join("%s %s%s" % (other, tensors[other].dtype.name,
                                          list(getattr(tensors[other].value, "shape", ())))
                             for other in taken)))
        state = [float(x) for x in tensors[name].value]
        new[names["loss_scale"]] = _Tensor(state[_SCALE], tf.float32)
        new[names["good_steps"]] = _Tensor(int(state[_GOOD]), tf.int32)
        new[names["bad_steps"]] = _Tensor(int(state[_BAD]), tf.int32)
        consumed.add(name)
    return _Converted(new, consumed)


def _applied(tensors, converted):
    """``tensors`` with a ``_Converted`` pass applied."""
    result = dict((name, tensor) for name, tensor in tensors.items()
                  if name not in converted.consumed)
    result.update(converted.new)
    return result


def _checkpoint_path(name, value, fix):
    """``value`` as a str path, checked.

    Raises:
      TypeError: if it is not a str or an ``os.PathLike`` of one.
      ValueError: if it is empty.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError("%s must be a checkpoint prefix (a str or os.PathLike), got "
                        "%r (%s). %s" % (name, value, type(value).__name__, fix))
    if not value:
        raise ValueError("%s must be a checkpoint prefix, got %r. %s" % (name, value, fix))
    return value


def convert_checkpoint(source, target, to="npu_lossscale"):
    """Rewrites a name-based checkpoint's loss-scale state for another layout.

    ``to="npu_lossscale"`` (the default) makes a checkpoint restorable into
    this version's managers. It converts:

    * npu_lossscale 0.1's layout (``<scope>/loss_scale`` float32,
      ``good_steps``, ``bad_steps`` int32, and, once the floor warning came,
      ``overflows_at_floor`` int32 and ``floor_warned`` bool, all scalars,
      under ``dynamic_loss_scale/`` or ``exponential_loss_scale/``) into
      ``<scope>/state`` = ``[scale, good, bad, streak]`` float32, same scope;
      ``floor_warned`` is dropped;
    * npu_bridge's / contrib's ``ExponentialUpdateLossScaleManager`` layout
      (``loss_scale`` float32, ``good_steps`` and ``bad_steps`` int32, all
      scalars, each with the same ``_N`` suffix) into
      ``exponential_loss_scale_N/state`` with a zero streak.

    ``to="npu_bridge"`` goes back: each ``exponential_loss_scale_N/state``
    (float32[4]) becomes npu_bridge's ``loss_scale_N`` (float32),
    ``good_steps_N`` and ``bad_steps_N`` (int32); the streak is dropped.
    ``dynamic_loss_scale`` states are copied as they are (npu_bridge has no
    such manager).

    Only the managers' own variables are converted: tensors are recognised by
    these exact layouts (names, dtypes, shapes, all siblings present), and a
    layout whose converted name the checkpoint already holds is left alone.
    Every other tensor, such as a user's own ``model/loss_scale`` or
    ``good_steps``, is copied unchanged. The mapping assumes the managers are
    built in the same order and name scopes as when the checkpoint was
    written (TF numbers them ``_1``, ``_2``... in creation order).
    Object-based checkpoints (``tf.train.Checkpoint``) are not converted.

    Args:
      source: prefix of the checkpoint to read (as given to ``Saver.restore``),
        a str or ``os.PathLike``.
      target: prefix to write the converted checkpoint to (its directory must
        exist), a str or ``os.PathLike``. Only the checkpoint's data and
        index files are written: the directory's ``checkpoint`` state file
        (``tf.train.latest_checkpoint``) is left as it is.
      to: "npu_lossscale" or "npu_bridge".

    Returns:
      The sorted names of the loss-scale tensors written in the new layout.

    Raises:
      TypeError: if ``source`` or ``target`` is not a path, or ``to`` not a str.
      ValueError: if ``to`` is not one of the two formats, ``source`` is not a
        readable checkpoint, ``target``'s directory does not exist, is a file
        or cannot be written, or (with ``to="npu_bridge"``) a name
        npu_bridge's layout needs is taken by another tensor. Nothing is
        written then.
    """
    if not isinstance(to, str):
        raise TypeError("to must be a str, one of %r, got %r (%s). Pass \"npu_lossscale\" "
                        "to restore into this package's managers." % (
                            _FORMATS, to, type(to).__name__))
    if to not in _FORMATS:
        raise ValueError("to must be one of %r, got %r. Pass \"npu_lossscale\" to "
                         "restore into this package's managers." % (_FORMATS, to))
    source = _checkpoint_path("source", source,
                              "Pass what Saver.save returned, e.g. \"ckpt/model-1000\".")
    target = _checkpoint_path("target", target,
                              "Pass the prefix to write, e.g. \"converted/model-1000\".")
    _check_target_directory(target)
    try:
        reader = tf.train.load_checkpoint(source)
    except (ValueError, tf.errors.OpError) as error:
        raise ValueError("source must be a checkpoint prefix, got %r (%s). Pass what "
                         "Saver.save returned." % (source, error))
    tensors = dict((name, _Tensor(reader.get_tensor(name), dtype))
                   for name, dtype in reader.get_variable_to_dtype_map().items())
    ours = _state_from_old(tensors)
    from_npu_bridge = _state_from_npu_bridge(tensors, set(ours.new))
    tensors = _applied(_applied(tensors, ours), from_npu_bridge)
    converted = sorted(ours.new) + sorted(from_npu_bridge.new)
    if to == "npu_bridge":
        back = _npu_bridge_from_state(tensors)
        tensors = _applied(tensors, back)
        converted = sorted(back.new)
    _write_checkpoint(tensors, target)
    return converted


def _check_target_directory(target):
    """Checks that ``target``'s directory exists and takes new files.

    The check writes and removes an empty file there, as the checkpoint
    writer would (``tf.io.gfile``, so remote file systems are checked too).

    Raises:
      ValueError: if the directory does not exist, is a file, or refuses
        the file.
    """
    directory = os.path.dirname(target) or "."
    if not tf.io.gfile.isdir(directory):
        if tf.io.gfile.exists(directory):
            raise ValueError("target must be a prefix in a directory, got %r: %r is a "
                             "file, not a directory. Pass a prefix in an existing "
                             "directory, e.g. %r." % (target, directory, os.path.join(
                                 os.path.dirname(directory) or ".",
                                 os.path.basename(target))))
        raise ValueError("target must be a prefix in an existing directory, got %r (%r "
                         "does not exist). Create it first, e.g. os.makedirs(%r)."
                         % (target, directory, directory))
    probe = os.path.join(directory, ".%s.npu_lossscale_write_test" % os.path.basename(target))
    try:
        with tf.io.gfile.GFile(probe, "w") as stream:
            stream.write("")
        tf.io.gfile.remove(probe)
    except tf.errors.OpError as error:
        raise ValueError("target must be a prefix in a writable directory, got %r (%s: "
                         "%s). Pass a prefix in a directory you can write to."
                         % (target, type(error).__name__, error.message))


def _write_checkpoint(entries, target):
    """Writes {name: ``_Tensor``} as a name-based checkpoint at ``target``:
    its data and index files only. The directory's ``checkpoint`` state file
    (which ``latest_checkpoint`` reads) is left as it is: a conversion into
    the training directory must not replace the list of the user's
    checkpoints."""
    with tf.Graph().as_default():
        feeds, variables = {}, {}
        for index, name in enumerate(sorted(entries)):
            value, dtype = entries[name]
            placeholder = tf.placeholder(dtype, name="value_%d" % index)
            variables[name] = tf.Variable(placeholder, trainable=False,
                                          validate_shape=False, name="v_%d" % index)
            feeds[placeholder] = value
        saver = tf.train.Saver(var_list=variables)
        with tf.Session() as session:
            session.run([v.initializer for v in variables.values()], feeds)
            saver.save(session, target, write_meta_graph=False, write_state=False)
