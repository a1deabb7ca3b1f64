"""``build(measure_first_scale=True)``: a first loss scale measured from one
step, so that a script started at a scale far too high (ModelZoo's
``ExponentialUpdateLossScaleManager(2**32, ...)``) skips no step while the
scale comes down, and one started far too low does not train on flushed
gradients while it climbs.

The first run of a step op that reaches a manager's scale read measures,
before that read, the float32 view of its groups' losses
(``float32_view``; each in-graph tower's loss on its own): the largest
magnitude ``amax`` of every tensor the float16 backprop would hold (the
variables' gradients and those of every float16 forward tensor), over the
scale. The manager's scale becomes the largest power of two ``s`` with
``s * amax <= 65504 / 2**margin`` (Transformer Engine's rule for FP8 with
its amax history), within the manager's bounds, and the step runs at it. A
measurement that is 0 or not finite leaves the scale as it was.

Each group is measured once. With ``per_group_ops`` a group's op measures
its own groups on its first run (it may not be fed what the others need):
the first measurement of a manager sets its scale, a later one of another
group only lowers it, so the group's first step does not overflow either.
Later runs read one flag per group, ``<scope>/first_scale_measured``
(saved with checkpoints, so a restored run does not measure again).
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import manager_protocol as _manager_protocol
from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.underflow.float32_view import Float32View, check_float32_view


class _Measured(collections.namedtuple("_Measured", ["manager", "groups", "flags"])):
    """One manager's measurement state: the names of its groups (as the
    joint step has them) and a bool variable, one flag per group, True once
    that group was measured."""


class FirstScale(_seams.StepObserver):
    """Measures each manager's first scale before its first scale read (the
    module docstring).

    Args:
      margin: powers of two of headroom below float16's largest value, an
        int >= 0.
    """

    name = "first_scale"

    def __init__(self, margin):
        self.margin = margin
        self._scope = _helpers.current_scope()
        self._measured = []  # a _Measured per manager

    def check_plan(self, plan, options, global_step, api):
        """Refuses a manager that cannot take a measured scale
        (``managers.base.assign_scale``), or a group whose float32 view
        cannot be built (``float32_view.check_float32_view``): ValueError."""
        del options, global_step, api
        for use in plan.managers:
            if use.groups and not _manager_protocol.takes_measured_scale(use.manager):
                raise ValueError(
                    "measure_first_scale=True, but the manager of groups %s (%s) cannot take "
                    "a measured scale. Use DynamicLossScaleManager or "
                    "ExponentialUpdateLossScaleManager, or leave measure_first_scale off."
                    % (list(use.groups), type(use.manager).__name__))
        for group in plan.groups:
            if group.loss is not None:
                check_float32_view(
                    group.loss, group.var_list, group.name, "measure_first_scale=True",
                    "Leave measure_first_scale off and pick an initial scale.")

    def _state(self, use):
        for known in self._measured:
            if known.manager is use.manager:
                return known
        with _helpers.outside(self._scope):
            flags = tf.Variable([False] * len(use.groups), trainable=False,
                                name="first_scale_measured" if not self._measured
                                else "first_scale_measured_%d" % len(self._measured))
        known = _Measured(use.manager, tuple(use.groups), flags)
        self._measured.append(known)
        return known

    def before_scale_read(self, state):
        plan = state.plan
        ops, entries = [], []
        for use in plan.managers:
            groups = [plan.group(name) for name in use.groups
                      if plan.group(name).loss is not None]
            if not groups:
                continue
            known = self._state(use)
            mine = tf.constant([name in use.groups for name in known.groups])
            with tf.name_scope("first_scale_%s" % use.name):
                flags = known.flags.read_value()
                due = tf.logical_not(tf.reduce_all(tf.logical_or(flags, tf.logical_not(mine))),
                                     name="due")
                first = tf.logical_not(tf.reduce_any(flags), name="first")

                def measure(scope, manager=use.manager, groups=groups, known=known,
                            mine=mine, flags=flags, first=first):
                    del scope
                    scale = measured_scale(groups, self.margin, plan.engine)
                    lowered = tf.minimum(tf.cast(manager.get_loss_scale(), tf.float32), scale)
                    scale = tf.where(tf.logical_or(first, tf.is_nan(scale)), scale, lowered)
                    assign = _manager_protocol.assign_scale(manager, scale)
                    with tf.control_dependencies([assign]):
                        return [tf.assign(known.flags, tf.logical_or(flags, mine)).op]

                # A cond, whatever the gate: under the pivot, grappler removes
                # the view's float32-to-float32 casts with the control inputs
                # that hold the view back, and its forward pass would run on
                # every run.
                ops.append(_helpers.cond_if(due, measure, "measure").op)
            entries.append(due.op)
        return _seams.Hooked(ops, entries)


def measured_scale(groups, margin, engine=None):
    """The first scale of ``groups``' manager: the largest power of two under
    which their float32 view's amax stays at or below 65504 / 2**margin;
    NaN when the measurement is 0 or not finite (the manager then keeps its
    scale).

    Each replica's loss (``seams.ReductionEngine.replica_losses``: each
    in-graph tower's) is measured on its own, as its float16 backprop runs.

    Args:
      groups: ``seams.GroupView`` records sharing one manager.
      margin: powers of two of headroom, an int >= 0.
      engine: the step's ``seams.ReductionEngine``, or None for one replica.

    Returns:
      A float32 scalar tensor.
    """
    engine = _seams.ReductionEngine() if engine is None else engine
    replicas = [(loss, group) for group in groups
                for loss in _helpers.replica_losses(engine, group)]
    view = Float32View([loss for loss, _ in replicas])
    maxima = []
    for loss, group in replicas:
        backprop = view.backprop(loss, group.var_list)
        maxima.append(backprop.activations_max_abs)
        maxima.extend(tf.reduce_max(tf.abs(tf.cast(_dense(grad), tf.float32)))
                      for grad in backprop.grads if grad is not None)
    amax = tf.reduce_max(tf.stack(maxima))
    return largest_power_of_two(amax, _manager_protocol.FLOAT16_MAX / 2.0 ** margin)


#: The exponents a float32 scale and its inverse can both take as normal
#: numbers (``managers.SCALE_RANGE``).
_EXPONENTS = (-126.0, 126.0)


def largest_power_of_two(amax, limit):
    """The largest power of two ``s`` with ``s * amax <= limit`` (within
    2**-126..2**126), or NaN when ``amax`` is 0, inf or NaN.

    The logarithm only estimates the exponent (it may round either way at
    an exact power of two); the two exact comparisons that follow correct
    it by one step.

    Args:
      amax: a float32 scalar tensor.
      limit: a positive Python float.

    Returns:
      A float32 scalar tensor.
    """
    limit = np.float32(limit)
    estimate = tf.floor(tf.math.log(limit / amax) / np.float32(np.log(2.0)))
    scale = tf.pow(2.0, tf.clip_by_value(estimate, *_EXPONENTS))
    scale = tf.where(tf.greater(scale * amax, limit), scale * 0.5, scale)
    scale = tf.where(tf.logical_and(tf.less_equal(scale * 2.0 * amax, limit),
                                    tf.less(scale, 2.0 ** _EXPONENTS[1])), scale * 2.0, scale)
    usable = tf.logical_and(tf.greater(amax, 0.0), _helpers.finite(amax))
    return tf.where(usable, scale, tf.constant(np.nan, tf.float32))


def _dense(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


#: ``build(first_scale_margin=...)``'s default: a factor of 2 below 65504.
DEFAULT_MARGIN = 1


def check_first_scale(measure_first_scale, margin):
    """The observer of ``build(measure_first_scale=..., first_scale_margin=...)``,
    its arguments checked (the plan's in ``FirstScale.check_plan``).

    Returns:
      A ``FirstScale``, or None when not asked.

    Raises:
      TypeError: for a non-bool ``measure_first_scale`` or a non-int margin.
      ValueError: for a margin outside 0..15, or a margin other than the
        default without ``measure_first_scale``.
    """
    if not isinstance(measure_first_scale, bool):
        raise TypeError("measure_first_scale must be a bool, got %r. Pass True to measure "
                        "the first loss scale." % (measure_first_scale,))
    _check_margin(margin)
    if not measure_first_scale:
        if margin != DEFAULT_MARGIN:
            raise ValueError("first_scale_margin=%r has no effect without "
                             "measure_first_scale=True. Pass measure_first_scale=True too, or "
                             "leave the margin out." % (margin,))
        return None
    return FirstScale(int(margin))


def measure_first_scale(margin=DEFAULT_MARGIN):
    """The first-scale observer (``underflow.measure_first_scale``), as
    ``build(measure_first_scale=True, first_scale_margin=margin)`` makes it.

    Args:
      margin: powers of two of headroom below 65504, an int in 0..15.

    Returns:
      A ``FirstScale``.

    Raises:
      TypeError, ValueError: for a margin that is not an int in 0..15.
    """
    return FirstScale(int(_check_margin(margin)))


def _check_margin(margin):
    """``margin``, checked to be an int in 0..15 (TypeError, ValueError)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)):
        raise TypeError("first_scale_margin must be an int, got %r. Pass e.g. 1 (a factor of "
                        "2 below 65504)." % (margin,))
    if margin < 0 or margin > 15:
        raise ValueError("first_scale_margin must be in 0..15 powers of two, got %r. Pass "
                         "e.g. 1." % (margin,))
    return margin
