"""``build(measure_first_scale=True)``: a first loss scale measured from one
step, so that a script started at a scale far too high (ModelZoo's
``ExponentialUpdateLossScaleManager(2**32, ...)``) skips no step while the
scale comes down, and one started far too low does not train on flushed
gradients while it climbs.

The first run that reaches a manager's scale read measures, before that
read, the float32 view of its groups' losses (``float32_view``): the
largest magnitude ``amax`` of every tensor the float16 backprop would hold
(the variables' gradients and those of every float16 forward tensor), over
the scale. The manager's scale becomes the largest power of two ``s`` with
``s * amax <= 65504 / 2**margin`` (Transformer Engine's rule for FP8 with
its amax history), within the manager's bounds, and the step runs at it. A
measurement that is 0 or not finite leaves the scale as it was. Later runs
only read one flag, ``<scope>/first_scale_measured`` (saved with
checkpoints, so a restored run does not measure again).
"""

from __future__ import absolute_import, division, print_function

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale.core import commit as _commit
from npu_lossscale.core import gradients as _gradients
from npu_lossscale.core import graph_state as _graph_state
from npu_lossscale.managers import base as _manager_base
from npu_lossscale.underflow.float32_view import Float32View, check_float32_view


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
        self._scope = _graph_state.current_scope()
        self._measured = []  # (manager, its flag variable)

    def _flag(self, manager):
        for known, flag in self._measured:
            if known is manager:
                return flag
        with _graph_state.outside(self._scope):
            flag = tf.Variable(False, trainable=False,
                               name="first_scale_measured" if not self._measured
                               else "first_scale_measured_%d" % len(self._measured))
        self._measured.append((manager, flag))
        return flag

    def before_scale_read(self, state):
        plan = state.plan
        ops, entries = [], []
        for use in plan.managers:
            groups = [plan.group(name) for name in use.groups
                      if plan.group(name).loss is not None]
            if not groups:
                continue
            flag = self._flag(use.manager)
            with tf.name_scope("first_scale_%s" % use.name):
                due = tf.logical_not(flag.read_value(), name="due")

                def measure(scope, manager=use.manager, groups=groups, flag=flag):
                    del scope
                    scale = measured_scale(groups, self.margin)
                    assign = _manager_base.assign_scale(manager, scale)
                    with tf.control_dependencies([assign]):
                        return [tf.assign(flag, True).op]

                gate = _commit.cond_if if plan.gate_kind == "cond" else _commit.run_if
                ops.append(gate(due, measure, "measure").op)
            entries.append(due.op)
        return _seams.Hooked(ops, entries)


def measured_scale(groups, margin):
    """The first scale of ``groups``' manager: the largest power of two under
    which their float32 view's amax stays at or below 65504 / 2**margin;
    NaN when the measurement is 0 or not finite (the manager then keeps its
    scale).

    Args:
      groups: ``plan.Group`` records sharing one manager.
      margin: powers of two of headroom, an int >= 0.

    Returns:
      A float32 scalar tensor.
    """
    view = Float32View([group.loss for group in groups])
    maxima = []
    for group in groups:
        backprop = view.backprop(group.loss, group.var_list)
        maxima.append(backprop.activations_max_abs)
        maxima.extend(tf.reduce_max(tf.abs(tf.cast(_dense(grad), tf.float32)))
                      for grad in backprop.grads if grad is not None)
    amax = tf.reduce_max(tf.stack(maxima))
    limit = _manager_base.FLOAT16_MAX / 2.0 ** margin
    exponent = tf.floor(tf.math.log(limit / amax) / np.float32(np.log(2.0)))
    scale = tf.pow(2.0, exponent)
    # log2 may round up at an exact power of two: step down once if so.
    scale = tf.where(tf.greater(scale * amax, limit), scale * 0.5, scale)
    usable = tf.logical_and(tf.greater(amax, 0.0), _gradients.finite(scale))
    return tf.where(usable, scale, tf.constant(np.nan, tf.float32))


def _dense(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def check_first_scale(plan, measure_first_scale, margin):
    """The observer of ``build(measure_first_scale=..., first_scale_margin=...)``,
    checked.

    Returns:
      A ``FirstScale``, or None when not asked.

    Raises:
      TypeError: for a non-bool ``measure_first_scale`` or a non-int margin.
      ValueError: for a negative margin, a manager that cannot take a
        measured scale (``managers.base.assign_scale``), or a group whose
        float32 view cannot be built (``float32_view.check_float32_view``).
    """
    if not isinstance(measure_first_scale, bool):
        raise TypeError("measure_first_scale must be a bool, got %r. Pass True to measure "
                        "the first loss scale." % (measure_first_scale,))
    if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)):
        raise TypeError("first_scale_margin must be an int, got %r. Pass e.g. 1 (a factor of "
                        "2 below 65504)." % (margin,))
    if margin < 0 or margin > 15:
        raise ValueError("first_scale_margin must be in 0..15 powers of two, got %r. Pass "
                         "e.g. 1." % (margin,))
    if not measure_first_scale:
        return None
    for use in plan.managers:
        if use.groups and not _manager_base.takes_measured_scale(use.manager):
            raise ValueError(
                "measure_first_scale=True, but the manager of groups %s (%s) cannot take a "
                "measured scale. Use DynamicLossScaleManager or "
                "ExponentialUpdateLossScaleManager, or leave measure_first_scale off."
                % (list(use.groups), type(use.manager).__name__))
    for group in plan.groups:
        if group.loss is not None:
            check_float32_view(
                group.loss, group.var_list, group.name, "measure_first_scale=True",
                "Leave measure_first_scale off and pick an initial scale.")
    return FirstScale(int(margin))
