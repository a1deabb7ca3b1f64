"""``build(skip_global_steps=...)``: steps skipped on request, through the
step's own gate, to restart past a known-bad range of batches (Megatron's
``--iterations-to-skip``).

A collection of global steps skips the step whenever ``global_step`` (its
value before the step's increment) is one of them; a bool scalar tensor
skips the runs where it is True (a bool variable is read on each run). A
tensor computed from a step that the loop reads out of ``global_step`` and
feeds back needs ``count_skipped_steps=True`` as one computed from
``global_step`` itself does, which the build cannot see (docs/features.md
says so). A skipped step changes no weight, slot,
gated statistic or loss scale, and is counted and diagnosed with the reason
``requested``.
"""

from __future__ import absolute_import, division, print_function

import numbers

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import seams as _seams
from npu_lossscale import plugin_helpers as _helpers


class RequestedSkips(_seams.SkipCondition):
    """Skips the steps asked for (the module docstring).

    Args:
      steps: a ``range``, or a sorted tuple of distinct global steps; or a
        bool scalar tensor.
      given: what the user passed, for messages.
    """

    name = "requested_skip"
    reason = "requested"
    fix = "the step was asked to be skipped (build(skip_global_steps=...)): nothing to fix."

    def __init__(self, steps, given=None):
        self.steps = steps
        self.given = steps if given is None else given

    def check_plan(self, plan, options, global_step, api):
        """``check_step`` with the build's ``global_step`` and
        ``count_skipped_steps``."""
        del plan, api
        self.check_step(global_step, options.count_skipped_steps)

    def check_step(self, global_step, count_skipped_steps):
        """Refuses steps that the build's ``global_step`` cannot reach.

        Raises:
          ValueError: for a collection without ``global_step`` or without
            ``count_skipped_steps=True``, a step above what its dtype holds,
            or a tensor computed from ``global_step`` without
            ``count_skipped_steps=True``.
        """
        steps = self.given
        if isinstance(self.steps, tf.Tensor):
            if (global_step is not None and not count_skipped_steps
                    and _helpers.computed_from(self.steps, global_step.op)):
                raise ValueError(
                    "skip_global_steps=%r is computed from global_step, with "
                    "count_skipped_steps=False: a skipped step would leave global_step where "
                    "it is, so the same step would be skipped forever. Pass "
                    "count_skipped_steps=True." % (steps,))
            return
        if not len(self.steps):
            return
        if global_step is None:
            raise ValueError(
                "skip_global_steps=%r names global steps, but build() got no global_step. "
                "Pass global_step=tf.train.get_or_create_global_step()." % (steps,))
        largest = global_step.dtype.base_dtype.max
        if max(self.steps) > largest:
            raise ValueError(
                "skip_global_steps=%r holds a step above %d, the largest %s global_step "
                "holds. Drop it." % (steps, largest, global_step.dtype.base_dtype.name))
        if not count_skipped_steps:
            raise ValueError(
                "skip_global_steps=%r with count_skipped_steps=False: a skipped step would "
                "leave global_step where it is, so the same step would be skipped forever. "
                "Pass count_skipped_steps=True." % (steps,))

    def flag(self, state):
        if isinstance(self.steps, tf.Tensor):
            return tf.cast(self.steps, tf.float32)
        step = state.global_step.read_value()
        if isinstance(self.steps, range):
            r = self.steps
            inside = tf.logical_and(tf.greater_equal(step, r.start), tf.less(step, r.stop))
            if r.step != 1:
                inside = tf.logical_and(inside, tf.equal((step - r.start) % r.step, 0))
        else:
            inside = tf.reduce_any(tf.equal(
                step, tf.constant(np.array(self.steps, np.int64), step.dtype.base_dtype)))
        return tf.cast(inside, tf.float32)


def requested_skips(steps, global_step, count_skipped_steps):
    """The condition of ``build(skip_global_steps=steps)``, checked.

    Args:
      steps: None, a collection of global steps (a list, tuple, set,
        ``range`` or 1-D integer array), or a bool scalar tensor.
      global_step: build()'s ``global_step``.
      count_skipped_steps: build()'s ``count_skipped_steps``.

    Returns:
      A ``RequestedSkips``, or None for None or an empty collection.

    Raises:
      TypeError, ValueError: as ``requested`` and ``RequestedSkips.check_step``.
    """
    if steps is None:
        return None
    condition = requested(steps)
    if isinstance(condition.steps, tuple) and not condition.steps:
        return None
    condition.check_step(global_step, count_skipped_steps)
    return condition


def requested(steps):
    """A condition that skips the steps asked for (``skips.requested``).

    Args:
      steps: a collection of global steps (a list, tuple, set, ``range`` or
        1-D integer array), or a bool scalar tensor (or variable), True on
        the runs to skip.

    Returns:
      A ``RequestedSkips``; ``build()`` checks it against its
      ``global_step`` and ``count_skipped_steps`` (``check_plan``).

    Raises:
      TypeError: for anything else, or a tensor that is not a bool scalar.
      ValueError: for a negative step, or a tensor of another graph.
    """
    if isinstance(steps, tf.Tensor) or _helpers.is_variable(steps):
        if steps.dtype.base_dtype != tf.bool or steps.shape.ndims != 0:
            raise TypeError(
                "skip_global_steps must be a bool scalar tensor or a collection of global "
                "steps, got %r. Pass e.g. tf.equal(global_step %% 1000, 999) or "
                "range(4000, 4100)." % (steps,))
        if _helpers.of_another_graph(steps):
            raise ValueError(
                "skip_global_steps=%r belongs to another graph. Build it in the graph of "
                "the losses." % (steps,))
        return RequestedSkips(steps.read_value() if _helpers.is_variable(steps) else steps,
                              steps)
    if isinstance(steps, (str, bytes, bool, numbers.Number)) or not hasattr(steps, "__iter__"):
        raise TypeError(
            "skip_global_steps must be a collection of global steps or a bool scalar "
            "tensor, got %r. Pass e.g. range(4000, 4100) or [4000, 4001]." % (steps,))
    if isinstance(steps, range):
        # Ascending, whatever the direction given.
        chosen = (() if not len(steps) else steps if steps.step > 0
                  else range(steps[-1], steps[0] + 1, -steps.step))
    else:
        values = list(steps)
        if any(isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer))
               for v in values):
            raise TypeError(
                "skip_global_steps must hold int global steps, got %r. Pass e.g. "
                "range(4000, 4100)." % (steps,))
        chosen = tuple(sorted(set(int(v) for v in values)))
    if len(chosen) and min(chosen) < 0:
        raise ValueError("skip_global_steps must hold global steps >= 0, got %r. Drop the "
                         "negative ones." % (steps,))
    return RequestedSkips(chosen, steps)
