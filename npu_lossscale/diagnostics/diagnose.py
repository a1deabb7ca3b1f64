"""Why a step skipped, worked out in its skip branch from the evidence
(``evidence.Evidence``): the reason code, and the groups and variables
that overflowed (``Diagnosed``), which the record writes.

On a saturating register (Ascend's saturation mode) an overflowing float16
result is +-65504 and a NaN is 0 (tf_adapter's documentation of
``npu_plugin.set_device_sat_mode``: "saturation mode: Inf -> +-MAX, NaN ->
0"), so a gradient counts as overflowed when it holds a non-finite value or
exactly +-65504 (also as a float32 value cast from float16), or the largest
value of its own dtype, or when a term of the sum that makes it does (a
variable used more than once: ``evidence.summed_terms``). A saturated value
that was added to other terms further up the backprop, and a NaN flushed to
0, leave no mark on the gradients: such a step reads as
``register_outside_gradients``.
"""

from __future__ import absolute_import, division, print_function

import collections

import numpy as np
import tensorflow.compat.v1 as tf

from npu_lossscale import plugin_helpers as _helpers
from npu_lossscale.diagnostics import evidence as _inspection
from npu_lossscale.diagnostics import reasons as _reasons
from npu_lossscale.diagnostics import (
    BACKEND_FLAGGED, GRADIENTS_OVERFLOWED, LOSS_NOT_FINITE, OTHER_WORKER_OVERFLOWED,
    REGISTER_OUTSIDE_GRADIENTS)


class Diagnosed(collections.namedtuple("Diagnosed", ["reason", "groups", "variables"])):
    """Why a step skipped (``Record.diagnose``): an int64 reason code, and
    int64 0/1 masks over the record's groups and variables."""


def diagnose(record, plan, evidence, local_flags, reduced_flags):
    """Works out why a step skipped, without writing anything.

    Build it only in a skip branch. Every op made here is a node the
    executor passes over (dead) on each applied step, so the checks are
    vectors: one reduction per large gradient, one per pack of small
    ones of a shape, then one test of all the sums (``skip_inspection.bad_entries``).

    Args:
      record: the builder's ``record.Record`` (its group and variable names).
      plan: the ``seams.PlanView`` of the step (the builder's, or one group's).
      evidence: the ``Evidence``.
      local_flags: ordered dict from flag name to this worker's flag,
        before the sum across workers (the branch runs only when the
        summed flags say skip).
      reduced_flags: the same flags summed across workers.

    Returns:
      A ``Diagnosed``.
    """
    checked = [name for name in plan.group_names
               if any(name in check.groups for check in plan.checks)]
    heads = _inspection.LossHeads(evidence)
    losses = [(name, heads.value(evidence.losses[name]))
              for name in checked if evidence.losses.get(name) is not None]
    counted = [(name, evidence.loss_flags[name]) for name in checked
               if evidence.loss_flags is not None and name in evidence.loss_flags]
    grads = [(name, grad, var.op.name) for name in checked
             for grad, var in evidence.grads.get(name, ())]
    # One entry per loss, then per gradient; bad[i] for entry i.
    entries = [loss for _, loss in losses] + [grad for _, grad, _ in grads]
    entry_groups = [name for name, _ in losses] + [name for name, _, _ in grads]
    bad = _inspection.bad_entries(entries, evidence.saturation,
                                  terms_from=len(losses))
    if counted:
        # A window's losses, as counts of non-finite ones: first.
        bad = tf.concat([tf.greater(tf.stack([flag for _, flag in counted]), 0.0), bad], 0)
        losses = counted + losses
        entries = [flag for _, flag in counted] + entries
        entry_groups = [name for name, _ in counted] + entry_groups
    flags = tf.cast(bad, tf.int64)
    if entries:
        membership = np.array([[int(group == name) for group in entry_groups]
                               for name in record.group_names], np.int64)
        groups = tf.reduce_max(flags * membership, axis=1)
    else:
        groups = tf.zeros([len(record.group_names)], tf.int64)
    position = dict((var, len(losses) + index) for index, (_, _, var) in enumerate(grads))
    variables = tf.gather(tf.concat([flags, tf.zeros([1], tf.int64)], 0),
                          [position.get(var, len(entries)) for var in record.variable_names])
    reason = tf.constant(
        REGISTER_OUTSIDE_GRADIENTS if evidence.saturation
        else GRADIENTS_OVERFLOWED if plan.backend.gives_evidence
        else BACKEND_FLAGGED, tf.int64)
    bad_losses, bad_grads = tf.split(bad, [len(losses), len(grads)])
    if grads:
        reason = tf.where(tf.reduce_any(bad_grads),
                          tf.constant(GRADIENTS_OVERFLOWED, tf.int64), reason)
    checks = [item.name for item in plan.checks]
    if plan.crosses_workers and checks:
        clear = tf.reduce_all(tf.equal(tf.stack([local_flags[name] for name in checks]),
                                       0.0))
        reason = tf.where(clear, tf.constant(OTHER_WORKER_OVERFLOWED, tf.int64), reason)
    reason, groups = _transforms_fault(record, plan, evidence, bad, reason, groups)
    if losses:
        reason = tf.where(tf.reduce_any(bad_losses),
                          tf.constant(LOSS_NOT_FINITE, tf.int64), reason)
    if plan.conditions:
        # A condition is the reason only where no check says overflow;
        # the first condition that fired names it.
        fired = tf.constant(GRADIENTS_OVERFLOWED, tf.int64)
        for item in reversed(plan.conditions):
            code = record.reasons.code(item.condition.reason)
            fired = tf.where(tf.greater(reduced_flags[item.name], 0.0),
                             tf.constant(code, tf.int64), fired)
        overflowed = (tf.reduce_any(tf.greater(
            tf.stack([reduced_flags[name] for name in checks]), 0.0))
                      if checks else tf.constant(False))
        reason = tf.where(overflowed, reason, fired)
    return Diagnosed(reason, groups, variables)


def _transforms_fault(record, plan, evidence, bad, reason, groups):
    """``reason`` and ``groups``, where every loss and gradient inspected
    is finite and a group's transforms returned inf or NaN: that
    group's transform reason (``reasons.transform_reason``), the
    first such group's, and those groups marked."""
    faults = []
    transformed = evidence.transformed or {}
    for name in [name for name in record.group_names if transformed.get(name)]:
        pairs = transformed[name]
        found = _reasons.transform_reason(plan.group(name))
        if found is not None and any(name in check.groups for check in plan.checks):
            # Read as the close's check read them (transformed_flags).
            faults.append((name, record.reasons.code(found.name), tf.greater(
                _helpers.values_flag([grad for grad, _ in pairs],
                                     plan.backend.reads_register), 0.0)))
    if not faults:
        return reason, groups
    clean = tf.logical_not(tf.reduce_any(bad))
    fired = reason
    for _, code, flagged in reversed(faults):
        fired = tf.where(flagged, tf.constant(code, tf.int64), fired)
    mask = np.array([[int(group == name) for name, _, _ in faults]
                     for group in record.group_names], np.int64)
    marked = tf.reduce_max(mask * tf.cast(tf.stack([f for _, _, f in faults]), tf.int64),
                           axis=1)
    return (tf.where(clean, fired, reason),
            tf.where(clean, tf.maximum(groups, marked), groups))
