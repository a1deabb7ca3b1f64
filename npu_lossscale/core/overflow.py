"""Phase 2 of the step, the overflow check: one float32 flag per check (one
status read or one is_finite pass of the plan's backend), 0.0 when the
check's gradients are finite. Deciding on the flags is the close's
(``close.Decisions``)."""

from __future__ import absolute_import, division, print_function

import collections
import contextlib

import tensorflow.compat.v1 as tf

from npu_lossscale import backend_protocol as _backend_protocol
from npu_lossscale import manager_protocol as _manager_protocol
from npu_lossscale.core import checks as _checks
from npu_lossscale.core import gradients as _gradients
from npu_lossscale.core import graph_walk as _graph_walk


def flags(plan, grads, packing, after, checks=None):
    """One overflow flag per check, each read by the plan's backend.

    Args:
      plan: the ``plan.Plan``.
      grads: ordered dict from group name to (gradient, variable) pairs:
        scaled, or given.
      packing: the ``gradients.Packing`` of the small gradients (a check
        reads a pack once instead of its rows).
      after: tensors every read must follow beside the gradients (the
        losses: a forward overflow whose value no gradient needs still lands
        before a register read).
      checks: the ``plan.Check``s to read; all of the plan's by default.

    Returns:
      Ordered dict from check name to a float32 scalar, 0.0 when finite.
    """
    result = collections.OrderedDict()
    for item in plan.checks if checks is None else checks:
        tensors = packing.to_check([grad for name in item.groups for grad, _ in grads[name]])
        # A scope of its own only when there are several checks to tell apart.
        scope = tf.name_scope(item.name) if len(plan.checks) > 1 else contextlib.suppress()
        with scope:
            result[item.name] = _backend_protocol.checked_flag(plan.backend, tensors, after=list(after))
    return result


def condition_flags(plan, state):
    """One flag per skip condition after the overflow check.

    Args:
      plan: the ``plan.Plan``.
      state: the ``seams.StepState`` the conditions read.

    Returns:
      Ordered dict from the condition's flag name to a float32 scalar: 0.0
      to apply, 1.0 to skip. Any flag but 0.0 skips (a negative one, NaN),
      and counts as 1.0, so that the flags of an accumulation window's
      micro-batches cannot cancel in their sum.

    Raises:
      TypeError: when a condition's flag is not a float32 scalar tensor.
      ValueError: when it is a tensor of another graph.
    """
    result = collections.OrderedDict()
    for item in plan.conditions:
        with tf.name_scope(item.name):
            flag = item.condition.flag(state)
            if _checks.is_variable(flag):  # a flag kept in a variable: its value
                flag = flag.read_value()
            if not (isinstance(flag, tf.Tensor) and flag.dtype.base_dtype == tf.float32
                    and flag.shape.ndims == 0):
                raise TypeError(
                    "skip condition %r returned %r from flag(state); return a float32 scalar "
                    "tensor (0.0 to apply): %s" % (item.condition.name, flag, _flag_fix(flag)))
            if flag.graph is not tf.get_default_graph():
                raise ValueError(
                    "skip condition %r returned %r from flag(state), a tensor of another "
                    "graph. Build the flag from the step's own tensors (state.plan, "
                    "state.global_step)." % (item.condition.name, flag))
            if not item.condition.moves_scale and _reads_a_moving_scale(flag, plan, state):
                raise ValueError(
                    "skip condition %r: its flag %r is computed from the loss scale and "
                    "moves_scale is False, so a step it skips keeps the scale and it skips "
                    "every step. Set moves_scale = True." % (item.condition.name, flag))
            result[item.name] = tf.cast(tf.not_equal(flag, 0.0), tf.float32, name="skips")
    return result


def _reads_a_moving_scale(flag, plan, state):
    """Whether ``flag`` is computed, through data inputs, from a scale
    that can move (its snapshot, its inverse, or the manager's state
    variables, which its own ``get_loss_scale`` reads), other than through
    the step's gradients (``state.grads``, ``state.scaled``), which every
    scale computes and a flag may read."""
    sources = []
    for use in plan.managers:
        scale = (state.scales or {}).get(use.name)
        if scale is None or not _manager_protocol.scale_moves(use.manager):
            continue
        sources.append(scale.value.op)
        if scale.inverse is not None:
            sources.append(scale.inverse.op)
        for variable in _manager_protocol.manager_variables(use.manager):
            if variable is state.global_step:  # held by a scheduled manager: no scale
                continue
            handle = getattr(variable, "handle", None)
            sources.extend([variable.op] + ([] if handle is None else [handle.op]))
    if not sources:
        return False
    gradients = set(_gradients.dense_values(grad).op
                    for pairs in list((state.grads or {}).values())
                    + list((state.scaled or {}).values()) for grad, _ in pairs)
    return _graph_walk.first_reached(
        [flag.op], lambda op: [] if op in gradients else [t.op for t in op.inputs],
        sources) is not None


