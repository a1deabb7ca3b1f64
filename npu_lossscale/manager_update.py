"""Phase 4 of the step: each manager moves its scale from its groups' decision."""

from __future__ import absolute_import, division, print_function

import tensorflow.compat.v1 as tf

from npu_lossscale import checks as _checks


def update_manager(manager, is_finite, after):
    """The manager's update, ordered after ``after`` (the step's scale reads).

    Args:
      manager: a loss-scale manager.
      is_finite: bool scalar, the decision its groups were gated on.
      after: ops or tensors the update must follow.

    Returns:
      The update op.

    Raises:
      TypeError: if ``update_loss_scale`` returns no op (None, a number...).
    """
    with tf.control_dependencies(after):
        update = manager.update_loss_scale(is_finite)
    return update_op(manager, update)


def update_op(manager, update):
    """The op of what ``manager.update_loss_scale`` returned, checked.

    Accepts an ``Operation``, a ``Tensor`` (an assign's output) or anything
    whose ``op`` is an ``Operation`` (what ``tf.assign`` returns for a
    resource variable), the forms contrib's and npu_bridge's optimizers
    accept in ``tf.group``.

    Args:
      manager: the manager (its class names the error).
      update: the value its ``update_loss_scale`` returned.

    Returns:
      A ``tf.Operation``.

    Raises:
      TypeError: for anything else, before the step uses it.
    """
    op = _checks.op_of(update)
    if op is not None:
        return op
    raise TypeError(
        "%s.update_loss_scale(finite_grads) returned %r (%s), not an op. It must "
        "return the op that moves the scale: return the assign op (e.g. "
        "tf.assign(self._scale, new_scale)), or tf.no_op() for a scale that "
        "never moves." % (type(manager).__name__, update, type(update).__name__))


def update_managers(plan, decisions, after):
    """Every used manager's update, fed with its groups' decision.

    A manager no group uses (the builder's, when every group brings its own)
    is read for ``TrainOps.loss_scale`` but never updated.

    Args:
      plan: the ``plan.Plan``.
      decisions: the step's ``close.Decisions``.
      after: ops or tensors every update must follow (the applies and the
        scale reads, so that the step reads the scale before it moves).

    Returns:
      A list of ops.
    """
    return [update_manager(use.manager, decisions.all_of(use.checks), after)
            for use in plan.managers if use.groups]
