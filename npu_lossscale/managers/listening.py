"""A dynamic scale that listens to the underflow measurement:
``ListeningLossScaleManager``."""

from __future__ import absolute_import, division, print_function

import math

import tensorflow.compat.v1 as tf

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.managers.base import (_DEFAULT_FLOOR_WARNING_AFTER, _DEFAULT_MAX_LOSS_SCALE,
                                         _DEFAULT_MIN_LOSS_SCALE, FLOAT16_MAX, _check_period)
from npu_lossscale.managers.counting import _GOOD, _SCALE
from npu_lossscale.managers.dynamic import (_DEFAULT_GROWTH_STEPS, _DEFAULT_INITIAL_SCALE,
                                            _DEFAULT_MULTIPLIER, DynamicLossScaleManager)

# A measurement costs about a step (a float32 copy of the forward pass and
# its backprop): every 100 updates is about 1 % more work.
_DEFAULT_MEASURE_EVERY_N_STEPS = 100
_DEFAULT_RAISE_ABOVE_UNDERFLOW_SHARE = 0.01
# A raise aims at a quarter of the threshold: training gradients shrink, and
# a scale raised just to it would cross it again before the next measurement.
_RAISE_TARGET_FRACTION = 0.25
# A factor of 4 below 65504 when raising: the maximum moves from step to
# step, and backprop tensors the measurement does not read may be larger.
_DEFAULT_HEADROOM_MARGIN_BITS = 2.0

# Positions in ``heard`` (see ListeningLossScaleManager.heard).
_RUNS, _MAX, _UNDERFLOW, _NEEDED, _FRESH = 0, 1, 2, 3, 4
_HEARD_SIZE = 5