def _flag_fix(flag):
    """How to make ``flag`` (a skip condition's wrong flag) right."""
    if not isinstance(flag, tf.Tensor):
        return "e.g. tf.constant(0.0), or tf.cast(skip, tf.float32) of a bool tensor."
    if flag.dtype.base_dtype != tf.float32:
        return "tf.cast(flag, tf.float32)."
    if flag.shape.ndims is None:
        return "its shape is unknown; tf.reshape(flag, []) of a one-value tensor."
    return "reduce it to one value, e.g. tf.reduce_max(flag)."


def unscaled_flags(plan, before, unscaled):
    """The checks' flags, each also covering its groups' unscaled float16
    gradients where the scale may be below 1 (the unscale then multiplies
    by more than 1, and a finite float16 value can overflow in it;
    ``managers.scale_may_be_below_one``).

    Args:
      plan: the ``plan.Plan``.
      before: ordered dict from flag name to float32 flag.
      unscaled: ordered dict from group name to the unscaled pairs.

    Returns:
      A new ordered dict of the same names.
    """
    result = collections.OrderedDict(before)
    for item in plan.checks:
        tensors = [grad for name in item.groups
                   if _manager_protocol.scale_may_be_below_one(plan.group(name).manager)
                   for grad, _ in unscaled[name]
                   if grad.dtype.base_dtype == tf.float16]
        if tensors:
            with tf.name_scope("unscaled"):
                result[item.name] = result[item.name] + _backend_protocol.checked_flag(
                    plan.backend, tensors)
    return result


def transformed_flags(plan, before, after):
    """The checks' flags, each also covering its groups' transformed
    gradients where a transform may turn finite values into non-finite ones
    (``seams.GradientTransform.keeps_finite`` False).

    Args:
      plan: the ``plan.Plan``.
      before: ordered dict from flag name to float32 flag.
      after: ordered dict from group name to the transformed pairs.

    The transformed values are read themselves (``values_flag``), not
    through the backend: the close may run inside an accumulation window's
    cond, where a float-status read cannot be built.

    Returns:
      A ``Transformed``: the new flags, of the same names, and each covering
      check's transform fault.
    """
    result = collections.OrderedDict(before)
    faults = collections.OrderedDict()
    for item in plan.checks:
        tensors = [grad for name in item.groups
                   if not all(t.keeps_finite for t in plan.group(name).transforms)
                   for grad, _ in after[name]]
        if tensors and item.name in result:
            with tf.name_scope("transformed"):
                flag = values_flag(tensors, plan.backend.reads_register)
                # The transforms' own fault: finite before them, not after.
                faults[item.name] = tf.logical_and(tf.equal(result[item.name], 0.0),
                                                   tf.not_equal(flag, 0.0))
                result[item.name] = result[item.name] + flag
    return Transformed(result, faults)


class Transformed(collections.namedtuple("Transformed", ["flags", "faults"])):
    """The checks' flags after the transforms (``transformed_flags``).

    Attributes:
      flags: ordered dict from flag name to float32 flag, each check's
        covering its groups' transformed gradients.
      faults: ordered dict from the name of each check whose groups have a
        transform that may turn finite values into non-finite ones to a
        bool scalar: True when the check passed on the gradients and failed
        on what the transforms returned. The managers hold on such a step:
        the transform failed, not the loss scale.
    """


def values_flag(tensors, saturation):
    """A float32 flag, 1.0 when a tensor holds an inf or a NaN, or with
    ``saturation`` a float16 tensor holds +-65504 (a saturated result on
    Ascend's register). Read from the values, so it can be built anywhere
    (an accumulation window's cond), without ``IsFinite`` (CANN has none).
    """
    values = [_gradients.dense_values(tensor) for tensor in tensors]
    total = tf.add_n([tf.reduce_sum(tf.cast(value, tf.float32)) for value in values])
    bad = tf.logical_not(_gradients.finite(total))
    saturable = [value for value in values if value.dtype.base_dtype == tf.float16]
    if saturation and saturable:
        largest = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(tf.cast(value, tf.float32)))
                                          for value in saturable]))
        bad = tf.logical_or(bad, tf.greater_equal(largest, 65504.0))
    return tf.cast(bad, tf.float32)