class ListeningLossScaleManager(DynamicLossScaleManager):
    """``DynamicLossScaleManager``'s rule, steered by the underflow measurement.

    Every ``measure_every_n_steps`` updates the step measures this manager's
    groups (``underflow.Underflow``). With ``share`` the underflow share
    (``flushed_share + subnormal_share``), ``m`` the measured largest |g|
    unscaled, and ``needed`` the smallest ``scale_measured * 2**j`` at which
    the float32 view predicts a share of at most ``raise_above / 4``, the
    update is the dynamic rule, then::

      if the dynamic rule grew the scale and scale * m > 65504:
        scale = the scale before (a growth the measurement says overflows)
      if finite and measured this run and share >= raise_above:
        room = floor((log2(65504 / (scale * m)) - margin_bits) / log2(multiplier))
        need = max(ceil(log2(needed / scale) / log2(multiplier)), 1)
        k = min(need, room)
        if k >= 1: scale = min(scale * multiplier ** k, cap); good = 0

    Until a finite measurement, and under ``LossScaleOptimizer`` (no loss to
    measure), it is ``DynamicLossScaleManager``. With a float16 loss ``m``
    includes the loss's own gradient, so the scale never probes past 65504.
    The state is ``dynamic_loss_scale/state`` and
    ``listening_loss_scale/heard`` (docs/diagnosis.md, "Is the scale too
    low?").

    Args:
      initial_scale, growth_steps, multiplier, min_loss_scale,
        max_loss_scale, floor_warning_after: as ``DynamicLossScaleManager``.
      measure_every_n_steps: updates between measurements, in [1, 2**24];
        the first update is measured.
      raise_above_underflow_share: the underflow share, in (0, 1], at which
        a measurement raises the scale early.
      headroom_margin_bits: the powers of two kept below 65504 when raising,
        in [0, 126].

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if an argument is out of range, NaN or infinite.
    """

    keeps_scale_in_range = True  # a revert keeps a scale, a raise is clipped

    def __init__(self, initial_scale=_DEFAULT_INITIAL_SCALE,
                 growth_steps=_DEFAULT_GROWTH_STEPS, multiplier=_DEFAULT_MULTIPLIER,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=_DEFAULT_MAX_LOSS_SCALE,
                 floor_warning_after=_DEFAULT_FLOOR_WARNING_AFTER,
                 measure_every_n_steps=_DEFAULT_MEASURE_EVERY_N_STEPS,
                 raise_above_underflow_share=_DEFAULT_RAISE_ABOVE_UNDERFLOW_SHARE,
                 headroom_margin_bits=_DEFAULT_HEADROOM_MARGIN_BITS):
        _helpers.require_graph_mode("ListeningLossScaleManager")
        self._every = _check_period("measure_every_n_steps", measure_every_n_steps, 100)
        _helpers.check_number("raise_above_underflow_share", raise_above_underflow_share,
                             minimum=0, maximum=1, min_open=True,
                             hint="Pass e.g. 0.01 (1 %).")
        _helpers.check_number("headroom_margin_bits", headroom_margin_bits, minimum=0,
                             maximum=126, hint="Pass e.g. 2 (a factor of 4).")
        self._raise_above = float(raise_above_underflow_share)
        self._margin_bits = float(headroom_margin_bits)
        super(ListeningLossScaleManager, self).__init__(
            initial_scale=initial_scale, growth_steps=growth_steps, multiplier=multiplier,
            min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
            floor_warning_after=floor_warning_after)
        with tf.name_scope(None, default_name="listening_loss_scale"):
            self._heard = tf.Variable([0.0, -1.0, 0.0, 0.0, 0.0], dtype=tf.float32,
                                      trainable=False, name="heard")

    @property
    def variables(self):
        """The state variables: ``state`` and ``heard``."""
        return [self.state, self._heard]

    @property
    def heard(self):
        """The float32[5] variable ``[update count mod N, m (-1: none yet),
        share, log2(needed), 1 if measured this run]``."""
        return self._heard

    @property
    def measure_every_n_steps(self):
        """Updates between measurements."""
        return self._every

    @property
    def raise_above_underflow_share(self):
        """The underflow share at which a measurement raises the scale."""
        return self._raise_above

    @property
    def headroom_margin_bits(self):
        """Powers of two kept below 65504 when raising."""
        return self._margin_bits

    def underflow_due(self):
        """True on the first update and every ``measure_every_n_steps``-th
        one after it."""
        runs = tf.unstack(self._heard.read_value(), num=_HEARD_SIZE)[_RUNS]
        return tf.equal(runs, 0.0)

    def observe_underflow(self, measurement):
        """The op that records a finite ``underflow.Underflow`` in ``heard``;
        after an overflowed one the last finite one stays, marked stale."""
        with tf.name_scope("observe_underflow"):
            heard = tf.unstack(self._heard.read_value(), num=_HEARD_SIZE)
            finite = tf.logical_and(tf.less_equal(measurement.max_abs, FLOAT16_MAX),
                                    tf.greater(measurement.scale, 0.0))
            unscaled = tf.maximum(measurement.max_abs / measurement.scale,
                                  measurement.float32_max_abs)
            share = measurement.flushed_share + measurement.subnormal_share
            # The first raise (in powers of two) at which the float32 view
            # predicts at most the target underflowing; all of them if none.
            by_raise = measurement.underflow_by_raise
            bits = tf.range(tf.size(by_raise), dtype=tf.float32)
            target = self._raise_above * _RAISE_TARGET_FRACTION
            enough = tf.reduce_min(tf.where(tf.less_equal(by_raise, target), bits,
                                            tf.fill(tf.shape(bits), 1.0 * tf.cast(
                                                tf.size(by_raise), tf.float32))))
            needed = tf.math.log(measurement.scale) / math.log(2.0) + enough
            new = tf.where(finite, tf.stack([heard[_RUNS], unscaled, share, needed, 1.0]),
                           tf.stack([heard[_RUNS], heard[_MAX], heard[_UNDERFLOW],
                                     heard[_NEEDED], 0.0]))
            with tf.control_dependencies([new]):
                return tf.assign(self._heard, new, name="assign_heard").op

    def update_loss_scale(self, finite_grads):
        """The dynamic rule, then the measurement's corrections (the class's)."""
        with tf.name_scope("listening_update"):
            finite = tf.convert_to_tensor(finite_grads, dtype=tf.bool)
            # Copies: the dynamic rule's assign overwrites a ref variable's
            # buffer in place.
            heard = tf.unstack(tf.raw_ops.Snapshot(input=self._heard.read_value()),
                               num=_HEARD_SIZE)
            before = tf.raw_ops.Snapshot(input=self.state.read_value())
        with tf.control_dependencies([before] + heard):
            dynamic = super(ListeningLossScaleManager, self).update_loss_scale(finite)
        with tf.name_scope("listening_update"), tf.control_dependencies([dynamic]):
            after = self.state.read_value()
            scale_before = before[_SCALE]
            scale = after[_SCALE]
            unscaled_max = heard[_MAX]
            known = tf.greater(unscaled_max, 0.0)
            # A growth the measurement says overflows is not made.
            overflowing_growth = tf.logical_and(
                tf.logical_and(known, tf.greater(scale, scale_before)),
                tf.greater(scale * unscaled_max, FLOAT16_MAX))
            scale = tf.where(overflowing_growth, scale_before, scale)
            # An early raise, by whole multiplier steps: as far as the
            # underflow needs, within the headroom less the margin.
            step_bits = math.log(self.multiplier, 2.0)
            log2_scale = tf.math.log(scale) / math.log(2.0)
            room = tf.floor((tf.math.log(FLOAT16_MAX / (scale * tf.maximum(unscaled_max, 1e-30)))
                             / math.log(2.0) - self._margin_bits) / step_bits)
            need = tf.maximum(tf.math.ceil((heard[_NEEDED] - log2_scale) / step_bits), 1.0)
            steps = tf.minimum(need, room)
            raising = tf.logical_and(
                tf.logical_and(finite, tf.greater(heard[_FRESH], 0.0)),
                tf.logical_and(tf.logical_and(known, tf.greater_equal(steps, 1.0)),
                               tf.greater_equal(heard[_UNDERFLOW], self._raise_above)))
            raised = tf.minimum(scale * tf.pow(self.multiplier, tf.maximum(steps, 0.0)),
                                self._scale_cap())
            new_scale = tf.where(raising, raised, scale)
            new_good = tf.where(raising, tf.zeros([]), after[_GOOD])
            new_state = tf.concat([tf.stack([new_scale, new_good]), after[_GOOD + 1:]], 0)
            new_heard = tf.stack([tf.floormod(heard[_RUNS] + 1.0, float(self._every)),
                                  heard[_MAX], heard[_UNDERFLOW], heard[_NEEDED], 0.0])
            with tf.control_dependencies([new_state, new_heard]):
                return tf.group(tf.assign(self.state, new_state, name="assign_state"),
                                tf.assign(self._heard, new_heard, name="assign_heard"))
